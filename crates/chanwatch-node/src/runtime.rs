//! The node's event loop: session, keepalive, list-watch of its prefix, runners, acks,
//! self-fencing.
//!
//! Owns: one session at a time (node ID, lease, session key) and the runner tasks of its
//! channels. Every runner and the keepalive task are owned by the session and aborted when it
//! ends, so a dropped `run` future (a killed node) leaves nothing running.
//!
//! Must not: write any key but the ID counter, its session and its own channels' acks.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chanwatch_core::node::{NodeCommand, NodeEvent, NodeMachine};
use chanwatch_core::{ChannelInfo, ChannelName, Keys, NodeId, NodeSession};
use chanwatch_store::{
    Clock, Compare, EventKind, ListWatch, MetaStore, StoreError, Txn, TxnOp, Update,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::handler::{ChannelContext, ChannelHandler, RunnerEvent};
use crate::watchdog::{watchdog, Renewal};

/// Settings of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Key layout.
    pub keys: Keys,
    /// Lease TTL of the session (minimum 2 s).
    pub session_ttl: Duration,
    /// How early, before the lease could expire, a node that cannot renew it stops its
    /// channels: `max(1 s, ttl / 5)` unless set.
    pub fence_margin: Option<Duration>,
    /// Least time between two progress writes of one load.
    pub progress_interval: Duration,
    /// Written into the session for operators.
    pub admin_addr: String,
    /// Relative capacity written into the session.
    pub capacity: u32,
    /// Where the node's metrics go (shared by the nodes of one process).
    pub metrics: Arc<crate::metrics::NodeMetrics>,
    /// Test-only: a safety mechanism switched off, so the simulation can prove that its
    /// invariant checker notices. Never set outside tests; no flag reaches it.
    #[doc(hidden)]
    pub planted_bug: Option<PlantedBug>,
}

/// Safety mechanisms a test can switch off (see [`NodeConfig::planted_bug`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlantedBug {
    /// Keep running channels while keepalives fail, until the store says the lease is gone
    /// (no self-fencing at `ttl - margin`).
    NoFencing,
    /// Acknowledge without comparing the key's mod revision or the session.
    UnguardedAck,
    /// Ignore watch progress: a watch that stalls silently while keepalives succeed goes
    /// unnoticed (the node still pauses when keepalives or the list-watch fail).
    NoWatchProgress,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            keys: Keys::default(),
            session_ttl: Duration::from_secs(10),
            fence_margin: None,
            progress_interval: Duration::from_secs(5),
            admin_addr: String::new(),
            capacity: 0,
            metrics: Arc::new(crate::metrics::NodeMetrics::new()),
            planted_bug: None,
        }
    }
}

impl NodeConfig {
    fn margin(&self) -> Duration {
        self.fence_margin
            .unwrap_or_else(|| (self.session_ttl / 5).max(Duration::from_secs(1)))
    }
}

/// Why a node stopped for good.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// The configuration cannot work (fatal).
    #[error("bad node configuration: {0}")]
    Config(String),
    /// At start-up, the store refused the node's credentials or role (a configuration
    /// error; see [`StoreError::is_config`]). Every other store error is retried.
    #[error("store refused the node: {0}")]
    Store(#[source] StoreError),
}

/// What a node shows to the outside (tests, admin API).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeStatus {
    /// The current session's node ID (`None` between sessions).
    pub id: Option<NodeId>,
    /// Sessions started so far (a re-registration after fencing makes a new one).
    pub sessions: u64,
    /// Times the node fenced itself.
    pub fences: u64,
    /// Why every channel is paused, while it is (the store is out of reach).
    pub paused: Option<String>,
    /// Times the node paused its channels.
    pub pauses: u64,
}

