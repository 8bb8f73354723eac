//! Txn execution for a term: planned txns become guarded store txns, run pipelined; a
//! refused txn's read-back refreshes the view; nodes the planner wants fenced lose their
//! session lease.
//!
//! Owns: the term's one write path ([`sends`]: the translation of [`PlannedTxn`] into store
//! txns, every one guarded by the leader key's create revision so a deposed leader cannot
//! write, and their sending — plan rounds, bulk lists and admin requests all write through
//! it), fencing by lease revoke, and the txn metrics and transition log lines.
//! Must not: plan — what to write comes from the planner — or write anything but channel
//! keys, drain and fence marks.

use std::sync::Arc;

use chanwatch_core::planner::{Guard, Op, PlannedTxn};
use chanwatch_core::{Keys, NodeId};
use chanwatch_store::{Clock, Compare, MetaStore, OpResponse, StoreError, Txn, TxnOp};
use futures_util::StreamExt;
use tracing::{debug, info, warn};

use crate::term::Term;

/// A planned txn, what the store answered, and when it was sent.
pub(crate) type Sent = (
    PlannedTxn,
    Result<chanwatch_store::TxnResponse, StoreError>,
    tokio::time::Instant,
);

/// The term's one write path: each planned txn as a future that encodes it (guarded by the
/// leader key, [`Encoder`]) and sends it. Plan rounds run these `pipeline` at once in any
/// order ([`Term::execute`]), bulk lists in order off the loop (`bulk.rs`), an admin
/// request's one txn alone ([`Term::run_one`]).
pub(crate) fn sends(
    store: Arc<dyn MetaStore>,
    encoder: Arc<Encoder>,
    txns: Vec<PlannedTxn>,
) -> impl Iterator<Item = impl std::future::Future<Output = Sent>> {
    txns.into_iter().map(move |t| {
        let (store, encoder) = (store.clone(), encoder.clone());
        async move {
            let s = encoder.txn(&t);
            let started = encoder.clock.now();
            let answer = store.txn(s).await;
            (t, answer, started)
        }
    })
}

/// What turns a planned txn into a store txn, cut loose from the term: a round's txns are
/// each encoded by the future that sends it, so the first leaves as soon as its own values
/// are serialized (encoded all before the first was sent, a failover's 16 txns of 62 moves
/// held the first back by the serializing of all 1,000 values).
pub(crate) struct Encoder {
    keys: Keys,
    leader_rev: i64,
    /// Compares (and reads) a txn may hold.
    room: usize,
    clock: Clock,
    /// The mod revision of each live node's session as the view holds it.
    session_revs: std::collections::BTreeMap<NodeId, i64>,
}

