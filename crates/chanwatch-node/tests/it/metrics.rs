//! The data plane's metrics as Prometheus scrapes them from a node's admin `/metrics`: a
//! consumer node on the embedded store and the file log, a backlog it works off, then quiet.
//! The exposition is also checked with `promtool check metrics` (Debian's `prometheus`
//! package; a missing promtool fails the test with how to install it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use chanwatch_coord::Coordinator;
use chanwatch_core::{ChannelName, Checkpoint, Keys, VChannelInfo};
use chanwatch_node::handler::{ConsumerOptions, StreamConsumer};
use chanwatch_node::Node;
use chanwatch_store::{EmbeddedStore, MetaStore};
use chanwatch_stream::{FileLog, FileLogOptions, Log};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// `GET /metrics` over a plain socket.
async fn scrape(addr: std::net::SocketAddr) -> Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let (head, body) = out.split_once("\r\n\r\n").context("an HTTP answer")?;
    ensure!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    Ok(body.to_owned())
}

/// The value of the sample `name` (with its labels, exactly as exposed).
fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_nodes_metrics_show_commits_their_latency_messages_lag_and_checkpoint_age(
) -> Result<()> {
    let dir = tempfile::tempdir()?;
    let log: Arc<dyn Log> = Arc::new(FileLog::open(dir.path(), FileLogOptions::default())?);
    // A backlog before the node starts, read 8 at a time: the run is behind for a while.
    const BACKLOG: u64 = 20_000;
    for seq in 1..=BACKLOG {
        let mut p = seq.to_be_bytes().to_vec();
        p.extend_from_slice(b"payload");
        log.append("m-0", Bytes::from(p)).await?;
    }
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let mut ready = coordinator.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let consumer = Arc::new(StreamConsumer::new(
        log.clone(),
        ConsumerOptions {
            commit_every: 500,
            commit_interval: Duration::from_millis(200),
            batch: 8,
        },
    ));
    let node = Node::builder(store.clone())
        .handler(consumer)
        .session_ttl(Duration::from_secs(2))
        .spawn()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = chanwatch_node::admin::router(node.watch_status(), node.registry().clone());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let name = ChannelName::new("m-0")?;
    coordinator
        .add_channel(name.clone(), VChannelInfo::default())
        .await?;
    // Behind while it works off the backlog (sampled often: it takes well under a second).
    let key = Keys::default().checkpoint(&name);
    let started = Instant::now();
    let mut max_lag = 0;
    loop {
        max_lag = max_lag.max(node.metrics().consumer_lag.get());
        let cp = match store.get(&key).await? {
            Some(kv) => Some(Checkpoint::decode(&kv.value)?),
            None => None,
        };
        if cp.is_some_and(|cp| cp.position == BACKLOG.to_string()) {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "the backlog was not committed"
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    ensure!(
        max_lag > 0 && max_lag <= BACKLOG as i64,
        "lag never showed the backlog: max {max_lag}"
    );

    // Quiet now: nothing to commit, so the checkpoint ages.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let text = scrape(addr).await?;
    let get = |n: &str| sample(&text, n).with_context(|| format!("no {n} in:\n{text}"));
    ensure!(get("chanwatch_node_checkpoint_commits_total{result=\"ok\"}")? >= 1.0);
    for r in ["fenced", "unavailable", "too_large"] {
        let n = format!("chanwatch_node_checkpoint_commits_total{{result=\"{r}\"}}");
        ensure!(get(&n)? == 0.0, "{n}:\n{text}");
    }
    ensure!(
        get("chanwatch_node_checkpoint_commit_seconds_count")?
            == get("chanwatch_node_checkpoint_commits_total{result=\"ok\"}")?,
        "every commit's latency is observed:\n{text}"
    );
    ensure!(get("chanwatch_node_consumer_messages_total")? >= BACKLOG as f64);
    ensure!(
        get("chanwatch_node_consumer_lag_positions")? == 0.0,
        "caught up:\n{text}"
    );
    let age = get("chanwatch_node_checkpoint_oldest_age_seconds")?;
    ensure!((1.0..30.0).contains(&age), "age {age}:\n{text}");
    promtool_check(&text)?;

    // The channel leaves the node: its checkpoint no longer counts.
    coordinator.remove_channel(name).await?;
    let started = Instant::now();
    while node.metrics().checkpoint_ages.oldest_age_secs() != 0.0 {
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "a removed channel's checkpoint still counts"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node.stop().await?;
    Ok(())
}

/// `promtool check metrics` on the exposition, when promtool is installed: it reads stdin and
/// fails on malformed text and on lint findings (e.g. a counter without `_total`).
fn promtool_check(text: &str) -> Result<()> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let Ok(mut child) = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    else {
        anyhow::bail!(
            "promtool is not on PATH: it checks the metrics exposition. Install it with \
             `apt-get install -y prometheus` (Debian), or put a promtool binary on PATH"
        );
    };
    child
        .stdin
        .take()
        .context("stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    ensure!(out.status.success(), "promtool check metrics: {said}");
    Ok(())
}

/// `GET path` over a plain socket: the status code and the body.
async fn get_path(addr: std::net::SocketAddr, path: &str) -> Result<(u16, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    let (head, body) = out.split_once("\r\n\r\n").context("an HTTP answer")?;
    let code = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .context("a status code")?;
    Ok((code, body.to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_named_node_shows_its_name_in_its_session_the_coordinators_rows_and_status_and_is_ready_once_registered(
) -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let coordinator = Coordinator::builder(store.clone()).spawn()?;
    let node = Node::builder(store.clone())
        .name("db-7")
        .session_ttl(Duration::from_secs(2))
        .spawn()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let router = chanwatch_node::admin::router(node.watch_status(), node.registry().clone());
    tokio::spawn(async move { axum::serve(listener, router).await });
    let mut status = node.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.id.is_some())).await??;
    let id = node.status().id.context("registered")?;
    let session = store
        .get(&Keys::default().session(id))
        .await?
        .context("the session")?;
    let session = chanwatch_core::NodeSession::decode(&session.value)?;
    ensure!(session.name == "db-7", "{session:?}");
    let started = Instant::now();
    loop {
        let rows = coordinator.nodes().await.unwrap_or_default();
        if rows.iter().any(|r| r.id == id.0 && r.name == "db-7") {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(10),
            "the coordinator's rows lack the name: {rows:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, body) = get_path(addr, "/status").await?;
    ensure!(code == 200 && body.contains("\"name\":\"db-7\""), "{body}");
    let (code, body) = get_path(addr, "/readyz").await?;
    ensure!(code == 200, "{code} {body}");
    Ok(())
}
