//! The local agent API (DESIGN §7): the HTTP endpoints an `--exec` worker process
//! calls to talk to its node — one listener per [`ExecHandler`](crate::handler::ExecHandler)
//! (TCP, and the same API on a Unix socket in a private directory: `CHANWATCH_AGENT_SOCKET`),
//! one random bearer token per child.
//!
//! | request | answer |
//! |---|---|
//! | `POST /ready` | 200: the load is done (the node acks `Watched`) |
//! | `POST /progress {"percent": N}` | 200: load progress, feeds the coordinator's watch timeout |
//! | `POST /commit {"position": "P", "state": {...}?}` | 200 once the fenced commit landed; 409 fenced (the run no longer owns the channel: exit; said before "paused" when the node both fenced itself and paused); 503 not known to have landed (node paused or store unavailable: commit again later); 413 state over 64 KiB; 400 a body that is not such an object |
//! | `POST /fail {"reason": "..."}` | 200: the channel is broken; the node stops the worker and acks `WatchFailed` (before `/ready` it ends the load at once) |
//! | `GET /state` | 200 `{"state": "running" \| "paused", "channel", "epoch"}` |
//! | `GET /read?after=P&max=N&wait_ms=W` | when the node has a log (`--log`): 200 `{"messages": [{"position", "payload"}]}`, the channel's next messages after `P` (empty: from the start; the payloads in hex), waiting up to `W` ms (default 1000, at most 10000) for one; 404 without a log; 400 an `after` that is not a position; 503 log unavailable; 500 any other error of the log's |
//!
//! Every request carries `Authorization: Bearer $CHANWATCH_AGENT_TOKEN`: 401 without one, 403
//! with a token no running child holds (a stopped child's, or a made-up one). The token names
//! the child, so a request with another child's token acts on that other child only — a child
//! can act only as itself as long as it keeps its token to itself. Errors are
//! `{"error": "..."}`; a body that is not the JSON object asked for is 400.
//!
//! A path the agent does not have is 404, one of its paths with another method 405 (with
//! `Allow`; `HEAD` is served wherever `GET` is), a body over 1 MiB 413 — all with a JSON
//! error like the rest.
//!
//! It is served with hyper directly, a task per HTTP/1 connection, not through a
//! router framework: a thousand workers each commit in a loop, and with axum's routing and
//! boxed services the node spent 26–28 µs of CPU per agent commit, without them 22–23 (1–2 µs
//! less per bare round trip; `bench exec`, docs/BENCHMARKS.md, 2026-12-05 afternoon).
//!
//! Owns: the listeners (and the Unix socket's directory), the table token → child, and mapping each request onto the child's
//! [`ChannelContext`]. Must not: touch the store (commits go through the context), or start and
//! stop processes (the exec handler does).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use std::convert::Infallible;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::header::{HeaderValue, ALLOW, AUTHORIZATION, CONTENT_TYPE};
use hyper::{HeaderMap, Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::watch;

use crate::handler::{ChannelContext, CommitError};

/// What the agent knows of one child: its run's context, whether its load is done, and
/// whether the node is paused.
pub(crate) struct AgentChild {
    pub(crate) ctx: ChannelContext,
    /// The log `GET /read` serves, when the node has one.
    pub(crate) log: Option<Arc<dyn chanwatch_stream::Log>>,
    pub(crate) ready: watch::Sender<bool>,
    /// Why the worker said it is broken (`POST /fail`), once it has: before `/ready` it ends
    /// the load, whose error then names it (`ctx.fail`, sent too, waits for the load's end
    /// in the node machine).
    pub(crate) failed: watch::Sender<Option<String>>,
    pub(crate) paused: AtomicBool,
}

impl std::fmt::Debug for AgentChild {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentChild")
            .field("channel", &self.ctx.info.channel)
            .field("epoch", &self.ctx.info.epoch)
            .field("log", &self.log.is_some())
            .field("paused", &self.paused)
            .finish_non_exhaustive()
    }
}

