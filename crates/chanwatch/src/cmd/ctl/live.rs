//! What `ctl` asks the nodes themselves: whether each one has paused its channels.
//!
//! etcd cannot say: a node pauses exactly when it cannot reach etcd (or cannot trust its watch),
//! so it writes nothing about it. `ctl` asks each node's admin HTTP (`GET /status`, the address
//! in its session) with a short timeout, all nodes at once, and reports what each said or why it
//! could not tell.
//!
//! Owns: those HTTP reads and the columns they add. Must not: write anywhere, or fail the
//! command when a node does not answer (that is a finding to show, not an error).

use std::collections::BTreeMap;

use chanwatch_core::planner::NodeRow;
use serde_json::{json, Value};

use chanwatch_coord::probe::{NodeSays, ASK_TIMEOUT};

/// What one node said about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Live {
    /// Running its channels.
    Running,
    /// Every channel paused, and why.
    Paused(String),
    /// It did not answer (the reason), or it has no admin address.
    Unknown(String),
}

impl Live {
    /// The table cell.
    pub fn cell(&self) -> &str {
        match self {
            Live::Running => "running",
            Live::Paused(_) => "PAUSED",
            Live::Unknown(_) => "?",
        }
    }

    /// `paused` (true, false, or null when unknown) and the reason, for `-o json|yaml`.
    pub fn fields(&self) -> (Value, Value) {
        match self {
            Live::Running => (json!(false), Value::Null),
            Live::Paused(why) => (json!(true), json!(why)),
            Live::Unknown(why) => (Value::Null, json!(format!("unknown: {why}"))),
        }
    }
}

/// Asks every node at once.
pub async fn ask(rows: &[NodeRow]) -> BTreeMap<u64, Live> {
    let client = match reqwest::Client::builder().timeout(ASK_TIMEOUT).build() {
        Ok(c) => c,
        Err(e) => {
            let why = format!("no HTTP client: {e}");
            return rows
                .iter()
                .map(|r| (r.id, Live::Unknown(why.clone())))
                .collect();
        }
    };
    let asks = rows.iter().map(|r| {
        let client = client.clone();
        let addr = r.admin_addr.clone();
        async move { (r.id, ask_one(&client, &addr).await) }
    });
    futures_util::future::join_all(asks)
        .await
        .into_iter()
        .collect()
}

/// The coordinator's status page asks the same way (`chanwatch_coord::probe`).
async fn ask_one(client: &reqwest::Client, addr: &str) -> Live {
    match chanwatch_coord::probe::ask(client, addr).await {
        NodeSays::Running => Live::Running,
        NodeSays::Paused(why) => Live::Paused(why),
        NodeSays::Unknown(why) => Live::Unknown(why),
    }
}

/// `ctl nodes -o json`: each row with `paused` and `paused_reason`.
pub fn nodes_json(rows: &[NodeRow], live: &BTreeMap<u64, Live>) -> Value {
    let out = rows.iter().map(|r| {
        let mut v = json!(r);
        let (paused, why) = live
            .get(&r.id)
            .map_or((Value::Null, Value::Null), Live::fields);
        v["paused"] = paused;
        v["paused_reason"] = why;
        v
    });
    Value::Array(out.collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A node's own `/status` decides the column: a paused node, a running one, one that does
    /// not answer and one without an admin address.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_node_is_asked_and_an_unanswered_one_is_unknown_not_an_error() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let paused_addr = listener.local_addr().expect("addr").to_string();
        let app = axum::Router::new().route(
            "/status",
            axum::routing::get(|| async {
                axum::Json(json!({"id": 7, "paused": true, "paused_reason": "no keepalive"}))
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
        // A port nobody listens on.
        let closed = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let closed_addr = closed.local_addr().expect("addr").to_string();
        drop(closed);
        let row = |id, addr: &str| NodeRow {
            id,
            admin_addr: addr.to_owned(),
            channels: 1,
            started_at_ms: 0,
            draining: false,
            name: String::new(),
            capacity: 1,
            weight: 1,
            load: 1.0,
        };
        let rows = [row(7, &paused_addr), row(8, &closed_addr), row(9, "")];
        let live = ask(&rows).await;
        assert_eq!(live[&7], Live::Paused("no keepalive".into()));
        assert!(matches!(&live[&8], Live::Unknown(w) if w.contains("did not answer")));
        assert!(matches!(&live[&9], Live::Unknown(w) if w.contains("no admin HTTP")));
        let v = nodes_json(&rows, &live);
        assert_eq!(v[0]["paused"], json!(true));
        assert_eq!(v[0]["paused_reason"], json!("no keepalive"));
        assert_eq!(v[1]["paused"], Value::Null);
    }
}
