//! `chanwatch node --exec` through the real binary: real etcd, a real coordinator,
//! nodes as processes and their workers as real child processes, judged from outside — `ctl
//! --json`, `etcdctl`, the nodes' logs, the workers' own files and `/proc`.
//!
//! Over 600 lines: one flat list of independent scenarios sharing one small harness (`World`);
//! the process-tree ones are in `exec/tree.rs`.
//!
//! The Rust consumer and the Python worker resuming each other's checkpoints: `exec/mixed.rs`;
//! a node that fences itself killing its workers at once: `exec/fence.rs`; the Python worker
//! exiting at once on SIGTERM while its commit hangs: `exec/sigterm.rs`; a worker's last commit
//! on a node's shutdown answered at once: `exec/shutdown.rs`; a worker that hangs up mid-commit
//! not fenced by its own write: `exec/hangup.rs`; a node cut off from etcd counted paused by the
//! leader's summary: `exec/summary.rs`; a worker's wrong requests answered with JSON errors:
//! `exec/errors.rs`; workers started without `exec` (the node's death, SIGTERM and the grace
//! reaching the whole tree): `exec/tree.rs`.
//!
//! Over 600 lines: nine scenarios on one harness (`World`: etcd, a coordinator, nodes and
//! ctl; `/proc` scans; a TCP proxy that partitions a node), which they share; split it into a
//! `tests/exec/` module when it grows again.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod procs;
use procs::{bin, spawn, Proc};
#[path = "exec/errors.rs"]
mod errors;
#[path = "exec/fence.rs"]
mod fence;
#[path = "exec/hangup.rs"]
mod hangup;
#[path = "exec/mixed.rs"]
mod mixed;
#[path = "exec/shutdown.rs"]
mod shutdown;
#[path = "exec/sigterm.rs"]
mod sigterm;
#[path = "exec/summary.rs"]
mod summary;
#[path = "exec/tree.rs"]
mod tree;

use chanwatch_testkit::free_port;

/// The repository's `examples/workers/`.
fn workers() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/workers")
}

