//! The simulated cluster and the fault driver.
//!
//! Over 600 lines on purpose: every fault kind is a short arm of one driver, and the faults,
//! their undo list and the settle phase share the world's state; the checks are in `check.rs`.
//!
//! Owns: the processes of one run (coordinators and nodes as pausable tasks started by the
//! in-process harness, [`chanwatch_cluster`], each with its own [`FaultyStore`] over
//! the shared embedded store), the seeded choice of the next fault,
//! the undo list of timed faults, and the settle phase.
//! Must not: check invariants itself (the [`Checker`] does) or use anything but the seeded
//! RNG and tokio's paused clock.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chanwatch_cluster::{self as inproc, Timings};
use chanwatch_coord::CoordHandle;
use chanwatch_core::planner::Placement;
use chanwatch_core::{ChannelName, Keys, NodeId, VChannelInfo};
use chanwatch_node::handler::{ConsumerOptions, StreamConsumer};
use chanwatch_node::{Behaviour, ChannelHandler, RecordingHandler};
use chanwatch_store::{Clock, EmbeddedStore, Faults, FaultyStore, MetaStore};
use chanwatch_stream::Log;
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::time::Instant;

use crate::check::{overlaps, Checker, Excuse, Scope, Writer, Writers};
use crate::{MemLog, Report, SimOptions, Trace};

