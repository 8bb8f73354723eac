//! Unit tests of the agent API over a real socket: token checks, one child's token acting
//! on that child only, revocation, the pause in `GET /state`, and `GET /read`.
//!
//! Just over 600 lines: one flat list of independent request cases over a real socket.
use super::*;
use crate::handler::RunnerEvent;
use chanwatch_core::{ChannelInfo, ChannelName, Epoch, NodeId, VChannelInfo};
use tokio::sync::mpsc;

/// A context outside any node: its events (progress, fail) land in the receiver.
fn context(channel: &str) -> (ChannelContext, mpsc::UnboundedReceiver<RunnerEvent>) {
    let (events, rx) = mpsc::unbounded_channel();
    let ctx = ChannelContext {
        node: NodeId(1),
        info: ChannelInfo::new(
            ChannelName::new(channel).expect("valid"),
            Epoch(3),
            0,
            VChannelInfo::default(),
        ),
        clock: chanwatch_store::Clock::system(),
        events,
        last_progress: Arc::default(),
        progress_interval: std::time::Duration::from_secs(5),
        generation: 1,
        committer: None,
    };
    (ctx, rx)
}

async fn call(
    agent: &Agent,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, Value) {
    let (status, _, json) = call_raw(agent, method, path, token, body).await;
    (status, json)
}

/// One request on a connection of its own: the status, the head (lower-cased) and the JSON
/// body (`Null` when there is none).
async fn call_raw(
    agent: &Agent,
    method: &str,
    path: &str,
    token: Option<&str>,
    body: &str,
) -> (u16, String, Value) {
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    request(agent, method, path, &auth, body).await
}

/// One request with `Authorization: {value}` and no body.
async fn call_raw_auth(
    agent: &Agent,
    method: &str,
    path: &str,
    value: &str,
) -> (u16, String, Value) {
    request(
        agent,
        method,
        path,
        &format!("Authorization: {value}\r\n"),
        "",
    )
    .await
}

/// One request on a connection of its own, `auth` its authorization header line (or empty).
async fn request(
    agent: &Agent,
    method: &str,
    path: &str,
    auth: &str,
    body: &str,
) -> (u16, String, Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let addr = agent.url().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut out = String::new();
    s.read_to_string(&mut out).await.expect("read");
    let status = out[9..12].parse().expect("status");
    let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
    let json = serde_json::from_str(body).unwrap_or(Value::Null);
    (status, head.to_ascii_lowercase(), json)
}

/// A child of `channel` that `agent` answers by `token`: the child, its registration (the
/// token is revoked when it is dropped) and the node's end of its events.
fn registered(
    agent: &Agent,
    channel: &str,
    token: &str,
) -> (
    Arc<AgentChild>,
    Registration,
    mpsc::UnboundedReceiver<RunnerEvent>,
) {
    let (ctx, events) = context(channel);
    let child = Arc::new(AgentChild::new(ctx));
    let reg = agent.register(token.into(), child.clone());
    (child, reg, events)
}

async fn agent() -> Agent {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    Agent::serve(l).expect("serve")
}

#[tokio::test]
async fn a_request_without_a_token_or_with_an_unknown_one_is_refused_and_changes_nothing() {
    let agent = agent().await;
    let (child, _reg, mut events) = registered(&agent, "a", "tok-a");
    assert_eq!(call(&agent, "POST", "/ready", None, "").await.0, 401);
    assert_eq!(
        call(&agent, "POST", "/ready", Some("nope"), "").await.0,
        403
    );
    assert_eq!(
        call(&agent, "POST", "/fail", Some("nope"), "{\"reason\":\"x\"}")
            .await
            .0,
        403
    );
    assert_eq!(call(&agent, "GET", "/state", Some("nope"), "").await.0, 403);
    assert_eq!(agent.accepted(), 0, "refused requests are not counted");
    assert!(!*child.ready.borrow());
    assert!(
        events.try_recv().is_err(),
        "a refused /fail reached the node"
    );
    assert_eq!(
        call(&agent, "POST", "/ready", Some("tok-a"), "").await.0,
        200
    );
    assert!(*child.ready.borrow());
    assert_eq!(agent.accepted(), 1, "the accepted request is counted");
    // The scheme in any case.
    let (status, _, _) = call_raw_auth(&agent, "GET", "/state", "bearer tok-a").await;
    assert_eq!(status, 200, "a lower-case scheme");
    let (status, _, _) = call_raw_auth(&agent, "GET", "/state", "Basic tok-a").await;
    assert_eq!(status, 401, "another scheme");
}

