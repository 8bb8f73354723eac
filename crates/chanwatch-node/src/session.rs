//! One session of a node: the event loop over its list-watch, runner events, acks and the
//! pause signal, from registration until it is fenced or shut down.
//!
//! Owns: the [`NodeMachine`] of the session, its runners (see `runner.rs`; started and
//! stopped in `session/runners.rs`), the ack queue
//! (see `acks.rs`), the keepalive task and the watchdog. Every task it starts is aborted when
//! it ends, so a dropped session (a killed node) leaves nothing running.
//!
//! Must not: write any key but its own channels' acks (and, on shutdown, its own session's
//! `leaving` through `leave.rs`, and the revoke of its lease).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::node::leave::{Departure, DepartureStep};
use chanwatch_core::node::{NodeCommand, NodeEvent, NodeMachine};
use chanwatch_core::{ChannelInfo, ChannelName, ChannelState, Keys, RoundHint};
use chanwatch_store::{
    keep_lease, millis, Clock, Compare, EventKind, ListWatch, MetaStore, Update,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, error, info, warn};

use crate::acks::{AckOutcome, What};
use crate::checkpoint::{CommitRequest, CommitShared};
use crate::config::{NodeConfig, NodeStatus, Planted, Stop};
use crate::handler::{ChannelHandler, RunnerEvent};
use crate::register::Registered;
use crate::runner::Runner;
use crate::watchdog::{watchdog, Renewal};

mod runners;

pub(crate) enum SessionEnd {
    Shutdown,
    Fenced(String),
}

pub(crate) struct Session {
    pub(crate) store: Arc<dyn MetaStore>,
    pub(crate) handler: Arc<dyn ChannelHandler>,
    pub(crate) keys: Keys,
    pub(crate) ttl: Duration,
    pub(crate) margin: Duration,
    pub(crate) progress_interval: Duration,
    /// How long a leaving node waits for the coordinator to move its channels off.
    pub(crate) shutdown_timeout: Duration,
    pub(crate) clock: Clock,
    pub(crate) reg: Registered,
    pub(crate) machine: NodeMachine,
    pub(crate) runners: BTreeMap<ChannelName, Runner>,
    pub(crate) next_generation: u64,
    pub(crate) events_tx: mpsc::UnboundedSender<RunnerEvent>,
    pub(crate) events_rx: mpsc::UnboundedReceiver<RunnerEvent>,
    pub(crate) metrics: Arc<crate::metrics::NodeMetrics>,
    pub(crate) planted: Planted,
    /// Cancelled when the session must stop everything (the store says the lease is gone);
    /// every runner's token is a child of it.
    pub(crate) fence: CancellationToken,
    /// Why every channel is paused (`None`: running). Set by the watchdog when no keepalive
    /// succeeded, or the node could not see its assignments, for `ttl - margin`; cleared
    /// when the same lease is renewed again and the view is back (DESIGN §3, invariant 9:
    /// an etcd outage pauses channels, it does not stop them).
    pub(crate) pause: watch::Sender<Option<String>>,
    /// An ack failed for a store error (not a refusal): relist soon, which re-acks what is
    /// loaded, instead of leaving the channel to the coordinator's watch timeout.
    pub(crate) retry_acks: std::sync::atomic::AtomicBool,
    /// When each loading channel's assignment was seen, for the ack latency.
    pub(crate) seen_at: BTreeMap<ChannelName, tokio::time::Instant>,
    /// Acks waiting for the write in flight to return.
    pub(crate) ack_queue: Vec<(ChannelInfo, i64)>,
    pub(crate) ack_in_flight: bool,
    /// Plan rounds whose puts are still coming, and until when acks wait for them.
    pub(crate) round_hold: crate::acks::hold::RoundHold,
    pub(crate) hold_until: Option<tokio::time::Instant>,
    /// The write in flight; aborted with the session (its txn may still land: it is
    /// guarded by the session and the key's revision, so that is harmless).
    pub(crate) ack_task: Option<AbortOnDropHandle<()>>,
    pub(crate) acks_done_tx: mpsc::UnboundedSender<Vec<(What, AckOutcome)>>,
    pub(crate) acks_done_rx: mpsc::UnboundedReceiver<Vec<(What, AckOutcome)>>,
    /// Checkpoint commits from the runs, waiting for the next write (group commit with acks).
    pub(crate) commit_queue: Vec<CommitRequest>,
    pub(crate) commits_rx: mpsc::UnboundedReceiver<CommitRequest>,
    /// The create revision of each assignment key as last seen: a run's commits are fenced on
    /// the key it started under (a move or a removal deletes it).
    pub(crate) create_revisions: BTreeMap<ChannelName, i64>,
    /// What every run's committer shares.
    pub(crate) commit_shared: Arc<CommitShared>,
}