/// Unix ms of simulated time zero (fixed, so values written to the store are identical).
const BASE_MS: u64 = 1_800_000_000_000;
const SESSION_TTL: Duration = Duration::from_secs(4);
const WATCH_TIMEOUT: Duration = Duration::from_secs(5);
/// Time allowed after the faults stop and one session TTL has passed.
const SETTLE: Duration = Duration::from_secs(40);
/// A 64-bit mix of `seed` and `x` (splitmix64's finaliser).
fn mix(seed: u64, x: u64) -> u64 {
    let mut z = seed ^ x.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A channel's weight (1-3) and group (one of three, or none), hashed from the seed and its
/// name, so that invariant 5 is checked by weight and capacity (DESIGN §5).
fn placement_of(seed: u64, name: &ChannelName) -> Placement {
    let h = name
        .as_str()
        .bytes()
        .fold(seed, |h, b| mix(h, u64::from(b)));
    let group = match (h >> 8) % 4 {
        0 => None,
        g => Some(format!("g{g}")),
    };
    Placement {
        weight: 1 + (h % 3) as u32,
        group,
    }
}

/// Most network latency of one store call (each picked from the seed).
const LATENCY: Duration = Duration::from_millis(15);
/// How long an admin request may take before its outcome counts as unknown.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);
/// Data plane: the producer appends one message to every channel this often.
const PRODUCE_EVERY: Duration = Duration::from_millis(200);

struct NodeProc {
    slot: usize,
    proc: inproc::NodeProc,
    faults: Faults,
    /// While set, every load on this node fails (a node with a broken disk or dependency).
    sick: Arc<AtomicBool>,
    /// While set, every load on this node reports its channel broken (`ctx.fail`) and then
    /// succeeds (an `--exec` worker's `/fail` or exit just around its `/ready`).
    breaking: Arc<AtomicBool>,
}

impl NodeProc {
    fn id(&self) -> Option<NodeId> {
        self.proc.id()
    }
}

struct CoordProc {
    name: String,
    proc: inproc::CoordProc,
    faults: Faults,
}

/// A timed fault's end.
struct Undo {
    at: Instant,
    what: String,
    run: Box<dyn FnOnce()>,
}

/// What an admin request came to.
enum Outcome {
    Done,
    Refused,
    Unknown,
}

struct World {
    seed: u64,
    rng: XorShiftRng,
    options: SimOptions,
    clock: Clock,
    start: Instant,
    store: EmbeddedStore,
    writers: Writers,
    handler: RecordingHandler,
    /// Starts the processes (the in-process harness); each runs on a `FaultyStore` of its own.
    harness: inproc::Cluster,
    nodes: Vec<NodeProc>,
    coords: Vec<CoordProc>,
    next_slot: usize,
    incarnations: u32,
    next_channel: usize,
    /// Channels added for sure and not asked to be removed.
    expected: BTreeSet<ChannelName>,
    /// The channel added last: with the data plane, a remove often picks it, while its
    /// first run has consumed messages but not committed yet — the window in which only the
    /// assignment's create revision fences a commit (the release's last commit).
    newest: Option<ChannelName>,
    /// Channels whose add or remove has an unknown outcome: present or absent is fine.
    ambiguous: BTreeSet<ChannelName>,
    /// Load behaviour of each channel when it is not faulted.
    behaviours: Vec<(ChannelName, Behaviour)>,
    undo: Vec<Undo>,
    excuses: Vec<Excuse>,
    checker: Checker,
    trace: Trace,
    report: Report,
    /// The data plane, when [`SimOptions::data_plane`] is set.
    data: Option<DataPlane>,
    /// Slots of the nodes leaving after a planned restart.
    leaving: BTreeSet<usize>,
}

/// The data plane of a run: the log, the consumer every node runs, and the producer.
struct DataPlane {
    log: MemLog,
    consumer: Arc<StreamConsumer>,
    /// Channels the producer appends to (every channel asked for, in name order).
    channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>>,
    /// Set when the producer must stop.
    stop: Arc<AtomicBool>,
}

impl DataPlane {
    fn new(seed: u64) -> Self {
        let log = MemLog::new();
        // Commits every 3 s (the node's default is 1 s): a run's first commit comes late
        // enough that a remove often lands before it, the window in which only the
        // assignment's create revision fences the release's last commit.
        let consumer = Arc::new(StreamConsumer::new(
            Arc::new(log.clone()),
            ConsumerOptions {
                commit_interval: Duration::from_secs(3),
                ..ConsumerOptions::default()
            },
        ));
        let channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        tokio::spawn(produce(log.clone(), channels.clone(), stop.clone(), seed));
        DataPlane {
            log,
            consumer,
            channels,
            stop,
        }
    }
}

/// The producer: every [`PRODUCE_EVERY`], one message to every channel, with the channel's
/// next sequence number (big-endian, first 8 bytes) and bytes hashed from the seed.
async fn produce(
    log: MemLog,
    channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut seqs: std::collections::BTreeMap<ChannelName, u64> = Default::default();
    while !stop.load(Ordering::SeqCst) {
        let now: Vec<ChannelName> = channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        for c in now {
            let seq = seqs.entry(c.clone()).or_default();
            *seq += 1;
            let mut payload = seq.to_be_bytes().to_vec();
            let salt = chanwatch_node::handler::consumer::payload_hash(
                format!("{seed}/{c}/{seq}").as_bytes(),
            );
            payload.extend_from_slice(&salt.to_be_bytes());
            let _ = log.append(c.as_str(), payload.into()).await;
        }
        tokio::time::sleep(PRODUCE_EVERY).await;
    }
}

pub(crate) async fn simulate(seed: u64, options: SimOptions) -> Report {
    let store = EmbeddedStore::new();
    let keys = Keys::default();
    let writers = Writers::default();
    let mut checker = Checker::new(keys.clone(), store.observe(), writers.clone());
    checker.failed_node_backoff = WATCH_TIMEOUT;
    let clock = Clock::with_unix_base(BASE_MS);
    let handler = RecordingHandler::new(clock);
    let harness = harness(&store, &keys, clock, &handler, &options);
    let data = options.data_plane.then(|| DataPlane::new(seed));
    let mut w = World {
        data,
        seed,
        rng: XorShiftRng::seed_from_u64(seed),
        trace: Trace::new(options.keep_trace, options.echo_trace),
        options,
        clock,
        start: Instant::now(),
        store,
        writers,
        handler,
        harness,
        nodes: Vec::new(),
        coords: Vec::new(),
        next_slot: 0,
        incarnations: 0,
        next_channel: 0,
        expected: BTreeSet::new(),
        newest: None,
        ambiguous: BTreeSet::new(),
        behaviours: Vec::new(),
        undo: Vec::new(),
        leaving: BTreeSet::new(),
        excuses: Vec::new(),
        checker,
        report: Report {
            seed,
            violations: Vec::new(),
            trace: Vec::new(),
            trace_hash: 0,
            trace_lines: 0,
            faults: Default::default(),
            settle_ms: None,
            sim_ms: 0,
            revisions: 0,
        },
    };
    w.run().await;
    w.finish()
}

/// The harness with the simulation's settings: short TTLs, a planner whose balance and
/// cooldown fit them, the planted bugs of `options`, one set of node metrics.
fn harness(
    store: &EmbeddedStore,
    keys: &Keys,
    clock: Clock,
    handler: &RecordingHandler,
    options: &SimOptions,
) -> inproc::Cluster {
    let timings = Timings {
        session_ttl: SESSION_TTL,
        watch_timeout: WATCH_TIMEOUT,
        // Far off: a leader whose watch stalls must find out from its keepalives' revisions.
        resync_interval: Duration::from_secs(60),
        tick: Duration::from_millis(250),
        progress_interval: Duration::from_millis(500),
    };
    let mut h = inproc::Cluster::new(
        Arc::new(store.clone()),
        keys.clone(),
        clock,
        &timings,
        Arc::new(handler.clone()),
    );
    let planner = &mut h.coord_config.planner;
    planner.balance_quiet_ms = 1_000;
    planner.move_cooldown_ms = 10_000;
    planner.planted_bug = options.planner_bug;
    h.coord_config.pipeline = 4;
    h.node_config.planted_bug = options.planted_bug;
    h
}

impl World {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn log(&mut self, text: &str) {
        // Store events first, so the trace stays in time order.
        self.poll();
        let t = self.now_ms();
        self.trace.push(t, text);
    }

    fn fault(&mut self, kind: &'static str, text: &str) {
        if kind != "node-restart" {
            // A departure under way is no longer judged: this may move its channels again.
            self.checker.departures.disturb();
        }
        *self.report.faults.entry(kind).or_default() += 1;
        self.log(&format!("fault {kind}: {text}"));
    }

    /// Lets the cluster run for `d` of simulated time, then checks every new revision.
    async fn advance(&mut self, d: Duration) {
        tokio::time::sleep(d).await;
        self.poll();
    }

    fn poll(&mut self) {
        let start = self.start;
        let trace = &mut self.trace;
        self.checker.poll(&mut |at, line| {
            let since = at.saturating_duration_since(start);
            let t = u64::try_from(since.as_millis()).unwrap_or(u64::MAX);
            trace.push(t, &line);
        });
    }

    /// Records `writer` as the author of every revision committed through `faults`' store.
    fn attribute(&self, faults: &Faults, writer: Writer) {
        let writers = self.writers.clone();
        faults.on_commit(Arc::new(move |rev| {
            writers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(rev, writer.clone());
        }));
    }

    fn spawn_node(&mut self) {
        let slot = self.next_slot;
        self.next_slot += 1;
        let (store, faults) = FaultyStore::new(self.store.clone());
        faults.latency(LATENCY, self.seed ^ (slot as u64) << 8);
        self.attribute(&faults, Writer::Node(slot));
        let mut config = self.harness.node_config.clone();
        config.admin_addr = format!("proc{slot}");
        // Capacities 1-3, hashed from the seed (not drawn from `rng`: the fault schedule of
        // a seed stays what it was before placement v2).
        config.capacity = 1 + (mix(self.seed, slot as u64) % 3) as u32;
        let sick = Arc::new(AtomicBool::new(false));
        let breaking = Arc::new(AtomicBool::new(false));
        let inner: Arc<dyn ChannelHandler> = match &self.data {
            None => Arc::new(self.handler.clone()),
            Some(d) => Arc::new(Consuming {
                recording: self.handler.clone(),
                consumer: d.consumer.clone(),
            }),
        };
        let handler: Arc<dyn ChannelHandler> = Arc::new(Sickly {
            inner,
            sick: sick.clone(),
            breaking: breaking.clone(),
        });
        let proc = self
            .harness
            .spawn_node_with(Arc::new(store), handler, config);
        self.log(&format!("start proc{slot}"));
        self.nodes.push(NodeProc {
            slot,
            proc,
            faults,
            sick,
            breaking,
        });
    }

    fn spawn_coord(&mut self) {
        self.incarnations += 1;
        let name = format!("coord{}", self.incarnations);
        let (store, faults) = FaultyStore::new(self.store.clone());
        faults.latency(LATENCY, self.seed ^ u64::from(self.incarnations) << 32);
        self.attribute(&faults, Writer::Coord(name.clone()));
        let mut config = self.harness.coord_config(&name);
        config.admin_addr.clone_from(&name);
        // Its own task: the world pauses and kills it there. Its handle lives as long as the
        // task, so it is never stopped otherwise.
        let proc = match self.harness.spawn_coord_with(Arc::new(store), config) {
            Ok(p) => p,
            Err(inproc::InProcError::Coord { source, .. }) => {
                self.log(&format!("start {name} failed: {source}"));
                return;
            }
            Err(e) => {
                self.log(&format!("start {name} failed: {e}"));
                return;
            }
        };
        self.log(&format!("start {name}"));
        self.coords.push(CoordProc { name, proc, faults });
    }

    fn leader(&self) -> Option<CoordHandle> {
        self.coords
            .iter()
            .find(|c| {
                let s = c.proc.handle.status();
                s.leader && s.ready && !c.proc.paused()
            })
            .map(|c| c.proc.handle.clone())
    }

    fn pick(&mut self, n: usize) -> Option<usize> {
        (n > 0).then(|| self.rng.random_range(0..n))
    }

    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(self.rng.random_range(lo..=hi))
    }

    fn schedule(&mut self, after: Duration, what: String, run: Box<dyn FnOnce()>) {
        self.undo.push(Undo {
            at: Instant::now() + after,
            what,
            run,
        });
    }

    fn run_due_undos(&mut self, all: bool) {
        let now = Instant::now();
        // In schedule order, so ties resolve the same way every run.
        let (due, later): (Vec<Undo>, Vec<Undo>) = std::mem::take(&mut self.undo)
            .into_iter()
            .partition(|u| all || u.at <= now);
        self.undo = later;
        for u in due {
            self.log(&format!("end {}", u.what));
            (u.run)();
        }
    }

    fn excuse(&mut self, scope: Scope, for_ms: u64) {
        let from_ms = self.clock.unix_ms();
        self.excuses.push(Excuse {
            scope,
            from_ms,
            to_ms: from_ms + for_ms,
        });
    }

    async fn run(&mut self) {
        self.spawn_coord();
        self.spawn_coord();
        for _ in 0..self.options.nodes {
            self.spawn_node();
        }
        let mut waited = 0;
        while self.leader().is_none() && waited < 100 {
            self.advance(Duration::from_millis(100)).await;
            waited += 1;
        }
        for _ in 0..self.options.channels {
            let behaviour = match self.rng.random_range(0..10) {
                0 => Behaviour::Slow {
                    delay: self.ms(6_000, 12_000),
                },
                1 => Behaviour::Fail,
                _ => Behaviour::Load {
                    delay: self.ms(0, 800),
                },
            };
            let name = self.next_name();
            if behaviour == Behaviour::Fail {
                // A failing channel fails only for a while, or it could never settle.
                self.handler.set(name.as_str(), Behaviour::Fail);
                let after = self.ms(1_000, 20_000);
                let handler = self.handler.clone();
                let n = name.clone();
                self.schedule(
                    after,
                    format!("load failures of {name}"),
                    Box::new(move || {
                        handler.set(
                            n.as_str(),
                            Behaviour::Load {
                                delay: Duration::from_millis(100),
                            },
                        )
                    }),
                );
            }
            self.add_channel(name, behaviour).await;
        }
        for _ in 0..self.options.steps {
            self.run_due_undos(false);
            self.step().await;
            let dt = self.ms(50, 1_500);
            self.advance(dt).await;
        }
        self.stop_faults();
        self.settle().await;
    }

    fn next_name(&mut self) -> ChannelName {
        let name = format!("ch-{:03}", self.next_channel);
        self.next_channel += 1;
        ChannelName::new(name).unwrap_or_else(|_| unreachable!("generated names are valid"))
    }

    /// Asks the leader to add `name`; a `Fail` behaviour is already set by the caller.
    async fn add_channel(&mut self, name: ChannelName, behaviour: Behaviour) {
        let failing = behaviour == Behaviour::Fail;
        let behaviour = if failing {
            Behaviour::Load {
                delay: Duration::from_millis(100),
            }
        } else {
            behaviour
        };
        self.behaviours.push((name.clone(), behaviour));
        if !failing {
            self.handler.set(name.as_str(), behaviour);
        }
        self.checker.requested_adds.insert(name.clone());
        self.newest = Some(name.clone());
        if let Some(d) = &self.data {
            d.channels
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(name.clone());
        }
        let outcome = match self.leader() {
            None => Outcome::Refused,
            Some(h) => {
                let n = name.clone();
                self.log(&format!("request add {n}"));
                let placement = placement_of(self.seed, &n);
                let r = tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    h.add_channel_with(n, VChannelInfo::default(), placement),
                )
                .await;
                classify(r.map(|r| r.map(|_| ())))
            }
        };
        self.record(&name, outcome, true);
    }

    async fn remove_channel(&mut self) {
        let newest = self
            .newest
            .clone()
            .filter(|n| self.data.is_some() && self.expected.contains(n));
        let name = match newest {
            Some(n) if self.rng.random_bool(0.5) => n,
            _ => {
                let candidates: Vec<ChannelName> = self.expected.iter().cloned().collect();
                let Some(i) = self.pick(candidates.len()) else {
                    return;
                };
                candidates[i].clone()
            }
        };
        let Some(h) = self.leader() else { return };
        self.checker.requested_removes.insert(name.clone());
        self.log(&format!("request remove {name}"));
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.remove_channel(name.clone())).await;
        let outcome = classify(r.map(|r| r.map(|_| ())));
        self.record(&name, outcome, false);
    }

    fn record(&mut self, name: &ChannelName, outcome: Outcome, add: bool) {
        let word = match outcome {
            Outcome::Done => "done",
            Outcome::Refused => "refused",
            Outcome::Unknown => "unknown",
        };
        self.log(&format!(
            "{} {name}: {word}",
            if add { "add" } else { "remove" }
        ));
        match (outcome, add) {
            (Outcome::Done, true) => {
                self.expected.insert(name.clone());
            }
            (Outcome::Done, false) => {
                self.expected.remove(name);
            }
            (Outcome::Refused, _) => {}
            (Outcome::Unknown, _) => {
                self.expected.remove(name);
                self.ambiguous.insert(name.clone());
            }
        }
    }

    /// One step: maybe one fault or request, chosen by the RNG.
    async fn step(&mut self) {
        self.reap_departed();
        let roll = self.rng.random_range(0..128u32);
        match roll {
            0..=37 => {}
            38..=39 => self.planned_restart(),
            40..=44 => {
                // Crash: the process dies without revoking its lease.
                if let Some(i) = self.pick(self.nodes.len()) {
                    let node = self.nodes.remove(i);
                    let id = node.id();
                    node.proc.kill();
                    if let Some(id) = id {
                        self.handler.mark_dead(id);
                    }
                    self.fault("node-crash", &format!("proc{} (node {id:?})", node.slot));
                    // Admin requests during the failover.
                    match self.rng.random_range(0..4) {
                        0 => self.drain().await,
                        1 => self.balance().await,
                        _ => {}
                    }
                }
            }
            45..=49 => {
                if self.nodes.len() < self.options.max_nodes {
                    *self.report.faults.entry("node-start").or_default() += 1;
                    self.spawn_node();
                }
            }
            50..=54 => {
                // Frozen (SIGSTOP), often past the TTL: on waking it must not ack anything.
                if let Some(i) = self.pick(self.nodes.len()) {
                    let ttl = u64::try_from(SESSION_TTL.as_millis()).unwrap_or(4_000);
                    let d = self.ms(1_000, 3 * ttl);
                    let node = &self.nodes[i];
                    if node.proc.paused() {
                        return;
                    }
                    let (slot, id) = (node.slot, node.id());
                    node.proc.pause(true);
                    node.faults.hold(true);
                    let (pause, faults) = (node.proc.pause_switch(), node.faults.clone());
                    if let Some(id) = id {
                        self.excuse(Scope::Node(id), d.as_millis() as u64 + ttl);
                    }
                    self.fault("node-pause", &format!("proc{slot} (node {id:?}) for {d:?}"));
                    self.schedule(
                        d,
                        format!("pause of proc{slot}"),
                        Box::new(move || {
                            faults.hold(false);
                            pause.send_replace(false);
                        }),
                    );
                }
            }
            55..=57 => {
                let Some(i) = self.leader_index() else { return };
                let c = self.coords.remove(i);
                c.proc.kill();
                self.fault("coord-crash", &c.name);
            }
            58..=61 => {
                if self.coords.len() < 2 {
                    *self.report.faults.entry("coord-start").or_default() += 1;
                    self.spawn_coord();
                }
            }
            62..=64 => {
                // A deposed leader: frozen past its TTL while a standby takes over, then
                // running again with its old view.
                let Some(i) = self.leader_index() else { return };
                let d = self.ms(4_000, 12_000);
                let c = &self.coords[i];
                c.proc.pause(true);
                c.faults.hold(true);
                let (pause, faults) = (c.proc.pause_switch(), c.faults.clone());
                let name = c.name.clone();
                self.fault("coord-pause", &format!("{name} for {d:?}"));
                self.schedule(
                    d,
                    format!("pause of {name}"),
                    Box::new(move || {
                        faults.hold(false);
                        pause.send_replace(false);
                    }),
                );
            }
            65..=69 => {
                let Some(i) = self.pick(self.nodes.len()) else {
                    return;
                };
                let d = self.ms(500, 8_000);
                let node = &self.nodes[i];
                let (slot, faults) = (node.slot, node.faults.clone());
                faults.fail_keepalives(true);
                self.fault("keepalive-loss", &format!("proc{slot} for {d:?}"));
                self.schedule(
                    d,
                    format!("keepalive loss of proc{slot}"),
                    Box::new(move || faults.fail_keepalives(false)),
                );
            }
            70..=72 => {
                let (who, faults) = self.any_actor();
                let Some(faults) = faults else { return };
                let delay = self.ms(100, 2_000);
                let d = self.ms(1_000, 8_000);
                faults.delay_keepalives(delay);
                self.fault("keepalive-delay", &format!("{who} by {delay:?} for {d:?}"));
                self.schedule(
                    d,
                    format!("keepalive delay of {who}"),
                    Box::new(move || faults.delay_keepalives(Duration::ZERO)),
                );
            }
            73..=75 => {
                self.store.break_watches();
                self.fault("watch-break", "every watch stream");
            }
            76..=78 => {
                let back = self.rng.random_range(0..20);
                let rev = self.store.revision() - back;
                let r = self.store.compact(rev).await;
                self.fault(
                    "compaction",
                    &format!("at r{rev}: {}", if r.is_ok() { "ok" } else { "refused" }),
                );
            }
            79..=82 => {
                let (who, faults) = self.any_actor();
                let Some(faults) = faults else { return };
                let d = self.ms(200, 3_000);
                faults.fail_txns(true);
                self.fault("txn-failures", &format!("{who} for {d:?}"));
                self.schedule(
                    d,
                    format!("txn failures of {who}"),
                    Box::new(move || faults.fail_txns(false)),
                );
            }
            83..=85 => {
                let candidates: Vec<ChannelName> = self.expected.iter().cloned().collect();
                let Some(i) = self.pick(candidates.len()) else {
                    return;
                };
                let name = candidates[i].clone();
                let d = self.ms(2_000, 15_000);
                self.handler.set(name.as_str(), Behaviour::Hang);
                self.fault("hung-load", &format!("{name} for {d:?}"));
                let restore = self.behaviours.iter().find(|(n, _)| n == &name).map_or(
                    Behaviour::Load {
                        delay: Duration::ZERO,
                    },
                    |(_, b)| *b,
                );
                let handler = self.handler.clone();
                self.schedule(
                    d,
                    format!("hung loads of {name}"),
                    Box::new(move || handler.set(name.as_str(), restore)),
                );
            }
            86..=90 => {
                *self.report.faults.entry("channel-add").or_default() += 1;
                let delay = self.ms(0, 800);
                let name = self.next_name();
                self.add_channel(name, Behaviour::Load { delay }).await;
            }
            91..=93 => {
                *self.report.faults.entry("channel-remove").or_default() += 1;
                self.remove_channel().await;
            }
            94..=96 => self.drain().await,
            97..=99 => self.balance().await,
            100..=104 => {
                // A stalled connection: calls hang (neither fail nor land) while the process
                // runs; its fencing must stop the channels before the lease can expire.
                let Some(i) = self.pick(self.nodes.len()) else {
                    return;
                };
                let d = self.ms(1_000, 12_000);
                let node = &self.nodes[i];
                if node.faults.held() {
                    return;
                }
                let (slot, faults) = (node.slot, node.faults.clone());
                faults.hold(true);
                self.fault("node-stall", &format!("proc{slot} for {d:?}"));
                self.schedule(
                    d,
                    format!("stall of proc{slot}"),
                    Box::new(move || faults.hold(false)),
                );
            }
            110..=115 => {
                // A watch that silently stops delivering while keepalives and txns work (a
                // proxy holding back one stream), then a drain of that node: its channels
                // sit in ToRelease unseen. A forced move must fence it first (found from
                // outside: a blind owner ran 7 channels beside their new owner for ~6 s).
                let Some(i) = self.pick(self.nodes.len()) else {
                    return;
                };
                let d = self.ms(6_000, 14_000);
                let node = &self.nodes[i];
                let (slot, id, faults) = (node.slot, node.id(), node.faults.clone());
                faults.stall_watches(true);
                self.fault(
                    "watch-stall",
                    &format!("proc{slot} (node {id:?}) for {d:?}"),
                );
                self.schedule(
                    d,
                    format!("watch stall of proc{slot}"),
                    Box::new(move || faults.stall_watches(false)),
                );
                if let Some(id) = id {
                    self.drain_node(Some(id)).await;
                }
            }
            108..=109 => {
                // The leader's watch stalls silently while its keepalives and txns work: it
                // must find out from its keepalives' revisions (the resync is far off) and
                // relist, not time out channels whose acks it cannot see.
                let Some(i) = self.leader_index() else { return };
                let d = self.ms(3_000, 12_000);
                let (name, faults) = (self.coords[i].name.clone(), self.coords[i].faults.clone());
                faults.stall_watches(true);
                self.fault("leader-watch-stall", &format!("{name} for {d:?}"));
                self.schedule(
                    d,
                    format!("watch stall of {name}"),
                    Box::new(move || faults.stall_watches(false)),
                );
            }
            116..=119 => {
                // A sick node: every load fails there for a while. Its channels move off
                // and must not be fed back to it by balance (found from outside: 601
                // transitions in 7 s, epochs in the hundreds). Or (118, 119) every load
                // there reports its channel broken while it loads, then succeeds: each such
                // run must stop before it is acknowledged `WatchFailed` (found from outside:
                // a worker's `/fail` before `/ready` was dropped as stale).
                let Some(i) = self.pick(self.nodes.len()) else {
                    return;
                };
                let d = self.ms(5_000, 20_000);
                let node = &self.nodes[i];
                let (kind, what, flag) = if roll >= 118 {
                    ("breaking-node", "breaking", node.breaking.clone())
                } else {
                    ("sick-node", "sickness", node.sick.clone())
                };
                let slot = node.slot;
                flag.store(true, Ordering::SeqCst);
                self.fault(kind, &format!("proc{slot} for {d:?}"));
                self.schedule(
                    d,
                    format!("{what} of proc{slot}"),
                    Box::new(move || flag.store(false, Ordering::SeqCst)),
                );
            }
            120..=121 => {
                // The whole store goes away (etcd crash, restart, lost quorum): every call of
                // every client fails, no lease expires, and on return every lease gets a
                // whole TTL again. Channels pause; none may move and no node may register
                // again (invariant 9). Other faults end first, so that what happens is
                // the outage's doing.
                let d = self.ms(1_000, 15_000);
                self.run_due_undos(true);
                self.checker.poll(&mut |_, _| {});
                self.checker.outage_began(SESSION_TTL / 2);
                self.store.set_outage(true);
                self.fault("store-outage", &format!("for {d:?}"));
                self.advance(d).await;
                self.store.set_outage(false);
                self.checker.outage_ended(Instant::now());
                self.log("end store outage");
            }
            122..=123 => {
                // NOSPACE: writes with a put and lease grants are refused, deletes pass.
                let d = self.ms(1_000, 10_000);
                self.store.set_nospace(true);
                self.fault("nospace", &format!("for {d:?}"));
                let store = self.store.clone();
                self.schedule(
                    d,
                    "NOSPACE alarm".into(),
                    Box::new(move || store.set_nospace(false)),
                );
            }
            124..=125 => {
                // An expired auth token: every call of one client but keepalives fails.
                let (who, faults) = self.any_actor();
                let Some(faults) = faults else { return };
                let d = self.ms(500, 6_000);
                faults.expire_auth(true);
                self.fault("auth-expired", &format!("{who} for {d:?}"));
                self.schedule(
                    d,
                    format!("expired token of {who}"),
                    Box::new(move || faults.expire_auth(false)),
                );
            }
            126..=127 => {
                // A slow store for one process: every call takes up to 1.5 s (an etcd
                // member under a compaction or a slow disk).
                let (who, faults) = self.any_actor();
                let Some(faults) = faults else { return };
                let d = self.ms(2_000, 10_000);
                let seed = self.seed ^ 0x5eed;
                faults.latency(Duration::from_millis(1_500), seed);
                self.fault("slow-store", &format!("{who} for {d:?}"));
                self.schedule(
                    d,
                    format!("slow store of {who}"),
                    Box::new(move || faults.latency(LATENCY, seed)),
                );
            }
            _ => {
                // Cut off from the store: every call fails and its watches end.
                let Some(i) = self.pick(self.nodes.len()) else {
                    return;
                };
                let d = self.ms(1_000, 12_000);
                let node = &self.nodes[i];
                let (slot, faults) = (node.slot, node.faults.clone());
                faults.partition(true);
                self.fault("node-partition", &format!("proc{slot} for {d:?}"));
                self.schedule(
                    d,
                    format!("partition of proc{slot}"),
                    Box::new(move || faults.partition(false)),
                );
            }
        }
    }

    /// A planned restart (DESIGN §5): a node is asked to leave (SIGTERM) and a replacement
    /// starts under a fresh ID; the leaving node ends by itself once the coordinator has
    /// moved its channels off (`departures.rs` judges it).
    fn planned_restart(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let node = &self.nodes[i];
        let (slot, Some(id)) = (node.slot, node.id()) else {
            return;
        };
        if node.proc.paused() || self.leaving.contains(&slot) {
            return;
        }
        node.proc.leave();
        self.leaving.insert(slot);
        self.checker.planned_restart(id);
        if !self.undo.is_empty() {
            // A timed fault is still on: not judged.
            self.checker.departures.disturb();
        }
        self.fault(
            "node-restart",
            &format!("proc{slot} (node {id}) leaves; a new node starts"),
        );
        self.spawn_node();
    }

    /// Forgets the nodes that left by themselves after a planned restart.
    fn reap_departed(&mut self) {
        let (gone, kept): (Vec<NodeProc>, Vec<NodeProc>) = std::mem::take(&mut self.nodes)
            .into_iter()
            .partition(|n| self.leaving.contains(&n.slot) && n.proc.is_finished());
        self.nodes = kept;
        for n in gone {
            self.leaving.remove(&n.slot);
            self.log(&format!("proc{} left", n.slot));
        }
    }

    fn leader_index(&self) -> Option<usize> {
        self.coords
            .iter()
            .position(|c| c.proc.handle.status().leader)
    }

    fn any_actor(&mut self) -> (String, Option<Faults>) {
        let n = self.nodes.len() + self.coords.len();
        let Some(i) = self.pick(n) else {
            return (String::new(), None);
        };
        if i < self.nodes.len() {
            let node = &self.nodes[i];
            (format!("proc{}", node.slot), Some(node.faults.clone()))
        } else {
            let c = &self.coords[i - self.nodes.len()];
            (c.name.clone(), Some(c.faults.clone()))
        }
    }

    async fn drain(&mut self) {
        self.drain_node(None).await;
    }

    /// Drains `which` (if it is not draining yet) or a random node, leaving at least two
    /// nodes that take channels (until nodes die later).
    async fn drain_node(&mut self, which: Option<NodeId>) {
        let draining = self.checker.draining();
        let ids: Vec<NodeId> = self
            .nodes
            .iter()
            .filter_map(NodeProc::id)
            .filter(|id| !draining.contains(id))
            .collect();
        if ids.len() < 3 {
            return;
        }
        let Some(i) = (match which {
            Some(id) => ids.iter().position(|n| *n == id),
            None => self.pick(ids.len()),
        }) else {
            return;
        };
        let Some(h) = self.leader() else { return };
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.drain(ids[i])).await;
        let word = match r {
            Ok(Ok(())) => "ok",
            Ok(Err(_)) => "refused",
            Err(_) => "timed out",
        };
        self.fault("drain", &format!("node {}: {word}", ids[i]));
    }

    async fn balance(&mut self) {
        let Some(h) = self.leader() else { return };
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.balance(false)).await;
        let word = match r {
            Ok(Ok(moves)) => format!("{} moves", moves.len()),
            Ok(Err(_)) => "refused".into(),
            Err(_) => "timed out".into(),
        };
        self.fault("balance", &word);
    }

    /// Ends every fault: timed ones are undone, a coordinator is running.
    fn stop_faults(&mut self) {
        self.log("faults stop");
        if let Some(d) = &self.data {
            d.stop.store(true, Ordering::SeqCst);
        }
        self.run_due_undos(true);
        while self.coords.len() < 2 {
            self.spawn_coord();
        }
        // The data plane must be consumed to catch up: with no node left that takes
        // channels (none, or all draining), start one.
        if self.data.is_some() {
            let draining = self.checker.draining();
            let takers = self
                .nodes
                .iter()
                .filter(|n| n.id().map_or(true, |id| !draining.contains(&id)))
                .count();
            if takers == 0 {
                self.spawn_node();
            }
        }
        for (name, b) in &self.behaviours {
            self.handler.set(name.as_str(), *b);
        }
    }

    async fn settle(&mut self) {
        let stopped = Instant::now();
        let deadline = stopped + SESSION_TTL + SETTLE;
        let mut last = None;
        while Instant::now() < deadline {
            self.advance(Duration::from_millis(250)).await;
            self.reap_departed();
            let expected = self.expected.clone();
            last = self.checker.settled(&expected, &self.ambiguous);
            if let (None, Some(d)) = (&last, &self.data) {
                last = self.checker.data_behind(&d.log);
            }
            if last.is_none() {
                if let Some(d) = &self.data {
                    self.checker.check_data(&d.log);
                }
                let ms = u64::try_from(stopped.elapsed().as_millis()).unwrap_or(u64::MAX);
                self.report.settle_ms = Some(ms);
                self.log(&format!("settled after {ms} ms"));
                return;
            }
        }
        let why = last.unwrap_or_default();
        self.log(&format!("not settled: {why}"));
        self.report.violations.push(format!(
            "not settled {:?} after the faults stopped: {why}",
            SESSION_TTL + SETTLE
        ));
    }

    fn finish(mut self) -> Report {
        let judged = self.checker.departures.judged;
        if judged > 0 {
            self.log(&format!("planned restarts judged (undisturbed): {judged}"));
        }
        let overlap = overlaps(&self.handler.intervals(), &self.excuses);
        for o in &overlap {
            self.log(&format!("violation: {o}"));
        }
        // Invariant 10: no process gives up because the store misbehaved.
        let exited: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.proc.is_finished())
            .map(|n| format!("liveness: proc{} exited on its own", n.slot))
            .chain(
                self.coords
                    .iter()
                    .filter(|c| c.proc.is_finished())
                    .map(|c| format!("liveness: {} exited on its own", c.name)),
            )
            .collect();
        let mut report = self.report;
        let mut violations = std::mem::take(&mut self.checker.violations);
        violations.extend(exited);
        violations.extend(overlap);
        violations.append(&mut report.violations);
        report.violations = violations;
        report.sim_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        report.revisions = self.checker.revision;
        report.trace_hash = std::hash::Hasher::finish(&self.trace.hash);
        report.trace_lines = self.trace.count;
        report.trace = self.trace.lines.into_iter().collect();
        for n in self.nodes {
            n.proc.kill();
        }
        for c in self.coords {
            c.proc.kill();
        }
        report
    }
}

