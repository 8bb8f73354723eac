//! (Over 600 lines: one black-box scenario per operator-facing behaviour, sharing one small
//! harness.)
//!
//! `chanwatch ctl get|describe|events|undrain`, waiting through a leader failover, and
//! `--admin` against `standalone`, as an operator runs them: the real binary, a real etcd
//! (chanwatch-testkit), real coordinator and node processes, judged from their output only.
//! The golden files of `get channel -o json|yaml` are in `tests/golden/`
//! (`CHANWATCH_GOLDEN_UPDATE=1` rewrites them).

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Checkpoint, Epoch, Keys, NodeId,
    NodeSession, VChannelInfo,
};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore, Txn, TxnOp};
use chanwatch_testkit::EtcdFixture;
use serde_json::Value;

mod procs;
use procs::Proc;

/// One cluster at a time: the machine is small and the waits are timings.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// `--session-ttl` of every process, seconds.
const TTL: u64 = 3;

fn free_addr() -> String {
    format!("127.0.0.1:{}", chanwatch_testkit::free_port())
}

/// A process of the binary, its output in a file; killed on drop.
struct World {
    dir: tempfile::TempDir,
    etcd: EtcdFixture,
}

impl World {
    async fn new() -> World {
        World {
            dir: tempfile::Builder::new()
                .prefix("ctl-describe")
                .tempdir()
                .expect("tempdir"),
            etcd: EtcdFixture::start().await.expect("etcd fixture"),
        }
    }

    /// `chanwatch coord` named `id`; its admin address.
    fn coord(&self, id: &str) -> (Proc, String) {
        let admin = free_addr();
        let args = vec![
            "coord".to_owned(),
            format!("--endpoints={}", self.etcd.endpoint()),
            format!("--admin={admin}"),
            format!("--session-ttl={TTL}s"),
            "--balance-quiet=300s".to_owned(),
        ];
        (procs::spawn(self.dir.path(), id, &args), admin)
    }

    fn node(&self, name: &str) -> Proc {
        let args = vec![
            "node".to_owned(),
            format!("--endpoints={}", self.etcd.endpoint()),
            "--admin=127.0.0.1:0".to_owned(),
            format!("--session-ttl={TTL}s"),
        ];
        procs::spawn(self.dir.path(), name, &args)
    }

    fn ctl_raw(&self, args: &[&str]) -> Output {
        Command::new(procs::bin())
            .arg("ctl")
            .arg(format!("--endpoints={}", self.etcd.endpoint()))
            .args(args)
            .output()
            .expect("run ctl")
    }

