//! Planned events (DESIGN §5) driven against the real binary and real etcd, judged
//! only from outside: `chanwatch ctl ... --json`, a watch of the test's own on the assignment
//! keys, the nodes' handler logs, the coordinator's `/metrics` and the processes' exit codes.
//!
//! - A planned restart: SIGTERM on a node holding channels → they run elsewhere with no
//!   overlap, each moved once (epoch + 1), nothing counted as a failover, and the node exits 0
//!   well before its lease could have expired. With no leader, a second SIGTERM stops a
//!   leaving node at once, and a leaving node alone still exits after `--shutdown-timeout`.
//! - A cold start: 500 channels parked under `remaining`, 5 nodes started within 2 s,
//!   `coord --expected-nodes 5` → every channel placed exactly once, 100 per node.
//!
//! `CHANWATCH_BLACKBOX_KEEP=1` keeps the logs.

use std::time::{Duration, Instant};

#[path = "chaos/audit.rs"]
#[allow(dead_code)] // shared with chaos.rs; not every reader is needed here
mod audit;
#[path = "blackbox/cluster.rs"]
#[allow(dead_code)] // shared with blackbox.rs; not every helper is needed here
mod cluster;
mod procs;

use cluster::{unix_ms, Cluster};

/// One cluster at a time: the machine is small and the bounds are timings.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Session TTL of every process: a node that exits sooner after SIGTERM did not wait for it.
const TTL: &str = "--session-ttl=10s";

fn keep(c: Cluster) {
    if std::env::var_os("CHANWATCH_BLACKBOX_KEEP").is_some() {
        println!("logs kept in {}", c.dir.keep().display());
    }
}

fn proc_of<'a>(c: &'a mut Cluster, name: &str) -> &'a mut procs::Proc {
    c.procs
        .iter_mut()
        .find(|(n, _)| n == name)
        .map(|(_, p)| p)
        .expect("known process")
}