impl AgentChild {
    pub(crate) fn new(ctx: ChannelContext) -> Self {
        AgentChild {
            ctx,
            log: None,
            ready: watch::Sender::new(false),
            failed: watch::Sender::new(None),
            paused: AtomicBool::new(false),
        }
    }
}

#[derive(Debug, Default)]
struct Table {
    children: Mutex<HashMap<String, Arc<AgentChild>>>,
    /// Requests accepted: they bore a running child's token (whatever came of them).
    accepted: std::sync::atomic::AtomicU64,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<AgentChild>>> {
        self.children
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The agent: its address and the children it answers. Cloning shares it.
#[derive(Debug, Clone)]
pub struct Agent {
    table: Arc<Table>,
    url: String,
    /// The same API on a Unix socket, when [`Agent::serve_unix`] made one.
    socket: Option<Arc<SocketDir>>,
}

/// A private directory (mode 0700) holding the agent's Unix socket; removed with the last
/// clone of its agent.
#[derive(Debug)]
struct SocketDir {
    dir: std::path::PathBuf,
    socket: std::path::PathBuf,
}

impl Drop for SocketDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A child's place in the agent; dropping it revokes the token (its requests get 403).
#[derive(Debug)]
pub(crate) struct Registration {
    table: Arc<Table>,
    token: String,
}

impl Drop for Registration {
    fn drop(&mut self) {
        self.table.lock().remove(&self.token);
    }
}

impl Agent {
    /// Serves the agent API on `listener` until the process ends (the task holds nothing
    /// but the table).
    pub fn serve(listener: tokio::net::TcpListener) -> std::io::Result<Agent> {
        let addr = listener.local_addr()?;
        let table = Arc::new(Table::default());
        let served = table.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((tcp, _)) => {
                        // Answers go out at once, not after the worker's ACK of the previous
                        // one (Nagle).
                        if let Err(e) = tcp.set_nodelay(true) {
                            tracing::debug!(error = %e, "exec: cannot set TCP_NODELAY on an agent connection");
                        }
                        tokio::spawn(connection(tcp, served.clone()));
                    }
                    Err(e) => refused_connection(&e, "TCP listener").await,
                }
            }
        });
        Ok(Agent {
            table,
            url: format!("http://{addr}"),
            socket: None,
        })
    }

    /// Serves the same API, to the same children, on a Unix socket too: `agent.sock` in a
    /// fresh directory of `parent` only this user may enter (the token is checked all the
    /// same). A local worker saves the TCP stack's work per request there.
    ///
    /// # Errors
    /// The directory or the socket cannot be made.
    pub fn serve_unix(&mut self, parent: &std::path::Path) -> std::io::Result<()> {
        use std::os::unix::fs::DirBuilderExt;
        static DIRS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        sweep(parent);
        let n = DIRS.fetch_add(1, Ordering::Relaxed);
        let dir = parent.join(format!(
            "chanwatch-agent-{}-{n}-{}",
            std::process::id(),
            &random_token()?[..8]
        ));
        std::fs::DirBuilder::new().mode(0o700).create(&dir)?;
        let socket = dir.join("agent.sock");
        let made = SocketDir {
            dir,
            socket: socket.clone(),
        };
        let listener = tokio::net::UnixListener::bind(&socket)?;
        let served = self.table.clone();
        tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        tokio::spawn(connection(stream, served.clone()));
                    }
                    Err(e) => refused_connection(&e, "Unix socket").await,
                }
            }
        });
        self.socket = Some(Arc::new(made));
        Ok(())
    }

    /// The Unix socket children get as `CHANWATCH_AGENT_SOCKET`, when there is one.
    pub fn socket(&self) -> Option<&std::path::Path> {
        self.socket.as_deref().map(|s| s.socket.as_path())
    }

    /// The base URL children get as `CHANWATCH_AGENT_URL` (`http://127.0.0.1:PORT`).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// Requests accepted so far: those that bore a running child's token, to any endpoint,
    /// whatever came of them (401 and 403 are not counted; one counter add per request).
    pub fn accepted(&self) -> u64 {
        self.table.accepted.load(Ordering::Relaxed)
    }

    /// Answers requests bearing `token` for `child` until the registration is dropped.
    pub(crate) fn register(&self, token: String, child: Arc<AgentChild>) -> Registration {
        self.table.lock().insert(token.clone(), child);
        Registration {
            table: self.table.clone(),
            token,
        }
    }
}