/// Runs `chanwatch ARGS` to its end; (success, stdout, stderr).
fn run(args: &[String]) -> (bool, String, String) {
    let out = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("chanwatch runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Waits until `f` gives `Some`, for up to `secs`; panics with `what()` otherwise.
fn wait_for<T>(secs: u64, what: impl Fn() -> String, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out: {}", what());
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Pids of live (not zombie) processes whose command line contains `marker`, nodes (whose
/// `--exec=` holds the worker's command text) left out.
fn procs_with(marker: &str) -> Vec<u32> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        let cmdline = String::from_utf8_lossy(&cmdline);
        if !zombie
            && cmdline.contains(marker)
            && !cmdline.contains("--exec=")
            && pid != std::process::id()
        {
            out.push(pid);
        }
    }
    out
}

/// An etcd, a coordinator, and a temp dir; nodes are started by the test.
struct World {
    etcd: chanwatch_testkit::EtcdFixture,
    dir: tempfile::TempDir,
    /// The coordinator's admin API, `127.0.0.1:PORT`.
    admin: String,
    _coord: Proc,
}

impl World {
    async fn start() -> World {
        let etcd = chanwatch_testkit::EtcdFixture::start().await.expect("etcd");
        let dir = tempfile::tempdir().expect("tempdir");
        let admin = format!("127.0.0.1:{}", free_port());
        let coord = spawn(
            dir.path(),
            "coord",
            &[
                "coord".into(),
                format!("--endpoints={}", etcd.endpoint()),
                format!("--admin={admin}"),
                "--session-ttl=2s".into(),
                "--release-timeout=5s".into(),
                "--balance-quiet=60s".into(),
            ],
        );
        World {
            etcd,
            dir,
            admin,
            _coord: coord,
        }
    }

    fn endpoint(&self) -> String {
        format!("--endpoints={}", self.etcd.endpoint())
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `chanwatch node --exec CMD EXTRA…`, TTL 2 s, its log in `DIR/NAME.out`.
    fn node(&self, name: &str, exec: &str, extra: &[&str]) -> Proc {
        self.node_via(name, self.etcd.endpoint(), "2s", exec, extra)
    }

    /// [`World::node`] reaching etcd at `etcd` (a proxy, say) with session TTL `ttl`.
    fn node_via(&self, name: &str, etcd: &str, ttl: &str, exec: &str, extra: &[&str]) -> Proc {
        let mut args = vec![
            "node".to_owned(),
            // Port 0: several nodes share this machine (the default is 9871).
            "--admin=127.0.0.1:0".to_owned(),
            format!("--endpoints={etcd}"),
            format!("--session-ttl={ttl}"),
            format!("--exec={exec}"),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        spawn(self.dir.path(), name, &args)
    }

    fn ctl(&self, args: &[&str]) -> (bool, String, String) {
        let mut all = vec!["ctl".to_owned(), self.endpoint()];
        all.extend(args.iter().map(|s| (*s).to_owned()));
        run(&all)
    }

    /// Registers a channel, retrying while no coordinator leads yet.
    /// Waits until `n` nodes are registered (`ctl nodes`): channels added before a node
    /// registers all go to the others, and `--balance-quiet=60s` moves none to it in a test's
    /// time.
    fn wait_nodes(&self, n: usize) {
        wait_for(
            20,
            || format!("{n} nodes registered"),
            || {
                let (ok, out, _) = self.ctl(&["nodes", "--json"]);
                (ok && serde_json::from_str::<serde_json::Value>(&out)
                    .ok()?
                    .as_array()?
                    .len()
                    == n)
                    .then_some(())
            },
        );
    }

    fn add_channel(&self, name: &str, extra: &[&str]) {
        let mut args = vec!["add-channel", name];
        args.extend_from_slice(extra);
        wait_for(
            20,
            || format!("add-channel {name}"),
            || self.ctl(&args).0.then_some(()),
        );
    }

    /// The `ctl channels --json` row of `channel`.
    fn row(&self, channel: &str) -> Option<serde_json::Value> {
        let (ok, out, _) = self.ctl(&["channels", "--json"]);
        let rows: serde_json::Value = ok.then(|| serde_json::from_str(&out).ok())??;
        rows.as_array()?
            .iter()
            .find(|r| r["channel"] == channel)
            .cloned()
    }

    /// Waits until `channel` is `Watched`; its row.
    fn watched(&self, channel: &str, secs: u64) -> serde_json::Value {
        wait_for(
            secs,
            || format!("{channel} Watched: {:?}", self.row(channel)),
            || self.row(channel).filter(|r| r["state"] == "Watched"),
        )
    }

    /// `etcdctl get KEY --print-value-only`, or `None` when absent.
    fn etcd_get(&self, key: &str) -> Option<String> {
        let out = Command::new("etcdctl")
            .args([&self.endpoint(), "get", key, "--print-value-only"])
            .env("ETCDCTL_API", "3")
            .output()
            .expect("etcdctl runs");
        let v = String::from_utf8_lossy(&out.stdout).trim().to_owned();
        (!v.is_empty()).then_some(v)
    }

    fn etcd_put(&self, key: &str, value: &str) {
        let out = Command::new("etcdctl")
            .args([&self.endpoint(), "put", key, value])
            .env("ETCDCTL_API", "3")
            .output()
            .expect("etcdctl runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The process groups of [`procs_with`]: one per worker (each leads its own group; a
/// subshell it forked, not exec'd yet, has its command line too).
fn groups_with(marker: &str) -> std::collections::BTreeSet<u32> {
    procs_with(marker)
        .into_iter()
        .filter_map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let (_, rest) = stat.rsplit_once(')')?;
            rest.split_whitespace().nth(2)?.parse().ok()
        })
        .collect()
}

/// A node process whose log is `DIR/NAME.out` (as `procs::spawn`), with `env` added; killed
/// (SIGKILL) when dropped.
struct EnvProc {
    child: std::process::Child,
    out: PathBuf,
}

impl EnvProc {
    fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for EnvProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_with_env(dir: &Path, name: &str, args: &[String], env: &[(&str, &str)]) -> EnvProc {
    let out = dir.join(format!("{name}.out"));
    let file = std::fs::File::create(&out).expect("output file");
    let child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("dup"))
        .stderr(file)
        .spawn()
        .expect("spawn chanwatch");
    EnvProc { child, out }
}

/// Reads a worker's `env` dump (`KEY=VALUE` lines), once it exists.
fn env_file(path: &Path) -> std::collections::HashMap<String, String> {
    wait_for(
        20,
        || format!("{} written", path.display()),
        || {
            let text = std::fs::read_to_string(path).ok()?;
            text.contains("CHANWATCH_AGENT_TOKEN=").then(|| {
                text.lines()
                    .filter_map(|l| l.split_once('='))
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .collect()
            })
        },
    )
}

/// A worker command: dump the environment to `DIR/CHANNEL.env`, then run the shell example.
fn dumping_worker(dir: &Path) -> String {
    format!(
        "env > '{}'/\"$CHANWATCH_CHANNEL\".env; exec sh '{}/worker.sh' '{}'",
        dir.display(),
        workers().display(),
        dir.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_runs_per_channel_with_its_assignment_in_its_environment_and_stops_on_removal() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    let log = w.path("handler.log");
    // The node's own CHANWATCH_* settings (here `--load-delay`'s variable) must not reach its
    // workers; the rest of its environment does.
    let node = spawn_with_env(
        w.dir.path(),
        "node",
        &[
            "node".into(),
            // Port 0: several nodes share this machine (the default is 9871).
            "--admin=127.0.0.1:0".into(),
            w.endpoint(),
            "--session-ttl=2s".into(),
            format!("--exec={}", dumping_worker(w.dir.path())),
            format!("--handler-log={}", log.display()),
            "--stop-grace=5s".into(),
        ],
        &[
            ("CHANWATCH_LOAD_DELAY", "0s"),
            ("UNRELATED_SETTING", "kept"),
        ],
    );
    w.add_channel(
        "x-0",
        &[
            "--vchannel",
            r#"{"collection_id":7,"seek_position":"0x1f"}"#,
        ],
    );
    w.add_channel("x-1", &[]);
    let row = w.watched("x-0", 30);
    w.watched("x-1", 30);
    let env = env_file(&w.path("x-0.env"));
    assert_eq!(env["CHANWATCH_CHANNEL"], "x-0");
    assert_eq!(env["CHANWATCH_EPOCH"], row["epoch"].to_string());
    assert_eq!(env["CHANWATCH_NODE"], row["node"].to_string());
    let vchannel: serde_json::Value =
        serde_json::from_str(&env["CHANWATCH_VCHANNEL"]).expect("vchannel is JSON");
    assert_eq!(vchannel["collection_id"], 7);
    assert_eq!(vchannel["seek_position"], "0x1f");
    assert_eq!(env["CHANWATCH_RESUME_POSITION"], "");
    assert!(env["CHANWATCH_AGENT_URL"].starts_with("http://127.0.0.1:"));
    assert_eq!(env["CHANWATCH_AGENT_TOKEN"].len(), 32);
    assert!(
        !env.contains_key("CHANWATCH_LOAD_DELAY"),
        "the node's settings leaked"
    );
    assert_eq!(env["UNRELATED_SETTING"], "kept");
    let other = env_file(&w.path("x-1.env"));
    assert_eq!(other["CHANWATCH_CHANNEL"], "x-1");
    assert_ne!(other["CHANWATCH_AGENT_TOKEN"], env["CHANWATCH_AGENT_TOKEN"]);
    // One worker per channel, and its heartbeat commits land in etcd through the agent.
    assert_eq!(groups_with(&marker).len(), 2, "{}", node.output());
    let cp = wait_for(
        20,
        || "x-0 committed".into(),
        || w.etcd_get("chanwatch/worker/checkpoint/x-0"),
    );
    assert!(cp.contains("\"position\""), "{cp}");
    // Its stdout is in the node's log with the channel.
    assert!(
        node.output().contains("resuming after"),
        "{}",
        node.output()
    );
    let (ok, _, err) = w.ctl(&["remove-channel", "x-0"]);
    assert!(ok, "{err}");
    wait_for(
        10,
        || format!("x-0's worker gone: {}", node.output()),
        || (groups_with(&marker).len() == 1).then_some(()),
    );
    // The node writes `stop` once it has reaped the worker: a moment after the group is gone
    // (CI saw the log read in between).
    let read_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let lines = wait_for(
        10,
        || format!("a stop of x-0 in the handler log: {}", read_log()),
        || {
            let lines = read_log();
            lines
                .lines()
                .any(|l| l.starts_with("stop ") && l.contains(" x-0 "))
                .then_some(lines)
        },
    );
    assert!(
        lines
            .lines()
            .any(|l| l.starts_with("start ") && l.contains(" x-0 ")),
        "{lines}"
    );
    assert!(
        node.output().contains("exec: worker stopped"),
        "{}",
        node.output()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_with_sigkill_leaves_no_worker_running() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    let mut node = w.node("node", &dumping_worker(w.dir.path()), &[]);
    for c in ["k-0", "k-1", "k-2"] {
        w.add_channel(c, &[]);
    }
    for c in ["k-0", "k-1", "k-2"] {
        w.watched(c, 30);
    }
    assert_eq!(groups_with(&marker).len(), 3, "{}", node.output());
    assert!(node.running());
    drop(node); // SIGKILL: no release, no SIGTERM — only the kernel's death signal.
    wait_for(
        2,
        || format!("orphans left: {:?}", procs_with(&marker)),
        || procs_with(&marker).is_empty().then_some(()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_exits_1_fails_its_channel_and_it_runs_on_the_other_node() {
    let w = World::start().await;
    // Node a's worker says it is ready, runs 2 s (node b is up by then), then exits 1.
    let crashing = format!(
        "curl -s -X POST -H \"Authorization: Bearer $CHANWATCH_AGENT_TOKEN\" \"$CHANWATCH_AGENT_URL/ready\"; sleep 2; echo crashing; exit 1 # {}",
        w.dir.path().display()
    );
    let a = w.node("node-a", &crashing, &[]);
    w.add_channel("f-0", &[]);
    let first = w.watched("f-0", 30);
    let b = w.node("node-b", &dumping_worker(w.dir.path()), &[]);
    let env = env_file(&w.path("f-0.env"));
    let row = w.watched("f-0", 30);
    assert_ne!(row["node"], first["node"], "{}", a.output());
    assert_eq!(env["CHANWATCH_NODE"], row["node"].to_string());
    assert!(row["epoch"].as_u64() > first["epoch"].as_u64());
    let out = a.output();
    assert!(
        out.contains("exited on its own") && out.contains("exit code 1"),
        "{out}"
    );
    assert!(
        out.contains("crashing"),
        "the worker's stdout is in the node's log: {out}"
    );
    // Why it failed reaches the operator: the `failed` event carries the node's reason (a
    // newcomer saw only `failed f-0: 11 -> 10`).
    let (ok, events, err) = w.ctl(&["events", "-o", "json"]);
    assert!(ok, "ctl events: {err}");
    let events: Vec<serde_json::Value> = serde_json::from_str(&events).expect("events json");
    assert!(
        events.iter().any(|e| e["cause"] == "failed"
            && e["channel"] == "f-0"
            && e["detail"]
                .as_str()
                .is_some_and(|d| d.contains("exit code 1"))),
        "{events:?}"
    );
    // Not respawned in a loop on a: it stays on b.
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(
        w.row("f-0").expect("row")["node"],
        row["node"],
        "{}",
        b.output()
    );
}

/// A worker that reports itself broken before it said it is ready fails its channel at once
/// with its own reason, and is killed — judged from `ctl channels` and `/proc`. It used to be
/// answered 200 and ignored: it ran on until the watch timeout (30 s) killed it as a
/// `timeout`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_fails_before_its_ready_fails_its_channel_at_once() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    let broken = format!(
        "curl -s -X POST -H \"Authorization: Bearer $CHANWATCH_AGENT_TOKEN\" -d '{{\"reason\": \"no disk here\"}}' \"$CHANWATCH_AGENT_URL/fail\"; exec sleep 3600 # {marker}"
    );
    let node = w.node("node", &broken, &[]);
    let added = Instant::now();
    w.add_channel("b-0", &[]);
    // Alone, the node keeps the channel `WatchFailed` until the back-off ends (no other node
    // to move it to): its row says so, with the worker's reason.
    let row = wait_for(
        15,
        || format!("b-0 not WatchFailed: {:?}; {}", w.row("b-0"), node.output()),
        || w.row("b-0").filter(|r| r["state"] == "WatchFailed"),
    );
    assert!(
        added.elapsed() < Duration::from_secs(20),
        "failed only after the watch timeout: {row}"
    );
    assert!(
        row["reason"]
            .as_str()
            .is_some_and(|r| r.contains("no disk here")),
        "the worker's reason is the channel's: {row}"
    );
    wait_for(
        10,
        || format!("the broken worker still runs: {}", node.output()),
        || procs_with(&marker).is_empty().then_some(()),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_ignores_sigterm_is_killed_after_the_grace() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    let stubborn = format!(
        "trap '' TERM; echo $$ > '{0}/stubborn.pid'; while :; do sleep 0.2; done # {0}",
        w.dir.path().display()
    );
    let node = w.node(
        "node",
        &stubborn,
        &["--ready-on-start", "--stop-grace=1500ms"],
    );
    w.add_channel("s-0", &[]);
    w.watched("s-0", 30);
    wait_for(
        10,
        || "worker up".into(),
        || (!procs_with(&marker).is_empty()).then_some(()),
    );
    let removed = Instant::now();
    let (ok, _, err) = w.ctl(&["remove-channel", "s-0"]);
    assert!(ok, "{err}");
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        !procs_with(&marker).is_empty() || removed.elapsed() >= Duration::from_millis(1500),
        "SIGTERM is ignored: the worker lives until the grace ends"
    );
    wait_for(
        10,
        || format!("stubborn worker gone: {}", node.output()),
        || procs_with(&marker).is_empty().then_some(()),
    );
    // The node logs the stop once it reaped the worker (a moment after it vanished).
    wait_for(
        10,
        || format!("SIGKILL after the grace in the log: {}", node.output()),
        || {
            let out = node.output();
            (out.contains("did not exit within the stop grace")
                && out.contains("killed by signal 9"))
            .then_some(())
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_removed_before_it_is_ready_is_killed_at_once_without_the_grace() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    // Never calls /ready, ignores SIGTERM; the grace (60 s) would outlast the test.
    let loading = format!(
        "trap '' TERM; while :; do sleep 0.2; done # {}",
        w.dir.path().display()
    );
    let node = w.node("node", &loading, &["--stop-grace=60s"]);
    w.add_channel("l-0", &[]);
    wait_for(
        20,
        || format!("worker up: {}", node.output()),
        || (!procs_with(&marker).is_empty()).then_some(()),
    );
    assert_eq!(w.row("l-0").expect("row")["state"], "ToWatch");
    let (ok, _, err) = w.ctl(&["remove-channel", "l-0"]);
    assert!(ok, "{err}");
    wait_for(
        10,
        || format!("loading worker gone: {}", node.output()),
        || procs_with(&marker).is_empty().then_some(()),
    );
    wait_for(
        10,
        || format!("killed at once: {}", node.output()),
        || {
            node.output()
                .contains("released while paused, loading or fenced")
                .then_some(())
        },
    );
}

/// `curl` the agent as a worker would: (status, body).
fn agent(url: &str, token: &str, path: &str, body: &str) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-w", "\n%{http_code}", "-X", "POST", "-H"])
        .arg(format!("Authorization: Bearer {token}"))
        .args(["-H", "Content-Type: application/json", "-d", body])
        .arg(format!("{url}{path}"))
        .output()
        .expect("curl runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_workers_commit_gets_409_and_writes_nothing() {
    let w = World::start().await;
    // A worker that dumps its environment, says ready and then only sleeps: the test commits
    // with its token, as it would.
    let idle = format!(
        "env > '{0}'/\"$CHANWATCH_CHANNEL\".env; curl -s -X POST -H \"Authorization: Bearer $CHANWATCH_AGENT_TOKEN\" \"$CHANWATCH_AGENT_URL/ready\"; while :; do sleep 0.2; done # {0}",
        w.dir.path().display()
    );
    let node = w.node("node", &idle, &[]);
    w.add_channel("c-0", &[]);
    w.watched("c-0", 30);
    let env = env_file(&w.path("c-0.env"));
    let (url, token) = (&env["CHANWATCH_AGENT_URL"], &env["CHANWATCH_AGENT_TOKEN"]);
    let key = "chanwatch/worker/checkpoint/c-0";
    let (code, body) = agent(url, token, "/commit", r#"{"position":"5","state":{"n":5}}"#);
    assert_eq!(code, 200, "{body}\n{}", node.output());
    assert!(w.etcd_get(key).expect("landed").contains("\"5\""));
    assert_eq!(
        agent(url, "not-a-token", "/commit", r#"{"position":"9"}"#).0,
        403
    );
    // Another owner's commit lands (as a newer run's would): this run is fenced.
    let theirs = r#"{"epoch":99,"position":"77","updated_at_ms":1}"#;
    w.etcd_put(key, theirs);
    let (code, body) = agent(url, token, "/commit", r#"{"position":"6","state":{"n":6}}"#);
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("fenced"), "{body}");
    assert_eq!(
        w.etcd_get(key).as_deref(),
        Some(theirs),
        "a fenced commit wrote"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_worker_consumes_exactly_once_through_a_killed_node_and_audit_agrees() {
    let w = World::start().await;
    let dir = w.path("log");
    let python = format!(
        "exec python3 '{}/consumer.py' 'file:{}'",
        workers().display(),
        dir.display()
    );
    python_exactly_once(&w, &format!("--log=file:{}", dir.display()), &python, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_worker_reads_nats_through_the_agent_exactly_once_through_a_killed_node() {
    let w = World::start().await;
    let nats = chanwatch_testkit::NatsFixture::start().await.expect("nats");
    let log = format!("--log={}", nats.url());
    let python = format!("exec python3 '{}/consumer.py' agent", workers().display());
    python_exactly_once(&w, &log, &python, &[&log]);
}

/// Two nodes run the Python worker `python` on 4 channels while `produce` appends to `log`;
/// one node is killed mid-stream (its workers die with it, its channels move); `audit` finds
/// every channel exact.
fn python_exactly_once(w: &World, log: &str, python: &str, node_args: &[&str]) {
    let log = log.to_owned();
    let mut a = w.node("node-a", python, node_args);
    let b = w.node("node-b", python, node_args);
    // Both first: two nodes creating the NATS stream at once made one retry 200 ms, register
    // after the channels were added, and get none (CI: "a runs a worker" timed out).
    w.wait_nodes(2);
    for c in ["p-0", "p-1", "p-2", "p-3"] {
        w.add_channel(c, &[]);
    }
    let produced = w.path("produced.json");
    let producer = Command::new(bin())
        .args([
            "produce",
            &log,
            "--all",
            &w.endpoint(),
            "--rate=1000",
            "--duration=4s",
            &format!("--out={}", produced.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("produce runs");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(a.running(), "{}", a.output());
    wait_for(
        10,
        || format!("a runs a worker: {}", a.output()),
        || a.output().contains("exec: worker started").then_some(()),
    );
    // kill -9: a's workers die with it; its channels move after the TTL and resume from the
    // Python workers' commits.
    drop(std::mem::replace(
        &mut a,
        w.node("node-c", python, node_args),
    ));
    let out = producer.wait_with_output().expect("produce ends");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, stdout, stderr) = run(&[
        "audit".into(),
        log.clone(),
        w.endpoint(),
        format!("--produced={}", produced.display()),
        "--wait=40s".into(),
    ]);
    let last = stdout.lines().last().unwrap_or_default();
    let verdict: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("audit's last line is JSON ({e}):\n{stdout}\n{stderr}"));
    assert_eq!(verdict["channels"], 4, "{stdout}");
    assert_eq!(verdict["exact"], 4, "{stdout}\n{stderr}\n{}", b.output());
    assert!(ok, "{stdout}");
    let moved = ["p-0", "p-1", "p-2", "p-3"]
        .iter()
        .filter(|c| w.row(c).is_some_and(|r| r["epoch"].as_u64() > Some(1)))
        .count();
    assert!(moved > 0, "no channel moved off the killed node");
    eprintln!("{stdout}{moved} channel(s) moved off the killed node");
}

/// A TCP proxy in front of etcd that can cut every connection and refuse new ones (a
/// partition of the nodes behind it), and heal.
struct Cut {
    addr: String,
    cut: Arc<std::sync::atomic::AtomicBool>,
    conns: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>>,
}

impl Cut {
    async fn start(upstream: &str) -> Cut {
        let upstream = upstream.trim_start_matches("http://").to_owned();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = format!("http://{}", listener.local_addr().expect("addr"));
        let cut = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let conns: Arc<std::sync::Mutex<Vec<tokio::task::JoinHandle<()>>>> = Arc::default();
        let (c, k) = (cut.clone(), conns.clone());
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                if c.load(std::sync::atomic::Ordering::SeqCst) {
                    continue; // dropped: refused
                }
                let upstream = upstream.clone();
                let task = tokio::spawn(async move {
                    if let Ok(mut up) = tokio::net::TcpStream::connect(&upstream).await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                k.lock().expect("lock").push(task);
            }
        });
        Cut { addr, cut, conns }
    }

    fn set(&self, cut: bool) {
        self.cut.store(cut, std::sync::atomic::Ordering::SeqCst);
        if cut {
            for t in self.conns.lock().expect("lock").drain(..) {
                t.abort();
            }
        }
    }
}

/// `(kind, node, channel, epoch, unix_ms)` lines of a handler log.
fn runs(path: &Path) -> Vec<(String, String, String, u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            Some((
                f.first()?.to_string(),
                f.get(1)?.to_string(),
                f.get(2)?.to_string(),
                f.get(3)?.parse().ok()?,
                f.get(4)?.parse().ok()?,
            ))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partitioned_nodes_workers_are_paused_before_another_node_starts_their_channels_and_killed_once_its_lease_is_known_lost(
) {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    // Dumps its environment, says ready, then appends each change of GET /state to a file.
    let worker = format!(
        r#"env > '{0}'/"$CHANWATCH_NODE-$CHANWATCH_CHANNEL".env
auth="Authorization: Bearer $CHANWATCH_AGENT_TOKEN"
curl -s -X POST -H "$auth" "$CHANWATCH_AGENT_URL/ready" >/dev/null
last=
while :; do
  case $(curl -s -m 1 -H "$auth" "$CHANWATCH_AGENT_URL/state") in *paused*) s=paused ;; *running*) s=running ;; *) s=other ;; esac
  [ "$s" != "$last" ] && echo $s >> '{0}'/"$CHANWATCH_NODE-$CHANWATCH_CHANNEL".states
  last=$s; sleep 0.05
done # {0}"#,
        w.dir.path().display()
    );
    let proxy = Cut::start(w.etcd.endpoint()).await;
    let (log_a, log_b) = (w.path("a.log"), w.path("b.log"));
    let a = w.node_via(
        "node-a",
        &proxy.addr,
        "2s",
        &worker,
        &[&format!("--handler-log={}", log_a.display())],
    );
    w.add_channel("q-0", &[]);
    let row = w.watched("q-0", 30);
    let a_id = row["node"].to_string();
    let states = w.path(&format!("{a_id}-q-0.states"));
    wait_for(
        20,
        || format!("a's worker running: {}", a.output()),
        || {
            std::fs::read_to_string(&states)
                .ok()?
                .contains("running")
                .then_some(())
        },
    );
    let b = w.node(
        "node-b",
        &worker,
        &[&format!("--handler-log={}", log_b.display())],
    );
    w.wait_nodes(2);
    proxy.set(true);
    // a's lease expires: the channel moves to b.
    let moved = wait_for(
        30,
        || format!("q-0 on b: {:?}", w.row("q-0")),
        || {
            w.row("q-0")
                .filter(|r| r["state"] == "Watched" && r["node"] != row["node"])
        },
    );
    let text = std::fs::read_to_string(&states).unwrap_or_default();
    assert!(
        text.contains("paused"),
        "a's worker was never told to pause: {text:?}\n{}",
        a.output()
    );
    // Single ownership from the handler logs: a paused (stopped running) before b started.
    let a_pause = runs(&log_a)
        .into_iter()
        .find(|r| r.0 == "pause" && r.2 == "q-0")
        .expect("a paused q-0");
    let b_start = wait_for(
        10,
        || "b's start line".into(),
        || {
            runs(&log_b).into_iter().find(|r| {
                r.0 == "start" && r.2 == "q-0" && r.3 == moved["epoch"].as_u64().unwrap_or(0)
            })
        },
    );
    assert!(
        a_pause.4 <= b_start.4,
        "a paused at {} after b started at {}",
        a_pause.4,
        b_start.4
    );
    // Healed: a learns its lease is gone and kills its paused worker (no grace).
    proxy.set(false);
    wait_for(
        30,
        || format!("a's stop line: {}", a.output()),
        || {
            runs(&log_a)
                .into_iter()
                .find(|r| r.0 == "stop" && r.2 == "q-0")
        },
    );
    wait_for(
        10,
        || format!("only b's worker left: {:?}", procs_with(&marker)),
        || (groups_with(&marker).len() == 1).then_some(()),
    );
    assert!(
        a.output().contains("released while paused"),
        "{}",
        a.output()
    );
    drop(b);
}