/// Waits up to `limit` for process `name` to exit: its exit code and how long it took.
async fn exit_of(c: &mut Cluster, name: &str, since: Instant, limit: Duration) -> (i32, Duration) {
    loop {
        if let Some(code) = proc_of(c, name).exit_code() {
            return (code, since.elapsed());
        }
        assert!(
            since.elapsed() < limit,
            "{name} still runs {limit:?} after SIGTERM; its output:\n{}",
            c.output(name)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `chanwatch_reassignments_total{cause="CAUSE"}` on the coordinator (0 when absent).
async fn reassignments(c: &Cluster, cause: &str) -> f64 {
    let text = c.metrics(&c.admin).await;
    Cluster::metric(
        &text,
        &format!("chanwatch_reassignments_total{{cause=\"{cause}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_moves_a_nodes_channels_off_while_it_runs_and_a_second_one_stops_at_once() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-planned-").await;
    let endpoint = c.etcd.endpoint().to_owned();
    c.coord(&[TTL, "--balance-quiet=1s"]);
    c.node("a", &endpoint, &[TTL]);
    c.node("b", &endpoint, &[TTL]);
    c.node("c", &endpoint, &[TTL, "--shutdown-timeout=3s"]);
    c.wait_coord_nodes(3).await;
    let names: Vec<String> = (0..30).map(|i| format!("ch-{i:02}")).collect();
    c.add_channels(&names).await;
    let before = c
        .wait_settled(30, Duration::from_secs(60), |_, _| true)
        .await
        .expect("settled before the restart");
    let a = c.node_id("a").await;
    let on_a: Vec<&String> = before
        .iter()
        .filter(|(_, (n, _))| *n == a)
        .map(|(ch, _)| ch)
        .collect();
    assert!(!on_a.is_empty(), "node a holds no channel: {before:?}");

    // One SIGTERM: node a is drained while it runs, then exits by itself.
    let sent_ms = unix_ms();
    let sent = Instant::now();
    proc_of(&mut c, "a").signal("TERM");
    let (code, took) = exit_of(&mut c, "a", sent, Duration::from_secs(10)).await;
    assert_eq!(
        code,
        0,
        "node a's exit code; its output:\n{}",
        c.output("a")
    );
    assert!(
        took < Duration::from_secs(10),
        "node a took {took:?}, as long as its lease"
    );
    assert!(
        c.output("a").contains("node: left"),
        "node a did not say it left; its output:\n{}",
        c.output("a")
    );
    let after = c
        .wait_settled(30, Duration::from_secs(30), |_, n| n != a)
        .await
        .expect("settled after the restart");
    for (ch, (node, epoch)) in &before {
        let (node2, epoch2) = after[ch];
        if *node == a {
            assert_eq!(epoch2, epoch + 1, "{ch} moved off a: one epoch more");
        } else {
            assert_eq!(
                (node2, epoch2),
                (*node, *epoch),
                "{ch} was not on a: untouched"
            );
        }
    }
    let created: Vec<(String, u64)> = c
        .history
        .assignments()
        .into_iter()
        .filter(|(at, ..)| *at >= sent_ms)
        .map(|(_, ch, node, _)| (ch, node))
        .collect();
    for ch in &on_a {
        let n = created.iter().filter(|(c2, _)| c2 == *ch).count();
        assert_eq!(n, 1, "{ch} assigned {n} times after SIGTERM: {created:?}");
    }
    assert_eq!(
        created.len(),
        on_a.len(),
        "only a's channels moved: {created:?}"
    );
    assert!(c.overlaps().is_empty(), "overlaps: {:?}", c.overlaps());
    assert_eq!(
        reassignments(&c, "failover").await,
        0.0,
        "a failover happened"
    );
    assert!(reassignments(&c, "drain").await >= on_a.len() as f64);

    // No leader: a leaving node keeps running its channels; a second SIGTERM stops it at once.
    c.procs.retain(|(n, _)| n != "coord"); // dropped: killed
    let sent = Instant::now();
    proc_of(&mut c, "b").signal("TERM");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert!(
        proc_of(&mut c, "b").exit_code().is_none(),
        "node b exited with nobody to drain it; its output:\n{}",
        c.output("b")
    );
    let again = Instant::now();
    proc_of(&mut c, "b").signal("TERM");
    let (code, took) = exit_of(&mut c, "b", sent, Duration::from_secs(10)).await;
    assert_eq!(
        code,
        0,
        "node b's exit code; its output:\n{}",
        c.output("b")
    );
    assert!(
        again.elapsed() < Duration::from_secs(3),
        "node b took {took:?} after the second SIGTERM"
    );
    // And alone, it still leaves after --shutdown-timeout (node c: 3 s).
    let sent = Instant::now();
    proc_of(&mut c, "c").signal("TERM");
    let (code, took) = exit_of(&mut c, "c", sent, Duration::from_secs(8)).await;
    assert_eq!(
        code,
        0,
        "node c's exit code; its output:\n{}",
        c.output("c")
    );
    assert!(
        took >= Duration::from_millis(2_900),
        "node c left after {took:?}, before its --shutdown-timeout of 3 s with nobody draining it"
    );
    keep(c);
}

/// A node asked to leave while etcd is down cannot announce it: it retries the `leaving`
/// write with a back-off (100 ms doubling to 2 s), keeping its channels, instead of in a loop
/// (a newcomer saw ~10,000 warnings a second and the node at 100 % CPU); a second SIGTERM
/// still stops it, within 5 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_leaving_while_etcd_is_down_retries_with_a_back_off_not_in_a_loop() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-leave-down-").await;
    let endpoint = c.etcd.endpoint().to_owned();
    c.coord(&[TTL]);
    c.node("a", &endpoint, &[TTL]);
    c.wait_coord_nodes(1).await;
    let names: Vec<String> = (0..5).map(|i| format!("ch-{i}")).collect();
    c.add_channels(&names).await;
    c.wait_settled(5, Duration::from_secs(60), |_, _| true)
        .await
        .expect("settled");
    c.etcd.kill();
    let sent = Instant::now();
    proc_of(&mut c, "a").signal("TERM");
    tokio::time::sleep(Duration::from_secs(4)).await;
    let out = c.output("a");
    let tries = out.matches("leaving: cannot read our session yet").count();
    println!("{tries} leaving writes tried in 4 s with etcd down");
    assert!(
        (1..=10).contains(&tries),
        "{tries} leaving writes tried in 4 s (a back-off makes ~6); the node's output:\n{}",
        &out[out.len().saturating_sub(4_000)..]
    );
    assert!(
        proc_of(&mut c, "a").exit_code().is_none(),
        "node a exited on its first SIGTERM with etcd down"
    );
    let again = Instant::now();
    proc_of(&mut c, "a").signal("TERM");
    // At once: it stops its channels without waiting for etcd (its lease expires there).
    let (code, took) = exit_of(&mut c, "a", again, Duration::from_secs(5)).await;
    println!(
        "node a exited with {code} {took:?} after the second SIGTERM ({:?} after the first)",
        sent.elapsed()
    );
    keep(c);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_start_with_expected_nodes_places_every_parked_channel_once_and_evenly() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-coldstart-").await;
    let endpoint = c.etcd.endpoint().to_owned();
    c.coord(&[
        TTL,
        "--expected-nodes=5",
        "--startup-grace=30s",
        "--balance-quiet=1s",
    ]);
    let names: Vec<String> = (0..500).map(|i| format!("cold-{i:03}")).collect();
    c.add_channels(&names).await;
    let rows = c.channels().expect("ctl channels");
    assert_eq!(rows.len(), 500);
    assert!(
        rows.iter().all(|r| r.node.is_none()),
        "parked before any node"
    );
    let started = Instant::now();
    for i in 0..5 {
        c.node(&format!("n{i}"), &endpoint, &[TTL]);
    }
    assert!(started.elapsed() < Duration::from_secs(2));
    let placed = c
        .wait_settled(500, Duration::from_secs(60), |_, _| true)
        .await
        .expect("settled");
    // Long enough for balance (quiet 1 s) to move anything it wanted to.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let settled = c.settled(500, |_, _| true).expect("still settled");
    assert_eq!(placed, settled, "something moved after the first placement");
    let mut per_node = std::collections::BTreeMap::<u64, usize>::new();
    for (ch, (node, epoch)) in &settled {
        assert_eq!(*epoch, 2, "{ch}: parked at epoch 1, placed once");
        *per_node.entry(*node).or_default() += 1;
    }
    let placements = c.history.assignments();
    for ch in &names {
        let n = placements.iter().filter(|(_, c2, ..)| c2 == ch).count();
        assert_eq!(n, 1, "{ch} was placed {n} times");
    }
    let (min, max) = (
        per_node.values().min().copied().unwrap_or(0),
        per_node.values().max().copied().unwrap_or(0),
    );
    assert!(
        per_node.len() == 5 && max - min <= 1,
        "spread: {per_node:?}"
    );
    assert!(
        c.output("coord").contains("cold start: waiting for"),
        "the coordinator did not say it waited; its output:\n{}",
        c.output("coord")
    );
    keep(c);
}