/// A path the agent does not have is 404, one of its paths with another method 405 naming
/// the methods it takes (`Allow`), both with a JSON error and before the token is looked
/// at; `HEAD` is served wherever `GET` is.
#[tokio::test]
async fn a_path_or_a_method_the_agent_does_not_have_is_a_json_error() {
    let agent = agent().await;
    let (child, _reg, _events) = registered(&agent, "a", "tok-a");
    let (status, head, body) = call_raw(&agent, "POST", "/nope", Some("tok-a"), "{}").await;
    assert_eq!(status, 404);
    assert!(head.contains("content-type: application/json"), "{head}");
    assert!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("/commit")),
        "the error names the endpoints: {body}"
    );
    let (status, head, body) = call_raw(&agent, "GET", "/commit", None, "").await;
    assert_eq!(status, 405);
    assert!(head.contains("\r\nallow: post"), "{head}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("POST")),
        "the error names the method: {body}"
    );
    let (status, head, _) = call_raw(&agent, "POST", "/state", Some("tok-a"), "").await;
    assert_eq!(status, 405);
    assert!(head.contains("\r\nallow: get, head"), "{head}");
    assert_eq!(agent.accepted(), 0, "refused requests are not counted");
    assert!(!*child.ready.borrow());
    let (status, _, body) = call_raw(&agent, "HEAD", "/state", Some("tok-a"), "").await;
    assert_eq!(
        (status, body),
        (200, Value::Null),
        "HEAD: GET without the body"
    );
}

/// A body that says it is over the agent's limit is refused (413, a JSON error) before any
/// of it is sent, and changes nothing.
#[tokio::test]
async fn a_body_over_the_limit_is_refused_before_it_is_sent() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let agent = agent().await;
    let (_child, _reg, mut events) = registered(&agent, "a", "tok-a");
    let addr = agent.url().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    // The head alone, as a client that waits for `100 Continue` sends it.
    let head = format!(
        "POST /fail HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer tok-a\r\nContent-Length: {}\r\nExpect: 100-continue\r\n\r\n",
        MAX_BODY + 1
    );
    s.write_all(head.as_bytes()).await.expect("write head");
    let mut answer = String::new();
    tokio::time::timeout(
        std::time::Duration::from_secs(5),
        s.read_to_string(&mut answer),
    )
    .await
    .expect("an answer, and the connection closed, within 5 s")
    .expect("read");
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(
        !answer.contains("100 Continue"),
        "asked for the body: {answer}"
    );
    let body: Value = answer
        .split_once("\r\n\r\n")
        .and_then(|(_, b)| serde_json::from_str(b).ok())
        .unwrap_or(Value::Null);
    assert!(body["error"].as_str().is_some(), "{answer}");
    assert!(
        events.try_recv().is_err(),
        "the refused /fail reached the node"
    );
}

#[tokio::test]
async fn another_childs_token_acts_on_that_child_only() {
    let agent = agent().await;
    let (a, _ra, mut ev_a) = registered(&agent, "a", "tok-a");
    let (b, _rb, mut ev_b) = registered(&agent, "b", "tok-b");
    assert_eq!(
        call(&agent, "POST", "/ready", Some("tok-b"), "").await.0,
        200
    );
    assert!(*b.ready.borrow() && !*a.ready.borrow());
    assert_eq!(
        call(
            &agent,
            "POST",
            "/fail",
            Some("tok-b"),
            "{\"reason\":\"boom\"}"
        )
        .await
        .0,
        200
    );
    assert!(ev_a.try_recv().is_err());
    assert!(ev_b.try_recv().is_ok());
    let (s, body) = call(&agent, "GET", "/state", Some("tok-a"), "").await;
    assert_eq!((s, body["channel"].as_str()), (200, Some("a")));
}