    /// `ctl ARGS`: stdout, or stderr as the error.
    fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = self.ctl_raw(args);
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// `ctl channels -o json`, by channel: (node, state).
    fn channels(&self) -> Vec<(String, Option<u64>, String)> {
        let Ok(out) = self.ctl(&["channels", "-o", "json"]) else {
            return Vec::new();
        };
        let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        v.as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        (
                            c["channel"].as_str().unwrap_or("").to_owned(),
                            c["node"].as_u64(),
                            c["state"].as_str().unwrap_or("").to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    fn node_ids(&self) -> Vec<u64> {
        let Ok(out) = self.ctl(&["nodes", "-o", "json"]) else {
            return Vec::new();
        };
        let v: Value = serde_json::from_str(&out).unwrap_or(Value::Null);
        v.as_array()
            .map(|a| a.iter().filter_map(|n| n["id"].as_u64()).collect())
            .unwrap_or_default()
    }

    /// Waits until `pred` holds of the channels, or fails with them after `secs`.
    async fn wait(
        &self,
        secs: u64,
        what: &str,
        pred: impl Fn(&[(String, Option<u64>, String)]) -> bool,
    ) {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let c = self.channels();
            if pred(&c) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "not within {secs} s: {what}; channels: {c:?}"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// A coordinator and two nodes, leader ready, channels `orders-0..n` Watched.
    async fn cluster(&self, n: usize) -> (Proc, String, Vec<Proc>, Vec<u64>) {
        let (coord, admin) = self.coord("coord");
        let nodes = vec![self.node("node-a"), self.node("node-b")];
        let deadline = Instant::now() + Duration::from_secs(30);
        let ids = loop {
            let ids = self.node_ids();
            if ids.len() == 2 {
                break ids;
            }
            assert!(
                Instant::now() < deadline,
                "nodes did not register: {}",
                coord.output()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        // The leader must see both before channels are added, so they spread.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !self
            .ctl(&["--admin", &admin, "nodes", "-o", "json"])
            .is_ok_and(|o| serde_json::from_str::<Vec<Value>>(&o).is_ok_and(|v| v.len() == 2))
        {
            assert!(
                Instant::now() < deadline,
                "the leader never listed 2 nodes: {}",
                coord.output()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for i in 0..n {
            self.ctl(&["add-channel", &format!("orders-{i}")])
                .expect("add-channel");
        }
        self.wait(30, "every channel Watched", |c| {
            c.len() == n
                && c.iter()
                    .all(|(_, node, s)| node.is_some() && s == "Watched")
        })
        .await;
        (coord, admin, nodes, ids)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manual_move_shows_in_describe_and_events_with_cause_manual() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (_coord, _admin, _nodes, ids) = w.cluster(1).await;
    let on = w.channels()[0].1.expect("assigned");
    let other = ids.iter().copied().find(|&i| i != on).expect("two nodes");
    // It says where the channel goes (it printed `node A -> A (ToRelease)`: the release).
    let said = w
        .ctl(&["move", "orders-0", "--to", &other.to_string()])
        .expect("move");
    assert!(
        said.starts_with(&format!("orders-0: node {on} -> node {other} (")),
        "{said}"
    );
    w.wait(20, "orders-0 Watched on the other node", |c| {
        c[0].1 == Some(other) && c[0].2 == "Watched"
    })
    .await;
    let describe = w
        .ctl(&["describe", "channel", "orders-0"])
        .expect("describe");
    for want in [
        &format!("Assigned to: node {other}\n"),
        "State:       Watched\n",
        "history since this leader",
        "assign",
        "manual    orders-0:",
    ] {
        assert!(describe.contains(want), "{want:?} not in\n{describe}");
    }
    let events = w.ctl(&["events"]).expect("events");
    assert!(
        events.contains(&format!("manual    orders-0: {on} -> {other} (ToWatch")),
        "{events}"
    );
    let json: Value =
        serde_json::from_str(&w.ctl(&["events", "-o", "json"]).expect("events")).expect("json");
    assert!(
        json.as_array()
            .expect("a list")
            .iter()
            .any(|e| e["cause"] == "manual" && e["channel"] == "orders-0"),
        "{json}"
    );
    let node = w
        .ctl(&["describe", "node", &other.to_string()])
        .expect("describe node");
    assert!(
        node.contains("orders-0") && node.contains("Draining:    no"),
        "{node}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_sees_a_killed_nodes_channels_fail_over() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (_coord, _admin, mut nodes, _ids) = w.cluster(4).await;
    let follow = procs::spawn(
        w.dir.path(),
        "follow",
        &[
            "ctl".to_owned(),
            format!("--endpoints={}", w.etcd.endpoint()),
            "events".to_owned(),
            "--follow".to_owned(),
        ],
    );
    // It prints the history first: the assignments.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !follow.output().contains("assign") {
        assert!(Instant::now() < deadline, "no history: {}", follow.output());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(nodes.remove(0)); // killed
    let deadline = Instant::now() + Duration::from_secs(30);
    while !follow.output().contains("failover ") {
        assert!(
            Instant::now() < deadline,
            "events --follow never showed a failover: {}",
            follow.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        follow.output().contains(" left — session gone"),
        "{}",
        follow.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_api_answers_a_path_or_method_it_does_not_have_with_a_json_error() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (_coord, admin, _nodes, _ids) = w.cluster(1).await;
    // The real coordinator binary's admin API: a path it does not have, and a path asked with a method
    // it does not take, are JSON errors that say so (axum's own are empty).
    let http = reqwest::Client::new();
    for (url, code, says) in [
        (
            format!("http://{admin}/api/v1/nodez"),
            404,
            "no such endpoint: GET /api/v1/nodez",
        ),
        (
            format!("http://{admin}/api/v1/balance"),
            405,
            "/api/v1/balance does not take GET",
        ),
    ] {
        let answer = http.get(&url).send().await.expect("the admin API answers");
        assert_eq!(answer.status().as_u16(), code, "GET {url}");
        let body: serde_json::Value = answer.json().await.expect("a JSON error body");
        assert!(
            body["error"].as_str().is_some_and(|e| e.contains(says)),
            "GET {url}: {body}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undrained_node_takes_channels_again() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (_coord, _admin, _nodes, ids) = w.cluster(2).await;
    let (a, b) = (ids[0], ids[1]);
    w.ctl(&["drain", &b.to_string()]).expect("drain");
    w.wait(30, "every channel on the other node", |c| {
        c.iter().all(|(_, n, s)| *n == Some(a) && s == "Watched")
    })
    .await;
    let out = w.ctl(&["undrain", &b.to_string()]).expect("undrain");
    assert!(out.contains("takes channels again"), "{out}");
    let out = w.ctl(&["undrain", &b.to_string()]).expect("undrain again");
    assert!(out.contains("was not draining"), "{out}");
    let err = w.ctl(&["undrain", "999"]).expect_err("undrain of no node");
    assert!(err.contains("node 999 is not alive"), "{err}");
    let node = w
        .ctl(&["describe", "node", &b.to_string()])
        .expect("describe");
    assert!(
        node.contains("Draining:    no") && node.contains(" undrained"),
        "{node}"
    );
    // A new channel goes to the least-loaded node that takes channels: b again.
    w.ctl(&["add-channel", "orders-9"]).expect("add");
    w.wait(20, "orders-9 Watched on the undrained node", |c| {
        c.iter()
            .any(|(n, node, s)| n == "orders-9" && *node == Some(b) && s == "Watched")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_waits_through_a_leader_failover_and_a_frozen_leader_then_succeeds() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (first, _admin, _nodes, _ids) = w.cluster(1).await;
    let (second, _) = w.coord("coord-2");
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Frozen: the leader key stays until its lease runs out; requests get no answer.
    first.signal("STOP");
    let started = Instant::now();
    let out = w.ctl_raw(&["--timeout=15s", "describe", "channel", "orders-0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ctl failed after {:?}: {stderr}\nsecond coord: {}",
        started.elapsed(),
        second.output()
    );
    assert!(
        stderr.contains("waiting up to 15 s (--timeout) for a leader"),
        "{stderr}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("Channel:     orders-0"));
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    eprintln!("ctl waited {:?} through a frozen leader", started.elapsed());
    drop(first);
    // Killed: its key stays until its lease runs out, its port refuses; ctl waits for the next.
    let (third, _) = w.coord("coord-3");
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(second);
    let started = Instant::now();
    let out = w.ctl_raw(&["describe", "channel", "orders-0"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "{stderr}\nthird coord: {}",
        third.output()
    );
    eprintln!("ctl waited {:?} through a killed leader", started.elapsed());
    assert!(
        stderr.contains("waiting up to 20 s (--timeout) for a leader"),
        "{stderr}"
    );
    // With no coordinator left ctl gives up after --timeout, saying why.
    drop(third);
    let started = Instant::now();
    let out = w.ctl_raw(&["--timeout=3s", "balance", "--dry-run"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no leader answered within 3 s"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(8),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_admin_reads_a_standalone_which_has_no_etcd() {
    let _one = SERIAL.lock().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let admin = free_addr();
    let standalone = procs::spawn(
        dir.path(),
        "standalone",
        &[
            "standalone".to_owned(),
            format!("--admin={admin}"),
            "--nodes=2".to_owned(),
            "--channels=3".to_owned(),
        ],
    );
    let ctl = |args: &[&str]| {
        Command::new(procs::bin())
            .arg("ctl")
            // Nothing listens here: ctl must not need etcd.
            .arg("--endpoints=127.0.0.1:1")
            .args(["--admin", &admin])
            .args(args)
            .output()
            .expect("run ctl")
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let rows = loop {
        let out = ctl(&["channels", "-o", "json"]);
        let rows: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        if rows.len() == 3 && rows.iter().all(|r| r["state"] == "Watched") {
            break rows;
        }
        assert!(
            Instant::now() < deadline,
            "ctl --admin channels: {}{}\nstandalone: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            standalone.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(rows[0]["channel"], "ch-000");
    // The admin list carries no vchannel: null, not a made-up default (a newcomer saw
    // `{"collection_id": 0}` for a channel added with collection 7).
    assert!(rows.iter().all(|r| r["vchannel"].is_null()), "{rows:?}");
    let table = ctl(&["channels"]);
    assert!(String::from_utf8_lossy(&table.stdout).contains("3 channel(s)"));
    let nodes = ctl(&["nodes"]);
    assert!(String::from_utf8_lossy(&nodes.stdout).contains("2 node(s)"));
    // Each in-process node serves an admin HTTP of its own: ctl asks it and hears "running"
    // (a newcomer saw `NODE SAYS ?` and "status unknown (the node serves no admin HTTP)").
    let nodes = ctl(&["nodes", "-o", "json"]);
    let rows: Vec<Value> = serde_json::from_slice(&nodes.stdout).expect("ctl nodes -o json");
    assert_eq!(rows.len(), 2, "{rows:?}");
    for row in &rows {
        assert_eq!(row["paused"], Value::Bool(false), "{row}");
        let addr = row["admin_addr"].as_str().unwrap_or_default();
        assert!(addr.starts_with("127.0.0.1:"), "{row}");
    }
    let says = ctl(&["channels"]);
    let (out, err) = (
        String::from_utf8_lossy(&says.stdout),
        String::from_utf8_lossy(&says.stderr),
    );
    assert!(
        !err.contains("status unknown") && !out.contains(" ?"),
        "{out}{err}"
    );
    assert!(out.contains("running"), "{out}");
    let d = ctl(&["describe", "channel", "ch-001"]);
    assert!(
        String::from_utf8_lossy(&d.stdout).contains("Channel:     ch-001"),
        "{}",
        String::from_utf8_lossy(&d.stderr)
    );
    let get = ctl(&["get", "channel", "ch-002", "-o", "json"]);
    let v: Value = serde_json::from_slice(&get.stdout).expect("json");
    assert_eq!(v["channel"], "ch-002");
    assert!(v["vchannel"].is_null(), "{v}");
}

/// etcd holding node 1's session, `orders-10` on it (vchannel, checkpoint) with fixed times.
async fn seeded() -> EtcdFixture {
    let fixture = EtcdFixture::start().await.expect("etcd");
    let store = EtcdStore::connect(EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        ..EtcdConfig::default()
    })
    .await
    .expect("connect");
    let keys = Keys::default();
    let t = 1_700_000_000_000;
    let session = NodeSession {
        id: NodeId(1),
        name: "n1".into(),
        admin_addr: String::new(),
        version: "test".into(),
        started_at_ms: t,
        capacity: 0,
        extra: Default::default(),
    };
    let name = ChannelName::new("orders-10").expect("name");
    let vchannel = VChannelInfo::from_json(br#"{"collection_id":7,"seek_position":"p-42"}"#)
        .expect("vchannel");
    let mut info = ChannelInfo::new(name.clone(), Epoch(3), t + 1_000, vchannel);
    info.state = ChannelState::Watched;
    let checkpoint = Checkpoint {
        epoch: Epoch(3),
        position: "1234".into(),
        state: None,
        updated_at_ms: t + 2_000,
        extra: Default::default(),
    };
    let ops = vec![
        TxnOp::put(keys.session(NodeId(1)), session.encode()),
        TxnOp::put(
            keys.channel(ChannelOwner::Node(NodeId(1)), &name),
            info.encode(),
        ),
        TxnOp::put(keys.checkpoint(&name), checkpoint.encode()),
    ];
    store.txn(Txn::new().and_then(ops)).await.expect("seed");
    fixture
}

/// `age_ms` grows with the clock: the golden files hold 0.
fn steady(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("age_ms") {
            Some(i) => {
                let head = &l[..i + "age_ms".len()];
                let tail = &l[i + "age_ms".len()..];
                let sep: String = tail.chars().take_while(|c| !c.is_ascii_digit()).collect();
                let rest: String = tail[sep.len()..]
                    .chars()
                    .skip_while(char::is_ascii_digit)
                    .collect();
                format!("{head}{sep}0{rest}\n")
            }
            None => format!("{l}\n"),
        })
        .collect()
}

fn golden(name: &str, got: &str) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    if std::env::var_os("CHANWATCH_GOLDEN_UPDATE").is_some() {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&path, got).expect("write golden");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (CHANWATCH_GOLDEN_UPDATE=1 writes it)",
            path.display()
        )
    });
    assert_eq!(got, want, "{} differs", path.display());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn get_channel_prints_the_golden_json_and_yaml() {
    let _one = SERIAL.lock().await;
    let etcd = seeded().await;
    let ctl = |args: &[&str]| {
        let out = Command::new(procs::bin())
            .arg("ctl")
            .arg(format!("--endpoints={}", etcd.endpoint()))
            .args(args)
            .output()
            .expect("run ctl");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    golden(
        "get_channel.json",
        &steady(&ctl(&["get", "channel", "orders-10", "-o", "json"])),
    );
    golden(
        "get_channel.yaml",
        &steady(&ctl(&["get", "channel", "orders-10", "-o", "yaml"])),
    );
    let table = ctl(&["get", "channel", "orders-10"]);
    assert!(table.starts_with("CHANNEL "), "{table}");
    assert_eq!(table.lines().count(), 2, "{table}");
    let out = Command::new(procs::bin())
        .arg("ctl")
        .arg(format!("--endpoints={}", etcd.endpoint()))
        .args(["get", "channel", "nope"])
        .output()
        .expect("run ctl");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("channel nope does not exist"),
        "{out:?}"
    );
}

#[test]
fn completion_scripts_are_printed_for_bash_zsh_and_fish_without_etcd() {
    for (shell, want) in [
        ("bash", "complete -F"),
        ("zsh", "#compdef chanwatch"),
        ("fish", "complete -c chanwatch"),
    ] {
        let out = Command::new(procs::bin())
            .args(["ctl", "--endpoints=127.0.0.1:1", "completion", shell])
            .output()
            .expect("run ctl");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{shell}: {out:?}");
        assert!(
            text.contains(want) && text.contains("describe"),
            "{shell}: {text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_follow_reconnects_to_the_new_leader_after_a_failover() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (first, _admin, _nodes, ids) = w.cluster(2).await;
    let (_second, _) = w.coord("coord-2");
    let follow = procs::spawn(
        w.dir.path(),
        "follow",
        &[
            "ctl".to_owned(),
            format!("--endpoints={}", w.etcd.endpoint()),
            "--timeout=20s".to_owned(),
            "events".to_owned(),
            "--follow".to_owned(),
        ],
    );
    let histories = |out: &str| out.matches("# history since this leader").count();
    let deadline = Instant::now() + Duration::from_secs(10);
    while histories(&follow.output()) < 1 {
        assert!(Instant::now() < deadline, "no history: {}", follow.output());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    drop(first); // killed: the standby takes over after the lease runs out
    let deadline = Instant::now() + Duration::from_secs(30);
    while histories(&follow.output()) < 2 {
        assert!(
            Instant::now() < deadline,
            "events --follow never reached the new leader: {}",
            follow.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And it prints what the new leader does.
    let on = w.channels()[0].1.expect("assigned");
    let other = ids.iter().copied().find(|&i| i != on).expect("two nodes");
    w.ctl(&["move", &w.channels()[0].0, "--to", &other.to_string()])
        .expect("move");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let out = follow.output();
        let after = &out[out.rfind("# history since").unwrap_or(0)..];
        if after.contains("manual ") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no move after the failover: {out}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `ctl --admin` given a standby's address: the standby answers 503 naming the leader, and
/// ctl asks the leader instead, with one line on stderr (before, it waited out `--timeout`
/// against the standby). Reads and writes; no etcd reachable from ctl.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_admin_pointed_at_a_standby_follows_the_leader() {
    let _one = SERIAL.lock().await;
    let w = World::new().await;
    let (leader, leader_admin) = w.coord("coord-a");
    let deadline = Instant::now() + Duration::from_secs(30);
    while w.ctl(&["--admin", &leader_admin, "nodes"]).is_err() {
        assert!(
            Instant::now() < deadline,
            "coord-a never led: {}",
            leader.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (standby, standby_admin) = w.coord("coord-b");
    let client = reqwest::Client::new();
    // The standby serves its API (and refuses, naming the leader).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let r = client
            .get(format!("http://{standby_admin}/api/v1/nodes"))
            .send()
            .await;
        if let Ok(r) = r {
            let code = r.status().as_u16();
            let body: Value = r.json().await.unwrap_or(Value::Null);
            if code == 503 && body["leader"] == leader_admin.as_str() {
                break;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the standby never named the leader: {}",
            standby.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ctl = |args: &[&str]| {
        let out = Command::new(procs::bin())
            .arg("ctl")
            // Nothing listens here: ctl must not need etcd.
            .arg("--endpoints=127.0.0.1:1")
            .args(["--admin", &standby_admin, "--timeout=3s"])
            .args(args)
            .output()
            .expect("run ctl");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let note = format!(
        "http://{standby_admin} is a standby coordinator; asking the leader at http://{leader_admin}\n"
    );
    let (ok, out, err) = ctl(&["add-channel", "orders-9"]);
    assert!(ok, "{out}{err}");
    assert_eq!(err, note, "one line on stderr");
    assert!(out.contains("orders-9"), "{out}");
    let (ok, out, err) = ctl(&["channels", "-o", "json"]);
    assert!(ok, "{out}{err}");
    assert_eq!(err, note);
    let rows: Vec<Value> = serde_json::from_str(&out).expect("json");
    assert_eq!(rows.len(), 1, "{out}");
    assert_eq!(rows[0]["channel"], "orders-9");
    let (ok, out, err) = ctl(&["events", "-o", "json"]);
    assert!(ok && out.contains("orders-9"), "{out}{err}");
}

/// `ctl --admin` at an address where nothing listens waits `--timeout` for a leader, saying
/// what the connection said (reqwest's own message leaves the cause out), then fails.
#[test]
fn ctl_at_a_dead_admin_address_says_why_and_gives_up_after_its_timeout() {
    let started = Instant::now();
    let out = Command::new(procs::bin())
        .args(["ctl", "--endpoints=127.0.0.1:1", "--admin=127.0.0.1:1"])
        .args(["--timeout=1s", "channels"])
        .output()
        .expect("run ctl");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(started.elapsed() < Duration::from_secs(10), "{err}");
    assert!(
        err.contains("does not answer") && err.to_lowercase().contains("connection refused"),
        "{err}"
    );
}
