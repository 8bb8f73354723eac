//! Placement v2 (DESIGN §5) against the real binary and a real etcd, judged from outside
//! (`chanwatch ctl ... -o json`, the test's own watch of the assignment keys, the nodes'
//! handler logs): a node started with `--capacity 2` gets twice the channels of the others;
//! channels pinned with `ctl pin` stay put (same key, same epoch) through the balance a new
//! node sets off; and after most nodes die, `--max-load` keeps the survivor at its cap and
//! parks the overflow under `remaining` with the reason, placing it once a node with room
//! joins. And two properties of failovers: a failover whose moves come in many txns is
//! acknowledged in one write per receiving node (DESIGN §2 `round`, §4), counted from the
//! revisions of the test's watch; and a burst of session losses (five leases revoked at
//! once) moves every channel of the dead nodes once, to a live node (DESIGN §3), whether the
//! leader saw the burst in one watch batch or several (how many of its txns were refused
//! because a round came before the burst was over is printed, not judged: that is timing).

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

#[path = "chaos/audit.rs"]
#[allow(dead_code)] // shared with chaos.rs; not every reader is needed here
mod audit;
#[path = "blackbox/cluster.rs"]
#[allow(dead_code)] // shared with blackbox.rs; not every helper is needed here
mod cluster;
mod procs;

use chanwatch_core::ChannelState;
use cluster::Cluster;

/// Nodes' and the coordinator's `--session-ttl`, seconds.
const TTL: u64 = 4;

