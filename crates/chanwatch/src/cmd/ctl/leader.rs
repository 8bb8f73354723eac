//! The leader's admin API as `ctl` uses it, typed both ways: requests are built from
//! validated values (`ChannelName`, `VChannelInfo`, `NodeId`), answers are read once into the
//! core types the API serializes (`Transition`, `PlannedMove`).
//!
//! Owns: finding the leader (`{root}/coord/leader`, or the `--admin` URL — when that is a
//! standby, the leader its 503 names, with one line on stderr), the HTTP calls and
//! their headers, waiting (up to `--timeout`) while no leader answers — one line on stderr
//! says so — and turning a refusal into one line. Must not: print anything else (that is
//! `ctl`'s presentation) or write to etcd.

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use anyhow::{anyhow, bail, Result};
use chanwatch_core::planner::{PlannedMove, Transition};
use chanwatch_core::{ChannelName, CoordSession, Keys, NodeId, VChannelInfo};
use chanwatch_store::MetaStore;
use reqwest::Method;
use serde::de::{DeserializeOwned, IgnoredAny};
use serde::{Deserialize, Serialize};

pub use chanwatch_coord::detail::{ChannelDetail, NodeDetail};
pub use chanwatch_coord::events::{Event, HistoryInfo};

/// Pause between two tries while no leader answers.
const RETRY_EVERY: Duration = Duration::from_millis(200);

/// Where the admin API is.
pub enum Source {
    /// The leader's address, read from its key in the store.
    Etcd(Arc<dyn MetaStore>),
    /// This base URL (`--admin`; e.g. a `standalone`, which has no etcd).
    Admin(String),
}

/// The leader's admin API, found through the store or given.
pub struct Leader {
    pub source: Source,
    pub keys: Keys,
    /// Bearer token, when the API requires one.
    pub token: Option<String>,
    /// How long to wait for a leader to answer (`--timeout`), one call included.
    pub timeout: Duration,
    /// With `--admin`: the leader a standby there named (its 503 says where the leader is),
    /// asked instead until it stops answering.
    pub followed: std::sync::Mutex<Option<String>>,
}

/// One try's failure: worth another try (no leader now), or final.
pub enum Failed {
    /// No leader now: try again.
    Retry(String),
    /// Refused or broken: do not try again.
    Final(anyhow::Error),
    /// A standby named the leader: try it now (nothing was done).
    Redirect,
}

/// `--admin`'s value as a base URL: `http://` added when no scheme is given, no trailing `/`.
pub fn admin_url(raw: &str) -> String {
    let raw = raw.trim().trim_end_matches('/');
    if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("http://{raw}")
    }
}

/// The answer to `POST /api/v1/balance`.
#[derive(Debug, Deserialize)]
pub struct BalancePlan {
    /// Whether the leader only planned (nothing moved).
    pub dry_run: bool,
    /// The moves, planned or started.
    pub moves: Vec<PlannedMove>,
}

/// The answer to `GET /api/v1/events?follow=0`.
#[derive(Debug, Deserialize)]
pub struct EventList {
    /// Whose history it is.
    pub history: HistoryInfo,
    /// Its events, oldest first.
    pub events: Vec<Event>,
}

/// A channel row with its checkpoint, as `GET /api/v1/channels?checkpoints=1` answers.
#[derive(Debug, Deserialize)]
pub struct RemoteChannel {
    /// The assignment.
    #[serde(flatten)]
    pub row: chanwatch_core::planner::ChannelRow,
    /// Its checkpoint, if any.
    pub checkpoint: Option<super::channels::CheckpointLine>,
}

#[derive(Serialize)]
struct AddChannel<'a> {
    name: &'a ChannelName,
    #[serde(skip_serializing_if = "Option::is_none")]
    vchannel: Option<&'a VChannelInfo>,
    #[serde(skip_serializing_if = "Option::is_none")]
    weight: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    group: Option<&'a str>,
}

/// The answer of `POST /api/v1/channels/{name}/pin|unpin`.
#[derive(Debug, serde::Deserialize)]
pub struct Pinned {
    /// The rewrite (empty when it already was so).
    pub transitions: Vec<Transition>,
}

#[derive(Serialize)]
struct MoveTo {
    to: NodeId,
}

/// How the reason to retry begins when the leader answered but etcd failed its change (a 503
/// whose message is `chanwatch_coord::ApiError::Store`'s); a standby's or a new leader's 503
/// is a wait for a leader instead.
const STORE_FAILED: &str = "the leader could not make the change";

/// What the API says when it refuses.
#[derive(Deserialize)]
struct Refusal {
    error: String,
    /// A standby's answer: the leader's admin address.
    #[serde(default)]
    leader: Option<String>,
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
    /// Registers a channel with a weight and group (either may be left to the default).
    pub async fn add_channel_with(
        &self,
        name: &ChannelName,
        vchannel: Option<&VChannelInfo>,
        weight: Option<u32>,
        group: Option<&str>,
    ) -> Result<Vec<Transition>> {
        let body = AddChannel {
            name,
            vchannel,
            weight,
            group,
        };
        self.call(Method::POST, "/api/v1/channels", Some(&body))
            .await
    }

