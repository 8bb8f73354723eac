//! A small cluster of the real binary for the black-box tests: one `chanwatch coord` and a
//! few `chanwatch node --handler-log` processes against a real etcd fixture (a node may reach
//! etcd through a [`GrpcProxy`]), and what the tests read from outside: `chanwatch ctl ...
//! --json`, the processes' `/metrics`, the nodes' handler logs, and every change of an
//! assignment key as a watch of the test's own sees it ([`History`]).
//!
//! Must not: reach into a process (no in-process handles, no shared state): a verdict comes
//! only from what an operator could see.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chanwatch_core::planner::{ChannelRow, NodeRow};
use chanwatch_core::{ChannelInfo, ChannelOwner, ChannelState, Keys};
use chanwatch_testkit::EtcdFixture;

use crate::procs::{self, Proc};

pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn free_addr() -> String {
    let port = chanwatch_testkit::free_port();
    format!("127.0.0.1:{port}")
}

/// One change of an assignment key, as the test's watch saw it.
#[derive(Debug, Clone)]
pub struct Change {
    /// When the test saw it (Unix ms).
    pub at_ms: u64,
    pub channel: String,
    /// Owning node (None: `remaining`).
    pub node: Option<u64>,
    /// None: the key was deleted.
    pub state: Option<ChannelState>,
    pub epoch: u64,
    /// The key was created (a new assignment), not updated.
    pub created: bool,
    /// The revision of the write (one txn, one revision).
    #[allow(dead_code)] // read by placement.rs, not by every test binary that shares this
    pub revision: i64,
}

/// Every change of `{root}/channel/` since [`History::start`], in order.
#[derive(Clone, Default)]
pub struct History(Arc<Mutex<Vec<Change>>>);

impl History {
    /// Watches the fixture's assignment keys directly (never through a proxy).
    pub async fn start(endpoint: &str) -> Self {
        let history = History::default();
        let keys = Keys::default();
        let mut client = etcd_client::Client::connect([endpoint], None)
            .await
            .expect("test watch connects");
        let mut stream = client
            .watch(
                keys.channels_prefix(),
                Some(
                    etcd_client::WatchOptions::new()
                        .with_prefix()
                        .with_prev_key(),
                ),
            )
            .await
            .expect("test watch");
        let out = history.clone();
        tokio::spawn(async move {
            let _client = client;
            while let Ok(Some(resp)) = stream.message().await {
                let at_ms = unix_ms();
                for ev in resp.events() {
                    let Some(kv) = ev.kv() else { continue };
                    let Ok(key) = keys.parse_channel(kv.key_str().unwrap_or_default()) else {
                        continue;
                    };
                    let node = match key.owner {
                        ChannelOwner::Node(n) => Some(n.0),
                        ChannelOwner::Remaining => None,
                    };
                    let deleted = ev.event_type() == etcd_client::EventType::Delete;
                    let info = if deleted {
                        ev.prev_kv()
                            .and_then(|p| ChannelInfo::decode(p.value()).ok())
                    } else {
                        ChannelInfo::decode(kv.value()).ok()
                    };
                    out.0.lock().expect("history").push(Change {
                        at_ms,
                        channel: key.channel.to_string(),
                        node,
                        state: if deleted {
                            None
                        } else {
                            info.as_ref().map(|i| i.state)
                        },
                        epoch: info.map_or(0, |i| i.epoch.0),
                        created: !deleted && kv.version() == 1,
                        revision: kv.mod_revision(),
                    });
                }
            }
        });
        history
    }

    pub fn changes(&self) -> Vec<Change> {
        self.0.lock().expect("history").clone()
    }

    /// `Ok` once this watch has seen every channel of `settled` (channel → (node, epoch),
    /// as [`Cluster::settled`] gives) created where it is; the watch may lag behind what
    /// `ctl` shows on a busy machine. Else which channel it has not seen yet.
    #[allow(dead_code)] // used by the placement tests, not by every binary that includes this
    pub fn seen(&self, settled: &BTreeMap<String, (u64, u64)>) -> Result<(), String> {
        let mut last = BTreeMap::new();
        for c in self.changes() {
            if let (true, Some(n)) = (c.created, c.node) {
                last.insert(c.channel, (n, c.epoch));
            }
        }
        match settled.iter().find(|(ch, at)| last.get(*ch) != Some(*at)) {
            Some((ch, at)) => Err(format!(
                "the test's watch has not seen {ch} created at {at:?}"
            )),
            None => Ok(()),
        }
    }

