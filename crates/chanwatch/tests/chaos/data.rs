//! The chaos run's data plane (issue 12 point 6): a `nats-server -js` the nodes consume from
//! (`node --handler stream --log nats://…`, or on some nodes — [`python_nodes`], issue 14 —
//! `node --exec 'exec python3 examples/workers/consumer.py agent' --log nats://…`, the Python
//! worker reading through the agent), `chanwatch produce` as a process at a steady rate
//! for the whole fault phase, the `nats-restart` fault, a watch on the store that times every
//! checkpoint commit from outside, and `chanwatch audit` at the end (with a planted loss and a
//! planted duplicate it must catch).
//!
//! Over 600 lines: the data plane of one chaos run — producer, consumers, audit and the
//! per-fault stream checks read the same records.
//!
//! Owns: the NATS fixture (and, for the node in the network namespace, a TCP forwarder from
//! the veth's host end to it: the fixture binds only 127.0.0.1), the producer process, the
//! checkpoint watch and what it measures, the audit's verdict. Must not: touch assignments
//! or sessions (it only reads them), or decide anything about ownership (`chaos.rs` does).
//!
//! What it measures, from outside (receive times of a watch on `{root}/`, one clock):
//! * a **move** is a checkpoint whose epoch differs from the channel's previous checkpoint;
//!   its **gap** is the old owner's last commit → the new owner's first commit. It is a
//!   *failover* when the old epoch's owner, or the owner of an epoch in between (one that
//!   never committed), is the node the fault aimed at (owners from the assignment keys);
//!   else another move (balance, a drain). Each is attributed to the fault in progress when
//!   the new owner's first commit landed (a fault lasts until the next begins).
//! * the **worst gap** of a fault: the longest time any channel went without a commit, over
//!   the gaps that ended during the fault — the unavailability of faults that move nothing
//!   (an outage, a NATS restart: channels pause in place).
//! * **re-read**: a new owner resumes from the old owner's last landed commit, so it re-reads
//!   what the old owner folded after it. Only a bound is visible from outside: the count of
//!   the new owner's first commit minus the old owner's last (everything the new owner folded
//!   before its first commit: the re-read messages and the ones appended since).
//!
//! Both gaps include up to one message interval and one commit interval (a run commits only
//! when it folded something, and at most every `COMMIT_INTERVAL`): the run prints the usual
//! spacing of one channel's commits beside the table.
//!
//! Just over 600 lines: one concern (what the chaos run does with data), whose parts share the
//! watch's record and the fixture; split further, each part would be a handful of functions.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use chanwatch_core::{ChannelInfo, ChannelOwner, Checkpoint, Keys};
use chanwatch_node::handler::consumer::payload_hash;
use chanwatch_node::handler::StreamState;
use chanwatch_store::{EventKind, MetaStore, StoreError, Txn, TxnOp, WatchEvent};
use chanwatch_stream::Position;
use chanwatch_testkit::NatsFixture;
use futures_util::StreamExt;
use tokio::task::JoinHandle;

use super::audit::tail;

/// Messages per second over all channels (`produce --rate`): one every 2 s per channel with
/// 500 channels. `produce` appends one at a time, each waiting for JetStream's ack: on 2
/// cores shared with compiles it kept 250-450 msg/s when asked for 500, so 250 is what it
/// sustains steadily beside everything else.
pub const RATE: u32 = 250;
/// The consumer's `--commit-interval` (it commits at most this often per channel, and only
/// when it folded something).
const COMMIT_INTERVAL: &str = "500ms";
/// The JetStream stream `LogArgs` derives from the default root `chanwatch`.
const STREAM: &str = "chanwatch";