/// Runs a node until `shutdown` completes: register, serve, fence and re-register as needed.
/// On shutdown it stops every channel and revokes its lease, so its channels move at once.
///
/// # Errors
/// [`NodeError`] for a bad configuration only: a TTL below the minimum, or credentials or a
/// role etcd refuses before the first session. Every other store error (an outage, NOSPACE,
/// an expired auth token, a garbled ID counter) is logged once and retried with jittered
/// back-off, so a node started during a NOSPACE alarm registers once it is disarmed.
pub async fn run(
    store: Arc<dyn MetaStore>,
    handler: Arc<dyn ChannelHandler>,
    config: NodeConfig,
    clock: Clock,
    status: watch::Sender<NodeStatus>,
    shutdown: impl Future<Output = ()>,
) -> Result<(), NodeError> {
    if config.session_ttl < Duration::from_secs(2) {
        return Err(NodeError::Config(format!(
            "--session-ttl {:?} is below the minimum of 2s",
            config.session_ttl
        )));
    }
    tokio::pin!(shutdown);
    // Alarms (NOSPACE above all) for `chanwatch_etcd_alarm` and one log line each way.
    let _alarms = {
        let metrics = config.metrics.clone();
        AbortOnDrop(tokio::spawn(chanwatch_store::follow_alarms(
            store.clone(),
            ALARM_POLL,
            move |raised| metrics.set_alarms(raised),
        )))
    };
    let mut attempt = 0u32;
    let mut registered_once = false;
    let mut last_error: Option<String> = None;
    loop {
        let session = tokio::select! {
            biased;
            () = &mut shutdown => return Ok(()),
            s = register(&*store, &config, &clock) => s,
        };
        let session = match session {
            Ok(s) => {
                attempt = 0;
                last_error = None;
                registered_once = true;
                s
            }
            // Only a configuration error at start-up ends the node (wrong credentials, a
            // role without the node's keys): once it has run, an operator may be fixing
            // etcd's side, and the node waits for it like for any other store error.
            Err(e) if e.is_config() && !registered_once => return Err(NodeError::Store(e)),
            Err(e) => {
                attempt += 1;
                let wait = register_backoff(attempt, clock.unix_ms());
                // Say it once per kind of trouble, then quietly keep trying.
                let text = e.to_string();
                if last_error.as_deref() != Some(text.as_str()) {
                    if e.is_config() {
                        error!(error = %e, "node: etcd refuses the node's credentials or role; retrying until an operator fixes it");
                    } else {
                        warn!(error = %e, ?wait, "node: cannot register yet; retrying with back-off");
                    }
                    last_error = Some(text);
                } else {
                    debug!(error = %e, ?wait, attempt, "node: cannot register yet; retrying");
                }
                tokio::select! {
                    biased;
                    () = &mut shutdown => return Ok(()),
                    () = clock.sleep(wait) => continue,
                }
            }
        };
        config.metrics.sessions.inc();
        status.send_modify(|s| {
            s.id = Some(session.id);
            s.sessions += 1;
        });
        info!(node = %session.id, lease = session.lease, ttl = ?config.session_ttl, "node: session registered");
        let end = Session::new(store.clone(), handler.clone(), &config, clock, session)
            .serve(&mut shutdown, &status)
            .await;
        status.send_modify(|s| {
            s.id = None;
            s.paused = None;
        });
        match end {
            SessionEnd::Shutdown => return Ok(()),
            SessionEnd::Fenced(why) => {
                config.metrics.fences.inc();
                status.send_modify(|s| s.fences += 1);
                warn!(reason = %why, "node: fenced itself: every channel stopped; registering again under a new id");
            }
        }
    }
}

/// How often a node reads the store's alarms.
const ALARM_POLL: Duration = Duration::from_secs(5);

/// The wait before registration attempt `attempt` (from 1): 100 ms doubling to 5 s, less a
/// jitter of up to half, picked from `seed` (the clock) so that nodes that failed together
/// (an etcd restart, a NOSPACE alarm disarmed) do not retry together, and a simulation with a
/// paused clock still replays the same waits.
fn register_backoff(attempt: u32, seed: u64) -> Duration {
    use std::hash::{Hash, Hasher};
    let full = Duration::from_millis(100)
        .saturating_mul(1u32 << attempt.saturating_sub(1).min(6))
        .min(Duration::from_secs(5));
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (seed, attempt).hash(&mut h);
    full.saturating_sub(full.mul_f64((h.finish() % 500) as f64 / 1000.0))
}

/// A registered session.
#[derive(Debug, Clone, Copy)]
struct Registered {
    id: NodeId,
    lease: i64,
    /// Create revision of the session key: acks compare it, so a node whose session is gone
    /// can never ack.
    session_revision: i64,
    /// When the lease was asked for: it cannot expire before `granted_at + ttl`.
    granted_at: tokio::time::Instant,
}