impl Session {
    pub(crate) fn new(
        store: Arc<dyn MetaStore>,
        handler: Arc<dyn ChannelHandler>,
        config: &NodeConfig,
        clock: Clock,
        reg: Registered,
    ) -> Self {
        let (events_tx, events_rx) = mpsc::unbounded_channel();
        let (acks_done_tx, acks_done_rx) = mpsc::unbounded_channel();
        let (commits_tx, commits_rx) = mpsc::unbounded_channel();
        let commit_shared = Arc::new(CommitShared {
            store: store.clone(),
            tx: commits_tx.clone(),
            keys: config.keys.clone(),
            node: reg.id,
            clock,
            metrics: config.metrics.clone(),
            planted: Planted::of(config),
        });
        Session {
            store,
            handler,
            keys: config.keys.clone(),
            ttl: config.session_ttl,
            margin: config.margin(),
            progress_interval: config.progress_interval,
            shutdown_timeout: config.shutdown_timeout,
            clock,
            reg,
            machine: NodeMachine::new(),
            runners: BTreeMap::new(),
            next_generation: 0,
            events_tx,
            events_rx,
            metrics: config.metrics.clone(),
            planted: Planted::of(config),
            fence: CancellationToken::new(),
            pause: watch::channel(None).0,
            retry_acks: std::sync::atomic::AtomicBool::new(false),
            seen_at: BTreeMap::new(),
            ack_queue: Vec::new(),
            ack_in_flight: false,
            round_hold: Default::default(),
            hold_until: None,
            ack_task: None,
            acks_done_tx,
            acks_done_rx,
            commit_queue: Vec::new(),
            commits_rx,
            create_revisions: BTreeMap::new(),
            commit_shared,
        }
    }

