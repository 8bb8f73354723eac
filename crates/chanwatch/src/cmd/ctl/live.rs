//! What `ctl` asks the nodes themselves: whether each one has paused its channels.
//!
//! etcd cannot say: a node pauses exactly when it cannot reach etcd (or cannot trust its watch),
//! so it writes nothing about it. `ctl` asks each node's admin HTTP (`GET /status`, the address
//! in its session) with a short timeout, all nodes at once, and reports what each said or why it
//! could not tell. The asking, and what an answer means ([`NodeSays`]), are the coordinator's
//! (`chanwatch_coord::probe`, which its status page uses); the answer's shape is the node's
//! (`chanwatch_node::admin::StatusAnswer`).
//!
//! Owns: the columns and fields those answers add to `ctl`'s output. Must not: write anywhere,
//! or fail the command when a node does not answer (that is a finding to show, not an error).

use std::collections::BTreeMap;

use chanwatch_core::planner::NodeRow;
use serde_json::{json, Value};

pub use chanwatch_coord::probe::NodeSays;

/// The table cell of what a node said.
pub fn cell(said: &NodeSays) -> &'static str {
    match said {
        NodeSays::Running => "running",
        NodeSays::Paused(_) => "PAUSED",
        NodeSays::Unknown(_) => "?",
    }
}

/// `paused` (true, false, or null when unknown) and the reason, for `-o json|yaml`.
pub fn fields(said: &NodeSays) -> (Value, Value) {
    match said {
        NodeSays::Running => (json!(false), Value::Null),
        NodeSays::Paused(why) => (json!(true), json!(why)),
        NodeSays::Unknown(why) => (Value::Null, json!(format!("unknown: {why}"))),
    }
}

/// Asks every node at once, as the coordinator's status page does
/// (`chanwatch_coord::probe`).
pub async fn ask(rows: &[NodeRow]) -> BTreeMap<u64, NodeSays> {
    let nodes: Vec<(u64, String)> = rows.iter().map(|r| (r.id, r.admin_addr.clone())).collect();
    let client = chanwatch_coord::probe::client();
    chanwatch_coord::probe::ask_all(client.as_ref().map_err(String::as_str), &nodes).await
}

/// `ctl nodes -o json`: each row with `paused` and `paused_reason`.
pub fn nodes_json(rows: &[NodeRow], live: &BTreeMap<u64, NodeSays>) -> Value {
    let out = rows.iter().map(|r| {
        let mut v = json!(r);
        let (paused, why) = live.get(&r.id).map_or((Value::Null, Value::Null), fields);
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
        assert_eq!(live[&7], NodeSays::Paused("no keepalive".into()));
        assert!(matches!(&live[&8], NodeSays::Unknown(w) if w.contains("did not answer")));
        assert!(matches!(&live[&9], NodeSays::Unknown(w) if w.contains("no admin HTTP")));
        let v = nodes_json(&rows, &live);
        assert_eq!(v[0]["paused"], json!(true));
        assert_eq!(v[0]["paused_reason"], json!("no keepalive"));
        assert_eq!(v[1]["paused"], Value::Null);
    }
}