impl Encoder {
    pub(crate) fn txn(&self, t: &PlannedTxn) -> Txn {
        let keys = &self.keys;
        let mut compares = Vec::with_capacity(t.guards.len() + 1);
        // The leader never rewrites its key, so its mod revision is the revision that created
        // it: any write to the key since — a blind overwrite keeps the create revision — and
        // every txn of this term is refused.
        compares.push(Compare::mod_revision(keys.leader(), self.leader_rev));
        compares.extend(t.guards.iter().map(|g: &Guard| {
            let key = keys.channel(g.owner, &g.channel);
            if g.mod_revision == 0 {
                Compare::absent(key)
            } else {
                Compare::mod_revision(key, g.mod_revision)
            }
        }));
        let sessions = self.session_guards(t);
        // The session as seen, not just any session: a node that announced `leaving`
        // (rewriting its session) after this was planned must not get the put — it may be
        // about to end its session with nothing under it (found by the simulation: a move
        // landed on a node one revision before its planned restart revoked the lease).
        compares.extend(sessions.iter().map(|n| {
            let key = keys.session(*n);
            match self.session_revs.get(n) {
                Some(rev) => Compare::mod_revision(key, *rev),
                None => Compare::exists(key),
            }
        }));
        // Deletes first, so one revision's events read "old key gone, new key there".
        let mut ops: Vec<TxnOp> = Vec::with_capacity(t.ops.len());
        for op in &t.ops {
            if let Op::Delete { owner, channel } = op {
                ops.push(TxnOp::delete(keys.channel(*owner, channel)));
            }
        }
        for op in &t.ops {
            match op {
                Op::Put { owner, info } => {
                    ops.push(TxnOp::put(
                        keys.channel(*owner, &info.channel),
                        info.encode(),
                    ));
                }
                Op::Drain { node } => {
                    let since = serde_json::json!({ "since_ms": self.clock.unix_ms() });
                    ops.push(TxnOp::put(keys.drain(*node), since.to_string()));
                }
                Op::Undrain { node } => ops.push(TxnOp::delete(keys.drain(*node))),
                Op::DeleteCheckpoint { channel } => {
                    ops.push(TxnOp::delete(keys.checkpoint(channel)));
                }
                Op::Fence { node } => {
                    let since = serde_json::json!({ "since_ms": self.clock.unix_ms() });
                    ops.push(TxnOp::put(keys.fence(*node), since.to_string()));
                }
                Op::Unfence { node } => ops.push(TxnOp::delete(keys.fence(*node))),
                Op::Delete { .. } => {}
            }
        }
        // When a compare fails, the same round trip returns what the keys hold now (leader
        // key first), so the view is fixed at once instead of when the watch catches up: a
        // single stale guard refuses a whole txn of ~127 channels, and a watch that lags
        // under load made a failover retry the same doomed txn for hundreds of ms.
        let mut reads = Vec::with_capacity(t.guards.len() + 1);
        reads.push(TxnOp::get(keys.leader()));
        reads.extend(
            t.guards
                .iter()
                .map(|g| TxnOp::get(keys.channel(g.owner, &g.channel))),
        );
        reads.extend(sessions.iter().map(|n| TxnOp::get(keys.session(*n))));
        Txn::new().when(compares).and_then(ops).or_else(reads)
    }

    /// Nodes a txn puts channel keys under: the txn also requires their sessions to exist,
    /// so nothing is assigned to a node that died before the watch told us (a put on a dead
    /// node is refused and the refusal's reads show the session gone). Empty when the
    /// compare and read lists have no room left (big planned txns; the next plan fixes
    /// those).
    pub(crate) fn session_guards(&self, t: &PlannedTxn) -> Vec<NodeId> {
        let nodes: std::collections::BTreeSet<NodeId> = t
            .ops
            .iter()
            .filter_map(|op| match op {
                Op::Put {
                    owner: chanwatch_core::ChannelOwner::Node(n),
                    ..
                } => Some(*n),
                _ => None,
            })
            .collect();
        if t.guards.len() + 1 + nodes.len() > self.room {
            return Vec::new();
        }
        nodes.into_iter().collect()
    }
}