/// Allocates a fresh ID by compare-and-swap on the counter, then puts the session.
async fn register(
    store: &dyn MetaStore,
    config: &NodeConfig,
    clock: &Clock,
) -> Result<Registered, StoreError> {
    let counter = config.keys.node_id_counter();
    let id = loop {
        let current = store.get(&counter).await?;
        let (last, compare) = match &current {
            Some(kv) => {
                let text = String::from_utf8_lossy(&kv.value);
                let last: NodeId = text.trim().parse().map_err(|_| {
                    StoreError::InvalidArgument(format!(
                        "{counter} holds {text:?}, not a node id; fix or delete the key"
                    ))
                })?;
                (last.0, Compare::mod_revision(&counter, kv.mod_revision))
            }
            None => (0, Compare::absent(&counter)),
        };
        let next = last + 1;
        let resp = store
            .txn(
                Txn::new()
                    .when([compare])
                    .and_then([TxnOp::put(&counter, next.to_string())]),
            )
            .await?;
        if resp.succeeded {
            break NodeId(next);
        }
    };
    // The lease runs from when etcd granted it, which is no earlier than this: the watchdog
    // counts from here, not from when the session began serving (a slow registration
    // otherwise gave the node more time than its lease had; found by the simulation).
    let granted_at = clock.now();
    let lease = store.grant(config.session_ttl).await?;
    let session = NodeSession {
        id,
        admin_addr: config.admin_addr.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at_ms: clock.unix_ms(),
        capacity: config.capacity,
        extra: Default::default(),
    };
    let key = config.keys.session(id);
    let resp = store
        .txn(
            Txn::new()
                .when([Compare::absent(&key)])
                .and_then([TxnOp::put_with_lease(&key, session.encode(), lease.id)]),
        )
        .await?;
    if !resp.succeeded {
        return Err(StoreError::InvalidArgument(format!(
            "{key} already exists although the id was just allocated; someone else writes node ids"
        )));
    }
    Ok(Registered {
        id,
        lease: lease.id,
        session_revision: resp.revision,
        granted_at,
    })
}

enum SessionEnd {
    Shutdown,
    Fenced(String),
}

struct Runner {
    generation: u64,
    cancel: CancellationToken,
    /// The session's pause state, passed on by the event loop in channel order: one waiter
    /// per channel (tokio's watch wakes several waiters in a random order, which would make
    /// the simulation's runs differ).
    pause: watch::Sender<Option<String>>,
    task: JoinHandle<()>,
}

/// Aborts the keepalive task when the session ends for any reason.
struct AbortOnDrop(JoinHandle<()>);
impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

struct Session {
    store: Arc<dyn MetaStore>,
    handler: Arc<dyn ChannelHandler>,
    keys: Keys,
    ttl: Duration,
    margin: Duration,
    progress_interval: Duration,
    clock: Clock,
    reg: Registered,
    machine: NodeMachine,
    runners: BTreeMap<ChannelName, Runner>,
    next_generation: u64,
    events_tx: mpsc::UnboundedSender<RunnerEvent>,
    events_rx: mpsc::UnboundedReceiver<RunnerEvent>,
    metrics: Arc<crate::metrics::NodeMetrics>,
    planted_bug: Option<PlantedBug>,
    /// Cancelled when the session must stop everything (the store says the lease is gone);
    /// every runner's token is a child of it.
    fence: CancellationToken,
    /// Why every channel is paused (`None`: running). Set by the watchdog when no keepalive
    /// succeeded, or the node could not see its assignments, for `ttl - margin`; cleared
    /// when the same lease is renewed again and the view is back (DESIGN §3, invariant 9:
    /// an etcd outage pauses channels, it does not stop them).
    pause: watch::Sender<Option<String>>,
    /// An ack failed for a store error (not a refusal): relist soon, which re-acks what is
    /// loaded, instead of leaving the channel to the coordinator's watch timeout.
    retry_acks: std::sync::atomic::AtomicBool,
    /// When each loading channel's assignment was seen, for the ack latency.
    seen_at: BTreeMap<ChannelName, tokio::time::Instant>,
    /// Acks waiting for the write in flight to return.
    ack_queue: Vec<(ChannelInfo, i64)>,
    ack_in_flight: bool,
    /// The write in flight; aborted with the session (its txn may still land: it is
    /// guarded by the session and the key's revision, so that is harmless).
    ack_task: Option<AbortOnDrop>,
    acks_done_tx: mpsc::UnboundedSender<Vec<(ChannelInfo, AckOutcome)>>,
    acks_done_rx: mpsc::UnboundedReceiver<Vec<(ChannelInfo, AckOutcome)>>,
}

/// One acknowledgement to write.
struct AckWrite {
    info: ChannelInfo,
    /// The key's mod revision must be unchanged (`None` only under a planted bug).
    compare: Option<Compare>,
    put: TxnOp,
}

/// How one acknowledgement write ended.
#[derive(Debug)]
enum AckOutcome {
    Committed(i64),
    /// A compare failed: the assignment changed (or the session ended) meanwhile.
    Refused,
    Failed(String),
}