/// One cluster at a time: the ack-count test judges timing (pauses over 15 ms), and beside
/// the burst test's eleven processes on two cores its node wrote 9 acks with 2 such pauses
/// seen (a fresh-machine CI run).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Polls `check` every 200 ms until it answers `Ok`, for up to `secs`.
async fn wait_for<T>(secs: u64, what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        match check() {
            Ok(v) => return v,
            Err(why) if Instant::now() > deadline => panic!("{what} within {secs} s: {why}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
}

/// Channels per node ID (`None`: remaining), from `ctl channels -o json`.
fn per_node(c: &Cluster) -> Result<BTreeMap<Option<u64>, Vec<String>>, String> {
    let mut out: BTreeMap<Option<u64>, Vec<String>> = BTreeMap::new();
    for r in c.channels()? {
        out.entry(r.node).or_default().push(r.channel.to_string());
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_pins_and_max_load_shape_placement_from_outside() {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-placement").await;
    let ttl = format!("--session-ttl={TTL}s");
    c.coord(&[
        &ttl,
        "--balance-quiet=1s",
        "--move-cooldown=1s",
        "--max-load=3",
    ]);
    let endpoint = c.etcd.endpoint().to_owned();
    c.node("a", &endpoint, &[&ttl, "--capacity=2"]);
    c.node("b", &endpoint, &[&ttl]);
    c.node("c", &endpoint, &[&ttl]);
    let ids: BTreeMap<&str, u64> = [
        ("a", c.node_id("a").await),
        ("b", c.node_id("b").await),
        ("c", c.node_id("c").await),
    ]
    .into_iter()
    .collect();
    c.wait_coord_nodes(3).await;
    let names: Vec<String> = (0..12).map(|i| format!("p-{i:02}")).collect();
    c.add_channels(&names).await;

    // 1. Capacity 2 gets twice: 6 / 3 / 3, every load 3.0, and `ctl nodes` says so.
    let placed = wait_for(30, "12 channels Watched", || {
        c.settled(12, |_, _| true)?;
        per_node(&c)
    })
    .await;
    let count = |id: u64| placed.get(&Some(id)).map_or(0, Vec::len);
    assert_eq!(
        (count(ids["a"]), count(ids["b"]), count(ids["c"])),
        (6, 3, 3),
        "{placed:?}"
    );
    let rows = c.node_rows().expect("ctl nodes");
    let a = rows.iter().find(|r| r.id == ids["a"]).expect("node a");
    assert_eq!((a.capacity, a.channels, a.load), (2, 6, 3.0), "{rows:?}");

    // 2. Pin b's channels: a new node sets off a balance, which moves others only.
    let pinned = placed[&Some(ids["b"])].clone();
    for ch in &pinned {
        c.ctl(&["pin", ch]).expect("ctl pin");
    }
    let wide = c.ctl(&["channels", "-o", "wide"]).expect("ctl channels");
    assert!(
        wide.lines().filter(|l| l.contains(" pinned ")).count() == pinned.len(),
        "{wide}"
    );
    let before = c.history.changes().len();
    c.node("d", &endpoint, &[&ttl]);
    let d = c.node_id("d").await;
    wait_for(40, "balance onto the new node", || {
        c.settled(12, |_, _| true)?;
        let now = per_node(&c)?;
        let on_d = now.get(&Some(d)).map_or(0, Vec::len);
        if on_d >= 2 {
            Ok(())
        } else {
            Err(format!("{on_d} on node d: {now:?}"))
        }
    })
    .await;
    for ch in &pinned {
        let touched: Vec<_> = c.history.changes()[before..]
            .iter()
            .filter(|x| &x.channel == ch && x.state != Some(ChannelState::Watched))
            .cloned()
            .collect();
        assert!(touched.is_empty(), "pinned {ch} changed: {touched:?}");
    }
    let rows = c.channels().expect("ctl channels");
    for r in rows
        .iter()
        .filter(|r| pinned.contains(&r.channel.to_string()))
    {
        assert!(
            r.pinned && r.node == Some(ids["b"]) && r.epoch == 1,
            "{r:?}"
        );
    }

    // 3. a, c and d die: b is full at 3.0 with its pinned channels, so the other nine wait
    //    under remaining, saying why; a node with capacity 2 joins and takes six.
    for name in ["a", "c", "d"] {
        c.procs.retain(|(n, _)| n != name); // dropped: killed, its lease expires
    }
    let parked = wait_for(40, "the dead nodes' channels parked", || {
        let now = per_node(&c)?;
        let parked = now.get(&None).map_or(0, Vec::len);
        if parked == 9 && now.len() == 2 {
            Ok(now)
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await;
    assert_eq!(parked[&Some(ids["b"])].len(), 3, "b took nothing above 3.0");
    let rows = c.channels().expect("ctl channels");
    for r in rows.iter().filter(|r| r.node.is_none()) {
        assert_eq!(
            r.reason.as_deref(),
            Some("park: no node has room under --max-load 3.0 (weight 1)"),
            "{r:?}"
        );
    }
    let table = c.ctl(&["channels"]).expect("ctl channels");
    assert!(
        table.contains("waits in remaining: park: no node has room under --max-load 3.0"),
        "{table}"
    );
    c.node("e", &endpoint, &[&ttl, "--capacity=2"]);
    let e = c.node_id("e").await;
    wait_for(40, "room placed", || {
        let now = per_node(&c)?;
        let on_e = now.get(&Some(e)).map_or(0, Vec::len);
        let parked = now.get(&None).map_or(0, Vec::len);
        if on_e == 6 && parked == 3 {
            Ok(())
        } else {
            Err(format!("{now:?}"))
        }
    })
    .await;
    let rows = c.node_rows().expect("ctl nodes");
    assert!(rows.iter().all(|r| r.load <= 3.0), "{rows:?}");
    for (name, p) in &mut c.procs {
        assert!(p.running(), "{name} exited:\n{}", p.output());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_spread_over_many_txns_is_acknowledged_in_one_write_per_receiving_node() {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::new("chanwatch-rounds").await;
    let ttl = format!("--session-ttl={TTL}s");
    // One move per txn (a delete and a put, within 3 ops and the leader guard): the
    // failover of ~100 channels is ~100 txns, landing over many of etcd's commits. No balance.
    c.coord(&[&ttl, "--balance-quiet=300s", "--max-txn-ops=4"]);
    let endpoint = c.etcd.endpoint().to_owned();
    for name in ["a", "b", "c"] {
        c.node(name, &endpoint, &[&ttl]);
    }
    let a = c.node_id("a").await;
    c.wait_coord_nodes(3).await;
    let names: Vec<String> = (0..300).map(|i| format!("r-{i:03}")).collect();
    c.add_channels(&names).await;
    let placed = wait_for(60, "300 channels Watched", || c.settled(300, |_, _| true)).await;
    let on_a = placed.values().filter(|(n, _)| *n == a).count();
    assert!(on_a >= 50, "a holds {on_a} of 300: {:?}", per_node(&c));

    let before = c.history.changes().len();
    c.procs.retain(|(n, _)| n != "a"); // dropped: killed, its lease expires
    wait_for(40, "a's channels Watched elsewhere", || {
        c.settled(300, |_, n| n != a)
    })
    .await;
    let changes = c.history.changes()[before..].to_vec();
    let moved: BTreeMap<String, u64> = changes
        .iter()
        .filter(|x| x.created && x.epoch == 2)
        .filter_map(|x| x.node.map(|n| (x.channel.clone(), n)))
        .collect();
    assert_eq!(
        moved.len(),
        on_a,
        "each of a's channels moved once: {moved:?}"
    );
    let move_txns: BTreeSet<i64> = changes
        .iter()
        .filter(|x| x.created && moved.contains_key(&x.channel))
        .map(|x| x.revision)
        .collect();
    let mut ack_writes: BTreeMap<u64, BTreeSet<i64>> = BTreeMap::new();
    for x in &changes {
        if x.state == Some(ChannelState::Watched) && moved.get(&x.channel) == x.node.as_ref() {
            if let Some(n) = x.node {
                ack_writes.entry(n).or_default().insert(x.revision);
            }
        }
    }
    println!(
        "{} moves in {} txns; ack writes per receiving node: {:?}",
        moved.len(),
        move_txns.len(),
        ack_writes
            .iter()
            .map(|(n, r)| (n, r.len()))
            .collect::<Vec<_>>()
    );
    assert!(
        move_txns.len() >= 10,
        "the moves came in {} txns",
        move_txns.len()
    );
    // Both b and c received, or only the one with fewer channels (a cold start on a busy
    // machine can place unevenly).
    // When each receiving node started each channel, from its handler log (ms).
    let mut started: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for log in c.logs() {
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            if let ["start", node, channel, epoch, ms] = f[..] {
                let (Ok(node), Ok(epoch), Ok(ms)) =
                    (node.parse(), epoch.parse::<u64>(), ms.parse())
                else {
                    continue;
                };
                if epoch == 2 && moved.get(channel) == Some(&node) {
                    started.entry(node).or_default().push(ms);
                }
            }
        }
    }
    // One write each, and one more per pause in what a node's acks wait for — its moves
    // (as the test's own watch saw them) and its loads (its handler log's starts) — longer
    // than the 20 ms quiet period of the node's round hold (DESIGN §4), less a margin for
    // the clocks of the watch and the log: a loaded machine spaces them out. One more for a
    // round whose last put came while its first acks were written. With the round hold
    // planted away: 3 to 5 writes a node on a quiet machine, with no such pause (failed 4
    // runs of 4).
    for (node, writes) in &ack_writes {
        let mut seen: Vec<u64> = changes
            .iter()
            .filter(|x| x.created && x.node == Some(*node) && moved.get(&x.channel) == Some(node))
            .map(|x| x.at_ms)
            .collect();
        let starts = started.get(node).map_or(&[][..], Vec::as_slice);
        assert!(
            starts.len() >= seen.len(),
            "node {node}: a start in its handler log for each channel it received"
        );
        seen.extend(starts);
        seen.sort_unstable();
        let pauses = seen.windows(2).filter(|w| w[1] - w[0] > 15).count();
        println!(
            "node {node}: {} ack writes; pauses over 15 ms in its moves and loads: {pauses}",
            writes.len()
        );
        // On a failure, the nodes' warnings (a batched ack the store refused is retried one
        // by one, a write each): a CI run once failed here with three writes at consecutive
        // revisions and nothing else to tell why.
        let warned = || {
            c.procs
                .iter()
                .map(|(name, p)| {
                    let out = p.output();
                    let w: Vec<&str> = out.lines().filter(|l| l.contains(" WARN ")).collect();
                    format!("\n{name}: {}", w[w.len().saturating_sub(8)..].join("\n"))
                })
                .collect::<String>()
        };
        assert!(
            writes.len() <= 2 + pauses,
            "node {node} acknowledged its share of the failover in {} writes ({pauses} pauses \
             in its moves and loads): {writes:?}; the processes' last warnings:{}",
            writes.len(),
            warned()
        );
    }
    for (name, p) in &mut c.procs {
        assert!(p.running(), "{name} exited:\n{}", p.output());
    }
}

/// The coordinator's refused txns so far, from its `/metrics`.
async fn refused_txns(c: &Cluster) -> f64 {
    let text = c.metrics(&c.admin).await;
    Cluster::metric(&text, "chanwatch_store_txns_total{result=\"refused\"}").unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_session_losses_moves_each_channel_once_onto_a_live_node() {
    let _one = SERIAL.lock().await;
    // Whether a burst reaches the leader in one watch batch or several is up to etcd and
    // the machine's load: four bursts.
    let mut refused = 0.0;
    for run in 0..4 {
        refused += burst(run).await;
    }
    // Not asserted: how often a burst outlasts the leader's quiet period (DESIGN §3) is
    // timing — on a quiet machine none does (0 refused txns in 4 of 4 bursts, and 1–2 per
    // burst in about one burst of two with `--plant no-loss-hold`), under three CPU hogs about
    // one in fourteen does, and its refused round costs a retry, not a move.
    println!("refused coordinator txns over the four bursts: {refused}");
}

/// What a burst must do, judged from the test's watch of the assignment keys: `after` is
/// what it saw from the kill on, `revoked` the revision at which each dead node's session
/// went. Each channel the dead nodes `held` moves, no other channel does, and no channel is
/// put on a node whose session was already gone; a channel moves again only off a dead node
/// it was put on before that node's session went (the leader could not know yet: a burst
/// that outlasted its quiet period).
fn judge_burst(
    after: &[cluster::Change],
    revoked: &BTreeMap<u64, i64>,
    held: &BTreeSet<String>,
) -> Result<(), String> {
    let mut created: BTreeMap<&str, Vec<(u64, i64)>> = BTreeMap::new();
    for x in after {
        if let (true, Some(n)) = (x.created, x.node) {
            created.entry(&x.channel).or_default().push((n, x.revision));
        }
    }
    for (channel, puts) in &created {
        if let Some((n, rev)) = puts
            .iter()
            .find(|(n, rev)| revoked.get(n).is_some_and(|gone| rev > gone))
        {
            return Err(format!(
                "{channel} put on node {n} at revision {rev}, its session already gone at {}: {puts:?}",
                revoked[n]
            ));
        }
        if let Some((n, _)) = puts[..puts.len() - 1]
            .iter()
            .find(|(n, _)| !revoked.contains_key(n))
        {
            return Err(format!(
                "{channel} moved more than once, off live node {n}: {puts:?}"
            ));
        }
    }
    let moved: BTreeSet<&str> = created.keys().copied().collect();
    let held: BTreeSet<&str> = held.iter().map(String::as_str).collect();
    if moved != held {
        let stayed: Vec<_> = held.difference(&moved).collect();
        let extra: Vec<_> = moved.difference(&held).collect();
        return Err(format!(
            "the dead nodes' channels, and only they, should move: not moved {stayed:?}, moved though not on a dead node {extra:?}"
        ));
    }
    Ok(())
}

/// The judge fails each way a burst can go wrong (a checker that cannot fail proves nothing).
#[test]
fn the_burst_judge_fails_a_needless_second_move_a_move_onto_a_lost_node_and_a_missed_channel() {
    let put = |channel: &str, node: u64, revision: i64| cluster::Change {
        at_ms: 0,
        channel: channel.into(),
        node: Some(node),
        state: Some(ChannelState::ToWatch),
        epoch: 1,
        created: true,
        revision,
    };
    // Nodes 1 and 2 died: their sessions went at revisions 10 and 20.
    let revoked = BTreeMap::from([(1, 10), (2, 20)]);
    let held = BTreeSet::from(["x".to_owned(), "y".to_owned()]);
    let fails = |after: &[cluster::Change], why: &str| match judge_burst(after, &revoked, &held) {
        Err(e) => assert!(e.contains(why), "{e}"),
        Ok(()) => panic!("the judge passed a history where {why}"),
    };
    let judge = |after: &[cluster::Change]| judge_burst(after, &revoked, &held);
    assert_eq!(judge(&[put("x", 3, 21), put("y", 4, 21)]), Ok(()));
    // Put on node 2 before its session went, then moved on: the leader could not know.
    assert_eq!(
        judge(&[put("x", 2, 15), put("y", 4, 21), put("x", 3, 22)]),
        Ok(())
    );
    fails(
        &[put("x", 2, 25), put("y", 4, 21), put("x", 3, 26)],
        "already gone",
    );
    fails(
        &[put("x", 3, 21), put("y", 4, 21), put("x", 4, 22)],
        "off live node 3",
    );
    fails(&[put("x", 3, 21)], "not moved [\"y\"]");
    fails(
        &[put("x", 3, 21), put("y", 4, 21), put("z", 4, 21)],
        "moved though",
    );
}

/// Seven nodes hold 350 channels; five die together: killed, then their leases revoked at
/// once from outside (as when a rack loses power and its sessions expire in one instant).
async fn burst(run: usize) -> f64 {
    let mut c = Cluster::new("chanwatch-burst").await;
    let ttl = format!("--session-ttl={TTL}s");
    let plant = std::env::var("CHANWATCH_BLACKBOX_PLANT")
        .ok()
        .map(|p| format!("--plant={p}"));
    let mut coord = vec![ttl.as_str(), "--balance-quiet=300s"];
    coord.extend(plant.as_deref());
    c.coord(&coord);
    let endpoint = c.etcd.endpoint().to_owned();
    let names = ["a", "b", "c", "d", "e", "f", "g"];
    let dying = ["a", "b", "c", "d", "e"];
    for name in names {
        c.node(name, &endpoint, &[&ttl]);
    }
    let mut ids = BTreeMap::new();
    for name in names {
        ids.insert(name, c.node_id(name).await);
    }
    c.wait_coord_nodes(names.len()).await;
    let channels: Vec<String> = (0..350).map(|i| format!("l-{i:03}")).collect();
    c.add_channels(&channels).await;
    let placed = wait_for(60, "350 channels Watched", || c.settled(350, |_, _| true)).await;
    wait_for(10, "the test's watch", || c.history.seen(&placed)).await;

    let dead: BTreeSet<u64> = dying.iter().map(|n| ids[n]).collect();
    let keys = chanwatch_core::Keys::default();
    let mut etcd = etcd_client::Client::connect([c.etcd.endpoint()], None)
        .await
        .expect("test client");
    let mut leases = Vec::new();
    for id in &dead {
        let got = etcd
            .get(keys.session(chanwatch_core::NodeId(*id)), None)
            .await
            .expect("session read");
        leases.push((*id, got.kvs().first().expect("a live session").lease()));
    }
    let refused_before = refused_txns(&c).await;
    let before = c.history.changes().len();
    // What each dying node holds (how many is up to the cold start: under load the first
    // nodes seen get more).
    let mut owner = BTreeMap::new();
    for x in &c.history.changes()[..before] {
        if let (true, Some(n)) = (x.created, x.node) {
            owner.insert(x.channel.clone(), n);
        }
    }
    let held: BTreeSet<String> = owner
        .into_iter()
        .filter(|(_, n)| dead.contains(n))
        .map(|(ch, _)| ch)
        .collect();
    c.procs.retain(|(n, _)| !dying.contains(&n.as_str()));
    let revokes = leases.iter().map(|(id, l)| {
        let mut etcd = etcd.clone();
        async move { (*id, etcd.lease_revoke(*l).await) }
    });
    // The revision at which each session went.
    let mut revoked = BTreeMap::new();
    for (id, r) in futures_util::future::join_all(revokes).await {
        let r = r.expect("revoke");
        revoked.insert(id, r.header().expect("a revoke's header").revision());
    }
    let live = [ids["f"], ids["g"]];
    let after = wait_for(30, "every channel Watched on f and g", || {
        c.settled(350, |_, n| live.contains(&n))
    })
    .await;
    wait_for(10, "the test's watch", || c.history.seen(&after)).await;

    let refused = refused_txns(&c).await - refused_before;
    println!("burst {run}: refused coordinator txns {refused}");
    if let Err(why) = judge_burst(&c.history.changes()[before..], &revoked, &held) {
        panic!("burst {run}: {why}");
    }
    for (name, p) in &mut c.procs {
        assert!(p.running(), "{name} exited:\n{}", p.output());
    }
    refused
}