    pub(crate) async fn serve(
        mut self,
        stop: &mut watch::Receiver<Stop>,
        status: &watch::Sender<NodeStatus>,
    ) -> SessionEnd {
        // A planned restart in progress (`Stop::Leave`), and its announce writes' outcomes.
        let mut departure: Option<Departure> = None;
        let (announced_tx, mut announced_rx) = mpsc::unbounded_channel::<Option<i64>>();
        let mut last_left = usize::MAX;
        let mut last_left_log = self.clock.now();
        let (renewed_tx, mut renewed) = mpsc::unbounded_channel();
        let (last_ok_tx, last_ok) = watch::channel(Renewal {
            sent: self.reg.granted_at,
            revision: 0,
        });
        let lost = CancellationToken::new();
        // The shared lease keeper (every ttl/3, every 500 ms while failing); a renewal after
        // failures asks for a relist at once (`renewed`), not after the list-watch's back-off.
        // When the store says the lease is gone, everything stops.
        let keeper = keep_lease(
            self.store.clone(),
            self.reg.lease,
            self.ttl,
            self.clock,
            last_ok_tx,
            Some(renewed_tx.clone()),
            "node",
        );
        let (gone, fence) = (lost.clone(), self.fence.clone());
        let _keepalive = AbortOnDropHandle::new(tokio::spawn(async move {
            keeper.await;
            gone.cancel();
            fence.cancel();
        }));
        let prefix = self
            .keys
            .owner_prefix(chanwatch_core::ChannelOwner::Node(self.reg.id));
        let mut lw = ListWatch::spawn(self.store.clone(), prefix);
        // The revision of the last full list applied: a leaving node is done only once it
        // has applied a list read after its `leaving` write (a put committed just before it
        // may still be on its way; the watch's `reached` will not do, it counts events still
        // queued for this loop — found by the simulation).
        let mut listed_at: i64 = 0;
        // Pausing runs beside the event loop, not in it: a store call that hangs in the loop
        // (an ack on a stalled connection) must not keep channels running past the lease
        // (found by the simulation). Runners follow `pause` themselves. A node also pauses
        // when it cannot see its assignments for as long: a node that kept renewing its lease
        // between short partitions, yet never saw a release request, must not run the
        // channel once the coordinator fences it (found by the simulation too).
        let _watchdog = (!planted!(self.planted, NoFencing)).then(|| {
            AbortOnDropHandle::new(tokio::spawn(watchdog(
                last_ok,
                lw.blind_since(),
                if planted!(self.planted, NoWatchProgress) {
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
            let hold = self.hold_until;
            if let Some(d) = departure.as_mut() {
                let held = self.machine.channels().len();
                match d.step(self.clock.unix_ms(), held, listed_at) {
                    DepartureStep::Announce => {
                        let (store, keys, reg, tx) = (
                            self.store.clone(),
                            self.keys.clone(),
                            self.reg,
                            announced_tx.clone(),
                        );
                        tokio::spawn(async move {
                            let _ = tx.send(crate::leave::announce_leaving(store, keys, reg).await);
                        });
                    }
                    DepartureStep::Wait { left } => {
                        if left != last_left
                            && self.clock.now() >= last_left_log + Duration::from_secs(1)
                        {
                            info!(
                                node = %self.reg.id,
                                left,
                                of = d.initial,
                                timeout = ?self.shutdown_timeout,
                                "node: leaving: channels still here, waiting for the coordinator to move them (with no other live node that has room, or no coordinator, they stay until the shutdown timeout, then fail over; a second SIGTERM stops at once)"
                            );
                            last_left = left;
                            last_left_log = self.clock.now();
                        }
                    }
                    DepartureStep::Done { after_ms } => {
                        info!(node = %self.reg.id, channels = d.initial, seconds = after_ms as f64 / 1000.0, "node: left: every channel moved off; revoking the lease");
                        return self.stop_and_revoke().await;
                    }
                    DepartureStep::TimedOut { left: 0 } => {
                        info!(node = %self.reg.id, timeout = ?self.shutdown_timeout, "node: leaving: shutdown timeout with no channel here; revoking the lease");
                        return self.stop_and_revoke().await;
                    }
                    DepartureStep::TimedOut { left } => {
                        warn!(node = %self.reg.id, left, of = d.initial, timeout = ?self.shutdown_timeout, "node: shutdown timeout: stopping the channels still here and revoking the lease (they fail over)");
                        return self.stop_and_revoke().await;
                    }
                }
            }
            tokio::select! {
                biased;
                r = stop.changed() => {
                    // Nobody left to ask (the owner dropped its handle): stop, as before.
                    let asked = if r.is_err() { Stop::Now } else { *stop.borrow_and_update() };
                    if asked == Stop::Now {
                        let left = self.machine.channels().len();
                        if departure.is_some() {
                            info!(node = %self.reg.id, channels = left, "node: asked again to stop: stopping channels and revoking the lease at once");
                        } else {
                            info!(node = %self.reg.id, channels = left, "node: shutting down; stopping channels and revoking the lease");
                        }
                        return self.stop_and_revoke().await;
                    }
                    if asked == Stop::Leave && departure.is_none() {
                        let held = self.machine.channels().len();
                        info!(node = %self.reg.id, channels = held, timeout = ?self.shutdown_timeout, "node: leaving: asking the coordinator to move our channels off while they run (a second SIGTERM stops at once)");
                        departure = Some(Departure::begin(self.clock.unix_ms(), millis(self.shutdown_timeout), held));
                    }
                }
                Some(landed) = announced_rx.recv() => {
                    if let Some(d) = departure.as_mut() {
                        d.announce_done(landed, self.clock.unix_ms());
                        if landed.is_some() {
                            info!(node = %self.reg.id, channels = self.machine.channels().len(), "node: leaving: announced; the coordinator drains us");
                            // A fresh list, read after the write: once applied, our view
                            // holds every put that can ever reach us.
                            lw.relist();
                        }
                    }
                }
                () = self.fence.cancelled() => {
                    // Nothing of this session can land any more: every commit, queued or to
                    // come, is answered fenced at once (a run's last commit on release would
                    // otherwise wait for the end of `stop_all`, which waits for the run), and
                    // the closed channel tells the exec handler to kill its workers at once.
                    self.commits_rx.close();
                    while self.commits_rx.try_recv().is_ok() {}
                    self.commit_queue.clear();
                    self.stop_all(false).await;
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
                            // A fresh list at once: if only the watch is stuck (the store
                            // answers), it shows what was missed — a release request above all.
                            lw.relist();
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
                    // Drain what else is ready so that their acks share txns. Channels
                    // started together (one watch batch) finish their loads as separate
                    // tasks: yielding once first lets those already runnable report too,
                    // so a failover's ~50 channels per node ack in one or two txns instead
                    // of one for the first and one for the rest of each wake-up.
                    tokio::task::yield_now().await;
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
                () = tokio::time::sleep_until(hold.unwrap_or_else(|| self.clock.now())), if hold.is_some() => self.send_acks(),
                Some(first) = self.commits_rx.recv() => {
                    self.commit_queue.push(first);
                    while let Ok(more) = self.commits_rx.try_recv() {
                        self.commit_queue.push(more);
                    }
                    self.send_acks();
                }
                update = lw.next() => match update {
                    Some(Update::Reset { kvs, revision }) => {
                        listed_at = revision;
                        self.metrics.relists.inc();
                        debug!(node = %self.reg.id, keys = kvs.len(), revision, "node: listed own channels");
                        let list: Vec<_> = kvs.iter().filter_map(|kv| self.decode(&kv.key, &kv.value).map(|(i, _)| (i, kv.mod_revision))).collect();
                        self.create_revisions = kvs.iter().filter_map(|kv| self.keys.parse_channel(&kv.key).ok().map(|ck| (ck.channel, kv.create_revision))).collect();
                        let cmds = self.machine.reset(list);
                        self.execute_or_fence(cmds).await;
                    }
                    Some(Update::Events(events)) => {
                        let mut cmds = Vec::new();
                        for ev in events {
                            let event = match ev.kind {
                                EventKind::Put => match self.decode(&ev.kv.key, &ev.kv.value) {
                                    Some((info, round)) => {
                                        if let (Some(round), ChannelState::ToWatch) = (round, info.state) {
                                            self.round_hold.saw(round, &info.channel, self.clock.now());
                                        }
                                        self.create_revisions.insert(info.channel.clone(), ev.kv.create_revision);
                                        NodeEvent::Put { info, mod_revision: ev.kv.mod_revision }
                                    }
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
                        self.stop_all(false).await;
                        return SessionEnd::Fenced("list-watch task ended".into());
                    }
                },
            }
        }
    }

    fn on_runner_event(&mut self, ev: RunnerEvent) -> Vec<NodeCommand> {
        let RunnerEvent { generation, event } = ev;
        let current = |s: &Self, channel: &ChannelName| {
            s.runners
                .get(channel)
                .is_some_and(|r| r.generation == generation)
        };
        match &event {
            NodeEvent::LoadDone {
                channel,
                epoch,
                result,
            } => match result {
                Ok(()) => {
                    info!(node = %self.reg.id, %channel, %epoch, "node: channel loaded; acknowledging Watched")
                }
                Err(reason) => {
                    warn!(node = %self.reg.id, %channel, %epoch, %reason, "node: load failed; acknowledging WatchFailed")
                }
            },
            NodeEvent::Stopped { channel } if current(self, channel) => {
                self.runners.remove(channel);
            }
            NodeEvent::Broke {
                channel,
                epoch,
                reason,
            } => {
                if !current(self, channel) {
                    return vec![]; // an earlier run of the channel: long stopped
                }
                warn!(node = %self.reg.id, %channel, %epoch, %reason, "node: the handler reports the channel broken; stopping it (once its load returned, if it is loading), then acknowledging WatchFailed");
            }
            _ => {}
        }
        self.machine.step(event)
    }

    /// The assignment under `key` and the round hint it came with (taken off: no ack carries
    /// it), or `None` (logged naming the key, counted) when the key or value is bad — a value
    /// naming another channel than its key included (DESIGN.md §2).
    fn decode(&self, key: &str, value: &[u8]) -> Option<(ChannelInfo, Option<RoundHint>)> {
        match chanwatch_core::node::decode_assignment(&self.keys, key, value) {
            Ok((_, mut info)) => {
                let round = info.round.take();
                Some((info, round))
            }
            Err(e) => {
                self.metrics.corrupt.inc();
                error!(node = %self.reg.id, key, error = %e, "node: assignment does not decode; not running it, leaving the key alone");
                None
            }
        }
    }

    /// Executes `cmds` unless the session is fenced meanwhile: then it gives up at once (an
    /// ack it abandons could only be refused, the session being gone).
    pub(crate) async fn execute_or_fence(&mut self, cmds: Vec<NodeCommand>) {
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
                } => {
                    // A progress report (still `ToWatch`) is not the load's outcome.
                    if info.state != ChannelState::ToWatch {
                        self.round_hold.acked(&info.channel, self.clock.now());
                    }
                    self.ack_queue.push((info, expect_mod_revision));
                }
            }
        }
        self.send_acks();
    }

    pub(crate) fn key(&self, channel: &ChannelName) -> String {
        self.keys
            .channel(chanwatch_core::ChannelOwner::Node(self.reg.id), channel)
    }

    pub(crate) fn session_guard(&self) -> Compare {
        Compare::create_revision(self.keys.session(self.reg.id), self.reg.session_revision)
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
