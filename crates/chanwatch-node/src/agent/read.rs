//! `GET /read` of the agent API: the channel's next messages from the node's `--log`, for
//! workers that cannot read the log themselves.
//!
//! Owns: the query's parsing and the answer's shape (payloads in hex). Must not: read any
//! channel but the asking child's own.

use std::collections::HashMap;

use hyper::StatusCode;
use serde_json::{json, Value};

use super::{error, json_answer, AgentChild, Answer};

/// `GET /read?after=P&max=N&wait_ms=W`, its query string `query`.
pub(super) async fn read(c: &AgentChild, query: &str) -> Answer {
    use std::fmt::Write;
    let Some(log) = &c.log else {
        return error(
            StatusCode::NOT_FOUND,
            "this node has no --log: read the log yourself",
        );
    };
    let q: HashMap<String, String> = form_urlencoded::parse(query.as_bytes())
        .into_owned()
        .collect();
    let after = match q.get("after").map(String::as_str).unwrap_or("") {
        "" => chanwatch_stream::Position::START,
        p => match p.parse() {
            Ok(p) => p,
            Err(e) => return error(StatusCode::BAD_REQUEST, format!("after: {e}")),
        },
    };
    let num = |k: &str, default: u64, max: u64| {
        q.get(k)
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(default)
            .min(max)
    };
    let max = usize::try_from(num("max", 256, 4096)).unwrap_or(256).max(1);
    let wait = std::time::Duration::from_millis(num("wait_ms", 1000, 10_000));
    match log
        .read(c.ctx.info.channel.as_str(), after, max, wait)
        .await
    {
        Ok(batch) => {
            let messages: Vec<Value> = batch
                .iter()
                .map(|m| {
                    let mut hex = String::with_capacity(m.payload.len() * 2);
                    for b in m.payload.iter() {
                        let _ = write!(hex, "{b:02x}");
                    }
                    json!({ "position": m.position.to_string(), "payload": hex })
                })
                .collect();
            json_answer(StatusCode::OK, &json!({ "messages": messages }))
        }
        Err(e) if e.is_retryable() => error(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
        Err(e) => error(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    }
}