/// Removes the socket directories in `parent` of nodes that are gone (`chanwatch-agent-PID-…`
/// with no process `PID`): a node killed with `SIGKILL` cannot remove its own. A directory
/// of a live process, or one this user may not remove, stays.
fn sweep(parent: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix("chanwatch-agent-"))
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A fresh random token: 32 hex digits from the OS's random source.
///
/// # Errors
/// `/dev/urandom` cannot be read.
pub(crate) fn random_token() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// An accept that failed. One connection's own trouble (reset or aborted before it was
/// taken) is no reason to wait; anything else (out of file descriptors, most likely) is
/// said, and the accept tried again a second later rather than in a busy loop, the agent
/// serving the connections it has meanwhile.
async fn refused_connection(e: &std::io::Error, listener: &str) {
    use std::io::ErrorKind::{ConnectionAborted, ConnectionRefused, ConnectionReset};
    if matches!(
        e.kind(),
        ConnectionAborted | ConnectionRefused | ConnectionReset
    ) {
        tracing::debug!(error = %e, listener, "exec: a worker's connection went before the agent took it");
        return;
    }
    tracing::warn!(error = %e, listener, "exec: the agent cannot accept a worker's connection; trying again in 1 s");
    tokio::time::sleep(std::time::Duration::from_secs(1)).await;
}

/// Serves one worker's keep-alive connection, HTTP/1.1, until it closes.
async fn connection<S>(stream: S, table: Arc<Table>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let service = hyper::service::service_fn(move |req| answer(table.clone(), req));
    let served = hyper::server::conn::http1::Builder::new()
        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
        .await;
    if let Err(e) = served {
        tracing::debug!(error = %e, "exec: an agent connection ended with an error");
    }
}

/// An answer of the agent: a whole JSON body.
type Answer = hyper::Response<Full<Bytes>>;

/// The endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Endpoint {
    Ready,
    Progress,
    Commit,
    Fail,
    State,
    Read,
}

/// The endpoint `method path` asks for, or the answer that refuses it (404: no such path;
/// 405: the path with another method, the one it takes in `Allow`).
fn endpoint(method: &Method, path: &str) -> Result<Endpoint, Box<Answer>> {
    let (endpoint, allowed) = match path {
        "/ready" => (Endpoint::Ready, "POST"),
        "/progress" => (Endpoint::Progress, "POST"),
        "/commit" => (Endpoint::Commit, "POST"),
        "/fail" => (Endpoint::Fail, "POST"),
        "/state" => (Endpoint::State, "GET"),
        "/read" => (Endpoint::Read, "GET"),
        _ => {
            return Err(Box::new(error(
                StatusCode::NOT_FOUND,
                format!("no endpoint {path}: the agent has POST /ready, /progress, /commit, /fail and GET /state, /read"),
            )))
        }
    };
    // HEAD is GET without the body (hyper leaves it out).
    if method.as_str() == allowed || (allowed == "GET" && *method == Method::HEAD) {
        return Ok(endpoint);
    }
    let allow = if allowed == "GET" {
        "GET, HEAD"
    } else {
        allowed
    };
    let mut refused = error(
        StatusCode::METHOD_NOT_ALLOWED,
        format!("{path} takes {allow}, not {method}"),
    );
    refused
        .headers_mut()
        .insert(ALLOW, HeaderValue::from_static(allow));
    Err(Box::new(refused))
}

/// The largest request body the agent takes, far over any it needs (a checkpoint state is
/// capped at 64 KiB encoded). A body that says it is larger (`Content-Length`) is refused
/// before any of it is read — a client that waits for `100 Continue` (curl) then sends none
/// of it; a chunked one is read up to the limit, then refused.
const MAX_BODY: usize = 1 << 20;