    /// Pins (`true`) or unpins a channel; nothing moves.
    pub async fn pin(&self, name: &ChannelName, pinned: bool) -> Result<Pinned> {
        let verb = if pinned { "pin" } else { "unpin" };
        let path = format!("/api/v1/channels/{name}/{verb}");
        self.call(Method::POST, &path, None::<&()>).await
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

    /// One channel: assignment, vchannel, checkpoint, history.
    pub async fn channel_detail(&self, name: &ChannelName) -> Result<ChannelDetail> {
        let path = format!("/api/v1/channels/{name}");
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// One node: session, drain mark, channels, history.
    pub async fn node_detail(&self, node: NodeId) -> Result<NodeDetail> {
        let path = format!("/api/v1/nodes/{node}");
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// Takes a node's drain mark away; whether it was draining.
    pub async fn undrain(&self, node: NodeId) -> Result<bool> {
        #[derive(Deserialize)]
        struct Undrained {
            was_draining: bool,
        }
        let path = format!("/api/v1/nodes/{node}/undrain");
        let u: Undrained = self.call(Method::POST, &path, None::<&()>).await?;
        Ok(u.was_draining)
    }

    /// The leader's event history from `since`.
    pub async fn events(&self, since: u64) -> Result<EventList> {
        let path = format!("/api/v1/events?follow=0&since={since}");
        self.call(Method::GET, &path, None::<&()>).await
    }

    /// Every channel with its checkpoint, from the admin API (`--admin`: no etcd to read).
    pub async fn channel_rows(&self) -> Result<Vec<RemoteChannel>> {
        self.call(Method::GET, "/api/v1/channels?checkpoints=1", None::<&()>)
            .await
    }

    /// Every live node, from the admin API.
    pub async fn node_rows(&self) -> Result<Vec<chanwatch_core::planner::NodeRow>> {
        self.call(Method::GET, "/api/v1/nodes", None::<&()>).await
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

    /// The admin API's base URL now (`http://host:port`).
    ///
    /// # Errors
    /// No leader key (retry), the store does not answer (retry), or a key that does not
    /// decode.
    async fn base(&self) -> Result<String, Failed> {
        let store = match &self.source {
            Source::Admin(url) => return Ok(self.followed().unwrap_or_else(|| url.clone())),
            Source::Etcd(store) => store,
        };
        let keys = &self.keys;
        let leader = store
            .get(&keys.leader())
            .await
            .map_err(|e| Failed::Retry(format!("etcd: {e}")))?
            .ok_or_else(|| {
                Failed::Retry(format!(
                    "no coordinator is leader ({} is absent; is `chanwatch coord` running?)",
                    keys.leader()
                ))
            })?;
        let session = CoordSession::decode(&leader.value)
            .map_err(|e| Failed::Final(anyhow!("{} does not decode: {e}", keys.leader())))?;
        Ok(format!("http://{}", session.admin_addr))
    }

    fn followed(&self) -> Option<String> {
        self.followed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    fn set_followed(&self, to: Option<String>) {
        *self
            .followed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = to;
    }

    /// A 503's reason to try again. With `--admin`, when its body names the leader (a standby
    /// answered), the next try goes there and one line on stderr says so.
    pub fn unavailable(&self, body: &[u8]) -> Failed {
        let refusal = serde_json::from_slice::<Refusal>(body).ok();
        let msg = refusal
            .as_ref()
            .map_or_else(|| "no error message".to_owned(), |r| r.error.clone());
        if let (Source::Admin(given), Some(addr)) = (
            &self.source,
            refusal.and_then(|r| r.leader).filter(|a| !a.is_empty()),
        ) {
            let to = admin_url(&addr);
            let asked = self.followed().unwrap_or_else(|| given.clone());
            if to != asked {
                eprintln!("{asked} is a standby coordinator; asking the leader at {to}");
                self.set_followed(Some(to));
                // Straight to the leader: no pause, no waiting line.
                return Failed::Redirect;
            }
        }
        if msg.starts_with("the store refused or failed the change") {
            Failed::Retry(format!("{STORE_FAILED} (503): {msg}"))
        } else {
            Failed::Retry(format!("the coordinator answered 503: {msg}"))
        }
    }

    /// A followed leader that does not answer is forgotten: the next try asks `--admin`
    /// again (it may lead now, or name the new leader).
    pub fn unreachable(&self, why: String) -> Failed {
        if self.followed().is_some() {
            self.set_followed(None);
        }
        Failed::Retry(why)
    }

    /// Runs `attempt` until it succeeds, fails for good, or `--timeout` has passed; the
    /// first time it must wait, one line on stderr says so.
    pub async fn patiently<T, F, Fut>(&self, mut attempt: F) -> Result<T>
    where
        F: FnMut(Instant) -> Fut,
        Fut: std::future::Future<Output = Result<T, Failed>>,
    {
        let deadline = Instant::now() + self.timeout;
        let mut said = false;
        loop {
            match attempt(deadline).await {
                Ok(v) => return Ok(v),
                Err(Failed::Final(e)) => return Err(e),
                // Two standbys naming each other would loop: still bounded by `--timeout`.
                Err(Failed::Redirect) if Instant::now() < deadline => {}
                Err(Failed::Redirect) => bail!(
                    "no leader answered within {} s (--timeout): the standby named a leader \
                     that did not answer as one",
                    self.timeout.as_secs_f64()
                ),
                Err(Failed::Retry(why)) => {
                    let store = why.starts_with(STORE_FAILED);
                    if Instant::now() + RETRY_EVERY >= deadline {
                        if store {
                            bail!(
                                "gave up after {} s (--timeout): {why}",
                                self.timeout.as_secs_f64()
                            );
                        }
                        bail!(
                            "no leader answered within {} s (--timeout): {why}",
                            self.timeout.as_secs_f64()
                        );
                    }
                    if !said {
                        // A leader that answered is there: ctl does not wait for one, it
                        // retries the change etcd failed.
                        let (wait, what) = if store {
                            ("retrying for up to", "")
                        } else {
                            ("waiting up to", " for a leader")
                        };
                        eprintln!(
                            "{wait} {} s (--timeout){what}: {why}",
                            self.timeout.as_secs_f64()
                        );
                        said = true;
                    }
                    tokio::time::sleep(RETRY_EVERY).await;
                }
            }
        }
    }

    /// Sends a request to the leader's admin API and reads its answer as `T`, waiting for a
    /// leader up to `--timeout`.
    pub async fn call<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
    ) -> Result<T> {
        self.patiently(|deadline| self.try_call(method.clone(), path, body, deadline))
            .await
    }

    /// The request as the leader now found gets it, `--timeout`'s remainder as its timeout.
    pub async fn request(
        &self,
        method: Method,
        path: &str,
        deadline: Option<Instant>,
    ) -> Result<reqwest::RequestBuilder, Failed> {
        let url = format!("{}{path}", self.base().await?);
        let mut client = reqwest::Client::builder().connect_timeout(Duration::from_secs(2));
        if let Some(d) = deadline {
            client = client.timeout(
                d.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(100)),
            );
        }
        let client = client
            .build()
            .map_err(|e| Failed::Final(anyhow!("no HTTP client: {e}")))?;
        let mut req = client.request(method.clone(), &url);
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        // The API refuses a write without this content type (no cross-site form posts),
        // bodiless ones included.
        if method != Method::GET {
            req = req.header(reqwest::header::CONTENT_TYPE, "application/json");
        }
        Ok(req)
    }

    async fn try_call<T: DeserializeOwned, B: Serialize>(
        &self,
        method: Method,
        path: &str,
        body: Option<&B>,
        deadline: Instant,
    ) -> Result<T, Failed> {
        // A read may be tried again: one try gets at most a third of `--timeout` (at least
        // 2 s), so a frozen leader leaves time to reach the next one. A write's outcome is
        // unknown after a timeout; it gets all the time left.
        let read = method == Method::GET;
        let until = if read {
            deadline.min(Instant::now() + (self.timeout / 3).max(Duration::from_secs(2)))
        } else {
            deadline
        };
        let mut req = self.request(method.clone(), path, Some(until)).await?;
        if let Some(b) = body {
            req = req.json(b);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            // Nothing reached a server: safe to try again, a write too.
            // `{:#}`: with the causes ("Connection refused"), which reqwest's own message
            // leaves out.
            Err(e) if e.is_connect() => {
                return Err(self.unreachable(format!(
                    "the admin API does not answer: {:#}",
                    anyhow::Error::new(e)
                )))
            }
            Err(e) if read => {
                return Err(self.unreachable(format!("no answer: {:#}", anyhow::Error::new(e))))
            }
            Err(e) if e.is_timeout() => {
                return Err(Failed::Final(anyhow!(
                    "the leader did not answer {method} {path} within {} s (--timeout); \
                     whether it made the change is unknown: look with `ctl get` / `ctl describe`",
                    self.timeout.as_secs_f64()
                )))
            }
            Err(e) => {
                return Err(Failed::Final(
                    anyhow!(e).context(format!("the leader's admin API failed {method} {path}")),
                ))
            }
        };
        let status = resp.status();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) if read => return Err(Failed::Retry(format!("reading the answer: {e}"))),
            Err(e) => {
                return Err(Failed::Final(anyhow!(e).context(format!(
                    "reading the leader's answer to {method} {path}"
                ))))
            }
        };
        if status == reqwest::StatusCode::SERVICE_UNAVAILABLE {
            // Not the leader (any more; then it names the leader), still recovering, or the
            // store failed the change.
            return Err(self.unavailable(&bytes));
        }
        if !status.is_success() {
            let r = serde_json::from_slice::<Refusal>(&bytes).ok();
            return Err(Failed::Final(anyhow::Error::new(Refused {
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
            })));
        }
        serde_json::from_slice(&bytes).map_err(|e| {
            Failed::Final(anyhow!(e).context(format!(
                "the leader's answer to {method} {path} is not what this ctl understands; \
                 run ctl and the coordinators from the same release"
            )))
        })
    }
}

#[cfg(test)]
mod tests;
