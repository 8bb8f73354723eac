//! The status page rendered by a real headless Chromium against a running coordinator.
//!
//! Chromium comes from `$CHANWATCH_CHROMIUM`, `chromium` on PATH or `/usr/bin/chromium`; when
//! it is missing the test fails with the install command (it never skips). Set
//! `CHANWATCH_SCREENSHOT` to a path to also save a PNG of the page (docs/status.png is made so).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};

use crate::cluster::{Cluster, TTL};

fn chromium() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os("CHANWATCH_CHROMIUM") {
        return Ok(PathBuf::from(p));
    }
    for name in ["chromium", "chromium-browser"] {
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                if dir.join(name).is_file() {
                    return Ok(dir.join(name));
                }
            }
        }
    }
    bail!("no chromium found (CHANWATCH_CHROMIUM, PATH); install it with `apt-get install -y chromium`")
}

/// Runs headless Chromium on `url` with `extra` flags and returns its stdout.
fn headless(url: &str, extra: &[String]) -> Result<String> {
    let profile = tempfile::tempdir()?;
    let out = Command::new(chromium()?)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
            "--window-size=1100,520",
            // Lets the page's fetches and one refresh run before the DOM is taken.
            "--virtual-time-budget=4000",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(extra)
        .arg(url)
        .output()
        .context("running chromium")?;
    ensure!(
        out.status.success(),
        "chromium failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_shows_a_killed_nodes_channels_under_the_other_nodes() -> Result<()> {
    chromium()?;
    let c = Cluster::embedded().await?;
    let coord = c.spawn_coord("c1");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}/", listener.local_addr()?);
    let router = chanwatch_coord::api::router(
        coord.handle.clone(),
        chanwatch_coord::api::ApiOptions::default(),
    );
    tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    let mut nodes = vec![c.spawn_node(), c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 3).await?;
    c.add_channels(&coord, "orders-", 9).await?;
    c.wait_until(Duration::from_secs(20), "9 Watched", |v| {
        v.all_watched_on_live_nodes(9)
    })
    .await?;
    // A checkpoint, written behind the coordinator's back: the page reads it through the API
    // from the store, and shows its position and age.
    let cp = chanwatch_core::Checkpoint {
        epoch: chanwatch_core::Epoch(1),
        position: "4242".into(),
        state: None,
        updated_at_ms: c.clock.unix_ms(),
        extra: Default::default(),
    };
    let key = c
        .keys
        .checkpoint(&chanwatch_core::ChannelName::new("orders-000")?);
    c.store
        .txn(chanwatch_store::Txn::new().and_then([chanwatch_store::TxnOp::put(&key, cp.encode())]))
        .await?;
    let before = headless(&url, &["--dump-dom".into()])?;
    ensure!(
        before.matches("· pos 4242 · ").count() == 1,
        "the page does not show orders-000's checkpoint position:\n{before}"
    );
    let dead = c.kill_node(nodes.remove(0)).context("node id")?;
    ensure!(
        before.contains(&format!("id=\"node-{dead}\"")),
        "the page did not show node {dead}:\n{before}"
    );

    c.wait_until(TTL + Duration::from_secs(5), "failover", |v| {
        v.nodes.len() == 2 && v.all_watched_on_live_nodes(9)
    })
    .await?;
    let dom = tokio::task::spawn_blocking({
        let url = url.clone();
        move || headless(&url, &["--dump-dom".into()])
    })
    .await??;
    ensure!(
        !dom.contains(&format!("id=\"node-{dead}\"")),
        "the dead node still has a column:\n{dom}"
    );
    for i in 0..9 {
        let name = format!("orders-{i:03} @");
        ensure!(
            dom.matches(&name).count() == 1,
            "{name} is not shown exactly once:\n{dom}"
        );
    }
    ensure!(
        dom.matches("class=\"ch Watched\"").count() == 9,
        "not every channel is shown Watched:\n{dom}"
    );
    if let Some(path) = std::env::var_os("CHANWATCH_SCREENSHOT") {
        let shot = format!("--screenshot={}", PathBuf::from(path).display());
        headless(&url, &[shot])?;
    }
    Ok(())
}
