//! The leader's admin API as `ctl` uses it, typed both ways: requests are built from
//! validated values (`ChannelName`, `VChannelInfo`, `NodeId`), answers are read once into the
//! core types the API serializes (`Transition`, `PlannedMove`).
//!
//! Owns: finding the leader (`{root}/coord/leader`), the HTTP calls and their headers, and
//! turning a refusal into one line. Must not: print (that is `ctl`'s presentation) or write
//! to etcd.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};
use chanwatch_core::planner::{PlannedMove, Transition};
use chanwatch_core::{ChannelName, CoordSession, Keys, NodeId, VChannelInfo};
use chanwatch_store::MetaStore;
use reqwest::Method;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};

/// How long one call may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The leader's admin API, found through the store.
pub struct Leader {
    pub store: Arc<dyn MetaStore>,
    pub keys: Keys,
    /// Bearer token, when the API requires one.
    pub token: Option<String>,
}

/// The answer to `POST /api/v1/balance`.
#[derive(Debug, Deserialize)]
pub struct BalancePlan {
    /// Whether the leader only planned (nothing moved).
    pub dry_run: bool,
    /// The moves, planned or started.
    pub moves: Vec<PlannedMove>,
}

#[derive(Serialize)]
struct AddChannel<'a> {
    name: &'a ChannelName,
    #[serde(skip_serializing_if = "Option::is_none")]
    vchannel: Option<&'a VChannelInfo>,
}

#[derive(Serialize)]
struct MoveTo {
    to: NodeId,
}

/// What the API says when it refuses.
#[derive(Deserialize)]
struct Refusal {
    error: String,
    /// A list's refused entries.
    #[serde(default)]
    refused: Vec<RefusedEntry>,
}

#[derive(Deserialize)]
struct RefusedEntry {
    index: usize,
    error: String,
}

/// The API's refusal, typed (the error of every [`Leader`] call the API refused).
#[derive(Debug)]
pub struct Refused {
    /// HTTP status, with its reason (`409 Conflict`).
    pub status: String,
    /// What it said.
    pub message: String,
    /// A list's refused entries: (index in the list, why).
    pub refused: Vec<(usize, String)>,
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the coordinator refused ({}): {}",
            self.status, self.message
        )
    }
}

impl std::error::Error for Refused {}

impl Leader {
    /// Registers a channel.
    pub async fn add_channel(
        &self,
        name: &ChannelName,
        vchannel: Option<&VChannelInfo>,
    ) -> Result<Vec<Transition>> {
        let body = AddChannel { name, vchannel };
        self.call(Method::POST, "/api/v1/channels", Some(&body))
            .await
    }

    /// Removes a channel.
    pub async fn remove_channel(&self, name: &ChannelName) -> Result<Vec<Transition>> {
        let path = format!("/api/v1/channels/{name}");
        self.call(Method::DELETE, &path, None::<&()>).await
    }

    /// Moves a channel to a node.
    pub async fn move_channel(&self, name: &ChannelName, to: NodeId) -> Result<Vec<Transition>> {
        let path = format!("/api/v1/channels/{name}/move");
        self.call(Method::POST, &path, Some(&MoveTo { to })).await
    }

    /// Drains a node.
    pub async fn drain(&self, node: NodeId) -> Result<()> {
        let path = format!("/api/v1/nodes/{node}/drain");
        let IgnoredAny = self.call(Method::POST, &path, None::<&()>).await?;
        Ok(())
    }

    /// Plans (`dry_run`) or starts the balance moves.
    pub async fn balance(&self, dry_run: bool) -> Result<BalancePlan> {
        let path = format!("/api/v1/balance?dry_run={dry_run}");
        self.call(Method::POST, &path, None::<&()>).await
    }

    /// Registers a list of channel objects (at most 10,000): all, or none (then [`Refused`]
    /// names the entries).
    pub async fn add_channels(&self, list: &[&serde_json::Value]) -> Result<Vec<Transition>> {
        self.call(Method::POST, "/api/v1/channels", Some(&list))
            .await
    }