#[tokio::test]
async fn a_dropped_registration_revokes_the_token_and_state_follows_the_pause() {
    let agent = agent().await;
    let (child, reg, _ev) = registered(&agent, "a", "tok-a");
    assert_eq!(
        call(&agent, "GET", "/state", Some("tok-a"), "").await.1["state"],
        "running"
    );
    child.paused.store(true, Ordering::SeqCst);
    assert_eq!(
        call(&agent, "GET", "/state", Some("tok-a"), "").await.1["state"],
        "paused"
    );
    let (s, _) = call(
        &agent,
        "POST",
        "/commit",
        Some("tok-a"),
        "{\"position\":\"3\"}",
    )
    .await;
    assert_eq!(s, 503, "a paused node commits nothing");
    assert_eq!(
        call(&agent, "POST", "/commit", Some("tok-a"), "[1]")
            .await
            .0,
        400
    );
    drop(reg);
    assert_eq!(
        call(&agent, "GET", "/state", Some("tok-a"), "").await.0,
        403
    );
}

#[tokio::test]
async fn read_serves_the_childs_own_channel_after_a_position_when_the_node_has_a_log() {
    let agent = agent().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let log: Arc<dyn chanwatch_stream::Log> = Arc::new(
        chanwatch_stream::FileLog::open(dir.path(), chanwatch_stream::FileLogOptions::default())
            .expect("log"),
    );
    for p in [&b"one"[..], b"two", b"\x00\xff"] {
        log.append("a", bytes::Bytes::copy_from_slice(p))
            .await
            .expect("append");
    }
    log.append("b", bytes::Bytes::from_static(b"not a's"))
        .await
        .expect("append");
    let (ctx, _ev) = context("a");
    let child = Arc::new(AgentChild {
        log: Some(log),
        ..AgentChild::new(ctx)
    });
    let _reg = agent.register("tok-a".into(), child);
    let (s, body) = call(
        &agent,
        "GET",
        "/read?after=1&max=10&wait_ms=0",
        Some("tok-a"),
        "",
    )
    .await;
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        body["messages"],
        json!([{"position": "2", "payload": "74776f"}, {"position": "3", "payload": "00ff"}])
    );
    let (s, body) = call(&agent, "GET", "/read?max=1&wait_ms=0", Some("tok-a"), "").await;
    assert_eq!(
        (s, body["messages"][0]["position"].as_str()),
        (200, Some("1"))
    );
    assert_eq!(
        call(&agent, "GET", "/read?after=x", Some("tok-a"), "")
            .await
            .0,
        400
    );
    assert_eq!(call(&agent, "GET", "/read", Some("nope"), "").await.0, 403);
    let (ctx, _ev) = context("b");
    let _rb = agent.register("tok-b".into(), Arc::new(AgentChild::new(ctx)));
    assert_eq!(
        call(&agent, "GET", "/read", Some("tok-b"), "").await.0,
        404,
        "no log"
    );
}

#[test]
fn tokens_are_random_and_long() {
    let (a, b) = (
        random_token().expect("token"),
        random_token().expect("token"),
    );
    assert_eq!(a.len(), 32);
    assert_ne!(a, b);
}

/// A context whose commits go to the returned receiver (the test answers them as the node's
/// group commit would), its checkpoint read from the returned embedded store (empty).
fn committing_context(
    channel: &str,
) -> (
    ChannelContext,
    mpsc::UnboundedReceiver<crate::checkpoint::CommitRequest>,
    chanwatch_store::EmbeddedStore,
) {
    use crate::checkpoint::{CommitShared, Committer};
    let (tx, commits) = mpsc::unbounded_channel();
    let store = chanwatch_store::EmbeddedStore::new();
    let shared = Arc::new(CommitShared {
        store: Arc::new(store.clone()),
        tx,
        keys: chanwatch_core::Keys::default(),
        node: NodeId(1),
        clock: chanwatch_store::Clock::system(),
        metrics: Arc::new(crate::metrics::NodeMetrics::new()),
        planted: crate::config::Planted::default(),
    });
    let (mut ctx, _events) = context(channel);
    ctx.committer = Some(Committer::new(
        shared,
        ChannelName::new(channel).expect("valid"),
        Epoch(3),
        1,
    ));
    (ctx, commits, store)
}

