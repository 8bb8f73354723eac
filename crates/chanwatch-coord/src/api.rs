//! The coordinator's admin HTTP API (JSON), DESIGN.md §7.
//!
//! Owns: routes, request validation, and the mapping of [`ApiError`] to status codes with a
//! JSON body `{"error": "...", "leader": "..."?}` that says what is wrong.
//! Every request first passes `guard` (Host, Origin, Content-Type, object body), then the
//! bearer token check when one is configured.
//! Must not: change state itself — every write goes through the [`CoordHandle`], so bad input
//! is refused before anything is written.

use std::future::Future;

use axum::extract::rejection::JsonRejection;
use axum::extract::{DefaultBodyLimit, Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use chanwatch_core::planner::{AdminError, Placement};
use chanwatch_core::{ChannelName, NodeId, VChannelInfo};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::handle::{ApiError, CoordHandle};

mod bulk;
mod events;
mod guard;
mod summary;

pub use bulk::MAX_BULK_BODY_BYTES;

/// Largest request body: a channel name plus a 64 KiB vchannel, with room for JSON escaping.
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// A JSON error response.
#[derive(Debug)]
pub struct HttpError {
    status: StatusCode,
    message: String,
    leader: Option<String>,
}

impl HttpError {
    fn bad_request(message: impl Into<String>) -> Self {
        HttpError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            leader: None,
        }
    }
}

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let mut body = json!({ "error": self.message });
        if let Some(l) = self.leader {
            body["leader"] = Value::String(l);
        }
        (self.status, Json(body)).into_response()
    }
}

impl From<ApiError> for HttpError {
    fn from(e: ApiError) -> Self {
        let message = e.to_string();
        let (status, leader) = match &e {
            ApiError::Admin(AdminError::AlreadyExists(_))
            | ApiError::Admin(AdminError::Busy(_))
            | ApiError::Admin(AdminError::AlreadyThere(..))
            | ApiError::Admin(AdminError::Draining(_)) => (StatusCode::CONFLICT, None),
            ApiError::Admin(AdminError::UnknownChannel(_))
            | ApiError::Admin(AdminError::UnknownNode(_)) => (StatusCode::NOT_FOUND, None),
            ApiError::NotLeader { leader_addr } => {
                (StatusCode::SERVICE_UNAVAILABLE, leader_addr.clone())
            }
            ApiError::Store(_) => (StatusCode::SERVICE_UNAVAILABLE, None),
            ApiError::Admin(AdminError::NoRoom(..)) => (StatusCode::CONFLICT, None),
            ApiError::Admin(AdminError::BadPlacement(_)) => (StatusCode::BAD_REQUEST, None),
        };
        HttpError {
            status,
            message,
            leader,
        }
    }
}

impl From<JsonRejection> for HttpError {
    fn from(r: JsonRejection) -> Self {
        let status = r.status();
        HttpError {
            status: if status == StatusCode::PAYLOAD_TOO_LARGE {
                status
            } else {
                StatusCode::BAD_REQUEST
            },
            message: format!("bad request body: {}", r.body_text()),
            leader: None,
        }
    }
}

type HttpResult = Result<Response, HttpError>;

fn channel_name(raw: &str) -> Result<ChannelName, HttpError> {
    ChannelName::new(raw).map_err(|e| HttpError::bad_request(e.to_string()))
}

/// What the router needs besides the coordinator handle.
#[derive(Debug, Clone, Default)]
pub struct ApiOptions {
    /// Metrics served on `/metrics`.
    pub registry: prometheus::Registry,
    /// When set, every write (any method but GET/HEAD) needs `Authorization: Bearer <token>`.
    pub token: Option<String>,
    /// Host names the API answers to besides IP addresses and `localhost` (`--admin-host`):
    /// any other `Host` is refused, against DNS rebinding. Matched without case or port.
    pub allowed_hosts: Vec<String>,
}

#[derive(Clone)]
struct AppState {
    handle: CoordHandle,
    registry: prometheus::Registry,
}

impl axum::extract::FromRef<AppState> for CoordHandle {
    fn from_ref(s: &AppState) -> CoordHandle {
        s.handle.clone()
    }
}

/// The status page: one self-contained HTML file that polls the API.
const STATUS_PAGE: &str = include_str!("status.html");

