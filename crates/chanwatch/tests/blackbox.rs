//! Faults of a cluster losing touch with etcd driven against the real binary and judged only from outside: the
//! keys in etcd (`chanwatch ctl ... --json` and a watch of the test's own), the nodes' handler
//! logs (`--handler-log`) and the processes' `/metrics`. Each starts a real etcd from
//! chanwatch-testkit (a missing binary fails the test with install instructions), runs in
//! well under a minute, and is part of `cargo test`.
//!
//! Over 600 lines: one flat list of independent fault scenarios; their shared harness is
//! `blackbox/cluster.rs`.
//!
//! - A drained node whose watch stalls silently: the node reaches etcd through a
//!   [`GrpcProxy`] that holds its watch responses while its keepalives pass, so it never sees
//!   its `ToRelease`. Judged: no channel ever runs on two nodes at once; the node's session
//!   ends or its channels move within a bound; once the stream recovers every channel is
//!   `Watched` and running off the drained session within a bound; no process exits. Which
//!   mechanism acted (the leader's fence, the node pausing itself, a re-registration) is
//!   reported, not asserted. A variant keeps the node blind throughout: it must still let its
//!   channels go (it notices by watch progress, relists and acknowledges the release; before
//!   that, its channels failed over to its own next session, again and again).
//! - A channel that fails to load on one node (before, it was put straight back there): it settles elsewhere and is not put
//!   back on that node within the back-off or the move cool-down; nothing else churns.
//!
//! - The leader's own watch stalls silently (a proxy holds its watch responses) past the watch
//!   timeout: it notices from its keepalives' revisions, relists, sees the acks; no channel
//!   is asked to release or assigned twice (`CHANWATCH_BLACKBOX_PLANT=no-watch-stall-check`
//!   must fail it).
//!
//! Planted bugs prove each can fail: `CHANWATCH_BLACKBOX_PLANT=force-without-fence` (or
//! `balance-ignores-backoff`) starts the coordinator with the hidden `--plant` switch, e.g.
//! `CHANWATCH_BLACKBOX_PLANT=force-without-fence cargo test -p chanwatch --test blackbox
//! stalled`; the test must then fail. `CHANWATCH_BLACKBOX_KEEP=1` keeps the logs.

use std::time::{Duration, Instant};

use chanwatch_testkit::GrpcProxy;

#[path = "chaos/audit.rs"]
#[allow(dead_code)] // shared with chaos.rs; not every reader is needed here
mod audit;
#[path = "blackbox/cluster.rs"]
mod cluster;
mod procs;

use cluster::{unix_ms, Cluster};

/// One cluster at a time: the machine is small and the bounds are timings.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Nodes' and the coordinator's `--session-ttl`, seconds.
const TTL: u64 = 4;

/// The coordinator flags of the planted bug named in `CHANWATCH_BLACKBOX_PLANT`, if any.
fn plant() -> Vec<String> {
    std::env::var("CHANWATCH_BLACKBOX_PLANT")
        .map(|p| vec![format!("--plant={p}")])
        .unwrap_or_default()
}

/// At most the first 8 items of a list, for messages.
fn few<T: std::fmt::Debug>(items: &[T]) -> String {
    if items.len() <= 8 {
        format!("{items:?}")
    } else {
        format!("{:?} and {} more", &items[..8], items.len() - 8)
    }
}

fn keep(c: Cluster) {
    if std::env::var_os("CHANWATCH_BLACKBOX_KEEP").is_some() {
        println!("logs kept in {}", c.dir.keep().display());
    }
}

/// `--release-timeout` of the stalled-drain test (must exceed the TTL).
const RELEASE_TIMEOUT: u64 = 6;
/// `--watch-timeout` of the stalled-drain test.
const WATCH_TIMEOUT: u64 = 6;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_watch_on_a_drained_node_moves_its_channels_without_running_any_twice() {
    stalled_drain(false).await;
}

/// The same, but b's process stays blind until its channels must have moved. Before watch
/// progress and lists handed over without a watch, they failed over to b's own next session
/// (the least loaded node, as blind as before), timed out there, and it was fenced again, in
/// a loop (3 fences in 50 s, channels never reached a).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stays_blind_does_not_get_its_channels_back_after_its_fence() {
    stalled_drain(true).await;
}