    /// Assignments (key creations under a node), as (ms, channel, node, epoch).
    pub fn assignments(&self) -> Vec<(u64, String, u64, u64)> {
        self.changes()
            .into_iter()
            .filter(|c| c.created)
            .filter_map(|c| c.node.map(|n| (c.at_ms, c.channel, n, c.epoch)))
            .collect()
    }
}

/// The processes of one test, their logs and the fixture; everything stops on drop.
pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub etcd: EtcdFixture,
    pub admin: String,
    pub procs: Vec<(String, Proc)>,
    /// Node name → (handler log, admin address).
    pub nodes: BTreeMap<String, (PathBuf, String)>,
    pub history: History,
    http: reqwest::Client,
}

impl Cluster {
    /// A real etcd (a missing binary fails the test with install instructions) and the
    /// test's own watch of its assignments.
    pub async fn new(prefix: &str) -> Self {
        let dir = tempfile::Builder::new()
            .prefix(prefix)
            .tempdir()
            .expect("tempdir");
        let etcd = EtcdFixture::start().await.expect("etcd fixture");
        let history = History::start(etcd.endpoint()).await;
        Cluster {
            dir,
            etcd,
            admin: free_addr(),
            procs: Vec::new(),
            nodes: BTreeMap::new(),
            history,
            http: reqwest::Client::new(),
        }
    }

    /// Starts `chanwatch coord` with `extra` flags.
    pub fn coord(&mut self, extra: &[&str]) {
        let direct = self.etcd.endpoint().to_owned();
        self.coord_via(&direct, extra);
    }