/// Writes acks in one shared txn (one compare per key, plus the session guard), and falls
/// back to one txn per ack when the shared one fails, so that one changed assignment cannot
/// hold back the others (DESIGN.md §4).
async fn write_acks(
    store: &dyn MetaStore,
    session: Option<&Compare>,
    chunk: Vec<AckWrite>,
) -> Vec<(ChannelInfo, AckOutcome)> {
    if chunk.len() > 1 {
        let compares = session
            .cloned()
            .into_iter()
            .chain(chunk.iter().filter_map(|w| w.compare.clone()));
        let puts = chunk.iter().map(|w| w.put.clone());
        match store.txn(Txn::new().when(compares).and_then(puts)).await {
            Ok(r) if r.succeeded => {
                return chunk
                    .into_iter()
                    .map(|w| (w.info, AckOutcome::Committed(r.revision)))
                    .collect();
            }
            Ok(_) => debug!(
                acks = chunk.len(),
                "node: a batched ack's compare failed; acking one by one"
            ),
            Err(e) => warn!(error = %e, "node: batched ack failed; acking one by one"),
        }
    }
    let mut out = Vec::with_capacity(chunk.len());
    for w in chunk {
        let compares = session.cloned().into_iter().chain(w.compare);
        let outcome = match store.txn(Txn::new().when(compares).and_then([w.put])).await {
            Ok(r) if r.succeeded => AckOutcome::Committed(r.revision),
            Ok(_) => AckOutcome::Refused,
            Err(e) => AckOutcome::Failed(e.to_string()),
        };
        out.push((w.info, outcome));
    }
    out
}

impl Session {
    fn new(
        store: Arc<dyn MetaStore>,
        handler: Arc<dyn ChannelHandler>,
        config: &NodeConfig,
        clock: Clock,
        reg: Registered,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (acks_done_tx, acks_done_rx) = mpsc::unbounded_channel();
        Session {
            store,
            handler,
            keys: config.keys.clone(),
            ttl: config.session_ttl,
            margin: config.margin(),
            progress_interval: config.progress_interval,
            clock,
            reg,
            machine: NodeMachine::new(),
            runners: BTreeMap::new(),
            next_generation: 0,
            events_tx,
            events_rx,
            metrics: config.metrics.clone(),
            planted_bug: config.planted_bug,
            fence: CancellationToken::new(),
            pause: watch::channel(None).0,
            retry_acks: std::sync::atomic::AtomicBool::new(false),
            seen_at: BTreeMap::new(),
            ack_queue: Vec::new(),
            ack_in_flight: false,
            ack_task: None,
            acks_done_tx,
            acks_done_rx,
        }
    }