fn classify<E>(r: Result<Result<(), E>, tokio::time::error::Elapsed>) -> Outcome
where
    E: Into<chanwatch_coord::ApiError>,
{
    match r {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => match e.into() {
            chanwatch_coord::ApiError::Admin(_) | chanwatch_coord::ApiError::NotLeader { .. } => {
                Outcome::Refused
            }
            chanwatch_coord::ApiError::Store(_) => Outcome::Unknown,
        },
        Err(_) => Outcome::Unknown,
    }
}

/// The recording handler (with the data plane: it, then the consumer), except that every
/// load fails while `sick` is set, and reports its channel broken while `breaking` is.
struct Sickly {
    inner: Arc<dyn ChannelHandler>,
    sick: Arc<AtomicBool>,
    breaking: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl ChannelHandler for Sickly {
    async fn load(&self, ctx: chanwatch_node::ChannelContext) -> Result<(), String> {
        if self.sick.load(Ordering::SeqCst) {
            return Err("the node is sick (simulated)".into());
        }
        if self.breaking.load(Ordering::SeqCst) {
            ctx.fail("the channel broke while it loaded (simulated)");
        }
        self.inner.load(ctx).await
    }

    async fn release(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.release(node, info).await;
    }

    async fn pause(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.pause(node, info).await;
    }

    async fn resume(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.resume(node, info).await;
    }
}

/// Data plane: the recording handler (load behaviour, intervals), then the stream consumer.
struct Consuming {
    recording: RecordingHandler,
    consumer: Arc<StreamConsumer>,
}

#[async_trait::async_trait]
impl ChannelHandler for Consuming {
    async fn load(&self, ctx: chanwatch_node::ChannelContext) -> Result<(), String> {
        self.recording.load(ctx.clone()).await?;
        self.consumer.load(ctx).await
    }

    /// The recording's interval ends first: the consumer's release may spend up to 3 s on a
    /// last commit (fenced, so harmless to the data, which the checkpoint invariants check),
    /// and the overlap check is about when the node let the channel go.
    async fn release(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.recording.release(node, info).await;
        self.consumer.release(node, info).await;
    }

    async fn pause(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.consumer.pause(node, info).await;
        self.recording.pause(node, info).await;
    }

    async fn resume(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.consumer.resume(node, info).await;
        self.recording.resume(node, info).await;
    }
}