/// The router, ready to serve.
pub fn router(handle: CoordHandle, options: ApiOptions) -> Router {
    let token = options.token.clone();
    let allowed = std::sync::Arc::new(guard::AllowedHosts(
        options
            .allowed_hosts
            .iter()
            .map(|h| h.trim().to_ascii_lowercase())
            .filter(|h| !h.is_empty())
            .collect(),
    ));
    Router::new()
        .route("/", get(|| async { axum::response::Html(STATUS_PAGE) }))
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .route(
            "/api/v1/channels",
            get(list_channels)
                .post(bulk::add_one_or_many)
                .layer(DefaultBodyLimit::max(MAX_BULK_BODY_BYTES)),
        )
        .route(
            "/api/v1/channels/{name}",
            get(events::channel).delete(remove_channel),
        )
        .route("/api/v1/channels/{name}/move", post(move_channel))
        .route("/api/v1/nodes", get(list_nodes))
        .route("/api/v1/nodes/{id}/drain", post(drain))
        .route("/api/v1/balance", post(balance))
        .route("/api/v1/nodes/{id}", get(events::node))
        .route("/api/v1/nodes/{id}/undrain", post(events::undrain))
        .route("/api/v1/events", get(events::events))
        .route("/api/v1/channels/{name}/pin", post(pin))
        .route("/api/v1/channels/{name}/unpin", post(unpin))
        .route("/api/v1/summary", get(summary::summary))
        .fallback(no_such_endpoint)
        .method_not_allowed_fallback(no_such_method)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(axum::middleware::from_fn(move |req, next| {
            let token = token.clone();
            async move { require_token(token.as_deref(), req, next).await }
        }))
        .layer(axum::middleware::from_fn(move |req, next| {
            let allowed = allowed.clone();
            async move { guard::guard(&allowed, req, next).await }
        }))
        .with_state(AppState {
            handle,
            registry: options.registry,
        })
}

/// Any other path: a JSON 404 that names what was asked (axum's own has an empty body).
async fn no_such_endpoint(method: axum::http::Method, uri: axum::http::Uri) -> HttpError {
    HttpError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "no such endpoint: {method} {}; docs/OPERATING.md, \"Admin HTTP API\", lists them",
            uri.path()
        ),
        leader: None,
    }
}

/// A known path asked with a method it does not take: a JSON 405 (axum's own is empty).
async fn no_such_method(method: axum::http::Method, uri: axum::http::Uri) -> HttpError {
    HttpError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message: format!(
            "{} does not take {method}; docs/OPERATING.md, \"Admin HTTP API\", says which it takes",
            uri.path()
        ),
        leader: None,
    }
}

/// Writes need the bearer token when one is configured; reads never do.
async fn require_token(
    token: Option<&str>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    use subtle::ConstantTimeEq;
    let Some(token) = token else {
        return next.run(req).await;
    };
    if matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD
    ) {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or("");
    // Constant time: the comparison must not tell an attacker how much of a guess was right.
    if bool::from(given.as_bytes().ct_eq(token.as_bytes())) {
        return next.run(req).await;
    }
    HttpError {
        status: StatusCode::UNAUTHORIZED,
        message: "missing or wrong bearer token; pass --admin-token or set CHANWATCH_ADMIN_TOKEN"
            .into(),
        leader: None,
    }
    .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4",
        )],
        crate::metrics::render(&s.registry),
    )
        .into_response()
}

/// Serves `router` on `listener` until `shutdown` completes. Every request carries the bound
/// address, which the [`router`]'s Host check needs (a router served otherwise answers 500).
///
/// # Errors
/// I/O errors of the listener.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let bound = guard::BoundAddr(listener.local_addr()?);
    axum::serve(listener, router.layer(axum::Extension(bound)))
        .with_graceful_shutdown(shutdown)
        .await
}

async fn readyz(State(h): State<CoordHandle>) -> Response {
    let s = h.status();
    let code = if s.ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (code, Json(json!(s))).into_response()
}

/// A channel row with its checkpoint, for `?checkpoints=1`.
#[derive(Serialize)]
struct WithCheckpoint<'a> {
    #[serde(flatten)]
    row: &'a chanwatch_core::planner::ChannelRow,
    checkpoint: Option<Brief<'a>>,
}

/// A checkpoint without its channel (the row has it) or state (the handler's).
#[derive(Serialize)]
struct Brief<'a> {
    position: &'a str,
    epoch: u64,
    updated_at_ms: u64,
    age_ms: u64,
}

#[derive(Debug, Deserialize)]
struct ChannelsQuery {
    /// `1` / `true`: add each channel's `checkpoint`.
    #[serde(default)]
    checkpoints: Option<String>,
    /// Paging and filters (`api/summary.rs`): any of them makes the answer one page.
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    node: Option<String>,
    #[serde(default)]
    state: Option<String>,
    #[serde(default)]
    offset: Option<String>,
    #[serde(default)]
    limit: Option<String>,
}