/// How many of `nodes` run the Python worker instead of the Rust consumer, from
/// `CHANWATCH_CHAOS_WORKERS`: `mixed` (the default: 2 of 5), `rust` (none) or `python` (all).
/// Channels move between the two kinds, so the audit judges both folds as one.
pub fn python_nodes(nodes: usize) -> usize {
    match std::env::var("CHANWATCH_CHAOS_WORKERS").as_deref() {
        Ok("rust") => 0,
        Ok("python") => nodes,
        Ok("mixed") | Err(_) => 2.min(nodes),
        Ok(other) => panic!("CHANWATCH_CHAOS_WORKERS={other}: want mixed, rust or python"),
    }
}

/// The Python worker's command: `examples/workers/consumer.py` reading its channel through
/// the agent (`GET /read` of the node's `--log`).
fn python_worker() -> String {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/workers/consumer.py");
    // The interpreter itself, not a version manager's shim on the PATH (pyenv's runs a shell
    // and a few processes per start: 100 workers starting at once took seconds of CPU).
    let python = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "python3".to_owned());
    // At a lower CPU priority than the node, etcd and nats-server: on 2 cores, 100 workers
    // starting at once (a failover onto a Python node) starved the nodes' keepalives.
    format!("exec nice -n 5 '{python}' '{}' agent", script.display())
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One checkpoint as the watch saw it land.
#[derive(Debug, Clone, Copy)]
struct Commit {
    ms: u64,
    epoch: u64,
    position: u64,
    count: u64,
}

/// What the watch has seen.
#[derive(Debug, Default)]
struct Seen {
    commits: BTreeMap<String, Vec<Commit>>,
    /// (channel, epoch) → the node it was assigned to.
    owners: HashMap<(String, u64), u64>,
    /// Times the watch was made again (an error, a stall, the end of its stream).
    rewatches: usize,
    /// Times it relisted because its revision was compacted (events in between are lost).
    relists: usize,
}

impl Seen {
    fn event(&mut self, keys: &Keys, ev: &WatchEvent, ms: u64) {
        if ev.kind != EventKind::Put {
            return;
        }
        if let Ok(channel) = keys.parse_checkpoint(&ev.kv.key) {
            let Ok(cp) = Checkpoint::decode(&ev.kv.value) else {
                return;
            };
            let count = cp
                .state
                .as_ref()
                .and_then(|v| StreamState::from_json(v).ok())
                .map_or(0, |s| s.count);
            self.commits
                .entry(channel.to_string())
                .or_default()
                .push(Commit {
                    ms,
                    epoch: cp.epoch.0,
                    position: cp.position.parse().unwrap_or(0),
                    count,
                });
        } else if let Ok(ck) = keys.parse_channel(&ev.kv.key) {
            if let (ChannelOwner::Node(n), Ok(info)) = (ck.owner, ChannelInfo::decode(&ev.kv.value))
            {
                self.owners
                    .insert((ck.channel.to_string(), info.epoch.0), n.0);
            }
        }
    }
}

