//! The simulated cluster and the fault driver.
//!
//! Owns: the processes of one run (coordinators and nodes as pausable tasks started by the
//! in-process harness, [`chanwatch_cluster`], each with its own [`FaultyStore`] over
//! the shared embedded store), each step's draw of a [`Fault`] and its dispatch to the
//! kind's function (`process.rs`: the processes and their handlers; `store.rs`: their
//! store; `requests.rs`: admin requests), the undo list of timed faults, and the settle
//! phase (`settle.rs`). What the nodes run is `handlers.rs`.
//! Must not: check invariants itself (the [`Checker`] does) or use anything but the seeded
//! RNG and tokio's paused clock.

mod handlers;
mod process;
mod requests;
mod settle;
mod store;

use std::collections::BTreeSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_cluster::{self as inproc, Timings};
use chanwatch_coord::CoordHandle;
use chanwatch_core::planner::Placement;
use chanwatch_core::{ChannelName, Keys, NodeId};
use chanwatch_node::{Behaviour, ChannelHandler, RecordingHandler};
use chanwatch_store::{Clock, EmbeddedStore, Faults, FaultyStore};
use rand::{RngExt, SeedableRng};
use rand_xorshift::XorShiftRng;
use tokio::time::Instant;

use crate::check::{Checker, Excuse, Scope, Writer, Writers};
use crate::fault::{self, Fault};
use crate::{Report, SimOptions, Trace};
use handlers::{Consuming, DataPlane, Sickly};

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
    /// When the last timed fault ended or a node last crashed: their effects (a lease that
    /// expires a moment after a keepalive loss ends, a dead node's session) outlast them by up
    /// to a session TTL.
    last_undo_at: Option<Instant>,
    excuses: Vec<Excuse>,
    checker: Checker,
    trace: Trace,
    report: Report,
    /// The data plane, when [`SimOptions::data_plane`] is set.
    data: Option<DataPlane>,
    /// Slots of the nodes leaving after a planned restart.
    leaving: BTreeSet<usize>,
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
        last_undo_at: None,
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
            departures_judged: 0,
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

    /// Counts one `kind` in the report and logs it.
    fn fault(&mut self, kind: Fault, text: &str) {
        if kind != Fault::NodeRestart {
            // A departure under way is no longer judged: this may move its channels again.
            self.checker.departures.disturb();
        }
        self.count(kind);
        self.log(&format!("fault {kind}: {text}"));
    }

    /// Counts one `kind` in the report, without a trace line (starts, adds and removes, which
    /// log their own).
    fn count(&mut self, kind: Fault) {
        *self.report.faults.entry(kind).or_default() += 1;
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
        if !due.is_empty() {
            self.last_undo_at = Some(now);
        }
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

    /// One step: maybe one fault or request, drawn from the weight table
    /// ([`Fault::weight`]) with the seeded RNG.
    async fn step(&mut self) {
        self.reap_departed();
        let Some(kind) = fault::draw(&mut self.rng) else {
            return;
        };
        match kind {
            Fault::NodeRestart => self.node_restart(),
            Fault::NodeCrash => self.node_crash().await,
            Fault::NodeStart => self.node_start(),
            Fault::NodePause => self.node_pause(),
            Fault::CoordCrash => self.coord_crash(),
            Fault::CoordStart => self.coord_start(),
            Fault::CoordPause => self.coord_pause(),
            Fault::KeepaliveLoss => self.keepalive_loss(),
            Fault::KeepaliveDelay => self.keepalive_delay(),
            Fault::WatchBreak => self.watch_break(),
            Fault::Compaction => self.compaction().await,
            Fault::TxnFailures => self.txn_failures(),
            Fault::HungLoad => self.hung_load(),
            Fault::ChannelAdd => self.channel_add().await,
            Fault::ChannelRemove => self.channel_remove().await,
            Fault::Drain => self.drain().await,
            Fault::Balance => self.balance().await,
            Fault::NodeStall => self.node_stall(),
            Fault::NodePartition => self.node_partition(),
            Fault::LeaderWatchStall => self.leader_watch_stall(),
            Fault::WatchStall => self.watch_stall().await,
            Fault::SickNode => self.sick_node(),
            Fault::BreakingNode => self.breaking_node(),
            Fault::StoreOutage => self.store_outage().await,
            Fault::Nospace => self.nospace(),
            Fault::AuthExpired => self.auth_expired(),
            Fault::SlowStore => self.slow_store(),
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
}
