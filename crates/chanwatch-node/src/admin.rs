//! The node's admin HTTP: `GET /healthz` (the process answers), `GET /readyz` (200 once
//! registered and not paused, else 503 with the reason), `GET /metrics` (Prometheus text) and
//! `GET /status` (JSON: id, name, sessions, fences, paused, paused_reason, pauses) — what `ctl`,
//! the coordinator's status page and monitoring read.
//!
//! Owns: the routes, and filling the status JSON ([`StatusAnswer`], a wire type of
//! `chanwatch-core`, which the readers deserialize: `chanwatch_coord::probe`, and `ctl`
//! through it). Must not: change the node
//! (read-only), or bind sockets (the caller serves the router where it wants).

use axum::http::StatusCode;
use axum::routing::get;
use tokio::sync::watch;

use crate::config::NodeStatus;

pub use chanwatch_core::StatusAnswer;

impl From<&NodeStatus> for StatusAnswer {
    fn from(s: &NodeStatus) -> Self {
        StatusAnswer {
            id: s.id.map(|i| i.0),
            name: s.name.clone(),
            sessions: s.sessions,
            fences: s.fences,
            paused: s.paused.is_some(),
            paused_reason: s.paused.clone(),
            pauses: s.pauses,
        }
    }
}

/// The status as `GET /status` shows it.
#[must_use]
pub fn status_json(s: &NodeStatus) -> serde_json::Value {
    // A struct of numbers, strings and options always serializes.
    serde_json::to_value(StatusAnswer::from(s)).unwrap_or_default()
}

/// Renders a registry as Prometheus text.
#[must_use]
pub fn render(registry: &prometheus::Registry) -> String {
    let mut out = String::new();
    if let Err(e) = prometheus::TextEncoder::new().encode_utf8(&registry.gather(), &mut out) {
        out = format!("# error encoding metrics: {e}\n");
    }
    out
}

/// The routes, for a node's status and its metrics registry (see
/// [`NodeHandle`](crate::NodeHandle)).
pub fn router(status: watch::Receiver<NodeStatus>, registry: prometheus::Registry) -> axum::Router {
    axum::Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", {
            let status = status.clone();
            get(move || {
                let not_ready = status.borrow().not_ready();
                async move {
                    match not_ready {
                        None => (StatusCode::OK, "ready\n".to_owned()),
                        Some(why) => (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready: {why}\n"),
                        ),
                    }
                }
            })
        })
        .route(
            "/metrics",
            get(move || {
                let text = render(&registry);
                async move { text }
            }),
        )
        .route(
            "/status",
            get(move || {
                let body = status_json(&status.borrow());
                async move { axum::Json(body) }
            }),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    use serde_json::json;

    #[test]
    fn the_status_json_names_the_pause_and_why() {
        let s = NodeStatus {
            id: Some(chanwatch_core::NodeId(4)),
            sessions: 1,
            fences: 0,
            paused: Some("no keepalive succeeded for 3s".into()),
            pauses: 2,
            name: "db-7".into(),
        };
        let v = status_json(&s);
        assert_eq!(v["id"], json!(4));
        assert_eq!(v["paused"], json!(true));
        assert_eq!(v["paused_reason"], json!("no keepalive succeeded for 3s"));
        assert_eq!(v["pauses"], json!(2));
        assert_eq!(v["name"], json!("db-7"));
        let back: StatusAnswer = serde_json::from_value(v).expect("a status answer");
        assert_eq!(back, StatusAnswer::from(&s));
    }

    #[test]
    fn an_answer_lacking_fields_reads_them_as_defaults() {
        let a: StatusAnswer =
            serde_json::from_value(json!({"paused": true, "paused_reason": "no keepalive"}))
                .expect("a status answer");
        assert_eq!(
            a,
            StatusAnswer {
                paused: true,
                paused_reason: Some("no keepalive".into()),
                ..StatusAnswer::default()
            }
        );
    }

    async fn get_readyz(status: &NodeStatus) -> (StatusCode, String) {
        use tower::ServiceExt;
        let (_tx, rx) = watch::channel(status.clone());
        let resp = router(rx, prometheus::Registry::new())
            .oneshot(
                axum::http::Request::get("/readyz")
                    .body(axum::body::Body::empty())
                    .expect("request"),
            )
            .await
            .expect("answers");
        let code = resp.status();
        let body = axum::body::to_bytes(resp.into_body(), 4096)
            .await
            .expect("body");
        (code, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn readyz_is_ok_only_when_registered_and_not_paused() {
        let (code, body) = get_readyz(&NodeStatus::default()).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("not registered"), "{body}");
        let registered = NodeStatus {
            id: Some(chanwatch_core::NodeId(3)),
            ..NodeStatus::default()
        };
        assert_eq!(get_readyz(&registered).await.0, StatusCode::OK);
        let paused = NodeStatus {
            paused: Some("no keepalive succeeded for 3s".into()),
            ..registered
        };
        let (code, body) = get_readyz(&paused).await;
        assert_eq!(code, StatusCode::SERVICE_UNAVAILABLE);
        assert!(body.contains("paused: no keepalive"), "{body}");
    }
}