    /// Sends a request to the leader's admin API and reads its answer as `T`.
    async fn call<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T> {
        let keys = &self.keys;
        let leader = self.store.get(&keys.leader()).await?.ok_or_else(|| {
            anyhow!(
                "no coordinator is leader ({} is absent); start `chanwatch coord`",
                keys.leader()
            )
        })?;
        let session = CoordSession::decode(&leader.value)
            .map_err(|e| anyhow!("{} does not decode: {e}", keys.leader()))?;
        let url = format!("http://{}{}", session.admin_addr, path);
        let client = reqwest::Client::builder().timeout(CALL_TIMEOUT).build()?;
        let mut req = client.request(method.clone(), &url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        // The API refuses a write without this content type (no cross-site form posts),
        // bodiless ones included.
        if method != Method::GET {
            req = req.header(reqwest::header::CONTENT_TYPE, "application/json");
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("leader's admin API unreachable at {url}"))?;
        let status = resp.status();
        let bytes = resp
            .bytes()
            .await
            .with_context(|| format!("reading the leader's answer from {url}"))?;
        if !status.is_success() {
            let r = serde_json::from_slice::<Refusal>(&bytes).ok();
            return Err(anyhow::Error::new(Refused {
                status: status.to_string(),
                refused: r
                    .as_ref()
                    .map(|r| {
                        r.refused
                            .iter()
                            .map(|e| (e.index, e.error.clone()))
                            .collect()
                    })
                    .unwrap_or_default(),
                message: r.map_or_else(|| "no error message".to_owned(), |r| r.error),
            }));
        }
        serde_json::from_slice(&bytes).with_context(|| {
            format!(
                "the leader's answer to {method} {path} is not what this ctl understands; \
                 run ctl and the coordinators from the same release"
            )
        })
    }
}

#[cfg(test)]
mod tests {
    use chanwatch_core::planner::Cause;
    use chanwatch_core::{ChannelInfo, ChannelOwner};
    use chanwatch_store::EmbeddedStore;

    use super::*;

    /// A leader on the embedded store, its admin API served on a free loopback port; the
    /// handle keeps it running.
    async fn leader_on_embedded_store() -> Result<(Leader, chanwatch_coord::CoordHandle)> {
        let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let handle = chanwatch_coord::Coordinator::builder(store.clone())
            .admin_addr(listener.local_addr()?.to_string())
            .session_ttl(Duration::from_secs(3))
            .spawn()?;
        let router = chanwatch_coord::api::router(
            handle.clone(),
            chanwatch_coord::api::ApiOptions::default(),
        );
        tokio::spawn(chanwatch_coord::api::serve(
            listener,
            router,
            std::future::pending(),
        ));
        let mut ready = handle.watch_status();
        tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
        let leader = Leader {
            store,
            keys: Keys::default(),
            token: None,
        };
        Ok((leader, handle))
    }

    /// ctl's writes pass the admin API's cross-site guard: the leader's advertised address as
    /// `Host`, and the JSON content type on every write, bodiless POSTs and DELETEs included
    /// (without it they got 415).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ctl_writes_pass_the_admin_apis_cross_site_guard() -> Result<()> {
        let (leader, _handle) = leader_on_embedded_store().await?;
        let c1 = ChannelName::new("c1")?;
        let out = leader.add_channel(&c1, None).await?;
        assert_eq!(out[0].channel, c1, "{out:?}");
        let plan = leader.balance(true).await?;
        assert!(plan.dry_run, "{plan:?}");
        leader.remove_channel(&c1).await?;
        // Refused for what it asks (no node 9), not for how it asks.
        let e = leader
            .drain(NodeId(9))
            .await
            .expect_err("node 9 does not exist");
        assert!(e.to_string().contains("not alive"), "{e}");
        Ok(())
    }

    /// `--vchannel` is parsed once into a `VChannelInfo` and sent typed: what lands in etcd is
    /// that value, fields this build does not know included, and the answer comes back as
    /// typed transitions (parked under `remaining`: no node is alive).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_typed_vchannel_reaches_etcd_unchanged_and_the_answer_reads_back_typed() -> Result<()>
    {
        let (leader, _handle) = leader_on_embedded_store().await?;
        let vchannel = VChannelInfo::from_json(
            br#"{"collection_id":7,"seek_position":"p-42","flushed_segment_ids":[3],
                 "metadata":{"k":"v"},"a_future_field":[1,2]}"#,
        )?;
        let c2 = ChannelName::new("c2")?;
        let out = leader.add_channel(&c2, Some(&vchannel)).await?;
        assert_eq!(out.len(), 1, "{out:?}");
        let t = &out[0];
        assert_eq!(
            (&t.channel, t.cause, t.from, t.to),
            (&c2, Cause::Assign, None, Some(ChannelOwner::Remaining)),
            "{t:?}"
        );
        let keys = &leader.keys;
        let list = leader.store.range(&keys.all_prefix()).await?;
        let stored = list
            .kvs
            .iter()
            .filter(|kv| keys.parse_channel(&kv.key).is_ok())
            .map(|kv| ChannelInfo::decode(&kv.value))
            .collect::<Result<Vec<_>, _>>()?;
        assert_eq!(stored.len(), 1, "{stored:?}");
        assert_eq!(stored[0].vchannel, vchannel);
        Ok(())
    }
}
