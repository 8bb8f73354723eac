//! One term as leader: the loop that drives the planner (election is in
//! [`crate::election`], txn execution in [`crate::execute`]).
//!
//! Owns: the planner state while leader, feeding the loop's events to the core's
//! [`Pacer`] (which decides when to plan and whether requests are served), serving the
//! requests of [`crate::CoordHandle`], and the leader's watch of its own key (it steps down
//! the moment the key is no longer its own).
//! Must not: decide anything itself — what to do comes from the core planner, when from the
//! core pacer — or write to the store except through [`crate::execute`].
//!
//! Requests are served in `term/requests.rs`, the unit tests are in `term/tests.rs`; this file
//! is just over 600 lines because the loop and the ingest share the term's one state.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::planner::pacer::REQUESTS_PER_TURN;
#[cfg(feature = "planted-bugs")]
use chanwatch_core::planner::PlannerBug;
use chanwatch_core::planner::{GateLog, Pacer, Planner};
use chanwatch_core::{ChannelName, NodeId};
use chanwatch_store::{Clock, EventKind, KeyRange, LeaseId, ListWatch, MetaStore, Renewal, Update};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::availability::StoreAvailability;
use crate::coordinator::CoordinatorConfig;
use crate::execute::millis;
use crate::handle::{refuse, ApiError, CoordStatus, Request};
use crate::watch_health::{resync_wait, stall_limit, StallCheck};

mod requests;

/// How a term as leader ended.
pub(crate) enum TermEnd {
    Shutdown,
    Lost(String),
}

/// A node's session seen gone, until each channel it held has been seen Watched elsewhere.
pub(crate) struct Failover {
    since: tokio::time::Instant,
    node: NodeId,
    /// How many channels it held.
    channels: usize,
    /// Those not yet seen Watched elsewhere (checked from the end).
    left: Vec<ChannelName>,
}

/// Whether rounds wait for a burst of session losses to be over: always, but under the
/// planted `NoLossHold`.
fn hold_losses(config: &CoordinatorConfig) -> bool {
    #[cfg(feature = "planted-bugs")]
    let hold = !config.planner.planted(PlannerBug::NoLossHold);
    #[cfg(not(feature = "planted-bugs"))]
    let hold = {
        let _ = config;
        true
    };
    hold
}

/// Sleeps until `at`, or forever when there is nothing to wake for.
async fn sleep_until_some(at: Option<tokio::time::Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// One term as leader.
pub(crate) struct Term<'a> {
    pub(crate) store: Arc<dyn MetaStore>,
    pub(crate) config: &'a CoordinatorConfig,
    pub(crate) clock: Clock,
    pub(crate) leader_rev: i64,
    /// The lease our leader key is attached to: the key is ours while it has this lease and
    /// create revision `leader_rev`.
    pub(crate) lease: LeaseId,
    pub(crate) state: Planner,
    pub(crate) status: &'a watch::Sender<CoordStatus>,
    /// Sessions seen gone, with the channels they held, until those are all Watched again.
    pub(crate) failovers: Vec<Failover>,
    /// When to plan and whether requests are served (the core's decisions; this loop only
    /// feeds it), the hold over a burst of session losses among them.
    pub(crate) pacer: Pacer,
    /// The term's start: the pacer's times are durations since it.
    pub(crate) origin: tokio::time::Instant,
    /// A request (drain, balance) wants a plan round; the loop runs it when its view is
    /// fresh (found by the simulation: a balance request right after an etcd outage planned
    /// from the stale view and fenced a node that was releasing).
    pub(crate) replan: bool,
    /// When the store was away (unreachable, or refusing writes), so that timers stand
    /// still that long.
    pub(crate) availability: StoreAvailability,
    /// The leader lease's renewals (set by the election): their revisions tell a quiet
    /// watch from a stalled one.
    pub(crate) renewals: Option<watch::Receiver<Renewal>>,
    /// Whether the last round ran with the view known to be behind (for its log line).
    was_behind: bool,
    /// Where committed transitions and node events are recorded (`events.rs`).
    pub(crate) events: Arc<crate::events::EventLog>,
    /// Bulk registrations whose txns are being written off the loop (`bulk.rs`).
    pub(crate) bulk: crate::bulk::InFlight,
    /// The revision the view has applied from the list-watch: a txn written off the loop
    /// that committed at or below it is already in the view, and booking it again would
    /// bring back older values (a `ToWatch` over its node's `Watched` ack).
    pub(crate) watched_rev: i64,
}