    async fn serve(
        mut self,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
        status: &watch::Sender<NodeStatus>,
    ) -> SessionEnd {
        let (renewed_tx, mut renewed) = mpsc::unbounded_channel();
        let (last_ok_tx, last_ok) = watch::channel(Renewal {
            sent: self.reg.granted_at,
            revision: 0,
        });
        let lost = CancellationToken::new();
        let _keepalive = AbortOnDrop(tokio::spawn(keepalive(
            self.store.clone(),
            self.reg.lease,
            self.ttl,
            self.clock,
            last_ok_tx,
            lost.clone(),
            self.fence.clone(),
            renewed_tx.clone(),
        )));
        let prefix = self
            .keys
            .owner_prefix(chanwatch_core::ChannelOwner::Node(self.reg.id));
        let mut lw = ListWatch::spawn(self.store.clone(), prefix);
        // Pausing runs beside the event loop, not in it: a store call that hangs in the loop
        // (an ack on a stalled connection) must not keep channels running past the lease
        // (found by the simulation). Runners follow `pause` themselves. A node also pauses
        // when it cannot see its assignments for as long: a node that kept renewing its lease
        // between short partitions, yet never saw a release request, must not run the
        // channel once the coordinator fences it (found by the simulation too).
        let _watchdog = (self.planted_bug != Some(PlantedBug::NoFencing)).then(|| {
            AbortOnDrop(tokio::spawn(watchdog(
                last_ok,
                lw.blind_since(),
                if self.planted_bug == Some(PlantedBug::NoWatchProgress) {
                    // A watch that always looks caught up.
                    watch::channel(chanwatch_store::Revision::MAX).1
                } else {
                    lw.reached()
                },
                self.ttl.saturating_sub(self.margin),
                self.pause.clone(),
                renewed_tx,
            )))
        });
        let mut paused = self.pause.subscribe();
        let mut metrics_tick = tokio::time::interval(Duration::from_millis(500));
        let mut restarts_seen = 0;
        metrics_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = shutdown.as_mut() => {
                    info!(node = %self.reg.id, "node: shutting down; stopping channels and revoking the lease");
                    self.stop_all().await;
                    if let Err(e) = self.store.revoke(self.reg.lease).await {
                        warn!(error = %e, "node: lease revoke failed; it will expire by itself");
                    }
                    return SessionEnd::Shutdown;
                }
                () = self.fence.cancelled() => {
                    self.stop_all().await;
                    return SessionEnd::Fenced(if lost.is_cancelled() {
                        "the store says our lease is gone".into()
                    } else {
                        "the session ended".into()
                    });
                }
                Ok(()) = paused.changed() => {
                    let why = paused.borrow_and_update().clone();
                    status.send_modify(|s| {
                        s.pauses += u64::from(why.is_some());
                        s.paused.clone_from(&why);
                    });
                    for r in self.runners.values() {
                        r.pause.send_replace(why.clone());
                    }
                    match why {
                        Some(why) => {
                            self.metrics.pauses.inc();
                            self.metrics.paused.set(1);
                            warn!(node = %self.reg.id, reason = %why, channels = self.runners.len(), "node: paused every channel (no effects, no commits) until the store answers again with our session alive");
                        }
                        None => {
                            self.metrics.paused.set(0);
                            info!(node = %self.reg.id, channels = self.runners.len(), "node: session survived; resuming channels and relisting");
                            lw.relist();
                            self.send_acks();
                        }
                    }
                }
                Some(()) = renewed.recv() => {
                    // Renewed while paused: the store is back. Look again at once rather than
                    // after the list-watch's back-off, so channels resume within a second.
                    lw.relist();
                }
                _ = metrics_tick.tick() => {
                    if self.retry_acks.swap(false, std::sync::atomic::Ordering::Relaxed) {
                        debug!(node = %self.reg.id, "node: relisting to retry failed acks");
                        lw.relist();
                    }
                    let restarts = lw.restarts();
                    self.metrics.watch_restarts.inc_by(restarts - restarts_seen);
                    restarts_seen = restarts;
                }
                Some(first) = self.events_rx.recv() => {
                    // Drain what else is ready so that their acks share txns.
                    let mut batch = vec![first];
                    while batch.len() < 1024 {
                        match self.events_rx.try_recv() {
                            Ok(ev) => batch.push(ev),
                            Err(_) => break,
                        }
                    }
                    let mut cmds = Vec::new();
                    for ev in batch {
                        cmds.extend(self.on_runner_event(ev));
                    }
                    self.execute_or_fence(cmds).await;
                }
                Some(outcomes) = self.acks_done_rx.recv() => self.acks_done(outcomes).await,
                update = lw.next() => match update {
                    Some(Update::Reset { kvs, revision }) => {
                        self.metrics.relists.inc();
                        debug!(node = %self.reg.id, keys = kvs.len(), revision, "node: listed own channels");
                        let list = kvs.iter().filter_map(|kv| self.decode(&kv.key, &kv.value).map(|i| (i, kv.mod_revision))).collect();
                        let cmds = self.machine.reset(list);
                        self.execute_or_fence(cmds).await;
                    }
                    Some(Update::Events(events)) => {
                        let mut cmds = Vec::new();
                        for ev in events {
                            let event = match ev.kind {
                                EventKind::Put => match self.decode(&ev.kv.key, &ev.kv.value) {
                                    Some(info) => NodeEvent::Put { info, mod_revision: ev.kv.mod_revision },
                                    None => continue,
                                },
                                EventKind::Delete => match self.keys.parse_channel(&ev.kv.key) {
                                    Ok(ck) => NodeEvent::Delete { channel: ck.channel },
                                    Err(_) => continue,
                                },
                            };
                            cmds.extend(self.machine.step(event));
                        }
                        self.execute_or_fence(cmds).await;
                    }
                    None => {
                        error!("node: list-watch task ended unexpectedly; fencing");
                        self.stop_all().await;
                        return SessionEnd::Fenced("list-watch task ended".into());
                    }
                },
            }
        }
    }

    fn on_runner_event(&mut self, ev: RunnerEvent) -> Vec<NodeCommand> {
        let event = match ev {
            RunnerEvent::LoadDone {
                channel,
                epoch,
                result,
            } => {
                match &result {
                    Ok(()) => {
                        info!(node = %self.reg.id, %channel, %epoch, "node: channel loaded; acknowledging Watched")
                    }
                    Err(reason) => {
                        warn!(node = %self.reg.id, %channel, %epoch, %reason, "node: load failed; acknowledging WatchFailed")
                    }
                }
                NodeEvent::LoadDone {
                    channel,
                    epoch,
                    result,
                }
            }
            RunnerEvent::Progress {
                channel,
                epoch,
                progress,
            } => NodeEvent::Progress {
                channel,
                epoch,
                progress,
            },
            RunnerEvent::Stopped {
                channel,
                generation,
            } => {
                if self
                    .runners
                    .get(&channel)
                    .is_some_and(|r| r.generation == generation)
                {
                    self.runners.remove(&channel);
                }
                NodeEvent::Stopped { channel }
            }
            RunnerEvent::Broke {
                channel,
                epoch,
                reason,
                generation,
            } => {
                let current = self
                    .runners
                    .get(&channel)
                    .is_some_and(|r| r.generation == generation);
                if !current {
                    return vec![]; // an earlier run of the channel: long stopped
                }
                warn!(node = %self.reg.id, %channel, %epoch, %reason, "node: the handler reports the running channel broken; stopping it, then acknowledging WatchFailed");
                NodeEvent::Broke {
                    channel,
                    epoch,
                    reason,
                }
            }
        };
        self.machine.step(event)
    }

    /// The assignment under `key`, or `None` (logged naming the key, counted) when the key or
    /// value is bad — a value naming another channel than its key included (DESIGN.md §2).
    fn decode(&self, key: &str, value: &[u8]) -> Option<ChannelInfo> {
        match chanwatch_core::node::decode_assignment(&self.keys, key, value) {
            Ok((_, info)) => Some(info),
            Err(e) => {
                self.metrics.corrupt.inc();
                error!(node = %self.reg.id, key, error = %e, "node: assignment does not decode; not running it, leaving the key alone");
                None
            }
        }
    }

    /// Executes `cmds` unless the session is fenced meanwhile: then it gives up at once (an
    /// ack it abandons could only be refused, the session being gone).
    async fn execute_or_fence(&mut self, cmds: Vec<NodeCommand>) {
        let fence = self.fence.clone();
        tokio::select! {
            biased;
            () = fence.cancelled() => {}
            () = self.execute(cmds) => {}
        }
    }

    async fn execute(&mut self, cmds: Vec<NodeCommand>) {
        let mut queue: std::collections::VecDeque<NodeCommand> = cmds.into();
        while let Some(cmd) = queue.pop_front() {
            match cmd {
                NodeCommand::Start { info } => self.start(info).await,
                NodeCommand::Stop { channel } => match self.runners.get(&channel) {
                    Some(r) => {
                        info!(node = %self.reg.id, %channel, "node: stopping channel");
                        r.cancel.cancel();
                    }
                    None => queue.extend(self.machine.step(NodeEvent::Stopped { channel })),
                },
                NodeCommand::Ack {
                    info,
                    expect_mod_revision,
                } => self.ack_queue.push((info, expect_mod_revision)),
            }
        }
        self.send_acks();
    }

    /// Sends what is queued for acknowledgement, unless a write is already in flight: then
    /// it goes when that one returns, together with whatever queued meanwhile (group
    /// commit). The event loop does not wait for the store, so it keeps starting channels
    /// while acks travel; with the loop blocked on each ack, a node under a burst of
    /// assignments started its next channels only one ack round trip later, and ack
    /// latency grew with the burst (the `ack` bench).
    fn send_acks(&mut self) {
        if self.ack_in_flight || self.ack_queue.is_empty() || self.pause.borrow().is_some() {
            return; // a paused node commits nothing
        }
        let unguarded = self.planted_bug == Some(PlantedBug::UnguardedAck);
        let session = (!unguarded).then(|| self.session_guard());
        // One compare slot is the session guard. Values are capped at 64 KiB, so a byte
        // budget of half the request limit also bounds a chunk.
        let max_keys = self.store.limits().max_txn_ops.saturating_sub(1).max(1);
        let max_bytes = self.store.limits().max_request_bytes / 2;
        let mut chunks: Vec<Vec<AckWrite>> = vec![Vec::new()];
        let mut bytes = 0;
        // In channel order: runners woken together (a resume) queue their acks in whatever
        // order the scheduler woke them (tokio's watch wakes its waiters through randomly
        // chosen shards), and a simulation must replay the same txns.
        let mut queue = std::mem::take(&mut self.ack_queue);
        queue.sort_by(|a, b| a.0.channel.cmp(&b.0.channel));
        for (info, expect) in queue {
            let key = self.key(&info.channel);
            let value = info.encode();
            let last = chunks.last().map_or(0, Vec::len);
            if last > 0 && (last >= max_keys || bytes + value.len() > max_bytes) {
                chunks.push(Vec::new());
                bytes = 0;
            }
            bytes += value.len();
            let write = AckWrite {
                compare: (!unguarded).then(|| Compare::mod_revision(&key, expect)),
                put: TxnOp::put(key, value),
                info,
            };
            if let Some(c) = chunks.last_mut() {
                c.push(write);
            }
        }
        self.ack_in_flight = true;
        let store = self.store.clone();
        let done = self.acks_done_tx.clone();
        self.ack_task = Some(AbortOnDrop(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for chunk in chunks {
                outcomes.extend(write_acks(store.as_ref(), session.as_ref(), chunk).await);
            }
            let _ = done.send(outcomes);
        })));
    }

    /// Books the outcomes of one ack write and sends what queued meanwhile.
    async fn acks_done(&mut self, outcomes: Vec<(ChannelInfo, AckOutcome)>) {
        self.ack_in_flight = false;
        let mut cmds = Vec::new();
        for (info, outcome) in outcomes {
            let committed = match outcome {
                AckOutcome::Committed(rev) => {
                    self.metrics.acks("committed", 1);
                    debug!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack committed");
                    self.observe_ack(&info);
                    Some(rev)
                }
                AckOutcome::Refused => {
                    self.metrics.acks("refused", 1);
                    info!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack refused: the assignment changed meanwhile");
                    None
                }
                AckOutcome::Failed(e) => {
                    self.metrics.acks("error", 1);
                    self.retry_acks
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    warn!(node = %self.reg.id, channel = %info.channel, error = %e, "node: ack failed; retrying after a relist");
                    None
                }
            };
            cmds.extend(self.machine.step(NodeEvent::AckDone {
                channel: info.channel,
                committed,
            }));
        }
        self.execute_or_fence(cmds).await;
        self.send_acks();
    }

    fn observe_ack(&mut self, info: &ChannelInfo) {
        if info.state == chanwatch_core::ChannelState::Watched {
            if let Some(seen) = self.seen_at.remove(&info.channel) {
                let secs = self
                    .clock
                    .now()
                    .saturating_duration_since(seen)
                    .as_secs_f64();
                self.metrics.ack_latency.observe(secs);
            }
        }
    }

    fn key(&self, channel: &ChannelName) -> String {
        self.keys
            .channel(chanwatch_core::ChannelOwner::Node(self.reg.id), channel)
    }

    fn session_guard(&self) -> Compare {
        Compare::create_revision(self.keys.session(self.reg.id), self.reg.session_revision)
    }

    async fn start(&mut self, info: ChannelInfo) {
        // One runner per channel: a restart waits for the previous one to finish releasing.
        if let Some(old) = self.runners.remove(&info.channel) {
            old.cancel.cancel();
            let _ = old.task.await;
        }
        info!(node = %self.reg.id, channel = %info.channel, epoch = %info.epoch, "node: starting channel");
        self.next_generation += 1;
        let generation = self.next_generation;
        let cancel = self.fence.child_token();
        let ctx = ChannelContext {
            node: self.reg.id,
            info: info.clone(),
            clock: self.clock,
            events: self.events_tx.clone(),
            last_progress: Arc::new(Mutex::new(None)),
            progress_interval: self.progress_interval,
            generation,
        };
        self.seen_at.insert(info.channel.clone(), self.clock.now());
        self.metrics.running.inc();
        let guard = RunningGuard(self.metrics.clone());
        let (pause, paused) = watch::channel(self.pause.borrow().clone());
        let task = tokio::spawn(run_channel(
            guard,
            self.handler.clone(),
            ctx,
            cancel.clone(),
            paused,
            generation,
        ));
        self.runners.insert(
            info.channel,
            Runner {
                generation,
                cancel,
                pause,
                task,
            },
        );
    }

    /// Stops every runner and waits for each release.
    async fn stop_all(&mut self) {
        let runners: Vec<(ChannelName, Runner)> =
            std::mem::take(&mut self.runners).into_iter().collect();
        for (_, r) in &runners {
            r.cancel.cancel();
        }
        for (_, r) in runners {
            let _ = r.task.await;
        }
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // A dropped session (killed node) must leave nothing running.
        for r in self.runners.values() {
            r.task.abort();
        }
    }
}