/// Answers one request: the endpoint (404, 405), then the caller's token (401, 403), then
/// the body (413 over [`MAX_BODY`]), then the endpoint's own work.
///
/// The body of a request that passes the first two checks is read whole before the
/// answer, even when the endpoint ignores it: hyper closes a keep-alive connection whose
/// request body was not read by the time the answer went out, and a worker that sends the
/// headers and the body in two writes (Python's `http.client`) would then find its next
/// request on a closed connection (a broken pipe). A refused request's connection may be
/// closed after the answer.
async fn answer(table: Arc<Table>, req: hyper::Request<Incoming>) -> Result<Answer, Infallible> {
    let (parts, body) = req.into_parts();
    let endpoint = match endpoint(&parts.method, parts.uri.path()) {
        Ok(e) => e,
        Err(refused) => return Ok(*refused),
    };
    let c = match child(&table, &parts.headers) {
        Ok(c) => c,
        Err(Refused(status, why)) => return Ok(error(status, why)),
    };
    if usize::try_from(hyper::body::Body::size_hint(&body).lower()).unwrap_or(usize::MAX) > MAX_BODY
    {
        return Ok(error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is over {MAX_BODY} bytes: nothing the agent takes is this large"),
        ));
    }
    let body = match Limited::new(body, MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Ok(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body is over {MAX_BODY} bytes"),
            ))
        }
        Err(e) => {
            return Ok(error(
                StatusCode::BAD_REQUEST,
                format!("the body could not be read: {e}"),
            ))
        }
    };
    Ok(match endpoint {
        Endpoint::Ready => {
            c.ready.send_replace(true);
            ok()
        }
        Endpoint::Progress => progress(&c, &body),
        Endpoint::Commit => commit(&c, &body).await,
        Endpoint::Fail => fail(&c, &body),
        Endpoint::State => state(&c),
        Endpoint::Read => read(&c, parts.uri.query().unwrap_or("")).await,
    })
}

/// `value` as a JSON answer with `status`.
fn json_answer(status: StatusCode, value: &Value) -> Answer {
    let body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    let mut answer = hyper::Response::new(Full::new(Bytes::from(body)));
    *answer.status_mut() = status;
    answer
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    answer
}

fn error(status: StatusCode, message: impl Into<String>) -> Answer {
    json_answer(status, &json!({ "error": message.into() }))
}

/// A refused request: its status and why.
struct Refused(StatusCode, &'static str);

/// The child the request's bearer token names (read from the request's headers in place,
/// with no copy of them), or why the request is refused.
fn child(table: &Table, headers: &HeaderMap) -> Result<Arc<AgentChild>, Refused> {
    let Some(token) = headers
        .get(AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        // The scheme's case does not matter (RFC 9110 §11.1): `bearer x` is `Bearer x`.
        .and_then(|v| {
            v.get(..7)
                .filter(|scheme| scheme.eq_ignore_ascii_case("Bearer "))
                .map(|_| &v[7..])
        })
    else {
        return Err(Refused(
            StatusCode::UNAUTHORIZED,
            "no `Authorization: Bearer $CHANWATCH_AGENT_TOKEN` header",
        ));
    };
    let child = table.lock().get(token.trim()).cloned().ok_or(Refused(
        StatusCode::FORBIDDEN,
        "this token belongs to no running worker (its run ended, or it was never issued): exit",
    ))?;
    table.accepted.fetch_add(1, Ordering::Relaxed);
    Ok(child)
}

/// The body as a JSON object (an empty body is `{}`).
fn object(body: &[u8]) -> Result<serde_json::Map<String, Value>, Refused> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) | Err(_) => Err(Refused(
            StatusCode::BAD_REQUEST,
            "the body must be a JSON object",
        )),
    }
}

