//! Process-level chaos against real etcd: a 3-member etcd cluster, 2 coordinator and 5 node
//! processes of the real binary, 500 channels. For `CHANWATCH_CHAOS_SECS` (default 180) it
//! injects faults of these kinds (`chaos/kinds.rs`): `kill -9` of a node or of the leader,
//! `SIGSTOP`/`SIGCONT` of a node past its TTL, a restart of one etcd member, a freeze of one
//! follower member (`SIGSTOP` for 5-10 s: it takes connections and answers nothing),
//! compaction, an etcd-wide outage (every member `kill -9`ed for 5-20 s, then restarted on its
//! data), a full quota (junk outside the root until NOSPACE, held 5-10 s, then deleted,
//! compacted, defragmented, alarm disarmed), a network partition of one node (the node runs in
//! a network namespace, see `chaos/netns.rs`; iptables drops its traffic to the host for
//! 5-15 s) and a restart of nats-server (`kill -9`, down 3-8 s, started again on its store
//! dir).
//!
//! The run's kinds are all of these but the ones it cannot inject, which it names with why at
//! the start: the partition without root, `ip` or `iptables` (unless
//! `CHANWATCH_CHAOS_NETNS=require`, which makes that a failure), the nats-server restart
//! without the data plane, and any kind `CHANWATCH_CHAOS_KINDS` does not name. It injects each
//! of the run's kinds once first, in an order drawn from the printed seed, then kinds at random
//! until the time is up (a fault begun before then runs to its end). The run fails, listing
//! them, when a kind of the run did not run at all: one round of all ten took 117-121 s on 2
//! cores (2026-12-06), so fewer than ~160 s may not fit it.
//!
//! The data plane (`chaos/data.rs`; `CHANWATCH_CHAOS_DATA=0` leaves it out and the nodes run
//! the timer load): the nodes run the stream consumer on a `nats-server -js` — 2 of the 5
//! live nodes the Python worker `examples/workers/consumer.py` through `--exec` instead of the
//! Rust consumer (a node runs it when fewer than 2 live nodes would without it; the first
//! node, in the network namespace, is one; `CHANWATCH_CHAOS_WORKERS=rust|python` makes all
//! of them one kind) —, `chanwatch
//! produce --all` appends at a steady rate for the whole fault phase, and at the end
//! `chanwatch audit` must find every channel exact (0 lost, 0 duplicated, 0 behind); then a
//! planted loss and duplicate (two checkpoints rewritten as a broken consumer would commit
//! them) must be caught by a second audit. A watch on the store times every commit: the table
//! at the end gives, per fault kind, the old owner's last commit → the new owner's first, the
//! longest any channel went without a commit, and a bound on the messages re-read.
//!
//! After each fault it measures the time until every channel is `Watched` on a live node and
//! that node's handler log says it runs it (same epoch, started, not stopped or paused); for
//! the outage and the quota the time counts from etcd's return (the restart, the disarm); for
//! the nats-server restart, from its return until every channel committed again. Any
//! chanwatch process that exits by itself is a violation (its output's tail is printed; it is
//! replaced). At the end it checks single ownership from the nodes' handler logs
//! (`--handler-log`).
//!
//! Ignored by `cargo test`: `.ci/run` runs it on its own (it takes minutes), as
//! `cargo test -p chanwatch --test chaos -- --ignored --nocapture`. To reproduce one kind:
//! `CHANWATCH_CHAOS_KINDS=partition` (comma-separated names as printed) and
//! `CHANWATCH_CHAOS_VERBOSE=1` (prints why the cluster is not settled whenever that changes).
//! On a violation the logs are kept and their directory printed. A node the fault did not aim
//! at that loses its session within the fault plus a TTL is a violation (DESIGN §6 invariant
//! 9); `CHANWATCH_CHAOS_ALLOW_REREGISTER=1` only prints it.
//!
//! Over 600 lines because the fault schedule, with each kind's check, reads best as one
//! story; what reads the handler logs is in `chaos/audit.rs`, the network namespace in
//! `chaos/netns.rs`, the data plane in `chaos/data.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chanwatch_core::{
    ChannelInfo, ChannelOwner, ChannelState, CoordSession, Keys, NodeId, NodeSession,
};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::{ClusterOptions, EtcdCluster};

#[path = "chaos/audit.rs"]
mod audit;
#[path = "chaos/data.rs"]
mod data;
#[path = "chaos/kinds.rs"]
mod kinds;
#[path = "chaos/netns.rs"]
mod netns;
use audit::{intervals, tail};
use data::DataPlane;
use kinds::{FaultKind, Mode, Schedule};
use netns::Netns;

const NODES: usize = 5;
const CHANNELS: usize = 500;
const TTL_SECS: u64 = 4;
const SETTLE: Duration = Duration::from_secs(60);
/// The chaos cluster's `--quota-backend-bytes`: small enough to fill in about a second with
/// 1 MiB junk values, large enough that chanwatch's own data never reaches it.
const QUOTA_BYTES: u64 = 32 << 20;
/// Where the quota fault writes its junk: outside chanwatch's root.
const JUNK_PREFIX: &str = "chaos-junk/";

use chanwatch_testkit::free_port;

fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One OS process of the binary; killed on drop (also when the test panics).
struct Proc {
    child: Child,
    log: Option<PathBuf>,
    /// Its stdout and stderr.
    out: PathBuf,
    /// The admin address (coordinators).
    admin: String,
    /// Runs in the network namespace.
    in_netns: bool,
    /// A node whose channels run the Python worker (`--exec`, see `chaos/data.rs`).
    python: bool,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    /// " (python)" for a node running the Python worker, for the fault lines.
    fn worker(&self) -> &'static str {
        if self.python {
            " (python)"
        } else {
            ""
        }
    }

    fn signal(&self, sig: &str) {
        let _ = Command::new("kill")
            .args([sig, &self.child.id().to_string()])
            .status();
    }
}

struct Chaos {
    bin: PathBuf,
    dir: tempfile::TempDir,
    endpoints: String,
    /// `ip netns exec NAME` and the endpoints seen from inside the namespace, when there is one.
    netns: Option<(Vec<String>, String)>,
    store: Arc<dyn MetaStore>,
    keys: Keys,
    coords: Vec<Proc>,
    nodes: Vec<Proc>,
    spawned: usize,
    /// (log file, unix ms) of processes killed with SIGKILL.
    killed: Vec<(PathBuf, u64)>,
    /// (log file, from, to) of processes stopped with SIGSTOP.
    frozen: Vec<(PathBuf, u64, u64)>,
    /// The data plane's node flags by (in the namespace, runs the Python worker).
    data_args: Option<BTreeMap<(bool, bool), Vec<String>>>,
    /// How many live nodes run the Python worker (`CHANWATCH_CHAOS_WORKERS`).
    python_nodes: usize,
    /// Handler logs of every node that ran the Python worker (also killed ones).
    python_logs: Vec<PathBuf>,
    rng: u64,
}

