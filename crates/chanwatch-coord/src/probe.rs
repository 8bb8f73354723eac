//! Whether each live node has paused its channels, for the status page's summary.
//!
//! The store cannot say: a node pauses exactly when it cannot reach the store or trust its
//! watch, so it writes nothing about it. The leader asks each node's admin HTTP (`GET
//! /status`, the address in its session) as `ctl status` does — but only while someone reads
//! summaries: a summary starts a round when the last one is older than [`FRESH`] and none is
//! running, and carries the answers of the last finished round (none on the first). A round
//! asks every node at once, each with [`ASK_TIMEOUT`].
//!
//! Owns: those reads ([`ask_all`], which `ctl` uses too), what they make of an
//! answer ([`NodeSays`]; the answer's shape is the wire type [`StatusAnswer`]) and their cache.
//! Must not: make a summary wait for a node, write anything, or start more than one round per
//! [`FRESH`].

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use chanwatch_core::StatusAnswer;
use tokio::time::Instant;

/// How old the last round's answers may be before a summary starts another.
pub const FRESH: Duration = Duration::from_secs(3);

/// How long one node may take to answer.
pub const ASK_TIMEOUT: Duration = Duration::from_secs(1);

/// What a node said about itself (the coordinator's status page and `ctl` show it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeSays {
    /// Running its channels.
    Running,
    /// Its channels are paused, and why (its own words).
    Paused(String),
    /// It did not answer, or serves no admin HTTP (why).
    Unknown(String),
}

/// The last round's answers, by node ID.
#[derive(Debug, Clone, Default)]
pub(crate) struct Answers {
    /// When the round finished (`None`: no round has finished yet).
    pub(crate) at: Option<Instant>,
    /// What each node asked said.
    pub(crate) nodes: Arc<BTreeMap<u64, NodeSays>>,
}

#[derive(Debug, Default)]
struct Inner {
    last: Answers,
    running: bool,
}

/// The cache and the client the rounds use. Shared by every clone of a handle.
#[derive(Debug, Default)]
pub(crate) struct NodeProbe {
    inner: Mutex<Inner>,
    client: std::sync::OnceLock<Result<reqwest::Client, String>>,
}

impl NodeProbe {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The last round's answers; starts a round over `nodes` (ID, admin address) in the
    /// background when those are older than [`FRESH`] and no round is running. Never waits.
    pub(crate) fn answers(self: &Arc<Self>, nodes: Vec<(u64, String)>) -> Answers {
        let mut g = self.lock();
        let stale = g.last.at.map_or(true, |t| t.elapsed() >= FRESH);
        if stale && !g.running && !nodes.is_empty() {
            g.running = true;
            let me = Arc::clone(self);
            tokio::spawn(async move {
                let said = me.round(&nodes).await;
                let mut g = me.lock();
                g.last = Answers {
                    at: Some(Instant::now()),
                    nodes: Arc::new(said),
                };
                g.running = false;
            });
        }
        g.last.clone()
    }

    /// Asks every node at once.
    async fn round(&self, nodes: &[(u64, String)]) -> BTreeMap<u64, NodeSays> {
        let client = self.client.get_or_init(client);
        ask_all(client.as_ref().map_err(String::as_str), nodes).await
    }
}

/// A client for asking nodes, each given [`ASK_TIMEOUT`], or why there is none.
///
/// # Errors
/// Why no client could be built (what every node's answer then says).
pub fn client() -> Result<reqwest::Client, String> {
    reqwest::Client::builder()
        .timeout(ASK_TIMEOUT)
        .build()
        .map_err(|e| format!("no HTTP client: {e}"))
}

/// Asks every node of `nodes` (ID, admin address) at once with `client` ([`client`]'s
/// answer), by ID.
pub async fn ask_all(
    client: Result<&reqwest::Client, &str>,
    nodes: &[(u64, String)],
) -> BTreeMap<u64, NodeSays> {
    let client = match client {
        Ok(c) => c,
        Err(why) => {
            return nodes
                .iter()
                .map(|(id, _)| (*id, NodeSays::Unknown(why.to_owned())))
                .collect();
        }
    };
    let asks = nodes
        .iter()
        .map(|(id, addr)| async move { (*id, ask(client, addr).await) });
    futures_util::future::join_all(asks)
        .await
        .into_iter()
        .collect()
}

/// What the node whose admin HTTP is at `addr` says of itself (its `GET /status`).
async fn ask(client: &reqwest::Client, addr: &str) -> NodeSays {
    if addr.is_empty() {
        return NodeSays::Unknown("the node serves no admin HTTP".into());
    }
    let status: StatusAnswer = match client.get(format!("http://{addr}/status")).send().await {
        Ok(resp) => match resp.json().await {
            Ok(v) => v,
            Err(e) => {
                return NodeSays::Unknown(format!("{addr}/status is not a node's status: {e}"))
            }
        },
        Err(e) => return NodeSays::Unknown(format!("{addr} did not answer: {e}")),
    };
    if status.paused {
        NodeSays::Paused(
            status
                .paused_reason
                .unwrap_or_else(|| "no reason given".to_owned()),
        )
    } else {
        NodeSays::Running
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::Value;

    async fn serve(body: Value) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let app = axum::Router::new().route(
            "/status",
            axum::routing::get(move || {
                let body = body.clone();
                async move { axum::Json(body) }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        addr
    }

    /// A round asks each node's `/status`: a paused one (with its reason), a running one,
    /// one whose port is closed and one with no admin address. The first call answers
    /// nothing (no round yet) and starts one; a call within [`FRESH`] starts none.
    #[tokio::test]
    async fn a_round_reads_each_nodes_own_status_and_is_not_repeated_while_fresh() {
        let paused =
            serve(serde_json::json!({"paused": true, "paused_reason": "no keepalive"})).await;
        let running = serve(serde_json::json!({"paused": false, "paused_reason": null})).await;
        let closed = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr").to_string()
        };
        let probe = Arc::new(NodeProbe::default());
        let nodes = vec![(1, paused), (2, running), (3, closed), (4, String::new())];
        let first = probe.answers(nodes.clone());
        assert!(first.at.is_none() && first.nodes.is_empty(), "{first:?}");
        let until = Instant::now() + Duration::from_secs(5);
        let got = loop {
            let a = probe.answers(nodes.clone());
            if a.at.is_some() {
                break a;
            }
            assert!(Instant::now() < until, "no round finished");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        assert_eq!(got.nodes[&1], NodeSays::Paused("no keepalive".into()));
        assert_eq!(got.nodes[&2], NodeSays::Running);
        assert!(
            matches!(&got.nodes[&3], NodeSays::Unknown(w) if w.contains("did not answer")),
            "{:?}",
            got.nodes[&3]
        );
        assert!(
            matches!(&got.nodes[&4], NodeSays::Unknown(w) if w.contains("no admin HTTP")),
            "{:?}",
            got.nodes[&4]
        );
        // Fresh: asked again at once, no new round starts (the same answers, no task).
        let again = probe.answers(vec![(9, String::new())]);
        assert_eq!(again.at, got.at);
        assert!(!probe.lock().running);
    }
}