    /// Starts `chanwatch coord` reaching etcd at `endpoint` (e.g. a proxy) with `extra` flags.
    pub fn coord_via(&mut self, endpoint: &str, extra: &[&str]) {
        let mut args = vec![
            "coord".to_owned(),
            format!("--endpoints={endpoint}"),
            format!("--admin={}", self.admin),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let p = procs::spawn(self.dir.path(), "coord", &args);
        self.procs.push(("coord".to_owned(), p));
    }

    /// Starts `chanwatch node` named `name`, reaching etcd at `endpoint`, with `extra` flags.
    pub fn node(&mut self, name: &str, endpoint: &str, extra: &[&str]) {
        let log = self.dir.path().join(format!("{name}.log"));
        let admin = free_addr();
        let mut args = vec![
            "node".to_owned(),
            format!("--endpoints={endpoint}"),
            format!("--admin={admin}"),
            format!("--handler-log={}", log.display()),
        ];
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        let p = procs::spawn(self.dir.path(), name, &args);
        self.procs.push((name.to_owned(), p));
        self.nodes.insert(name.to_owned(), (log, admin));
    }

    pub fn logs(&self) -> Vec<PathBuf> {
        self.nodes.values().map(|(l, _)| l.clone()).collect()
    }

    /// `chanwatch ctl ARGS` against the fixture: its stdout, or its stderr as the error.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new(procs::bin())
            .arg("ctl")
            .arg(format!("--endpoints={}", self.etcd.endpoint()))
            .args(args)
            .output()
            .map_err(|e| format!("cannot run ctl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    pub fn channels(&self) -> Result<Vec<ChannelRow>, String> {
        let out = self.ctl(&["channels", "--json"])?;
        serde_json::from_str(&out).map_err(|e| format!("ctl channels --json: {e}: {out}"))
    }

    pub fn node_rows(&self) -> Result<Vec<NodeRow>, String> {
        let out = self.ctl(&["nodes", "--json"])?;
        serde_json::from_str(&out).map_err(|e| format!("ctl nodes --json: {e}: {out}"))
    }

    /// The live session ID of node `name` (matched by its admin address), waiting up to 20 s.
    pub async fn node_id(&self, name: &str) -> u64 {
        let admin = &self.nodes[name].1;
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(rows) = self.node_rows() {
                if let Some(r) = rows.iter().find(|r| &r.admin_addr == admin) {
                    return r.id;
                }
            }
            assert!(
                Instant::now() < deadline,
                "node {name} did not register within 20 s; its output:\n{}",
                self.output(name)
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Adds channels through the leader's admin API, retrying until a leader answers.
    /// Waits (up to 30 s) until the leader itself lists `n` live nodes (`GET /api/v1/nodes`):
    /// a session in etcd is not yet a node the leader places channels on.
    pub async fn wait_coord_nodes(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = self
                .http
                .get(format!("http://{}/api/v1/nodes", self.admin))
                .send()
                .await;
            if let Ok(resp) = r {
                if let Ok(rows) = resp.json::<Vec<serde_json::Value>>().await {
                    if rows.len() >= n {
                        return;
                    }
                }
            }
            assert!(
                Instant::now() < deadline,
                "the leader never listed {n} nodes"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub async fn add_channels(&self, names: &[String]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        for name in names {
            loop {
                let r = self
                    .http
                    .post(format!("http://{}/api/v1/channels", self.admin))
                    .json(&serde_json::json!({ "name": name }))
                    .send()
                    .await;
                match r {
                    Ok(resp) if resp.status().is_success() || resp.status() == 409 => break,
                    _ => {
                        assert!(Instant::now() < deadline, "could not add {name}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
    }

    /// The text of a process's `/metrics` at `addr`.
    pub async fn metrics(&self, addr: &str) -> String {
        match self.http.get(format!("http://{addr}/metrics")).send().await {
            Ok(r) => r.text().await.unwrap_or_default(),
            Err(e) => format!("(no metrics: {e})"),
        }
    }

    /// The value of metric line `name` (e.g. `chanwatch_nodes_fenced_total`) in `text`.
    pub fn metric(text: &str, name: &str) -> Option<f64> {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Every channel `Watched` on a node `ok` accepts, with exactly one key, and running
    /// there at that epoch per the handler logs: channel → (node, epoch); else why not.
    pub fn settled(
        &self,
        expected: usize,
        ok: impl Fn(&str, u64) -> bool,
    ) -> Result<BTreeMap<String, (u64, u64)>, String> {
        let rows = self.channels()?;
        let logs = self.logs();
        let running = crate::audit::running(logs.iter().map(PathBuf::as_path));
        let mut out = BTreeMap::new();
        for r in &rows {
            let name = r.channel.to_string();
            let Some(node) = r.node else {
                return Err(format!("{name} is under remaining"));
            };
            if r.state != ChannelState::Watched || !ok(&name, node) {
                return Err(format!("{name} is {:?} on node {node}", r.state));
            }
            if !running.contains(&(node, name.clone(), r.epoch)) {
                return Err(format!(
                    "{name} is Watched on node {node} at epoch {} but does not run there",
                    r.epoch
                ));
            }
            if out.insert(name.clone(), (node, r.epoch)).is_some() {
                return Err(format!("{name} has two keys"));
            }
        }
        if out.len() != expected {
            return Err(format!("{} channels, expected {expected}", out.len()));
        }
        Ok(out)
    }

    /// Waits until [`Self::settled`] holds, or returns the last reason after `within`.
    pub async fn wait_settled(
        &self,
        expected: usize,
        within: Duration,
        ok: impl Fn(&str, u64) -> bool,
    ) -> Result<BTreeMap<String, (u64, u64)>, String> {
        let deadline = Instant::now() + within;
        loop {
            match self.settled(expected, &ok) {
                Ok(s) => return Ok(s),
                Err(why) if Instant::now() > deadline => return Err(why),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// The output of process `name` so far.
    pub fn output(&self, name: &str) -> String {
        self.procs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, p)| p.output())
            .unwrap_or_default()
    }

    /// Processes that exited by themselves, each with the tail of its output.
    pub fn exits(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, p) in &mut self.procs {
            if !p.running() {
                let text = p.output();
                let lines: Vec<&str> = text.lines().collect();
                let tail = lines[lines.len().saturating_sub(10)..].join("\n");
                out.push(format!("{name} exited; its output ends:\n{tail}"));
            }
        }
        out
    }

    /// Every overlap of two nodes running one channel, from the handler logs.
    pub fn overlaps(&self) -> Vec<String> {
        let runs = crate::audit::intervals(&self.logs(), &[], unix_ms());
        crate::audit::overlaps(&runs, &[])
    }

    /// How many lines of kind `what` (`start`, `stop`, `pause`, `resume`) node `name`'s
    /// handler log has.
    pub fn handler_lines(&self, name: &str, what: &str) -> usize {
        let text = std::fs::read_to_string(&self.nodes[name].0).unwrap_or_default();
        text.lines()
            .filter(|l| crate::audit::parse_line(l).is_some_and(|(w, ..)| w == what))
            .count()
    }
}