impl Chaos {
    fn rand(&mut self, n: u64) -> u64 {
        // xorshift64*: the fault order need not be reproducible here (real processes are
        // not), only varied; the seed is printed anyway.
        self.rng ^= self.rng >> 12;
        self.rng ^= self.rng << 25;
        self.rng ^= self.rng >> 27;
        self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) % n.max(1)
    }

    fn spawn(&mut self, args: &[&str], log: Option<PathBuf>, in_netns: bool) -> Proc {
        self.spawned += 1;
        let out_path = self.dir.path().join(format!("proc{}.out", self.spawned));
        let out = std::fs::File::create(&out_path).expect("process output file");
        let (mut cmd, endpoints) = match (&self.netns, in_netns) {
            (Some((prefix, endpoints)), true) => {
                let mut cmd = Command::new(&prefix[0]);
                cmd.args(&prefix[1..]).arg(&self.bin);
                (cmd, endpoints.clone())
            }
            _ => (Command::new(&self.bin), self.endpoints.clone()),
        };
        cmd.args(args)
            .arg(format!("--endpoints={endpoints}"))
            // Warnings, and the keepalive's recoveries (info): a session that ends tells how.
            .env("RUST_LOG", "warn,chanwatch_store::lease=info")
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("dup"))
            .stderr(out);
        if let Some(l) = &log {
            cmd.arg(format!("--handler-log={}", l.display()));
        }
        Proc {
            child: cmd.spawn().expect("spawn chanwatch"),
            log,
            out: out_path,
            admin: String::new(),
            in_netns: in_netns && self.netns.is_some(),
            python: false,
        }
    }

    /// Replaces every chanwatch process that exited by itself; says which, how and why (the
    /// tail of its output). Processes the test kills are removed from the lists first.
    fn reap(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        for coord in [true, false] {
            let list = if coord {
                &mut self.coords
            } else {
                &mut self.nodes
            };
            let mut exited = Vec::new();
            let mut k = 0;
            while k < list.len() {
                match list[k].child.try_wait() {
                    Ok(Some(status)) => exited.push((list.remove(k), status)),
                    _ => k += 1,
                }
            }
            for (p, status) in exited {
                out.push(format!(
                    "a {} process (pid {}) exited by itself ({status}); the tail of its output:\n{}",
                    if coord { "coordinator" } else { "node" },
                    p.child.id(),
                    tail(&p.out, 15)
                ));
                if coord {
                    self.spawn_coord();
                } else {
                    self.spawn_node();
                }
            }
        }
        out
    }

    fn spawn_coord(&mut self) {
        let ttl = format!("--session-ttl={TTL_SECS}s");
        // A known port, so the leader key tells which process leads.
        let admin = format!("127.0.0.1:{}", free_port());
        let flag = format!("--admin={admin}");
        let mut p = self.spawn(
            &[
                "coord",
                &flag,
                &ttl,
                "--watch-timeout=10s",
                "--reconcile-interval=5s",
            ],
            None,
            false,
        );
        p.admin = admin;
        self.coords.push(p);
    }

    fn spawn_node(&mut self) {
        let log = self
            .dir
            .path()
            .join(format!("node{}.log", self.spawned + 1));
        let ttl = format!("--session-ttl={TTL_SECS}s");
        // One node at a time lives in the network namespace (if there is one).
        let in_netns = !self.nodes.iter().any(|p| p.in_netns);
        // A known admin address: the session in the store names it, so the test can tell
        // which node ID a process has now (`node_id`).
        let admin = format!("127.0.0.1:{}", free_port());
        let flag = format!("--admin={admin}");
        let mut args = vec![
            "node",
            &ttl,
            &flag,
            "--load-delay=200ms",
            "--progress-interval=1s",
        ];
        // The rule for workers: a node runs the Python worker when, without it, fewer than
        // `python_nodes` live nodes would; so the first nodes started (the one in the
        // namespace among them) are Python ones, and a replacement takes the place of the
        // node it replaces.
        let python = self.data_args.is_some()
            && self.nodes.iter().filter(|p| p.python).count() < self.python_nodes;
        if let Some(data) = &self.data_args {
            args.extend(
                data[&(in_netns && self.netns.is_some(), python)]
                    .iter()
                    .map(String::as_str),
            );
        }
        let args: Vec<String> = args.into_iter().map(str::to_owned).collect();
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut p = self.spawn(&args, Some(log), in_netns);
        p.admin = admin;
        p.python = python;
        if python {
            self.python_logs.extend(p.log.clone());
        }
        self.nodes.push(p);
    }

    /// The node ID node process `p` has now: the session naming its admin address (None
    /// while it has none, e.g. registering again after a fence).
    async fn node_id(&self, p: &Proc) -> Option<NodeId> {
        let list = self.store.range(&self.keys.sessions_prefix()).await.ok()?;
        list.kvs.iter().find_map(|kv| {
            let s = NodeSession::decode(&kv.value).ok()?;
            (s.admin_addr == p.admin).then_some(s.id)
        })
    }

    /// The admin address each live session names, by node ID: which process a session is.
    async fn session_admins(&self) -> BTreeMap<NodeId, String> {
        let Ok(list) = self.store.range(&self.keys.sessions_prefix()).await else {
            return BTreeMap::new();
        };
        list.kvs
            .iter()
            .filter_map(|kv| NodeSession::decode(&kv.value).ok())
            .map(|s| (s.id, s.admin_addr))
            .collect()
    }

    /// What the node process that had session `id` (admin address from `admins`) said last,
    /// and what any coordinator said of node `id`: why its session ended, for a violation.
    fn last_words(&self, id: NodeId, admins: &BTreeMap<NodeId, String>) -> String {
        let node = admins
            .get(&id)
            .and_then(|a| self.nodes.iter().find(|p| &p.admin == a))
            .map_or_else(
                || format!("\n  node {id}: its process is gone or unknown"),
                |p| {
                    format!(
                        "\n  node {id} ({}), the tail of its output:\n{}",
                        p.out.display(),
                        audit::tail(&p.out, 12)
                    )
                },
            );
        // A leader that fenced it (a release timeout) says so with `node={id}`.
        let tag = format!("node={id} ");
        let mut said = Vec::new();
        for p in self.coords.iter().map(|p| &p.out) {
            let text = std::fs::read_to_string(p).unwrap_or_default();
            said.extend(
                text.lines()
                    .filter(|l| l.contains(&tag))
                    .map(str::to_owned)
                    .collect::<Vec<_>>(),
            );
        }
        let coords = said[said.len().saturating_sub(5)..].join("\n");
        format!("{node}\n  what the live coordinators said of node {id}:\n{coords}")
    }

    /// A random node process, one with a session if any has.
    async fn pick_node(&mut self) -> usize {
        let mut with_session = Vec::new();
        for (i, p) in self.nodes.iter().enumerate() {
            if self.node_id(p).await.is_some() {
                with_session.push(i);
            }
        }
        if with_session.is_empty() {
            self.rand(self.nodes.len() as u64) as usize
        } else {
            with_session[self.rand(with_session.len() as u64) as usize]
        }
    }

    /// Live sessions and the owner of every channel, to count what a fault changed.
    async fn snapshot(&self) -> (BTreeSet<NodeId>, BTreeMap<String, NodeId>) {
        // Retried: the first request to a member after an outage may get the connection's
        // stale error, and an empty snapshot would read as every session ended (a run once
        // reported all five ended after an outage that none of them noticed).
        let mut tries = 0;
        let list = loop {
            match self.store.range(self.keys.root()).await {
                Ok(list) => break list,
                Err(e) => {
                    tries += 1;
                    println!("chaos: reading the store failed ({e}); retrying");
                    assert!(tries < 20, "cannot read the store for 10 s: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
        };
        let mut sessions = BTreeSet::new();
        let mut owners = BTreeMap::new();
        for kv in &list.kvs {
            if let Ok(id) = self.keys.parse_session(&kv.key) {
                sessions.insert(id);
            } else if let Ok(ck) = self.keys.parse_channel(&kv.key) {
                if let ChannelOwner::Node(n) = ck.owner {
                    owners.insert(ck.channel.to_string(), n);
                }
            }
        }
        (sessions, owners)
    }

    /// How many channel keys are under node `id`.
    async fn load_of(&self, id: NodeId) -> usize {
        let Ok(list) = self.store.range(self.keys.root()).await else {
            return 0;
        };
        list.kvs
            .iter()
            .filter_map(|kv| self.keys.parse_channel(&kv.key).ok())
            .filter(|ck| ck.owner == ChannelOwner::Node(id))
            .count()
    }

    async fn leader_addr(&self) -> Option<String> {
        let kv = self.store.get(&self.keys.leader()).await.ok()??;
        CoordSession::decode(&kv.value).ok().map(|s| s.admin_addr)
    }

    /// Why the cluster is not settled (None: every channel Watched once on a live node; with
    /// `balanced`, also loads within one).
    async fn unsettled(&self, balanced: bool, after: &After) -> Option<String> {
        let before = &mut self.running();
        let list = match self.store.range(self.keys.root()).await {
            Ok(l) => l,
            Err(e) => return Some(format!("cannot list: {e}")),
        };
        let live: BTreeSet<NodeId> = list
            .kvs
            .iter()
            .filter_map(|kv| self.keys.parse_session(&kv.key).ok())
            .collect();
        match after {
            After::Nothing => {}
            After::NodeGone(n) if live.contains(n) => {
                return Some(format!("node {n} still has a session"))
            }
            After::NodeGone(_) => {}
            After::NewLeader(old) => match self.leader_addr().await {
                Some(a) if &a != old => {}
                other => return Some(format!("no new leader yet ({other:?})")),
            },
        }
        // Logs read before and after the list: a channel Watched in the list runs if either
        // read says so (a move may stop it just after the list; a start may be newer than the
        // first read). Neither saying so is a real mismatch.
        let mut running = std::mem::take(&mut *before);
        running.extend(self.running());
        let mut seen: BTreeMap<String, usize> = BTreeMap::new();
        let mut loads: BTreeMap<NodeId, usize> = live.iter().map(|n| (*n, 0)).collect();
        for kv in &list.kvs {
            let Ok(ck) = self.keys.parse_channel(&kv.key) else {
                continue;
            };
            *seen.entry(ck.channel.to_string()).or_default() += 1;
            let info = ChannelInfo::decode(&kv.value).ok();
            let state = info.as_ref().map(|i| i.state);
            match ck.owner {
                ChannelOwner::Node(n)
                    if live.contains(&n) && state == Some(ChannelState::Watched) =>
                {
                    let epoch = info.map_or(0, |i| i.epoch.0);
                    if !running.contains(&(n.0, ck.channel.to_string(), epoch)) {
                        return Some(format!(
                            "{} is Watched on node {n} (epoch {epoch}) but its handler log \
                             does not say it runs there; the channel's handler log lines:\n{}",
                            ck.channel,
                            self.history(ck.channel.as_str())
                        ));
                    }
                    *loads.entry(n).or_default() += 1;
                }
                other => return Some(format!("{} is {state:?} under {other}", ck.channel)),
            }
        }
        if seen.len() != CHANNELS {
            return Some(format!("{} channels, expected {CHANNELS}", seen.len()));
        }
        if let Some((c, n)) = seen.iter().find(|(_, n)| **n > 1) {
            return Some(format!("{c} has {n} keys"));
        }
        let (max, min) = (loads.values().max(), loads.values().min());
        if balanced && max.zip(min).is_some_and(|(a, b)| a - b > 1) {
            return Some(format!("unbalanced: {loads:?}"));
        }
        None
    }

    /// (node, channel, epoch) that run now according to the handler logs of processes not
    /// killed by the test.
    fn running(&self) -> BTreeSet<(u64, String, u64)> {
        audit::running(
            self.coords
                .iter()
                .chain(&self.nodes)
                .filter_map(|p| p.log.as_deref()),
        )
    }

    /// Every handler log line about `channel`, with its file's name.
    fn history(&self, channel: &str) -> String {
        audit::history(self.dir.path(), channel)
    }

    /// Waits until settled; returns the time since `since`.
    async fn wait_settled(
        &self,
        balanced: bool,
        after: &After,
        since: Instant,
        limit: Duration,
    ) -> Result<Duration, String> {
        let started = since;
        let verbose = std::env::var_os("CHANWATCH_CHAOS_VERBOSE").is_some();
        let mut last = String::new();
        loop {
            let why = self.unsettled(balanced, after).await;
            if let Some(w) = why.as_ref().filter(|w| verbose && **w != last) {
                let first = w.lines().next().unwrap_or_default();
                println!(
                    "chaos:   {:>6.2} s {first}",
                    started.elapsed().as_secs_f64()
                );
                last.clone_from(w);
            }
            match why {
                None => return Ok(started.elapsed()),
                Some(w) if started.elapsed() > limit => return Err(w),
                Some(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }
}

/// What a fault must have led to before the cluster counts as settled again.
enum After {
    Nothing,
    /// The node's session is gone (and, as always, its channels are elsewhere).
    NodeGone(NodeId),
    /// A leader other than the one at this admin address leads.
    NewLeader(String),
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes long; .ci/run runs it on its own"]
async fn chaos_against_real_etcd() {
    let secs: u64 = std::env::var("CHANWATCH_CHAOS_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(180);
    // The namespace first: etcd must listen on its veth's host end from the start. Declared
    // before the cluster and the processes, so dropped after them.
    let (mut netns, no_netns) = match Netns::create() {
        Ok(ns) => (Some(ns), None),
        Err(why) => {
            assert!(
                std::env::var("CHANWATCH_CHAOS_NETNS").as_deref() != Ok("require"),
                "CHANWATCH_CHAOS_NETNS=require but no network namespace: {why}"
            );
            println!(
                "chaos: NO network partitions in this run: cannot make a network namespace: {why}"
            );
            (None, Some(why))
        }
    };
    // The data plane (default; `CHANWATCH_CHAOS_DATA=0` runs the nodes' timer load instead).
    let with_data = std::env::var("CHANWATCH_CHAOS_DATA").as_deref() != Ok("0");
    // The kinds this run injects, each of which must run; `CHANWATCH_CHAOS_KINDS=partition,
    // nospace` injects only these (to reproduce one).
    let only = std::env::var("CHANWATCH_CHAOS_KINDS").ok();
    let mode = Mode::new(no_netns.as_deref(), with_data, only.as_deref())
        .unwrap_or_else(|e| panic!("{e}"));
    let mut cluster = EtcdCluster::start_with(
        3,
        ClusterOptions {
            extra_args: vec![format!("--quota-backend-bytes={QUOTA_BYTES}")],
            extra_client_hosts: netns.iter().map(|n| n.host_ip.clone()).collect(),
        },
    )
    .await
    .expect("3-member etcd cluster");
    let endpoints = cluster.endpoints();
    let store: Arc<dyn MetaStore> = Arc::new(
        EtcdStore::connect(EtcdConfig {
            endpoints: endpoints.clone(),
            ..EtcdConfig::default()
        })
        .await
        .expect("connect"),
    );
    let seed = unix_ms();
    let mut c = Chaos {
        bin: PathBuf::from(env!("CARGO_BIN_EXE_chanwatch")),
        dir: tempfile::tempdir().expect("tempdir"),
        endpoints: endpoints.join(","),
        netns: netns.as_ref().map(|n| {
            (
                n.exec_prefix().map(str::to_owned).to_vec(),
                cluster.endpoints_on(&n.host_ip).join(","),
            )
        }),
        store,
        keys: Keys::default(),
        coords: Vec::new(),
        nodes: Vec::new(),
        spawned: 0,
        killed: Vec::new(),
        frozen: Vec::new(),
        data_args: None,
        python_nodes: 0,
        python_logs: Vec::new(),
        rng: seed | 1,
    };
    let mut data = if with_data {
        Some(
            DataPlane::start(
                c.store.clone(),
                c.keys.clone(),
                netns.as_ref().map(|n| n.host_ip.as_str()),
                c.dir.path(),
            )
            .await,
        )
    } else {
        None
    };
    c.data_args = data.as_ref().map(|d| {
        [(false, false), (false, true), (true, false), (true, true)]
            .into_iter()
            .map(|(inside, python)| ((inside, python), d.node_args(inside, python)))
            .collect()
    });
    if data.is_some() {
        c.python_nodes = data::python_nodes(NODES);
        println!(
            "chaos: {} of {NODES} nodes run the Python worker (examples/workers/consumer.py \
             through --exec; CHANWATCH_CHAOS_WORKERS=mixed|rust|python), the others the Rust \
             consumer",
            c.python_nodes
        );
    }
    println!(
        "chaos: seed {seed}, {secs} s, logs in {}",
        c.dir.path().display()
    );
    c.spawn_coord();
    c.spawn_coord();
    for _ in 0..NODES {
        c.spawn_node();
    }
    // Register the channels through the leader's admin API.
    let http = reqwest::Client::new();
    let started = Instant::now();
    let mut added = 0;
    while added < CHANNELS {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "could not add channels"
        );
        let Some(addr) = c.leader_addr().await else {
            tokio::time::sleep(Duration::from_millis(200)).await;
            continue;
        };
        let r = http
            .post(format!("http://{addr}/api/v1/channels"))
            .json(&serde_json::json!({ "name": format!("ch-{added:04}") }))
            .send()
            .await;
        match r {
            Ok(resp) if resp.status().is_success() || resp.status() == 409 => added += 1,
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    c.wait_settled(true, &After::Nothing, Instant::now(), SETTLE)
        .await
        .expect("initial assignment");
    println!(
        "chaos: {CHANNELS} channels on {NODES} nodes in {:?}",
        started.elapsed()
    );

    if let Some(d) = data.as_mut() {
        // 20 s past the fault phase: a fault begun just before its end (a nats-server down
        // for 8 s, say) is still measured on flowing data.
        d.start_producer(&c.bin, &c.endpoints, secs + 20);
        println!(
            "chaos: producing {} msg/s over all channels for {} s",
            data::RATE,
            secs + 20
        );
    }
    // Every kind of the mode once (in an order drawn from the seed), then kinds at random
    // until the time is up; at the end each kind must have run (`chaos/kinds.rs`).
    let mut schedule = Schedule::new(&mode.kinds, &mut |n| c.rand(n));
    println!(
        "chaos: fault kinds of this run, each of which must run: {}; first round: {}",
        kinds::names(&mode.kinds),
        kinds::names(&schedule.first_round())
    );
    for (kind, why) in &mode.left_out {
        println!("chaos: fault kind {kind} left out of this run: {why}");
    }
    let phase = Instant::now();
    let deadline = phase + Duration::from_secs(secs);
    let mut first_round_took: Option<Duration> = None;
    let mut settle: BTreeMap<FaultKind, Vec<Duration>> = BTreeMap::new();
    let mut violations = Vec::new();
    // Until fencing pauses instead of re-registering (DESIGN §3 v2), every etcd outage breaks
    // invariant 9; this turns those violations into printed lines.
    let allow_reregister = std::env::var_os("CHANWATCH_CHAOS_ALLOW_REREGISTER").is_some();
    while Instant::now() < deadline {
        let mut t0 = Instant::now();
        let mut after = After::Nothing;
        let mut what = String::new();
        // The settle time when it is measured inside the fault (partition).
        let mut settled_while: Option<Duration> = None;
        let kind = schedule.next(&mut |n| c.rand(n));
        // Whether the fault happened (a compaction may fail): counted for `schedule.missing`.
        let mut injected = true;
        // When the fault began (unix ms), to match the processes' logs.
        let started_ms = unix_ms();
        let (sessions0, owners0) = c.snapshot().await;
        let admins0 = c.session_admins().await;
        match kind {
            FaultKind::KillNode => {
                let i = c.pick_node().await;
                if let Some(id) = c.node_id(&c.nodes[i]).await {
                    after = After::NodeGone(id);
                    what = format!("node {id}{}", c.nodes[i].worker());
                }
                let mut p = c.nodes.remove(i);
                let _ = p.child.kill();
                let _ = p.child.wait();
                let log = p.log.clone().expect("node log");
                c.killed.push((log, unix_ms()));
                c.spawn_node();
            }
            FaultKind::KillLeader => {
                let addr = c.leader_addr().await;
                let i = c
                    .coords
                    .iter()
                    .position(|p| Some(&p.admin) == addr.as_ref())
                    .unwrap_or(0);
                let mut p = c.coords.remove(i);
                let _ = p.child.kill();
                let _ = p.child.wait();
                after = After::NewLeader(p.admin.clone());
                c.spawn_coord();
            }
            FaultKind::StopNode => {
                let i = c.pick_node().await;
                let from = unix_ms();
                if let Some(id) = c.node_id(&c.nodes[i]).await {
                    after = After::NodeGone(id);
                    what = format!("node {id}{}", c.nodes[i].worker());
                }
                c.nodes[i].signal("-STOP");
                tokio::time::sleep(Duration::from_secs(TTL_SECS + 2)).await;
                c.nodes[i].signal("-CONT");
                let log = c.nodes[i].log.clone().expect("node log");
                // The frozen process may run until it notices: a few seconds of slack.
                c.frozen.push((log, from, unix_ms() + 2_000));
            }
            FaultKind::RestartEtcd => {
                let i = c.rand(3) as usize;
                cluster
                    .restart_member(i)
                    .await
                    .expect("etcd member restarts");
            }
            FaultKind::FreezeMember => {
                // A follower that takes connections and answers nothing (as one cut off from
                // the others): renewals that went to it must move on. Not the leader: etcd
                // before the fix of its issue 15247 (3.4.23 here) lets a leader that wakes
                // from a stall longer than the TTL revoke every lease (docs/TESTING.md, "Faults the
                // world has"); the chaos run found it, and nothing on the client can help.
                let leader = cluster.leader().await;
                let i = (leader.unwrap_or(0) + 1 + c.rand(2) as usize) % 3;
                let hold = Duration::from_millis(5_000 + c.rand(5_001));
                cluster.freeze_member(i).expect("SIGSTOP an etcd member");
                tokio::time::sleep(hold).await;
                cluster
                    .thaw_member(i)
                    .await
                    .expect("the etcd member wakes and serves");
                t0 = Instant::now();
                what = format!("member {i}, {:.1} s", hold.as_secs_f64());
            }
            FaultKind::EtcdOutage => {
                let down = Duration::from_millis(5_000 + c.rand(15_001));
                cluster.kill_all_members();
                tokio::time::sleep(down).await;
                t0 = Instant::now();
                cluster
                    .start_all_members()
                    .await
                    .expect("etcd members restart after the outage");
                what = format!("down {:.1} s", down.as_secs_f64());
            }
            FaultKind::NoSpace => {
                let hold = Duration::from_millis(5_000 + c.rand(5_001));
                let filled = Instant::now();
                let bytes = cluster
                    .fill_quota(JUNK_PREFIX)
                    .await
                    .expect("fill the quota");
                let fill = filled.elapsed();
                // A node dies during the alarm: its channels cannot move (no puts) and its
                // replacement cannot get a lease until the disarm; nobody may exit.
                tokio::time::sleep(hold / 2).await;
                // The busiest node, so that channels must move.
                let mut i = 0;
                let mut id = None;
                let mut most = 0;
                for (k, p) in c.nodes.iter().enumerate() {
                    let n = c.node_id(p).await;
                    let load = owners0.values().filter(|o| Some(**o) == n).count();
                    if id.is_none() || load > most {
                        (i, id, most) = (k, n, load);
                    }
                }
                if let Some(id) = id {
                    after = After::NodeGone(id);
                }
                let mut p = c.nodes.remove(i);
                let worker = p.worker();
                let _ = p.child.kill();
                let _ = p.child.wait();
                c.killed.push((p.log.clone().expect("node log"), unix_ms()));
                c.spawn_node();
                tokio::time::sleep(hold - hold / 2).await;
                let mut tries = 0;
                while let Err(e) = cluster.clear_quota(JUNK_PREFIX).await {
                    tries += 1;
                    assert!(tries < 20, "cannot clear the quota: {e}");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                t0 = Instant::now();
                what = format!(
                    "{} MiB in {:.2} s, held {:.1} s, node {}{worker} ({most} ch) killed",
                    bytes >> 20,
                    fill.as_secs_f64(),
                    hold.as_secs_f64(),
                    id.map_or("?".to_owned(), |i| i.to_string()),
                );
            }
            FaultKind::Partition => {
                let cut = Duration::from_millis(5_000 + c.rand(10_001));
                // Wait (up to 2 TTLs) until the node in the namespace has a session: cutting
                // off a node that is still registering tests little.
                let mut id = None;
                let mut worker = "";
                let waited = Instant::now();
                while id.is_none() && waited.elapsed() < Duration::from_secs(2 * TTL_SECS) {
                    let p = c
                        .nodes
                        .iter()
                        .find(|p| p.in_netns)
                        .expect("a node in the namespace");
                    worker = p.worker();
                    id = c.node_id(p).await;
                    if id.is_none() {
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
                t0 = Instant::now();
                let load = match id {
                    Some(id) => c.load_of(id).await,
                    None => 0,
                };
                if let Some(id) = id {
                    after = After::NodeGone(id);
                }
                netns
                    .as_mut()
                    .expect("partition needs the namespace")
                    .cut()
                    .expect("iptables cuts the namespace off");
                // Measured while the node is still cut off: its session expires and its
                // channels run elsewhere without its help. Then heal, and the wait below
                // checks that the node's return disturbs nothing.
                let during = c.wait_settled(false, &after, t0, cut).await;
                tokio::time::sleep(cut.saturating_sub(t0.elapsed())).await;
                netns
                    .as_mut()
                    .expect("partition needs the namespace")
                    .heal()
                    .expect("iptables heals the namespace");
                what = format!(
                    "node {}{worker} ({load} ch) cut {:.1} s, {}",
                    id.map_or("?".to_owned(), |i| i.to_string()),
                    cut.as_secs_f64(),
                    if during.is_ok() {
                        "settled while cut"
                    } else {
                        "NOT settled while cut"
                    }
                );
                settled_while = during.ok();
            }
            FaultKind::NatsRestart => {
                let d = data.as_mut().expect("nats-restart needs the data plane");
                let down = Duration::from_millis(3_000 + c.rand(5_001));
                d.restart_nats(down).await;
                // Measured from the server's return: every channel commits again (the
                // consumers and the producer reconnect by themselves).
                t0 = Instant::now();
                let back = d
                    .wait_committed_since(CHANNELS, unix_ms(), t0, SETTLE)
                    .await;
                what = format!("down {:.1} s (kill -9)", down.as_secs_f64());
                match back {
                    Ok((first, all)) => {
                        what += &format!(", first commit {:.2} s", first.as_secs_f64());
                        settled_while = Some(all);
                    }
                    Err(why) => violations.push(format!("nats-restart: {why}")),
                }
            }
            FaultKind::Compact => {
                let compacted = match c.store.range(&c.keys.leader()).await {
                    Ok(l) => c.store.compact(l.revision).await.map(|()| l.revision),
                    Err(e) => Err(e),
                };
                injected = compacted.is_ok();
                what = match compacted {
                    Ok(rev) => format!("at revision {rev}"),
                    // Not counted as run: a later draw may compact.
                    Err(e) => format!("FAILED, not counted: {e}"),
                };
            }
        }
        if injected {
            schedule.ran(kind);
        }
        let result = c
            .wait_settled(false, &after, t0, SETTLE)
            .await
            .map(|d| settled_while.unwrap_or(d));
        // A node that fences itself does so up to a TTL after the fault ended (it counts from
        // its last keepalive): watch that long before counting what the fault cost.
        let window = Duration::from_secs(TTL_SECS + 1);
        tokio::time::sleep(window.saturating_sub(t0.elapsed())).await;
        // What the fault cost: sessions that ended (re-registrations, deaths) and channels
        // now owned by another node than before.
        let (sessions1, owners1) = c.snapshot().await;
        let ended: Vec<String> = sessions0
            .difference(&sessions1)
            .map(ToString::to_string)
            .collect();
        // Only the node the fault aimed at may lose its session (DESIGN §6 invariant 9: an
        // etcd crash, restart or lost quorum costs no re-registration; a leader failover,
        // compaction or NOSPACE has no reason to).
        let target = match after {
            After::NodeGone(id) => Some(id),
            _ => None,
        };
        if let Some(d) = data.as_mut() {
            d.note_fault(kind.name(), started_ms, target.map(|n| n.0));
        }
        let unexpected: Vec<NodeId> = sessions0
            .difference(&sessions1)
            .filter(|id| Some(**id) != target)
            .copied()
            .collect();
        if !unexpected.is_empty() {
            // With each node's last words: whether etcd said its lease was gone, or it fenced
            // itself for another reason (a CI run once failed here with no clue why).
            let v = format!(
                "{kind} {what}: sessions of nodes it did not aim at ended (they fenced \
                 themselves and registered again; DESIGN invariant 9): [{}]{}",
                unexpected
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(" "),
                unexpected
                    .iter()
                    .map(|id| c.last_words(*id, &admins0))
                    .collect::<String>()
            );
            if allow_reregister {
                println!("chaos: ALLOWED by CHANWATCH_CHAOS_ALLOW_REREGISTER: {v}");
            } else {
                violations.push(v);
            }
            // Let the cluster settle again before the next fault.
            let _ = c
                .wait_settled(false, &After::Nothing, Instant::now(), SETTLE)
                .await;
        }
        let moved = owners0
            .iter()
            .filter(|(ch, n)| owners1.get(*ch).is_some_and(|m| m != *n))
            .count();
        println!(
            "chaos: {started_ms} {kind:<13} {what:<44} settled: {}, sessions ended: [{}], \
             {moved} channels moved",
            match &result {
                Ok(d) => format!("{:.2} s", d.as_secs_f64()),
                Err(why) => format!("NO: {why}"),
            },
            ended.join(" ")
        );
        match result {
            Ok(d) => settle.entry(kind).or_default().push(d),
            Err(why) => violations.push(format!("{kind}: not settled in {SETTLE:?}: {why}")),
        }
        for exit in c.reap() {
            println!("chaos: after {kind}: {exit}");
            violations.push(format!("after {kind}: {exit}"));
        }
        if first_round_took.is_none() && schedule.missing().is_empty() {
            let took = phase.elapsed();
            first_round_took = Some(took);
            println!(
                "chaos: every fault kind of this run has run, {:.1} s into the fault phase of \
                 {secs} s",
                took.as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(500 + c.rand(1500))).await;
    }
    let fault_phase = phase.elapsed();
    // Each kind of this run's mode ran at least once.
    let missing = schedule.missing();
    println!(
        "chaos: faults per kind in the fault phase of {:.1} s: {}",
        fault_phase.as_secs_f64(),
        schedule
            .counts()
            .iter()
            .map(|(k, n)| format!("{k} {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    if missing.is_empty() {
        println!(
            "chaos: all {} fault kinds of this run ran (the first round took {:.1} s)",
            mode.kinds.len(),
            first_round_took.unwrap_or_default().as_secs_f64()
        );
    } else {
        let v = format!(
            "fault kinds of this run that did not run in {secs} s (CHANWATCH_CHAOS_SECS): {} \
             (this run's kinds: {}; left out: {})",
            kinds::names(&missing),
            kinds::names(&mode.kinds),
            if mode.left_out.is_empty() {
                "none".to_owned()
            } else {
                kinds::names(&mode.left_out.iter().map(|(k, _)| *k).collect::<Vec<_>>())
            }
        );
        println!("chaos: {v}");
        violations.push(v);
    }
    if let Some(d) = data.as_mut() {
        violations.extend(d.stop_producing(Duration::from_secs(90)).await);
    }
    if let Err(why) = c
        .wait_settled(true, &After::Nothing, Instant::now(), SETTLE)
        .await
    {
        violations.push(format!(
            "final: not settled and balanced in {SETTLE:?}: {why}"
        ));
    }
    for exit in c.reap() {
        violations.push(format!("at the end: {exit}"));
    }
    // Single ownership from the handler logs.
    let logs: Vec<PathBuf> = std::fs::read_dir(c.dir.path())
        .expect("logs")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    let runs = intervals(&logs, &c.killed, unix_ms());
    let overlaps = audit::overlaps(&runs, &c.frozen);
    let overlap_count = overlaps.len();
    violations.extend(overlaps);
    let total: usize = schedule.counts().values().sum();
    println!(
        "chaos: {total} faults injected, {} runs audited, {overlap_count} overlaps",
        runs.len()
    );
    for (kind, ds) in &mut settle {
        ds.sort();
        let p = |q: f64| ds[((ds.len() - 1) as f64 * q).round() as usize];
        println!(
            "chaos: {kind:<13} {:>3} × settle p50 {:>6.2} s  p99 {:>6.2} s",
            ds.len(),
            p(0.5).as_secs_f64(),
            p(0.99).as_secs_f64()
        );
    }
    // Why nodes fenced themselves (their warnings), as evidence for what the faults cost.
    let fences = audit::fence_reasons(c.dir.path());
    for (reason, n) in &fences {
        println!("chaos: {n:>3} × a node fenced itself: {reason}");
    }
    if let Some(d) = &data {
        violations.extend(d.report(&audit::nodes_in(&c.python_logs)));
        let audit = d.audit(&c.bin, &c.endpoints, &*c.store, CHANNELS).await;
        violations.extend(audit);
    }
    println!("chaos: violations: {}", violations.len());
    for p in c.coords.iter_mut().chain(c.nodes.iter_mut()) {
        let _ = p.child.kill();
        let _ = p.child.wait();
    }
    if !violations.is_empty() {
        c.dir.disable_cleanup(true);
        println!("chaos: kept the logs in {}", c.dir.path().display());
    }
    assert!(
        violations.is_empty(),
        "violations:\n{}",
        violations.join("\n")
    );
}