/// A worker whose `/commit` times out, or whose connection breaks, makes hyper drop the
/// node's commit half way: if the write lands all the same, the run's next commit must be
/// guarded by its revision, or it would be refused as fenced (409) by the run's own write,
/// and the worker would exit.
#[tokio::test]
async fn a_commit_whose_worker_hung_up_still_lands_and_is_booked_for_the_next_one() {
    use chanwatch_store::MetaStore;
    use tokio::io::AsyncWriteExt;
    let agent = agent().await;
    let (ctx, mut commits, store) = committing_context("a");
    let key = chanwatch_core::Keys::default().checkpoint(&ctx.info.channel);
    let _reg = agent.register("tok-a".into(), Arc::new(AgentChild::new(ctx)));
    let addr = agent.url().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let body = "{\"position\":\"1\"}";
    let req = format!(
        "POST /commit HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer tok-a\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), commits.recv())
        .await
        .expect("the commit reaches the writer")
        .expect("open");
    // The worker hangs up before the answer; the write lands anyway (the writer had sent it).
    drop(s);
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let landed = store
        .txn(chanwatch_store::Txn::new().and_then([first.put]))
        .await
        .expect("the write lands")
        .revision;
    let _ = first.reply.send(Ok(landed));
    let second = tokio::spawn({
        let agent = agent.clone();
        async move {
            call(
                &agent,
                "POST",
                "/commit",
                Some("tok-a"),
                "{\"position\":\"2\"}",
            )
            .await
        }
    });
    let req = tokio::time::timeout(std::time::Duration::from_secs(5), commits.recv())
        .await
        .expect("the second commit reaches the writer")
        .expect("open");
    assert!(
        req.compares
            .contains(&chanwatch_store::Compare::mod_revision(&key, landed)),
        "the second commit is not guarded by the first one's revision {landed}: {:?}",
        req.compares
    );
    req.reply.send(Ok(landed + 1)).expect("answered");
    assert_eq!(second.await.expect("joined").0, 200);
}

/// A node that fences itself has mostly paused first (it lost the store): its workers' commits
/// are answered 409 (exit) at once, not 503 (commit again later) because of the pause. And a
/// paused node whose session still holds answers 503, as before.
#[tokio::test]
async fn a_fenced_nodes_commit_is_409_even_while_it_is_paused() {
    let agent = agent().await;
    let (ctx, commits, _store) = committing_context("a");
    let child = Arc::new(AgentChild::new(ctx));
    let _reg = agent.register("tok-a".into(), child.clone());
    child.paused.store(true, Ordering::SeqCst);
    let commit = || {
        call(
            &agent,
            "POST",
            "/commit",
            Some("tok-a"),
            "{\"position\":\"1\"}",
        )
    };
    assert_eq!(commit().await.0, 503, "paused, the session holds");
    // The session's writer is gone: the session fenced itself.
    drop(commits);
    let (status, body) = commit().await;
    assert_eq!(status, 409, "{body}");
    assert!(
        body["error"].as_str().is_some_and(|e| e.contains("fenced")),
        "{body}"
    );
}

/// `POST /fail` before `/ready` is heard by the exec handler's load (`failed`), which ends at
/// once; after `/ready` it reaches the node through `ctx.fail` as well.
#[tokio::test]
async fn fail_tells_the_load_and_the_node() {
    let agent = agent().await;
    let (child, _reg, mut events) = registered(&agent, "a", "tok-a");
    assert_eq!(
        call(
            &agent,
            "POST",
            "/fail",
            Some("tok-a"),
            "{\"reason\":\"no disk\"}"
        )
        .await
        .0,
        200
    );
    assert_eq!(
        child.failed.borrow().as_deref(),
        Some("worker: no disk"),
        "the load did not hear it"
    );
    assert!(events.try_recv().is_ok(), "the node did not hear it");
}

/// A worker that writes a request's headers and its body apart (Python's `http.client` does)
/// keeps its connection: the agent read `/ready`'s body it does not use before answering.
/// It used to answer at once and hyper then closed the connection with the body unread: the
/// worker's next request hit a broken pipe and it exited 1 (a `WatchFailed` in `bench exec`).
#[tokio::test]
async fn a_request_whose_body_comes_apart_from_its_headers_keeps_the_connection() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let agent = agent().await;
    let (child, _reg, _events) = registered(&agent, "a", "tok-a");
    let addr = agent.url().trim_start_matches("http://").to_owned();
    let mut s = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connect");
    let head = |path: &str, len: usize| {
        format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer tok-a\r\nContent-Type: application/json\r\nContent-Length: {len}\r\n\r\n")
    };
    // Two requests whose bodies come 100 ms after their headers, on one connection.
    for path in ["/ready", "/progress"] {
        let body = if path == "/ready" {
            "{}"
        } else {
            "{\"percent\":50}"
        };
        s.write_all(head(path, body.len()).as_bytes())
            .await
            .expect("write headers");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        s.write_all(body.as_bytes()).await.expect("write body");
        let mut answer = Vec::new();
        let mut buf = [0u8; 1024];
        while !String::from_utf8_lossy(&answer).contains("{\"ok\":true}") {
            let n = tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf))
                .await
                .expect("an answer within 5 s")
                .expect("read");
            assert!(
                n > 0,
                "the agent closed the connection before answering {path}: {}",
                String::from_utf8_lossy(&answer)
            );
            answer.extend_from_slice(&buf[..n]);
        }
        assert!(
            String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"),
            "{path}: {}",
            String::from_utf8_lossy(&answer)
        );
    }
    assert!(*child.ready.borrow());
}