/// Counts a runner in `chanwatch_node_channels_running` for as long as its task lives,
/// including when the task is aborted.
struct RunningGuard(Arc<crate::metrics::NodeMetrics>);
impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.running.dec();
    }
}

async fn run_channel(
    _guard: RunningGuard,
    handler: Arc<dyn ChannelHandler>,
    ctx: ChannelContext,
    cancel: CancellationToken,
    mut pause: watch::Receiver<Option<String>>,
    generation: u64,
) {
    let node = ctx.node;
    let info = ctx.info.clone();
    let events = ctx.events.clone();
    let stopped = |events: &mpsc::UnboundedSender<RunnerEvent>| {
        let _ = events.send(RunnerEvent::Stopped {
            channel: info.channel.clone(),
            generation,
        });
    };
    // Load, again after each pause that caught the load in progress (a paused node must not
    // even load: a load may be the start of its effects).
    loop {
        if !unpaused(&mut pause, &cancel).await {
            stopped(&events);
            return;
        }
        let loaded = tokio::select! {
            biased;
            () = cancel.cancelled() => None,
            true = until_paused(&mut pause) => {
                handler.release(node, &info).await;
                continue;
            }
            r = handler.watch(ctx.clone()) => Some(r),
        };
        let Some(result) = loaded else { break };
        let ok = result.is_ok();
        let _ = events.send(RunnerEvent::LoadDone {
            channel: info.channel.clone(),
            epoch: info.epoch,
            result,
        });
        if !ok {
            break;
        }
        // Running: pause and resume warm until released.
        loop {
            let paused = tokio::select! {
                biased;
                () = cancel.cancelled() => false,
                true = until_paused(&mut pause) => true,
            };
            if !paused {
                break;
            }
            handler.pause(node, &info).await;
            if !unpaused(&mut pause, &cancel).await {
                break;
            }
            handler.resume(node, &info).await;
        }
        break;
    }
    handler.release(node, &info).await;
    stopped(&events);
}