/// Node b reaches etcd through a proxy; its watches stall, then it is drained. With
/// `stay_blind` false the stall ends once b was fenced (or its channels moved), as a stuck
/// stream usually does; with true it lasts until the channels must have reached a.
async fn stalled_drain(stay_blind: bool) {
    stalled_drain_of(stay_blind, true).await;
}

/// A drained node whose watch stalls and which does not notice by itself (hidden
/// `node --plant no-watch-progress`): the leader must fence it — fence mark, lease revoke —
/// and move its channels only once it has surely stopped. With the coordinator's planted
/// `force-without-fence` this test finds channels running twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_node_that_does_not_notice_its_stalled_watch_is_fenced_before_its_channels_move()
{
    stalled_drain_of(false, false).await;
}

async fn stalled_drain_of(stay_blind: bool, b_notices: bool) {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-blackbox-stall-").await;
    let proxy = GrpcProxy::start(c.etcd.endpoint()).await.expect("proxy");
    let ttl = format!("--session-ttl={TTL}s");
    let release = format!("--release-timeout={RELEASE_TIMEOUT}s");
    let watch_timeout = format!("--watch-timeout={WATCH_TIMEOUT}s");
    let mut coord: Vec<&str> = vec![&ttl, &release, &watch_timeout];
    // No balance during the test: only the drain and its consequences move channels.
    coord.push("--balance-quiet=300s");
    let planted = plant();
    coord.extend(planted.iter().map(String::as_str));
    c.coord(&coord);
    let direct = c.etcd.endpoint().to_owned();
    c.node("a", &direct, &[&ttl]);
    if b_notices {
        c.node("b", &proxy.endpoint(), &[&ttl]);
    } else {
        c.node("b", &proxy.endpoint(), &[&ttl, "--plant=no-watch-progress"]);
    }
    let a = c.node_id("a").await;
    let b = c.node_id("b").await;
    // Balance is off in this test: both nodes must be the leader's before channels come.
    c.wait_coord_nodes(2).await;
    let names: Vec<String> = (0..20).map(|i| format!("sd-{i:02}")).collect();
    c.add_channels(&names).await;
    let before = c
        .wait_settled(20, Duration::from_secs(30), |_, _| true)
        .await
        .expect("20 channels run on a and b");
    let on_b = before.values().filter(|(n, _)| *n == b).count();
    assert!(on_b >= 5, "b runs {on_b} of 20 channels: {before:?}");
    assert!(proxy.watch_calls() >= 1, "b watches through the proxy");

    proxy.stall_watches();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let t_drain = unix_ms();
    c.ctl(&["drain", &b.to_string()])
        .unwrap_or_else(|e| panic!("ctl drain {b}: {e}"));

    // b's session ends when the leader fences it: one release timeout after the drain, plus
    // a plan round. Or its channels move some other way (a node that notices its blindness
    // and relists sees its ToRelease).
    let fence_by = Instant::now() + Duration::from_secs(RELEASE_TIMEOUT + TTL + 5);
    let mut b_gone_ms = None;
    let mut acted = false;
    while Instant::now() < fence_by {
        let rows = c.node_rows().unwrap_or_default();
        if !rows.is_empty() && !rows.iter().any(|r| r.id == b) {
            b_gone_ms = Some(unix_ms() - t_drain);
            acted = true;
            break;
        }
        if c.settled(20, |_, n| n != b).is_ok() {
            acted = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let bound = if stay_blind {
        // Fence and one TTL; failover, perhaps onto b's next session (as blind), which
        // times out after the watch timeout; then its release timeout and one TTL more
        // if that session must be fenced too; 5 s for plan rounds, acks and this poll.
        Duration::from_secs(2 * (RELEASE_TIMEOUT + TTL) + WATCH_TIMEOUT + 5)
    } else {
        // The stream recovers: held events reach b's process, which loads what it was
        // given and releases what it was asked to; a channel given to a session that is
        // gone moves after one TTL, one not started after the watch timeout; 5 s slack.
        proxy.release_watches();
        Duration::from_secs(TTL + WATCH_TIMEOUT + 5)
    };
    let t_phase = unix_ms();
    let moved = c.wait_settled(20, bound, |_, n| n != b).await;
    let moved_ms = unix_ms() - t_drain;
    let on_a = moved
        .as_ref()
        .map_or(0, |m| m.values().filter(|(n, _)| *n == a).count());

    // Let any held watch responses reach b (stale events now), and watch for late damage.
    proxy.release_watches();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = c.settled(20, |_, n| n != b);
    let overlaps = c.overlaps();
    let exits = c.exits();

    let coord_metrics = c.metrics(&c.admin).await;
    let b_metrics = c.metrics(&c.nodes["b"].1).await;
    let b_ids: Vec<u64> = c
        .node_rows()
        .unwrap_or_default()
        .iter()
        .filter(|r| r.admin_addr == c.nodes["b"].1)
        .map(|r| r.id)
        .collect();
    let fences = audit::fence_reasons(c.dir.path());
    let m = |t: &str, n: &str| Cluster::metric(t, n).map_or("?".to_owned(), |v| v.to_string());
    println!(
        "stalled drain (stay blind: {stay_blind}): b (node {b}, {on_b} channels) drained at \
         unix ms {t_drain}; its session gone after {} ms; all 20 off node {b} after {moved_ms} \
         ms ({} ms after the {} phase began, bound {} ms), {on_a} of them on a (node {a}); \
         leader fenced {} node(s); b: {} pause(s), {} stop(s), {} start(s) in its handler log, \
         pauses_total {}, fences_total {}, sessions_total {}, sessions now {b_ids:?}; \
         self-fence reasons {fences:?}; overlaps {}; exits {}",
        b_gone_ms.map_or_else(|| "never".to_owned(), |g| g.to_string()),
        moved_ms.saturating_sub(t_phase - t_drain),
        if stay_blind { "blind" } else { "recovered" },
        bound.as_millis(),
        m(&coord_metrics, "chanwatch_nodes_fenced_total"),
        c.handler_lines("b", "pause"),
        c.handler_lines("b", "stop"),
        c.handler_lines("b", "start"),
        m(&b_metrics, "chanwatch_node_pauses_total"),
        m(&b_metrics, "chanwatch_node_fences_total"),
        m(&b_metrics, "chanwatch_node_sessions_total"),
        overlaps.len(),
        exits.len(),
    );
    let mut violations: Vec<String> = overlaps;
    violations.extend(exits);
    if !acted {
        violations.push(format!(
            "within {} s of the drain, node {b} neither lost its session nor had its channels \
             moved: nothing acted on a blind node",
            RELEASE_TIMEOUT + TTL + 5
        ));
    }
    if !b_notices && b_gone_ms.is_none() {
        violations.push(format!(
            "node {b} cannot notice its stalled watch, yet the leader did not fence it \
             (its session never ended)"
        ));
    }
    if let Err(why) = moved {
        violations.push(format!(
            "not every channel Watched and running off node {b} within {} s: {why}",
            bound.as_secs()
        ));
    }
    if let Err(why) = after {
        violations.push(format!("4 s after the watches were released: {why}"));
    }
    if !violations.is_empty() {
        let dir = c.dir.keep();
        panic!(
            "stalled drain (logs in {}):\n{}\n--- coord output ends:\n{}",
            dir.display(),
            violations.join("\n"),
            audit::tail(&dir.join("coord.out"), 20)
        );
    }
    keep(c);
}

/// The coordinator's `--watch-timeout`, which is also the back-off of a node that failed a
/// channel (seconds).
const BACKOFF: u64 = 6;
const X: &str = "pp-x";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_failing_on_one_node_settles_elsewhere_without_ping_pong_or_churn() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-blackbox-pingpong-").await;
    let ttl = format!("--session-ttl={TTL}s");
    let backoff = format!("--watch-timeout={BACKOFF}s");
    let mut coord: Vec<&str> = vec![&ttl, &backoff, "--balance-quiet=1s", "--move-cooldown=60s"];
    let planted = plant();
    coord.extend(planted.iter().map(String::as_str));
    c.coord(&coord);
    let direct = c.etcd.endpoint().to_owned();
    // b and c register first, so a has the highest ID: the planner breaks ties by the lowest
    // ID, so 14 channels spread 5, 5, 4 with a holding 4, and X then goes to a. When X
    // fails there it goes to b, leaving a two behind: balance wants to fill a, and must
    // wait for a's back-off, and must not pick X (its cool-down).
    c.node("b", &direct, &[&ttl]);
    let b = c.node_id("b").await;
    c.node("c", &direct, &[&ttl]);
    let cc = c.node_id("c").await;
    let fail = format!("--fail-load={X}");
    c.node("a", &direct, &[&ttl, &fail]);
    let a = c.node_id("a").await;
    c.wait_coord_nodes(3).await;
    let names: Vec<String> = (0..14).map(|i| format!("pp-{i:02}")).collect();
    c.add_channels(&names).await;
    c.wait_settled(14, Duration::from_secs(30), |_, _| true)
        .await
        .expect("14 channels run on a, b and c");
    c.add_channels(&[X.to_owned()]).await;

    // X's first failure on a, as etcd shows it.
    let failed_on_a = |c: &Cluster| {
        c.history.changes().into_iter().find(|ch| {
            ch.channel == X
                && ch.node == Some(a)
                && ch.state == Some(chanwatch_core::ChannelState::WatchFailed)
        })
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut moved_by_hand = false;
    let t_fail = loop {
        if let Some(ch) = failed_on_a(&c) {
            break ch.at_ms;
        }
        if !moved_by_hand && Instant::now() > deadline {
            // The layout was not the expected one: put X on a by hand.
            moved_by_hand = true;
            let _ = c
                .wait_settled(15, Duration::from_secs(10), |_, _| true)
                .await;
            c.ctl(&["move", X, "--to", &a.to_string()])
                .unwrap_or_else(|e| panic!("ctl move {X} --to {a}: {e}"));
        }
        assert!(
            Instant::now() < deadline + Duration::from_secs(15),
            "{X} never failed on a (node {a}); its history:\n{}",
            audit::history(c.dir.path(), X)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Watch for twice the back-off (X's cool-down is longer), then judge.
    let window_end = t_fail + 2 * BACKOFF * 1000 + 2000;
    tokio::time::sleep(Duration::from_millis(window_end.saturating_sub(unix_ms()))).await;
    let settled = c
        .wait_settled(15, Duration::from_secs(5), |ch, n| ch != X || n != a)
        .await;
    let overlaps = c.overlaps();
    let exits = c.exits();

    let after: Vec<_> = c
        .history
        .assignments()
        .into_iter()
        .filter(|(at, ..)| *at > t_fail)
        .collect();
    let x_moves: Vec<_> = after.iter().filter(|(_, ch, ..)| ch == X).collect();
    let x_back_on_a: Vec<_> = x_moves.iter().filter(|(_, _, n, _)| *n == a).collect();
    let onto_a_in_backoff: Vec<_> = after
        .iter()
        .filter(|(at, _, n, _)| *n == a && *at < t_fail + BACKOFF * 1000)
        .collect();
    let others: Vec<_> = after.iter().filter(|(_, ch, ..)| ch != X).collect();
    let x_epochs: Vec<(u64, u64)> = c
        .history
        .assignments()
        .into_iter()
        .filter(|(_, ch, ..)| ch == X)
        .map(|(_, _, n, e)| (n, e))
        .collect();
    let coord_metrics = c.metrics(&c.admin).await;
    println!(
        "ping-pong: nodes a={a} b={b} c={cc}; {X} failed on a at unix ms {t_fail}{}; its \
         assignments (node, epoch) {}; in the {} s after: {} move(s) of {X} ({} back \
         onto a), {} move(s) of other channels {}, {} onto a within the back-off; \
         reassignments by cause: failed {}, balance {}; overlaps {}; exits {}",
        if moved_by_hand {
            " (moved there by hand)"
        } else {
            ""
        },
        few(&x_epochs),
        (window_end - t_fail) / 1000,
        x_moves.len(),
        x_back_on_a.len(),
        others.len(),
        few(&others),
        onto_a_in_backoff.len(),
        Cluster::metric(
            &coord_metrics,
            "chanwatch_reassignments_total{cause=\"failed\"}"
        )
        .unwrap_or(0.0),
        Cluster::metric(
            &coord_metrics,
            "chanwatch_reassignments_total{cause=\"balance\"}"
        )
        .unwrap_or(0.0),
        overlaps.len(),
        exits.len(),
    );
    let mut violations: Vec<String> = overlaps;
    violations.extend(exits);
    if let Err(why) = settled {
        violations.push(format!("not settled with {X} off a: {why}"));
    }
    if !x_back_on_a.is_empty() {
        violations.push(format!(
            "{X} was put back on a (node {a}) within {} s of failing there: {}",
            (window_end - t_fail) / 1000,
            few(&x_back_on_a)
        ));
    }
    if x_moves.len() != 1 {
        violations.push(format!(
            "{X} moved {} times after failing on a, expected once: {}",
            x_moves.len(),
            few(&x_moves)
        ));
    }
    if !onto_a_in_backoff.is_empty() {
        violations.push(format!(
            "channels assigned to a within its {BACKOFF} s back-off: {}",
            few(&onto_a_in_backoff)
        ));
    }
    // a is two behind after X left: balance may even it out with one move once a's
    // back-off is over; anything beyond that is churn.
    if others.len() > 1 {
        violations.push(format!(
            "{} moves of other channels after {X} failed (at most 1 expected): {}",
            others.len(),
            few(&others)
        ));
    }
    if !violations.is_empty() {
        let dir = c.dir.keep();
        let history = audit::history(&dir, X);
        let lines: Vec<&str> = history.lines().take(20).collect();
        panic!(
            "ping-pong (logs in {}):\n{}\n--- {X} (first 20 handler log lines):\n{}",
            dir.display(),
            violations.join("\n"),
            lines.join("\n")
        );
    }
    keep(c);
}

/// The leader's own watch stalls silently (it reaches etcd through a [`GrpcProxy`] that holds
/// its watch responses while its txns and keepalives pass) right after it assigns channels,
/// longer than the watch timeout, with the resync 5 minutes away. It must find out from its
/// keepalives' revisions and relist, and see the nodes' acks: judged from outside, every
/// channel is assigned once (epoch 1), none is asked to release, and all run; the leader's
/// `chanwatch_watch_stalls_total` says it noticed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_watch_stalls_notices_relists_and_moves_nothing() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-blackbox-leader-stall-").await;
    let proxy = GrpcProxy::start(c.etcd.endpoint()).await.expect("proxy");
    let ttl = format!("--session-ttl={TTL}s");
    let planted = plant();
    let mut flags: Vec<&str> = vec![
        &ttl,
        "--watch-timeout=6s",
        "--resync-interval=300s",
        "--balance-quiet=300s",
    ];
    flags.extend(planted.iter().map(String::as_str));
    c.coord_via(&proxy.endpoint(), &flags);
    let direct = c.etcd.endpoint().to_owned();
    c.node("a", &direct, &[&ttl]);
    c.node("b", &direct, &[&ttl]);
    c.node_id("a").await;
    c.node_id("b").await;
    c.wait_coord_nodes(2).await;
    proxy.stall_watches();
    let names: Vec<String> = (0..10).map(|i| format!("ls-{i:02}")).collect();
    c.add_channels(&names).await;
    // Past the watch timeout (6 s, plus the 6 s a term's first list stands timers still)
    // with the watch held: a leader that cannot see the acks would ask for releases now.
    tokio::time::sleep(Duration::from_secs(16)).await;
    proxy.release_watches();
    let settled = c
        .wait_settled(10, Duration::from_secs(15), |_, _| true)
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let changes = c.history.changes();
    let releases: Vec<String> = changes
        .iter()
        .filter(|ch| ch.state == Some(chanwatch_core::ChannelState::ToRelease))
        .map(|ch| ch.channel.clone())
        .collect();
    let assigned = c.history.assignments();
    let coord_metrics = c.metrics(&c.admin).await;
    let stalls = Cluster::metric(&coord_metrics, "chanwatch_watch_stalls_total");
    if std::env::var_os("CHANWATCH_BLACKBOX_VERBOSE").is_some() {
        let out = c.output("coord");
        let tail: Vec<&str> = out.lines().rev().take(40).collect();
        println!("coord output (newest first):\n{}", tail.join("\n"));
        println!(
            "relists {:?}, watch restarts {:?}, proxy watch calls {}",
            Cluster::metric(&coord_metrics, "chanwatch_relists_total"),
            Cluster::metric(&coord_metrics, "chanwatch_watch_restarts_total"),
            proxy.watch_calls()
        );
    }
    let exits = c.exits();
    println!(
        "leader watch stall: {} assignments, {} release requests, stalls counted {stalls:?}",
        assigned.len(),
        releases.len()
    );
    assert!(settled.is_ok(), "not settled: {settled:?}");
    assert!(releases.is_empty(), "release requests: {}", few(&releases));
    assert!(
        assigned.iter().all(|(_, _, _, epoch)| *epoch == 1) && assigned.len() == 10,
        "each channel assigned once: {}",
        few(&assigned)
    );
    assert!(
        stalls.unwrap_or(0.0) >= 1.0,
        "the leader never noticed its stalled watch"
    );
    assert!(exits.is_empty(), "processes exited: {exits:?}");
    keep(c);
}

/// The leader's view is behind (its watch held by a [`GrpcProxy`]) while a channel that failed
/// on node a waits out a's back-off, and node b registers meanwhile — unseen. When the
/// back-off is over, "no other candidate" is the stale view's: a leader that knows its view
/// is behind (its keepalives named a revision its watch has not reached) must not retry the
/// channel on a; once it sees b (the watch released), the channel goes to b. Judged from
/// etcd: after its failure on a the channel is never assigned to a again, and it ends
/// `Watched` on b. Timings: the coordinator's TTL of 12 s renews every 4 s and relists a
/// stalled watch after 6 s; the back-off (`--watch-timeout`) is 5 s, so the view is known
/// behind (≤ 4.3 s after the stall) before the back-off ends, and no stall relist (≥ 6.3 s)
/// shows b before it ends. `--plant ignore-behind` makes this test fail (CI).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_channel_failed_on_a_node_is_not_retried_there_while_the_leaders_view_is_behind() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-blackbox-stale-view-").await;
    let proxy = GrpcProxy::start(c.etcd.endpoint()).await.expect("proxy");
    let planted = plant();
    let mut flags: Vec<&str> = vec![
        "--session-ttl=12s",
        "--watch-timeout=5s",
        "--resync-interval=300s",
        "--balance-quiet=300s",
    ];
    flags.extend(planted.iter().map(String::as_str));
    c.coord_via(&proxy.endpoint(), &flags);
    let direct = c.etcd.endpoint().to_owned();
    let ttl = format!("--session-ttl={TTL}s");
    const Y: &str = "sv-y";
    let fail = format!("--fail-load={Y}");
    c.node("a", &direct, &[&ttl, &fail]);
    let a = c.node_id("a").await;
    c.wait_coord_nodes(1).await;
    c.add_channels(&[Y.to_owned()]).await;
    let deadline = Instant::now() + Duration::from_secs(15);
    let t_fail = loop {
        let failed = c.history.changes().into_iter().find(|ch| {
            ch.channel == Y
                && ch.node == Some(a)
                && ch.state == Some(chanwatch_core::ChannelState::WatchFailed)
        });
        if let Some(ch) = failed {
            break ch.at_ms;
        }
        assert!(
            Instant::now() < deadline,
            "{Y} never failed on a (node {a})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    // The leader has seen the failure (its watch was live); now it sees nothing more.
    tokio::time::sleep(Duration::from_millis(100)).await;
    proxy.stall_watches();
    c.node("b", &direct, &[&ttl]);
    let b = c.node_id("b").await;
    // Past the back-off (5 s after the failure), short of the first possible stall relist.
    let release_at = t_fail + 5_800;
    tokio::time::sleep(Duration::from_millis(release_at.saturating_sub(unix_ms()))).await;
    proxy.release_watches();
    let settled = c
        .wait_settled(1, Duration::from_secs(20), |ch, n| ch != Y || n == b)
        .await;
    // Every write of Y's keys: a retry on a rewrites a's key in place (a new epoch, not a
    // new key), so assignments are told by their epoch, not by key creation.
    let y: Vec<(u64, Option<u64>, Option<chanwatch_core::ChannelState>, u64)> = c
        .history
        .changes()
        .into_iter()
        .filter(|ch| ch.channel == Y)
        .map(|ch| (ch.at_ms, ch.node, ch.state, ch.epoch))
        .collect();
    let back_on_a: Vec<_> = y
        .iter()
        .filter(|(_, n, state, epoch)| {
            *n == Some(a) && *epoch > 1 && *state == Some(chanwatch_core::ChannelState::ToWatch)
        })
        .collect();
    let coord_metrics = c.metrics(&c.admin).await;
    println!(
        "stale view: a={a} b={b}; {Y} failed on a at unix ms {t_fail}, watch held from ~{} ms \
         after to {} ms after; its key's writes (unix ms, node, state, epoch): {}; stalls counted {:?}",
        100,
        release_at - t_fail,
        few(&y
            .iter()
            .map(|(at, _, n, e)| (*at, *n, *e))
            .collect::<Vec<_>>()),
        Cluster::metric(&coord_metrics, "chanwatch_watch_stalls_total"),
    );
    let exits = c.exits();
    if !back_on_a.is_empty() {
        let dir = c.dir.keep();
        panic!(
            "{Y} was retried on a (node {a}) while the leader's view was behind (b = {b} had \
             registered): {} (logs in {})",
            few(&back_on_a),
            dir.display()
        );
    }
    assert!(settled.is_ok(), "{Y} not Watched on b: {settled:?}");
    assert!(exits.is_empty(), "processes exited: {exits:?}");
    keep(c);
}

/// `ctl add-channels --from-file`: a file of names and JSON objects with one bad line
/// registers nothing and names the line (rc ≠ 0); the same file fixed registers every
/// channel, all of them `Watched` (as `ctl channels -o json` shows) and running; a file naming
/// a registered channel is refused whole, naming its line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_channels_from_a_file_registers_all_or_names_every_bad_line_and_registers_nothing() {
    let _serial = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-blackbox-bulk-").await;
    let ttl = format!("--session-ttl={TTL}s");
    c.coord(&[&ttl]);
    let direct = c.etcd.endpoint().to_owned();
    c.node("a", &direct, &[&ttl]);
    c.node("b", &direct, &[&ttl]);
    c.wait_coord_nodes(2).await;
    let mut lines = vec!["# bulk test".to_owned(), String::new()];
    lines.extend((0..150).map(|i| format!("bulk-{i:03}")));
    lines.extend((150..300).map(|i| {
        format!(r#"{{"name":"bulk-{i:03}","vchannel":{{"collection_id":{i}}},"weight":2}}"#)
    }));
    let good = lines.join("\n") + "\n";
    let bad = format!("{good}bulk bad name\n{{\"name\":\"bulk-301\"\n");
    let file = c.dir.path().join("channels.txt");
    std::fs::write(&file, &bad).expect("write the file");
    let path = file.display().to_string();
    let err = c
        .ctl(&["add-channels", "--from-file", &path])
        .expect_err("a bad line refuses the file");
    assert!(
        err.contains("line 303: bad name") && err.contains("line 304: bad JSON"),
        "{err}"
    );
    assert!(err.contains("nothing was registered"), "{err}");
    assert_eq!(c.channels().map(|r| r.len()), Ok(0), "nothing written");

    std::fs::write(&file, &good).expect("write the file");
    let out = c
        .ctl(&["add-channels", "--from-file", &path])
        .expect("a good file registers");
    assert!(out.starts_with("added 300 channel(s) in "), "{out}");
    let settled = c
        .wait_settled(300, Duration::from_secs(60), |_, _| true)
        .await;
    assert!(settled.is_ok(), "not all Watched and running: {settled:?}");
    let json = c.ctl(&["channels", "-o", "json"]).expect("ctl channels");
    let rows: Vec<serde_json::Value> = serde_json::from_str(&json).expect("json");
    assert!(
        rows.len() == 300 && rows.iter().all(|r| r["state"] == "Watched"),
        "{json}"
    );

    std::fs::write(&file, "bulk-new\nbulk-007\nbad name\n").expect("write the file");
    let err = c
        .ctl(&["add-channels", "--from-file", &path])
        .expect_err("a registered channel refuses the file");
    // Named together with the bad line, in line order (it was named only once the bad line
    // was fixed).
    assert!(
        err.contains("2 bad line(s)")
            && err.contains("line 2: channel bulk-007 is already registered\n  line 3: bad name"),
        "{err}"
    );
    assert_eq!(c.channels().map(|r| r.len()), Ok(300));
    assert!(c.exits().is_empty());
    keep(c);
}