/// The channel rows; with `?checkpoints=1` each also carries its `checkpoint` (`{position,
/// epoch, updated_at_ms, age_ms}` or `null`), read from the store with one range of the
/// checkpoint prefix for the request — the coordinator's view does not hold checkpoints. The
/// status page asks for them on every fifth poll only.
/// With any of `name`, `node`, `state`, `offset`, `limit` the answer is one page
/// `{total, offset, limit, rows}` in natural order (`api/summary.rs`).
async fn list_channels(State(h): State<CoordHandle>, Query(q): Query<ChannelsQuery>) -> HttpResult {
    let with = match q.checkpoints.as_deref() {
        None | Some("0" | "false") => false,
        Some("" | "1" | "true") => true,
        Some(other) => {
            return Err(HttpError::bad_request(format!(
                "checkpoints={other:?}: expected 1, true, 0 or false"
            )))
        }
    };
    let paged = summary::PageQuery {
        name: q.name.as_deref(),
        node: q.node.as_deref(),
        state: q.state.as_deref(),
        offset: q.offset.as_deref(),
        limit: q.limit.as_deref(),
    };
    if paged.given() {
        return summary::page(&h, &paged, with).await;
    }
    let rows = h.channels().await?;
    if !with {
        return Ok(Json(rows).into_response());
    }
    let read = h.checkpoints().await?;
    let by_channel: std::collections::HashMap<&str, &crate::checkpoints::CheckpointRow> = read
        .checkpoints
        .iter()
        .map(|c| (c.channel.as_str(), c))
        .collect();
    let out: Vec<WithCheckpoint<'_>> = rows
        .iter()
        .map(|row| WithCheckpoint {
            row,
            checkpoint: by_channel.get(row.channel.as_str()).map(|c| Brief {
                position: &c.position,
                epoch: c.epoch,
                updated_at_ms: c.updated_at_ms,
                age_ms: c.age_ms,
            }),
        })
        .collect();
    Ok(Json(out).into_response())
}

async fn list_nodes(State(h): State<CoordHandle>) -> HttpResult {
    Ok(Json(h.nodes().await?).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AddChannel {
    name: String,
    /// Read typed, once; its size is checked below (DESIGN §2: at most 64 KiB).
    #[serde(default)]
    vchannel: Option<VChannelInfo>,
    /// Relative load (DESIGN §5), default 1.
    #[serde(default)]
    weight: Option<u32>,
    /// Group spread across nodes (e.g. the collection).
    #[serde(default)]
    group: Option<String>,
}

async fn add_channel(
    State(h): State<CoordHandle>,
    body: Result<Json<AddChannel>, JsonRejection>,
) -> HttpResult {
    let Json(body) = body?;
    let name = channel_name(&body.name)?;
    let vchannel = body.vchannel.unwrap_or_default();
    vchannel
        .check_size()
        .map_err(|e| HttpError::bad_request(e.to_string()))?;
    let placement = Placement {
        weight: body.weight.unwrap_or(1),
        group: body.group,
    };
    placement
        .check()
        .map_err(|e| HttpError::bad_request(e.to_string()))?;
    let t = h.add_channel_with(name, vchannel, placement).await?;
    Ok((StatusCode::CREATED, Json(t)).into_response())
}

/// `POST /api/v1/channels/{name}/pin`: balance never moves it; nothing moves now.
async fn pin(State(h): State<CoordHandle>, Path(name): Path<String>) -> HttpResult {
    let t = h.pin(channel_name(&name)?, true).await?;
    Ok(Json(json!({ "channel": name, "pinned": true, "transitions": t })).into_response())
}

/// `POST /api/v1/channels/{name}/unpin`.
async fn unpin(State(h): State<CoordHandle>, Path(name): Path<String>) -> HttpResult {
    let t = h.pin(channel_name(&name)?, false).await?;
    Ok(Json(json!({ "channel": name, "pinned": false, "transitions": t })).into_response())
}

async fn remove_channel(State(h): State<CoordHandle>, Path(name): Path<String>) -> HttpResult {
    let t = h.remove_channel(channel_name(&name)?).await?;
    Ok(Json(t).into_response())
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    to: u64,
}

async fn move_channel(
    State(h): State<CoordHandle>,
    Path(name): Path<String>,
    body: Result<Json<MoveBody>, JsonRejection>,
) -> HttpResult {
    let Json(body) = body?;
    let t = h
        .move_channel(channel_name(&name)?, NodeId(body.to))
        .await?;
    Ok((StatusCode::ACCEPTED, Json(t)).into_response())
}

async fn drain(State(h): State<CoordHandle>, Path(id): Path<String>) -> HttpResult {
    let id: NodeId = id.parse().map_err(|_| {
        HttpError::bad_request(format!("{id:?} is not a node id (a decimal number)"))
    })?;
    h.drain(id).await?;
    Ok((StatusCode::ACCEPTED, Json(json!({ "draining": id.0 }))).into_response())
}

#[derive(Debug, Deserialize)]
struct BalanceQuery {
    #[serde(default)]
    dry_run: bool,
}

async fn balance(State(h): State<CoordHandle>, Query(q): Query<BalanceQuery>) -> HttpResult {
    let plan = h.balance(q.dry_run).await?;
    Ok(Json(json!({ "dry_run": q.dry_run, "moves": plan })).into_response())
}