async fn until_running(pause: &mut watch::Receiver<Option<String>>) -> bool {
    pause.wait_for(Option::is_none).await.is_ok()
}

/// Waits until the node is paused; false if the session is gone.
async fn until_paused(pause: &mut watch::Receiver<Option<String>>) -> bool {
    pause.wait_for(Option::is_some).await.is_ok()
}

/// Waits until the node is not paused; false when the runner is cancelled first.
async fn unpaused(pause: &mut watch::Receiver<Option<String>>, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = cancel.cancelled() => false,
        r = until_running(pause) => r,
    }
}

/// Renews the lease every ttl/3 and publishes when the last successful renewal was sent
/// (the lease runs from when the store got it, which is no earlier). After a failure it
/// tries again every half second, so that a paused node learns within a second that the
/// store is back. Cancels `lost` and `fence` when the store says the lease no longer exists.
// Each argument is a different input or output of this one task; a struct would only wrap them.
#[allow(clippy::too_many_arguments)]
async fn keepalive(
    store: Arc<dyn MetaStore>,
    lease: i64,
    ttl: Duration,
    clock: Clock,
    last_ok: watch::Sender<Renewal>,
    lost: CancellationToken,
    fence: CancellationToken,
    recovered: mpsc::UnboundedSender<()>,
) {
    const RETRY: Duration = Duration::from_millis(500);
    let period = ttl / 3;
    let mut failing = 0u32;
    loop {
        clock
            .sleep(if failing > 0 {
                RETRY.min(period)
            } else {
                period
            })
            .await;
        let sent = clock.now();
        let attempt = tokio::time::timeout(period, store.keepalive(lease)).await;
        let error = match attempt {
            Ok(Ok(revision)) => {
                if failing > 0 {
                    info!(lease, failures = failing, "node: keepalive succeeds again");
                    // The store is back: look at the assignments now, not after the
                    // list-watch's back-off (up to 5 s).
                    let _ = recovered.send(());
                }
                failing = 0;
                let _ = last_ok.send(Renewal { sent, revision });
                continue;
            }
            Ok(Err(StoreError::LeaseNotFound(_))) => {
                lost.cancel();
                fence.cancel();
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {period:?}"),
        };
        failing += 1;
        // One line when the trouble starts, then one every 20 attempts (~10 s).
        if failing % 20 == 1 {
            warn!(lease, failures = failing, error = %error, "node: keepalive failed; retrying every 500 ms");
        }
    }
}