/// Watches `{root}/` from now on, again from the next revision after an error or a stall
/// (no batch, not even a progress notification, for 5 s), relisting after a compaction.
async fn watch_store(store: Arc<dyn MetaStore>, keys: Keys, seen: Arc<Mutex<Seen>>) {
    let prefix = keys.all_prefix();
    let mut from = 0;
    loop {
        if let Ok(mut stream) = store.watch(&prefix, from).await {
            loop {
                match tokio::time::timeout(Duration::from_secs(5), stream.next()).await {
                    Ok(Some(Ok(batch))) => {
                        let ms = unix_ms();
                        let mut s = seen.lock().unwrap_or_else(PoisonError::into_inner);
                        for ev in &batch.events {
                            s.event(&keys, ev, ms);
                        }
                        from = batch.revision + 1;
                    }
                    Ok(Some(Err(StoreError::Compacted { .. }))) => {
                        if let Ok(list) = store.range(&prefix).await {
                            from = list.revision + 1;
                            seen.lock().unwrap_or_else(PoisonError::into_inner).relists += 1;
                        }
                        break;
                    }
                    _ => break,
                }
            }
        }
        seen.lock()
            .unwrap_or_else(PoisonError::into_inner)
            .rewatches += 1;
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Forwards TCP connections from `listener` to `to` (the node in the network namespace
/// reaches nats-server, which binds only 127.0.0.1, through the veth's host end).
async fn forward(listener: tokio::net::TcpListener, to: std::net::SocketAddr) {
    loop {
        let Ok((mut inbound, _)) = listener.accept().await else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        tokio::spawn(async move {
            if let Ok(mut out) = tokio::net::TcpStream::connect(to).await {
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut out).await;
            }
        });
    }
}

/// A fault as the data plane attributes to it.
struct Fault {
    kind: &'static str,
    start_ms: u64,
    /// The node it aimed at (kill, SIGSTOP, partition, the node killed under NOSPACE).
    target: Option<u64>,
}

/// The data plane of one chaos run; see the module docs.
pub struct DataPlane {
    pub nats: NatsFixture,
    /// `--log` for nodes outside the namespace, and inside it (through the forwarder).
    url: String,
    url_netns: Option<String>,
    tasks: Vec<JoinHandle<()>>,
    producer: Option<Child>,
    producer_out: PathBuf,
    produced: PathBuf,
    seen: Arc<Mutex<Seen>>,
    faults: Vec<Fault>,
    keys: Keys,
}

impl Drop for DataPlane {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
        if let Some(p) = self.producer.as_mut() {
            let _ = p.kill();
            let _ = p.wait();
        }
    }
}

impl DataPlane {
    /// Starts nats-server (and the stream, so that nodes and the producer do not race to
    /// create it), the forwarder on `netns_host` when there is a namespace, and the watch.
    pub async fn start(
        store: Arc<dyn MetaStore>,
        keys: Keys,
        netns_host: Option<&str>,
        dir: &Path,
    ) -> DataPlane {
        let nats = NatsFixture::start().await.expect("nats-server -js starts");
        let url = nats.url().to_owned();
        chanwatch_stream::open(&url, STREAM)
            .await
            .expect("the JetStream stream is created");
        let mut tasks = Vec::new();
        let mut url_netns = None;
        if let Some(host) = netns_host {
            let listener = tokio::net::TcpListener::bind((host, 0))
                .await
                .expect("a port on the veth's host end");
            let port = listener.local_addr().expect("bound").port();
            let to = url
                .trim_start_matches("nats://")
                .parse()
                .expect("the fixture's URL is nats://IP:PORT");
            tasks.push(tokio::spawn(forward(listener, to)));
            url_netns = Some(format!("nats://{host}:{port}"));
        }
        let seen = Arc::new(Mutex::new(Seen::default()));
        tasks.push(tokio::spawn(watch_store(store, keys.clone(), seen.clone())));
        DataPlane {
            nats,
            url,
            url_netns,
            tasks,
            producer: None,
            producer_out: dir.join("produce.out"),
            produced: dir.join("produced.json"),
            seen,
            faults: Vec::new(),
            keys,
        }
    }

    /// The flags that make a node consume the stream (inside the namespace or not): with the
    /// Rust consumer, or with a Python worker per channel (`--exec`) that reads through the
    /// agent.
    pub fn node_args(&self, in_netns: bool, python: bool) -> Vec<String> {
        let url = match (&self.url_netns, in_netns) {
            (Some(u), true) => u,
            _ => &self.url,
        };
        if python {
            return vec![
                format!("--exec={}", python_worker()),
                format!("--log={url}"),
                "--stop-grace=5s".to_owned(),
            ];
        }
        vec![
            "--handler=stream".to_owned(),
            format!("--log={url}"),
            format!("--commit-interval={COMMIT_INTERVAL}"),
        ]
    }

    /// Starts `chanwatch produce --all` at [`RATE`] for `secs`.
    pub fn start_producer(&mut self, bin: &Path, endpoints: &str, secs: u64) {
        let out = std::fs::File::create(&self.producer_out).expect("producer output file");
        let child = Command::new(bin)
            .args([
                "produce".to_owned(),
                format!("--log={}", self.url),
                "--all".to_owned(),
                format!("--endpoints={endpoints}"),
                format!("--root={}", self.keys.root()),
                format!("--rate={RATE}"),
                format!("--duration={secs}s"),
                format!("--out={}", self.produced.display()),
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out)
            .spawn()
            .expect("spawn chanwatch produce");
        self.producer = Some(child);
    }

    /// The `nats-restart` fault: `kill -9` of nats-server, down for `down`, started again on
    /// the same store dir and port. Returns when it serves again.
    pub async fn restart_nats(&mut self, down: Duration) {
        self.nats.kill();
        tokio::time::sleep(down).await;
        if let Err(e) = self.nats.start_again().await {
            panic!("nats-server does not start again on its store: {e}");
        }
    }

    /// Waits until every one of `channels` committed after `since_ms` (the consumers got
    /// going again); the times since `t0` until the first and the last of them did, or which
    /// channels did not.
    pub async fn wait_committed_since(
        &self,
        channels: usize,
        since_ms: u64,
        t0: Instant,
        limit: Duration,
    ) -> Result<(Duration, Duration), String> {
        let mut first = None;
        loop {
            let stale: Vec<String> = {
                let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
                let any = seen
                    .commits
                    .values()
                    .any(|cs| cs.last().is_some_and(|c| c.ms >= since_ms));
                if any && first.is_none() {
                    first = Some(t0.elapsed());
                }
                let mut stale: Vec<String> = seen
                    .commits
                    .iter()
                    .filter(|(_, cs)| cs.last().map_or(true, |c| c.ms < since_ms))
                    .map(|(ch, _)| ch.clone())
                    .collect();
                if seen.commits.len() < channels {
                    stale.push(format!(
                        "{} channels never committed",
                        channels - seen.commits.len()
                    ));
                }
                stale
            };
            if stale.is_empty() {
                return Ok((first.unwrap_or_default(), t0.elapsed()));
            }
            if t0.elapsed() > limit {
                return Err(format!(
                    "{} channels have not committed since the log came back: {}",
                    stale.len(),
                    stale.iter().take(5).cloned().collect::<Vec<_>>().join(" ")
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Records a fault for attribution (`start_ms`: when it began).
    pub fn note_fault(&mut self, kind: &'static str, start_ms: u64, target: Option<u64>) {
        self.faults.push(Fault {
            kind,
            start_ms,
            target,
        });
    }

    /// Waits for the producer to end (it runs for the fault phase); a violation when it
    /// failed or does not end.
    pub async fn stop_producing(&mut self, limit: Duration) -> Vec<String> {
        let Some(mut child) = self.producer.take() else {
            return vec!["the producer never started".to_owned()];
        };
        let started = Instant::now();
        loop {
            match child.try_wait() {
                Ok(Some(status)) if status.success() => {
                    println!("chaos data: produce: {}", tail(&self.producer_out, 1));
                    return Vec::new();
                }
                Ok(Some(status)) => {
                    return vec![format!(
                        "produce exited ({status}); the tail of its output:\n{}",
                        tail(&self.producer_out, 15)
                    )]
                }
                _ if started.elapsed() > limit => {
                    let _ = child.kill();
                    let _ = child.wait();
                    return vec![format!(
                        "produce did not end {limit:?} after its duration; the tail of its output:\n{}",
                        tail(&self.producer_out, 15)
                    )];
                }
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        }
    }

    /// Runs `chanwatch audit` as a process on `produced`; its exit status and last line.
    fn run_audit(&self, bin: &Path, endpoints: &str, produced: &Path) -> (bool, String, String) {
        let out = Command::new(bin)
            .args([
                "audit".to_owned(),
                format!("--log={}", self.url),
                format!("--endpoints={endpoints}"),
                format!("--root={}", self.keys.root()),
                format!("--produced={}", produced.display()),
                "--wait=60s".to_owned(),
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .output()
            .expect("chanwatch audit runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        let last = stdout.lines().last().unwrap_or_default().to_owned();
        let text = format!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
        (out.status.success(), last, text)
    }

    /// The audit: 0 lost, 0 duplicated, 0 behind over `channels` channels. Then its control:
    /// one checkpoint made to miss a message and one to hold a message twice (as a broken
    /// consumer would commit them), which a second audit of those two channels must call
    /// lost and duplicated. Returns violations.
    ///
    /// `CHANWATCH_CHAOS_PLANT=lose-one` plants them before the first audit instead (which
    /// must then fail the run): the check that a loss fails the whole run, not just `audit`.
    pub async fn audit(
        &self,
        bin: &Path,
        endpoints: &str,
        store: &dyn MetaStore,
        channels: usize,
    ) -> Vec<String> {
        let planted = std::env::var("CHANWATCH_CHAOS_PLANT").as_deref() == Ok("lose-one");
        if planted {
            let done = self.plant(store).await.map(|_| "planted");
            println!("chaos data: CHANWATCH_CHAOS_PLANT=lose-one: a loss and a duplicate {done:?}");
        }
        let started = Instant::now();
        let (ok, last, text) = self.run_audit(bin, endpoints, &self.produced);
        println!(
            "chaos data: audit ({:.1} s): {last}",
            started.elapsed().as_secs_f64()
        );
        let verdict: serde_json::Value = serde_json::from_str(&last).unwrap_or_default();
        let n = |k: &str| verdict.get(k).and_then(serde_json::Value::as_u64);
        let mut out = Vec::new();
        if !ok
            || n("channels") != Some(channels as u64)
            || n("lost") != Some(0)
            || n("duplicated") != Some(0)
            || n("behind") != Some(0)
        {
            let bad: Vec<&str> = text
                .lines()
                .filter(|l| !l.trim_end().ends_with("Exact"))
                .take(40)
                .collect();
            out.push(format!(
                "audit: not exactly once over {channels} channels: {last}\n{}",
                bad.join("\n")
            ));
            return out;
        }
        if planted {
            out.push("CHANWATCH_CHAOS_PLANT=lose-one, yet the audit found nothing".to_owned());
            return out;
        }
        // The first call to a member after an etcd outage may get the connection's stale
        // "tcp connect error" (nothing was sent): tried again then, and only then.
        let mut plant = self.plant(store).await;
        for _ in 0..5 {
            match &plant {
                Err(e) if e.contains("tcp connect error") => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    plant = self.plant(store).await;
                }
                _ => break,
            }
        }
        match plant {
            Ok(produced) => {
                let (ok, last, text) = self.run_audit(bin, endpoints, &produced);
                let v: serde_json::Value = serde_json::from_str(&last).unwrap_or_default();
                let caught = !ok
                    && v.get("lost").and_then(serde_json::Value::as_u64) == Some(1)
                    && v.get("duplicated").and_then(serde_json::Value::as_u64) == Some(1);
                println!(
                    "chaos data: audit of a planted loss and duplicate: {last} ({})",
                    if caught { "caught" } else { "NOT caught" }
                );
                if !caught {
                    out.push(format!(
                        "the audit missed a planted loss and duplicate:\n{text}"
                    ));
                }
            }
            Err(e) => out.push(format!("cannot plant a loss for the audit: {e}")),
        }
        out
    }

    /// Rewrites the checkpoints of the first two produced channels: the first without its
    /// first message, the second with it twice; returns a produced file naming only them.
    async fn plant(&self, store: &dyn MetaStore) -> Result<PathBuf, String> {
        let text = std::fs::read_to_string(&self.produced).map_err(|e| e.to_string())?;
        let mut produced: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| e.to_string())?;
        let chans = produced
            .get_mut("channels")
            .and_then(serde_json::Value::as_object_mut)
            .ok_or("no channels in the produced file")?;
        let names: Vec<String> = chans.keys().take(2).cloned().collect();
        chans.retain(|k, _| names.contains(k));
        let log = chanwatch_stream::open(&self.url, STREAM)
            .await
            .map_err(|e| e.to_string())?;
        let mut ops = Vec::new();
        for (name, delta) in names.iter().zip([-1i64, 1]) {
            let first = log
                .read(name, Position::START, 1, Duration::ZERO)
                .await
                .map_err(|e| e.to_string())?;
            let m = first.first().ok_or(format!("{name} has no message"))?;
            let key = self.keys.checkpoint(
                &chanwatch_core::ChannelName::new(name.as_str()).map_err(|e| e.to_string())?,
            );
            let kv = store
                .get(&key)
                .await
                .map_err(|e| e.to_string())?
                .ok_or(format!("{name} has no checkpoint"))?;
            let mut cp = Checkpoint::decode(&kv.value).map_err(|e| e.to_string())?;
            let mut state = StreamState::from_json(cp.state.as_ref().ok_or("no state")?)?;
            let h = payload_hash(&m.payload);
            if delta < 0 {
                state.count -= 1;
                state.digest = state.digest.wrapping_sub(h);
            } else {
                state.count += 1;
                state.digest = state.digest.wrapping_add(h);
            }
            cp.state = Some(state.to_json());
            ops.push(TxnOp::put(key, cp.encode()));
        }
        store
            .txn(Txn::new().and_then(ops))
            .await
            .map_err(|e| e.to_string())?;
        let path = self.produced.with_file_name("planted.json");
        std::fs::write(&path, produced.to_string()).map_err(|e| e.to_string())?;
        Ok(path)
    }

    /// The table of what each fault kind cost the data plane (see the module docs), how
    /// often a channel's commits passed between the Rust consumer and the Python worker
    /// (`python`: the node IDs that ran the Python worker), and violations: a committed count
    /// or position that went back.
    pub fn report(&self, python: &std::collections::BTreeSet<u64>) -> Vec<String> {
        let seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let mut violations = Vec::new();
        // (old owner's worker, new owner's worker) → moves between two committing epochs.
        let mut handovers: BTreeMap<(&str, &str), usize> = BTreeMap::new();
        let worker = |channel: &str, epoch: u64| match seen.owners.get(&(channel.to_owned(), epoch))
        {
            Some(n) if python.contains(n) => "python",
            Some(_) => "rust",
            None => "?",
        };
        #[derive(Default)]
        struct Kind {
            faults: usize,
            failover: Vec<u64>,
            other: Vec<u64>,
            worst: Vec<u64>,
            reread: Vec<u64>,
        }
        let mut kinds: BTreeMap<&str, Kind> = BTreeMap::new();
        let mut worst = vec![0u64; self.faults.len()];
        let mut spacing = Vec::new();
        // (fault, old owner, new owner) → (moves, longest gap), printed with
        // CHANWATCH_CHAOS_VERBOSE.
        type Owners = (usize, Option<u64>, Option<u64>);
        let mut moves: BTreeMap<Owners, (usize, u64)> = BTreeMap::new();
        let fault_at = |ms: u64| self.faults.iter().rposition(|f| f.start_ms <= ms);
        for f in &self.faults {
            kinds.entry(f.kind).or_default().faults += 1;
        }
        for (channel, cs) in &seen.commits {
            for w in cs.windows(2) {
                let (a, b) = (w[0], w[1]);
                let gap = b.ms.saturating_sub(a.ms);
                if a.epoch != b.epoch {
                    *handovers
                        .entry((worker(channel, a.epoch), worker(channel, b.epoch)))
                        .or_default() += 1;
                }
                if b.count < a.count || b.position < a.position {
                    violations.push(format!(
                        "{channel}: the committed state went back: count {} at {} (epoch {}) \
                         then {} at {} (epoch {})",
                        a.count, a.position, a.epoch, b.count, b.position, b.epoch
                    ));
                }
                let Some(i) = fault_at(b.ms) else {
                    if a.epoch == b.epoch {
                        spacing.push(gap);
                    }
                    continue;
                };
                worst[i] = worst[i].max(gap);
                let k = kinds.entry(self.faults[i].kind).or_default();
                if a.epoch == b.epoch {
                    spacing.push(gap);
                    continue;
                }
                let old_owner = seen.owners.get(&(channel.clone(), a.epoch)).copied();
                let new_owner = seen.owners.get(&(channel.clone(), b.epoch)).copied();
                let m = moves.entry((i, old_owner, new_owner)).or_default();
                m.0 += 1;
                m.1 = m.1.max(gap);
                // An owner that never committed (it had the channel for a moment, then lost
                // it) is seen only through the assignment keys: a failover off the target
                // may show as a move between two other owners.
                let target = self.faults[i].target;
                let aimed = target.is_some()
                    && (a.epoch..b.epoch)
                        .any(|e| seen.owners.get(&(channel.clone(), e)).copied() == target);
                if aimed {
                    k.failover.push(gap);
                    k.reread.push(b.count - a.count.min(b.count));
                } else {
                    k.other.push(gap);
                }
            }
        }
        if std::env::var_os("CHANWATCH_CHAOS_VERBOSE").is_some() {
            for ((i, from, to), (n, gap)) in &moves {
                let f = &self.faults[*i];
                println!(
                    "chaos data:   fault {i} {} at {} (aimed at {:?}): {n} moves {from:?} -> \
                     {to:?}, longest gap {:.2} s",
                    f.kind,
                    f.start_ms,
                    f.target,
                    *gap as f64 / 1000.0
                );
            }
        }
        for (i, f) in self.faults.iter().enumerate() {
            kinds.entry(f.kind).or_default().worst.push(worst[i]);
        }
        let s = |ms: u64| format!("{:.2}", ms as f64 / 1000.0);
        let pct = |v: &mut Vec<u64>, q: f64| {
            v.sort_unstable();
            if v.is_empty() {
                "-".to_owned()
            } else {
                s(v[((v.len() - 1) as f64 * q).round() as usize])
            }
        };
        println!(
            "chaos data: unavailability per fault kind (s; old owner's last commit -> new \
             owner's first, from a watch on the store; re-read is a bound, see chaos/data.rs)"
        );
        println!(
            "chaos data: {:<13} {:>6} {:>9} {:>20} {:>6} {:>12} {:>16} {:>15}",
            "kind",
            "faults",
            "failovers",
            "gap p50/p99/max",
            "moves",
            "gap p50/max",
            "worst gap p50/max",
            "re-read <= sum/max"
        );
        for (kind, k) in &mut kinds {
            let rr_sum: u64 = k.reread.iter().sum();
            let rr_max = k.reread.iter().max().copied().unwrap_or(0);
            println!(
                "chaos data: {kind:<13} {:>6} {:>9} {:>20} {:>6} {:>12} {:>16} {:>15}",
                k.faults,
                k.failover.len(),
                format!(
                    "{}/{}/{}",
                    pct(&mut k.failover, 0.5),
                    pct(&mut k.failover, 0.99),
                    pct(&mut k.failover, 1.0)
                ),
                k.other.len(),
                format!("{}/{}", pct(&mut k.other, 0.5), pct(&mut k.other, 1.0)),
                format!("{}/{}", pct(&mut k.worst, 0.5), pct(&mut k.worst, 1.0)),
                format!("{rr_sum}/{rr_max}"),
            );
        }
        let commits: usize = seen.commits.values().map(Vec::len).sum();
        println!(
            "chaos data: {commits} commits seen on {} channels; one channel's commits in one \
             epoch are {} s apart (p50: the message interval); the watch was made again {} \
             times, relisted {} times",
            seen.commits.len(),
            pct(&mut spacing, 0.5),
            seen.rewatches,
            seen.relists
        );
        println!(
            "chaos data: a channel's commits passed from one owner's worker to the next's \
             (both folds resume each other's state): {}",
            handovers
                .iter()
                .map(|((a, b), n)| format!("{a} -> {b} {n}"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        violations.truncate(20);
        violations
    }
}