impl Term<'_> {
    /// The encoder of this term's txns.
    pub(crate) fn encoder(&self) -> Encoder {
        Encoder {
            keys: self.config.keys.clone(),
            leader_rev: self.leader_rev,
            room: self
                .config
                .planner
                .max_txn_ops
                .min(self.store.limits().max_txn_ops),
            clock: self.clock,
            session_revs: self.state.session_revisions().clone(),
        }
    }

    /// Brings the view up to date with what a refused txn read back. `Err` when the leader
    /// key is no longer ours.
    pub(crate) fn refresh(
        &mut self,
        t: &PlannedTxn,
        resp: &chanwatch_store::TxnResponse,
    ) -> Result<(), String> {
        let mut reads = resp.responses.iter();
        match reads.next() {
            Some(OpResponse::Get { kv: Some(kv) }) if kv.mod_revision == self.leader_rev => {}
            Some(OpResponse::Get { .. }) => {
                return Err("the leader key belongs to someone else: deposed".into())
            }
            _ => return Ok(()),
        }
        let keys = &self.config.keys;
        for (g, r) in t.guards.iter().zip(reads.by_ref()) {
            let key = keys.channel(g.owner, &g.channel);
            let now = match r {
                OpResponse::Get { kv: Some(kv) } => kv.mod_revision,
                _ => 0,
            };
            if now != g.mod_revision {
                debug!(channel = %g.channel, owner = %g.owner, expected = g.mod_revision, found = now, "coord: stale guard");
            }
            match r {
                OpResponse::Get { kv: Some(kv) } => {
                    self.state.apply_put(&key, &kv.value, kv.mod_revision);
                }
                OpResponse::Get { kv: None } => self.state.apply_delete(&key, resp.revision),
                _ => {}
            }
        }
        for (n, r) in self.encoder().session_guards(t).into_iter().zip(reads) {
            let key = self.config.keys.session(n);
            match r {
                OpResponse::Get { kv: None } if self.state.nodes().contains_key(&n) => {
                    self.state.apply_delete(&key, resp.revision);
                    self.session_gone(n, "a refused txn");
                }
                // Rewritten since (`leaving`): the view takes the new value now.
                OpResponse::Get { kv: Some(kv) } => {
                    self.state.apply_put(&key, &kv.value, kv.mod_revision);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Runs planned txns, up to `pipeline` at once, and returns how many were refused (the
    /// view was stale; it is refreshed). `Err` when leadership was lost.
    pub(crate) async fn execute(&mut self, txns: Vec<PlannedTxn>) -> Result<usize, String> {
        self.fence_nodes().await;
        if txns.is_empty() {
            return Ok(0);
        }
        let txns_sent = txns.len();
        // Each txn is encoded in its own future: the first is sent once its own values are
        // serialized, while the others are still being encoded.
        let mut results =
            futures_util::stream::iter(sends(self.store.clone(), Arc::new(self.encoder()), txns))
                .buffer_unordered(self.config.pipeline.max(1));
        // Only a small txn sent alone times the store's commit (the others queue behind each
        // other, and a large one is etcd's apply as much as its commit).
        let alone = txns_sent == 1;
        // Each txn's result is applied to the view as it comes, while the others are still
        // in flight: applied after the last one, a failover's 16 txns of 62 moves each
        // added 3–9 ms of view updates after etcd had answered them all.
        let (mut refused, mut committed, mut count) = (0, 0, 0);
        while let Some((t, r, started)) = results.next().await {
            count += 1;
            self.record_txn(&r, started, alone && t.ops.len() <= PACE_OPS);
            match r {
                Ok(resp) if resp.succeeded => {
                    committed += 1;
                    self.state.applied(&t, resp.revision);
                    self.log_transitions(&t);
                    if let Some(refused) = self.availability.writes_taken(self.clock.now()) {
                        // Nodes could not ack either while etcd refused writes: that time
                        // does not count against their releases and loads.
                        info!(refused_ms = millis(refused), "coord: etcd takes writes again; timeouts wait as long as it refused them");
                        self.timers_stand_still(refused);
                    }
                }
                Ok(resp) => {
                    refused += 1;
                    self.refresh(&t, &resp)?;
                }
                Err(e) => {
                    if matches!(e, StoreError::NoSpace) {
                        self.availability.write_refused(started);
                    }
                    warn!(error = %e, channels = t.transitions.len(), "coord: txn failed; the next plan retries")
                }
            }
        }
        debug!(txns = count, committed, "coord: executed a plan round");
        if refused > 0 {
            debug!(
                refused,
                "coord: txns refused (stale view); refreshed the keys they guard"
            );
        }
        // Fence marks that just landed.
        self.fence_nodes().await;
        Ok(refused)
    }
}

impl Term<'_> {
    /// Revokes the session lease of every node the planner wants fenced: a node that did
    /// not release a channel within the release timeout, so that the channel can move
    /// without running beside it (DESIGN §3). A revoke that fails is asked for again by the
    /// planner; a session already gone needs none.
    pub(crate) async fn fence_nodes(&mut self) {
        let mut nodes = self.state.take_fence_requests();
        nodes.dedup();
        for node in nodes {
            let key = self.config.keys.session(node);
            let lease = match self.store.get(&key).await {
                Ok(Some(kv)) => kv.lease,
                Ok(None) => None,
                Err(e) => {
                    warn!(node = %node, error = %e, "coord: cannot read the session of a node to fence; retrying");
                    continue;
                }
            };
            let Some(lease) = lease else {
                continue; // the session is gone already
            };
            match self.store.revoke(lease).await {
                Ok(()) => {
                    warn!(
                        node = %node,
                        wait_ms = self.config.planner.fence_wait_ms,
                        "coord: node did not release a channel within the release timeout; revoked its session lease to fence it — its channels fail over once it has surely stopped them"
                    );
                    self.config.metrics.fences.inc();
                }
                Err(StoreError::LeaseNotFound(_)) => {}
                Err(e) => {
                    warn!(node = %node, error = %e, "coord: revoking the session lease of a node to fence failed; retrying");
                }
            }
        }
    }

    /// Counts a txn's outcome and time in the metrics; `pace`: it was small and alone in
    /// flight, so its time is the store's commit time (the pacer's loss hold: `core/planner/pacer/losses.rs`).
    pub(crate) fn record_txn(
        &mut self,
        r: &Result<chanwatch_store::TxnResponse, StoreError>,
        started: tokio::time::Instant,
        pace: bool,
    ) {
        let took = self.clock.now().saturating_duration_since(started);
        if pace && r.is_ok() {
            self.pacer.wrote(took);
        }
        let m = &self.config.metrics;
        m.txn_seconds.observe(took.as_secs_f64());
        m.txn(match r {
            Ok(resp) if resp.succeeded => "committed",
            Ok(_) => "refused",
            Err(_) => "error",
        });
    }

    /// One log line, one counter and one event per channel transition; an event per drain
    /// or fence mark written or deleted.
    pub(crate) fn log_transitions(&self, t: &PlannedTxn) {
        // A failed channel's new value says why (`failed: …`, the node's words): the event
        // and the log line carry it, so `ctl events` tells the operator.
        let failed_why = |tr: &chanwatch_core::planner::Transition| -> Option<String> {
            if tr.cause != chanwatch_core::planner::Cause::Failed {
                return None;
            }
            t.ops.iter().find_map(|op| match op {
                Op::Put { info, .. } if info.channel == tr.channel => info
                    .reason
                    .as_deref()
                    .and_then(|r| r.strip_prefix("failed: "))
                    .map(str::to_owned),
                _ => None,
            })
        };
        self.events.transitions_with(&t.transitions, failed_why);
        for op in &t.ops {
            match op {
                Op::Drain { node } => self.events.node(*node, "drained", None),
                Op::Undrain { node } => self.events.node(*node, "undrained", None),
                Op::Fence { node } => self.events.node(
                    *node,
                    "fenced",
                    Some("did not release a channel within the release timeout".into()),
                ),
                _ => {}
            }
        }
        for tr in &t.transitions {
            // Releases are the first half of a move; count the move once, when it lands.
            if tr.state != Some(chanwatch_core::ChannelState::ToRelease) {
                self.config.metrics.reassigned(tr.cause.as_str());
            }
            let (from, to) = (
                tr.from.map(|o| o.to_string()).unwrap_or_else(|| "-".into()),
                tr.to.map(|o| o.to_string()).unwrap_or_else(|| "-".into()),
            );
            let state = tr.state.map_or("deleted", |s| s.as_str());
            match failed_why(tr) {
                Some(reason) => {
                    info!(channel = %tr.channel, cause = tr.cause.as_str(), from, to, state, epoch = %tr.epoch, reason, "coord: channel transition")
                }
                None => {
                    info!(channel = %tr.channel, cause = tr.cause.as_str(), from, to, state, epoch = %tr.epoch, "coord: channel transition")
                }
            }
        }
    }
}

/// Most ops of a txn whose time counts toward the store's commit pace (`record_txn`).
pub(crate) const PACE_OPS: usize = 16;

pub(crate) use chanwatch_store::millis;