/// `{"ok":true}`, 200: built with no copy of the body.
fn ok() -> Answer {
    let mut answer = hyper::Response::new(Full::new(Bytes::from_static(br#"{"ok":true}"#)));
    answer
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    answer
}

fn progress(c: &AgentChild, body: &[u8]) -> Answer {
    let body = match object(body) {
        Ok(b) => b,
        Err(Refused(status, why)) => return error(status, why),
    };
    let Some(percent) = body.get("percent").and_then(Value::as_u64) else {
        return error(
            StatusCode::BAD_REQUEST,
            "want {\"percent\": 0..100} (an unsigned integer)",
        );
    };
    c.ctx
        .progress(u8::try_from(percent.min(100)).unwrap_or(100));
    ok()
}

/// The body of `POST /commit`; other fields are ignored.
#[derive(serde::Deserialize)]
struct CommitBody {
    position: Option<Value>,
    #[serde(default)]
    state: Option<Value>,
}

/// The body of `POST /commit` as (position, state), or why it is refused.
fn commit_body(body: &[u8]) -> Result<(String, Option<Value>), Refused> {
    const NOT_AN_OBJECT: Refused =
        Refused(StatusCode::BAD_REQUEST, "the body must be a JSON object");
    const BAD: Refused = Refused(
        StatusCode::BAD_REQUEST,
        "want {\"position\": \"...\" (a non-empty string), \"state\": {...} (optional)}",
    );
    let Some(start) = body.iter().position(|b| !b.is_ascii_whitespace()) else {
        return Err(BAD);
    };
    if body[start] != b'{' {
        return Err(NOT_AN_OBJECT);
    }
    let parsed: CommitBody = serde_json::from_slice(body).map_err(|_| NOT_AN_OBJECT)?;
    match parsed.position {
        Some(Value::String(p)) if !p.is_empty() => Ok((p, parsed.state.filter(|s| !s.is_null()))),
        _ => Err(BAD),
    }
}

async fn commit(c: &AgentChild, body: &[u8]) -> Answer {
    let (position, state) = match commit_body(body) {
        Ok(b) => b,
        Err(Refused(status, why)) => return error(status, why),
    };
    // Fenced before paused: a node that fences itself has mostly paused first, and its
    // worker must hear 409 (exit) at once, not 503 (commit again later).
    if c.ctx
        .committer
        .as_ref()
        .is_some_and(crate::checkpoint::Committer::session_closed)
    {
        let fenced = CommitError::Fenced("this node's session ended".into());
        return error(StatusCode::CONFLICT, fenced.to_string());
    }
    if c.paused.load(Ordering::SeqCst) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "the node is paused (it cannot reach the store): nothing committed; stop external effects and commit again once GET /state says running",
        );
    }
    // Awaited here: a worker that hangs up (its timeout, a broken connection) makes hyper
    // drop this future, which the commit is safe against (the run's next commit reconciles).
    match c.ctx.commit(position, state).await {
        Ok(()) => ok(),
        Err(e @ CommitError::Fenced(_)) => error(StatusCode::CONFLICT, e.to_string()),
        Err(e @ CommitError::Unavailable(_)) => {
            error(StatusCode::SERVICE_UNAVAILABLE, e.to_string())
        }
        Err(e @ CommitError::TooLarge(_)) => error(StatusCode::PAYLOAD_TOO_LARGE, e.to_string()),
    }
}

fn fail(c: &AgentChild, body: &[u8]) -> Answer {
    let body = match object(body) {
        Ok(b) => b,
        Err(Refused(status, why)) => return error(status, why),
    };
    let reason = body
        .get("reason")
        .and_then(Value::as_str)
        .unwrap_or("the worker reported itself broken (no reason given)");
    let reason = format!("worker: {reason}");
    // Before `/ready` the node waits on the load, which this ends; after, on `ctx.fail`.
    c.failed.send_replace(Some(reason.clone()));
    c.ctx.fail(reason);
    ok()
}

fn state(c: &AgentChild) -> Answer {
    let state = if c.paused.load(Ordering::SeqCst) {
        "paused"
    } else {
        "running"
    };
    json_answer(
        StatusCode::OK,
        &json!({
            "state": state,
            "channel": c.ctx.info.channel.as_str(),
            "epoch": c.ctx.info.epoch.0,
        }),
    )
}

mod read;
use read::read;

#[cfg(test)]
mod tests;