impl<'a> Term<'a> {
    /// A term that begins with our leader key created at `leader_rev` on `lease`.
    pub(crate) fn new(
        store: Arc<dyn MetaStore>,
        config: &'a CoordinatorConfig,
        clock: Clock,
        leader_rev: i64,
        lease: LeaseId,
        status: &'a watch::Sender<CoordStatus>,
    ) -> Self {
        Term {
            store,
            config,
            clock,
            leader_rev,
            lease,
            state: Planner::new(config.keys.clone(), config.planner.clone()),
            status,
            failovers: Vec::new(),
            pacer: Pacer::new(hold_losses(config)),
            origin: clock.now(),
            replan: false,
            availability: StoreAvailability::new(
                config.session_ttl,
                Duration::from_millis(config.planner.watch_timeout_ms),
            ),
            renewals: None,
            was_behind: false,
            events: Arc::new(crate::events::EventLog::new(clock)),
            bulk: crate::bulk::InFlight::default(),
            watched_rev: 0,
        }
    }

    /// Leads until shutdown or until leadership is lost (lease lost, or the leader key
    /// deleted or replaced: seen on the watch at once).
    ///
    /// Each turn serves one ready source in order — the watch, the tick, a due plan, the
    /// reconcile, then up to [`REQUESTS_PER_TURN`] requests — then drains every watch batch
    /// already waiting and plans if a plan is due. So requests never blind the leader, and
    /// the watch cannot starve requests for longer than it takes to apply what is waiting.
    pub(crate) async fn lead(
        &mut self,
        requests: &mut mpsc::Receiver<Request>,
        lost: &CancellationToken,
        shutdown: &mut std::pin::Pin<&mut impl Future<Output = ()>>,
    ) -> TermEnd {
        // Everything under the root but the data plane's checkpoints: at 10,000 channels
        // committing 10 times a second those would be 100,000 events a second it ignores.
        let keys = &self.config.keys;
        let mut lw = ListWatch::spawn(
            self.store.clone(),
            KeyRange::between(keys.all_prefix(), keys.worker_prefix()),
        );
        let blind = lw.blind_since();
        #[cfg(feature = "planted-bugs")]
        let limit = if self.config.planner.planted(PlannerBug::NoWatchStallCheck) {
            Duration::from_secs(365 * 24 * 3600) // never
        } else {
            stall_limit(self.config.session_ttl)
        };
        #[cfg(not(feature = "planted-bugs"))]
        let limit = stall_limit(self.config.session_ttl);
        let mut stall = StallCheck::new(self.renewals.clone(), lw.reached(), limit);
        // Compaction and the db size gauge, on a task of their own that ends with the term.
        let _upkeep = crate::upkeep::spawn(
            crate::upkeep::Upkeep::new(
                self.store.clone(),
                keys.clone(),
                self.leader_rev,
                self.config.metrics.clone(),
            )
            .assumed_quota(self.config.quota_backend_bytes),
            self.config.compact_interval,
        );
        let mut tick = tokio::time::interval(self.config.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut resyncs = 0;
        let resync = tokio::time::sleep(resync_wait(
            self.config.resync_interval,
            &self.config.id,
            resyncs,
        ));
        tokio::pin!(resync);
        let mut restarts_seen = 0;
        // A stall relist asked for and its list not yet applied: the view is known behind.
        let mut relist_pending = false;
        loop {
            let blinded = blind.borrow().is_some();
            let wake = self.pacer.wake_at(blinded).map(|at| self.origin + at);
            tokio::select! {
                biased;
                () = shutdown.as_mut() => return TermEnd::Shutdown,
                () = lost.cancelled() => return TermEnd::Lost("leader lease lost or not renewed in time".into()),
                update = lw.next() => {
                    let Some(update) = update else { return TermEnd::Lost("list-watch ended".into()) };
                    let relisted = matches!(update, Update::Reset { .. });
                    relist_pending &= !relisted;
                    if let Err(why) = self.apply(update) {
                        return TermEnd::Lost(why);
                    }
                    // Timers stood still while the store was away; a new term starts with
                    // one watch timeout of grace, knowing nothing of what came before.
                    if relisted {
                        let away = self
                            .availability
                            .relisted(self.clock.now(), !self.pacer.recovered());
                        if !away.is_zero() {
                            debug!(away_ms = millis(away), "coord: the store was away; timeouts wait as long");
                            self.timers_stand_still(away);
                        }
                    }
                    self.pacer.changed();
                }
                _ = tick.tick() => {
                    self.pacer.tick();
                    let since = *blind.borrow();
                    if let Some(since) = since {
                        self.availability.unreachable(since);
                        if let Some(for_) =
                            Pacer::resign_blind(self.since(self.clock.now()), Some(self.since(since)), self.config.session_ttl)
                        {
                            return TermEnd::Lost(format!(
                                "could not list or watch the store for {} ms (session TTL {} ms); resigning so a standby can lead",
                                for_.as_millis(),
                                self.config.session_ttl.as_millis()
                            ));
                        }
                    }
                }
                () = sleep_until_some(wake) => {}
                stalled = stall.stalled() => {
                    let behind = self.clock.now().saturating_duration_since(stalled.sent);
                    warn!(
                        revision = stalled.revision,
                        reached = *lw.reached().borrow(),
                        behind_ms = millis(behind),
                        "coord: the watch has not reached the revision a keepalive answer named: \
                         stalled or lagging; relisting (timers stand still meanwhile)"
                    );
                    self.config.metrics.watch_stalls.inc();
                    self.availability.unreachable(stalled.sent);
                    lw.relist();
                    // Still behind until the list is applied: the stall check has forgotten
                    // its renewals, but the view is as stale as it was.
                    relist_pending = true;
                }
                written = self.bulk.next() => {
                    if let Err(why) = self.bulk_written(written) {
                        return TermEnd::Lost(why);
                    }
                    self.pacer.changed();
                }
                () = &mut resync => {
                    lw.relist();
                    resyncs += 1;
                    let wait = resync_wait(self.config.resync_interval, &self.config.id, resyncs);
                    resync.as_mut().reset(tokio::time::Instant::now() + wait);
                }
                Some(req) = requests.recv() => {
                    let mut next = Some(req);
                    let mut served = 0;
                    while let Some(req) = next.take() {
                        if !self.pacer.recovered() {
                            refuse(req, ApiError::Store("the leader is still recovering; retry shortly".into()));
                        } else if let Err(why) = self.handle(req).await {
                            return TermEnd::Lost(why);
                        }
                        served += 1;
                        if served < REQUESTS_PER_TURN {
                            next = requests.try_recv().ok();
                        }
                    }
                    if std::mem::take(&mut self.replan) {
                        self.pacer.replan(self.since(self.clock.now()));
                    }
                }
            }
            // Whatever this turn served, what the watch delivered meanwhile is applied now.
            while let Some(more) = lw.try_next() {
                relist_pending &= !matches!(more, Update::Reset { .. });
                if let Err(why) = self.apply(more) {
                    return TermEnd::Lost(why);
                }
                self.pacer.changed();
            }
            // A failover is done when its last ack is seen, not at the next plan round (that
            // waited up to the plan gap: ~70 ms at 10,000 channels).
            if !self.failovers.is_empty() {
                self.finish_failovers();
            }
            if self.pacer.recover() {
                info!(
                    channels = self.state.channel_count(),
                    nodes = self.state.nodes().len(),
                    "coord: startup recovery listed the store"
                );
            }
            let restarts = lw.restarts();
            self.config
                .metrics
                .watch_restarts
                .inc_by(restarts - restarts_seen);
            restarts_seen = restarts;
            if self
                .pacer
                .due(self.since(self.clock.now()), blind.borrow().is_some())
            {
                if let Err(why) = self
                    .round(stall.behind_since().is_some() || relist_pending)
                    .await
                {
                    return TermEnd::Lost(why);
                }
            }
        }
    }

    /// `at` as the pacer's time: since the term began.
    fn since(&self, at: tokio::time::Instant) -> Duration {
        at.saturating_duration_since(self.origin)
    }

    /// One plan round: plan from the view, write the txns, book the outcome. `behind`: the
    /// watch has not reached a revision a keepalive answer named (the view may miss a node).
    async fn round(&mut self, behind: bool) -> Result<(), String> {
        let began = self.clock.now();
        self.pacer.round_begins(self.since(began));
        // While etcd refuses writes (NOSPACE) nodes cannot ack: their timers stand still,
        // round by round, as they do while the store is away. Until the next refusal: a round
        // that writes nothing must not keep the timers (and forgotten moves) frozen forever
        // (found by the simulation: 16 balance moves whose txns NOSPACE refused blocked
        // balance for good).
        if let Some(refused) = self.availability.writes_taken(began) {
            self.timers_stand_still(refused);
        }
        if self.bulk.len() > 0 {
            self.state.hold_balance(self.clock.unix_ms());
        }
        if behind != self.was_behind {
            debug!(behind, "coord: the view is known to be behind the store (a keepalive answer named a revision the watch has not reached)");
            self.was_behind = behind;
        }
        self.state.set_behind(behind);
        let txns = self.state.plan(self.clock.unix_ms());
        let planned = (
            txns.len(),
            self.clock.now().saturating_duration_since(began),
        );
        let gate = self.state.startup_wait(self.clock.unix_ms());
        match self
            .pacer
            .gate(self.since(self.clock.now()), gate.is_some())
        {
            GateLog::Waiting => {
                if let Some(w) = gate {
                    info!(
                        live = w.live,
                        expected = w.expected,
                        left_s = w.left_ms.div_ceil(1000),
                        "coord: cold start: waiting for {} more node(s) ({} of {} expected are live), {}s left",
                        w.expected.saturating_sub(w.live),
                        w.live,
                        w.expected,
                        w.left_ms.div_ceil(1000)
                    );
                }
            }
            GateLog::Opened => info!(
                nodes = self.state.nodes().len(),
                "coord: cold start: placing channels"
            ),
            GateLog::Quiet => {}
        }
        self.pacer.round_planned(self.since(self.clock.now()));
        let executing = self.clock.now();
        let result = self.execute(txns).await;
        if planned.0 > 0 {
            debug!(
                txns = planned.0,
                plan_us = u64::try_from(planned.1.as_micros()).unwrap_or(u64::MAX),
                execute_us = u64::try_from(
                    self.clock
                        .now()
                        .saturating_duration_since(executing)
                        .as_micros()
                )
                .unwrap_or(u64::MAX),
                "coord: planned and wrote a round"
            );
        }
        // Refused txns: the read-back fixed the view, and the pacer re-plans at once (found
        // by the failover bench: sessions lost together but seen in two watch batches made
        // the first round's txns fail on the second batch's dead nodes, and the retry waited
        // out the gap, ~10 ms) — unless the read-back found more sessions gone: the burst is
        // not over, and the retry waits for its quiet period like any loss.
        let refused = result?;
        self.pacer
            .round_written(self.since(self.clock.now()), refused);
        self.finish_failovers();
        let ticked = self.pacer.take_ticked();
        self.config.metrics.observe(&self.state, ticked);
        if self.pacer.recovered() && !self.status.borrow().ready {
            self.status.send_modify(|s| s.ready = true);
            info!("coord: recovered and ready");
        }
        Ok(())
    }

    /// Applies what the list-watch delivered. `Err` when it shows that the leader key is no
    /// longer ours (deleted, re-created by another campaign, or rewritten without our lease):
    /// the leader steps down at once instead of when its next txn is refused.
    fn apply(&mut self, update: Update) -> Result<(), String> {
        let leader_key = self.config.keys.leader();
        match update {
            Update::Reset { kvs, revision } => {
                debug!(keys = kvs.len(), revision, "coord: full list");
                self.config.metrics.relists.inc();
                match kvs.iter().find(|kv| kv.key == leader_key) {
                    Some(kv) => self.still_ours(kv)?,
                    None => {
                        return Err(format!(
                            "the leader key {leader_key} is gone (seen by a full list): deposed"
                        ))
                    }
                }
                // A session missing from the new list died while the watch was not looking:
                // it is a failover like one seen by a delete event (logged and measured).
                let listed: std::collections::BTreeSet<NodeId> = kvs
                    .iter()
                    .filter_map(|kv| self.config.keys.parse_session(&kv.key).ok())
                    .collect();
                let vanished: Vec<NodeId> = self
                    .state
                    .nodes()
                    .keys()
                    .filter(|id| !listed.contains(id))
                    .copied()
                    .collect();
                for id in listed
                    .iter()
                    .filter(|id| !self.state.nodes().contains_key(id))
                {
                    self.events
                        .node(*id, "joined", Some("seen by a full list".into()));
                }
                self.state.reset(
                    kvs.iter()
                        .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
                );
                for id in vanished {
                    self.session_gone(id, "a full list");
                }
                self.state.caught_up(revision);
                self.watched_rev = self.watched_rev.max(revision);
                for (key, why) in self.state.corrupt() {
                    error!(key, error = %why, "coord: key not taken (its value does not decode, or it is refused); leaving it alone");
                }
            }
            Update::Events(events) => {
                let last = events.last().map(|ev| ev.kv.mod_revision);
                for ev in events {
                    if ev.kv.key == leader_key {
                        match ev.kind {
                            EventKind::Put => self.still_ours(&ev.kv)?,
                            EventKind::Delete => {
                                return Err(format!(
                                "the leader key {leader_key} was deleted at revision {}: deposed",
                                ev.kv.mod_revision
                            ))
                            }
                        }
                    }
                    match ev.kind {
                        EventKind::Put => {
                            self.note_join(&ev.kv.key);
                            if let Some(why) =
                                self.state
                                    .apply_put(&ev.kv.key, &ev.kv.value, ev.kv.mod_revision)
                            {
                                error!(key = ev.kv.key, error = %why, "coord: key not taken (its value does not decode, or it is refused); leaving it alone");
                            }
                        }
                        EventKind::Delete => {
                            // Unknown when a refused txn already showed it gone.
                            let gone = self
                                .config
                                .keys
                                .parse_session(&ev.kv.key)
                                .ok()
                                .filter(|id| self.state.nodes().contains_key(id));
                            self.state.apply_delete(&ev.kv.key, ev.kv.mod_revision);
                            if let Some(id) = gone {
                                self.session_gone(id, "a delete event");
                            }
                        }
                    }
                    self.watched_rev = self.watched_rev.max(ev.kv.mod_revision);
                }
                // Once per batch (events come in revision order): per event, each a walk of
                // every tombstone, it was quadratic in a failover's own deletes.
                if let Some(rev) = last {
                    self.state.caught_up(rev);
                }
            }
        }
        Ok(())
    }

    /// Tells the planner that its timers stood still for `away` up to now (see
    /// [`StoreAvailability`]).
    pub(crate) fn timers_stand_still(&mut self, away: Duration) {
        self.state
            .store_was_away(self.clock.unix_ms(), millis(away));
    }

    /// `Err` unless `kv` (the leader key as the store holds it now) is still our key.
    fn still_ours(&self, kv: &chanwatch_store::KeyValue) -> Result<(), String> {
        if kv.create_revision != self.leader_rev {
            return Err(format!(
                "the leader key {} was re-created at revision {} (ours was created at {}): deposed",
                kv.key, kv.create_revision, self.leader_rev
            ));
        }
        if kv.lease != Some(self.lease) {
            return Err(format!(
                "the leader key {} was rewritten at revision {} without our lease {:x} (lease now {:x}): deposed",
                kv.key,
                kv.mod_revision,
                self.lease,
                kv.lease.unwrap_or(0)
            ));
        }
        Ok(())
    }

    /// Notes that node `id`'s session is gone (seen by `how`), so that the failover of the
    /// channels it held is logged and measured. Call after the view has forgotten the
    /// session: its channels are then in the planner's attention set, found without a walk
    /// of every channel.
    pub(crate) fn session_gone(&mut self, id: NodeId, how: &str) {
        let held: Vec<ChannelName> = self.state.held_by_gone(id);
        if held.is_empty() {
            info!(node = %id, seen_by = how, "coord: node session gone; it held no channel");
        } else {
            info!(
                node = %id,
                channels = held.len(),
                seen_by = how,
                wait_for_more_ms = self.pacer.quiet().as_secs_f64() * 1e3,
                "coord: node session gone; its channels fail over once no other loss is seen for wait_for_more_ms (at most 40 ms after the first of a burst)"
            );
        }
        self.events.node(
            id,
            "left",
            Some(format!(
                "session gone (seen by {how}); {} channel(s) fail over",
                held.len()
            )),
        );
        if !held.is_empty() {
            self.pacer.lost(self.since(self.clock.now()));
        }
        // Bounded: a storm of dead nodes must not grow this without limit.
        if !held.is_empty() && self.failovers.len() < 1024 {
            self.failovers.push(Failover {
                since: self.clock.now(),
                node: id,
                channels: held.len(),
                left: held,
            });
        }
    }

    /// Records a node event when `key` is the session of a node the view does not know yet.
    /// Call before the view applies the put.
    fn note_join(&self, key: &str) {
        if let Ok(id) = self.config.keys.parse_session(key) {
            if !self.state.nodes().contains_key(&id) {
                self.events.node(id, "joined", None);
            }
        }
    }

    /// Observes the failover duration of every dead node whose channels have each been
    /// seen Watched on another node (or removed). Called after every batch the watch
    /// delivers, so it checks from the end of each list and stops at the first channel not
    /// there yet: each channel is looked up about once, not once per batch (1,000 lookups
    /// per batch at 1,000,000 channels).
    fn finish_failovers(&mut self) {
        let state = &self.state;
        let metrics = &self.config.metrics;
        let now = self.clock.now();
        self.failovers.retain_mut(|f| {
            while let Some(c) = f.left.last() {
                let landed = state.entry(c).map_or(true, |e| {
                    e.info.state == chanwatch_core::ChannelState::Watched
                        && e.owner != chanwatch_core::ChannelOwner::Node(f.node)
                });
                if !landed {
                    return true;
                }
                f.left.pop();
            }
            let secs = now.saturating_duration_since(f.since).as_secs_f64();
            metrics.failover_seconds.observe(secs);
            info!(node = %f.node, channels = f.channels, seconds = secs, "coord: failover complete: every channel Watched elsewhere");
            false
        });
    }
}

#[cfg(test)]
mod tests;