/// The API on the agent's Unix socket answers the same children by the same tokens, and its
/// directory (only this user may enter it) goes with the agent.
#[tokio::test]
async fn the_unix_socket_serves_the_same_children_and_goes_with_the_agent() {
    use std::os::unix::fs::PermissionsExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let parent = tempfile::tempdir().expect("tempdir");
    let mut agent = agent().await;
    agent.serve_unix(parent.path()).expect("unix socket");
    let socket = agent.socket().expect("a socket").to_owned();
    let dir = socket.parent().expect("its directory").to_owned();
    let mode = std::fs::metadata(&dir).expect("dir").permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "{}", dir.display());
    let (child, _reg, _events) = registered(&agent, "a", "tok-a");
    for (token, want) in [("nope", "403"), ("tok-a", "200")] {
        let mut s = tokio::net::UnixStream::connect(&socket)
            .await
            .expect("connect");
        let req = format!("POST /ready HTTP/1.1\r\nHost: agent\r\nAuthorization: Bearer {token}\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{{}}");
        s.write_all(req.as_bytes()).await.expect("write");
        let mut out = String::new();
        s.read_to_string(&mut out).await.expect("read");
        assert_eq!(&out[9..12], want, "{token}: {out}");
    }
    assert!(*child.ready.borrow());
    drop(agent);
    assert!(!dir.exists(), "{} outlived its agent", dir.display());
}

/// A socket directory left by a node that is gone (killed with `SIGKILL`) is removed when the
/// next agent makes its own; one of a live process stays.
#[tokio::test]
async fn a_dead_nodes_socket_directory_is_swept_and_a_live_ones_stays() {
    let parent = tempfile::tempdir().expect("tempdir");
    // No process has pid 0 in /proc; this one is alive.
    let dead = parent.path().join("chanwatch-agent-0-0-deadbeef");
    let live = parent.path().join(format!(
        "chanwatch-agent-{}-99-cafecafe",
        std::process::id()
    ));
    let other = parent.path().join("something-else");
    for d in [&dead, &live, &other] {
        std::fs::create_dir(d).expect("mkdir");
    }
    let mut agent = agent().await;
    agent.serve_unix(parent.path()).expect("unix socket");
    assert!(!dead.exists(), "a dead node's directory stayed");
    assert!(live.exists() && other.exists());
}
