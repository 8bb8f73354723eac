//! The embedded backend: an in-process MVCC key-value store with etcd's semantics.
//!
//! Over 600 lines on purpose: one MVCC state behind one lock — keys, history, watchers,
//! leases — whose invariants (a revision's events delivered whole, leases and their keys
//! expiring together) are easiest to check in one place.
//!
//! Owns: the key space, the global revision counter, the event history (for watches from old
//! revisions, until compacted), the watchers, and the leases with their deadlines.
//!
//! Must not: block the async runtime. All state sits behind one `std::sync::Mutex` that is
//! never held across an `.await`; watch delivery is a non-blocking send to each watcher's
//! unbounded queue, so no event is ever dropped for a slow consumer (as in etcd, a slow
//! consumer costs memory, bounded by the history retention).
//!
//! Lease deadlines follow tokio time (see [`crate::Clock`]): under `tokio::time::pause()` a
//! test moves time and leases expire exactly when they would.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::error::{StoreError, StoreResult};
use crate::types::{
    Alarm, AlarmKind, Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, Lease,
    LeaseId, Limits, OpResponse, RangeResponse, Revision, Txn, TxnOp, TxnResponse, WatchBatch,
    WatchEvent,
};
use crate::{MetaStore, WatchStream};

/// Most events replayed per batch when a watch starts from an old revision; a revision is
/// never split, so a batch may exceed this by one revision's events.
const REPLAY_BATCH_EVENTS: usize = 1024;

/// Options of the embedded store.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// Request limits (etcd's defaults).
    pub limits: Limits,
    /// Keep at most this many revisions of history, compacting older ones automatically, so a
    /// long-running standalone does not grow without bound. `None` keeps everything until
    /// [`MetaStore::compact`] is called.
    pub history_revisions: Option<u64>,
    /// Smallest lease TTL granted, like etcd's minimum (which is about 2 s by default).
    pub min_lease_ttl: Duration,
}

impl Default for EmbeddedOptions {
    fn default() -> Self {
        EmbeddedOptions {
            limits: Limits::default(),
            history_revisions: Some(100_000),
            min_lease_ttl: Duration::from_secs(1),
        }
    }
}

/// The embedded store. Cheap to clone; clones share the data.
///
/// Must be created inside a tokio runtime: a background task expires leases on time. The
/// task stops when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    limits: Limits,
    history_revisions: Option<u64>,
    min_lease_ttl: Duration,
    /// Wakes the lease reaper when the earliest deadline may have moved.
    reaper_wake: Arc<Notify>,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.reaper_wake.notify_one();
    }
}

/// One committed revision, as [`EmbeddedStore::observe`] reports it.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The revision.
    pub revision: Revision,
    /// When it was committed (tokio time).
    pub at: Instant,
    /// Its events, in order.
    pub events: Arc<[WatchEvent]>,
}

#[derive(Debug)]
struct Watcher {
    keys: KeyRange,
    /// Events below this revision are not sent (a watch from a future revision).
    start_revision: Revision,
    /// Every event of the prefix up to this revision has been sent (events or progress).
    delivered: Revision,
    tx: mpsc::UnboundedSender<StoreResult<WatchBatch>>,
}

#[derive(Debug)]
struct LeaseState {
    ttl: Duration,
    deadline: Instant,
    keys: BTreeSet<String>,
}

#[derive(Debug, Default)]
struct State {
    revision: Revision,
    compact_revision: Revision,
    kvs: BTreeMap<String, KeyValue>,
    /// Events of each revision after `compact_revision`, oldest first.
    history: VecDeque<(Revision, Arc<[WatchEvent]>)>,
    watchers: Vec<Watcher>,
    /// Sees every revision, whatever happens to watches (see [`EmbeddedStore::observe`]).
    observers: Vec<mpsc::UnboundedSender<Observed>>,
    leases: HashMap<LeaseId, LeaseState>,
    /// Lease deadlines in order, for the reaper and for lazy expiry.
    deadlines: BTreeSet<(Instant, LeaseId)>,
    next_lease: LeaseId,
    /// The NOSPACE alarm is raised (see [`EmbeddedStore::set_nospace`]).
    nospace: bool,
    /// No leader: every call fails and no lease expires (see [`EmbeddedStore::set_outage`]).
    outage: bool,
}

impl EmbeddedStore {
    /// A store with default options.
    pub fn new() -> Self {
        Self::with_options(EmbeddedOptions::default())
    }

    /// A store with the given options.
    pub fn with_options(options: EmbeddedOptions) -> Self {
        let reaper_wake = Arc::new(Notify::new());
        let shared = Arc::new(Shared {
            state: Mutex::new(State {
                // etcd starts at revision 1 with an empty store.
                revision: 1,
                next_lease: 0x1000,
                ..State::default()
            }),
            limits: options.limits,
            history_revisions: options.history_revisions,
            min_lease_ttl: options.min_lease_ttl,
            reaper_wake: reaper_wake.clone(),
        });
        tokio::spawn(reap_leases(Arc::downgrade(&shared), reaper_wake));
        EmbeddedStore { shared }
    }

    /// The current revision.
    pub fn revision(&self) -> Revision {
        self.lock().revision
    }

    /// Fault injection: ends every open watch stream at once, as a broken connection to etcd
    /// would. Watchers must relist or watch again.
    pub fn break_watches(&self) {
        self.lock().watchers.clear();
    }

    /// Every revision committed from now on, in order: a test's or a simulation's invariant
    /// checker reads the whole history through it. Unlike a watch it is never broken by
    /// [`break_watches`](Self::break_watches) nor cut short by compaction.
    pub fn observe(&self) -> mpsc::UnboundedReceiver<Observed> {
        let (tx, rx) = mpsc::unbounded_channel();
        self.lock().observers.push(tx);
        rx
    }

    /// Fault injection: raises (`true`) or disarms (`false`) the NOSPACE alarm. While it is
    /// raised the store refuses what etcd 3.4 refuses then: every txn with a put in either
    /// branch and every lease grant, with [`StoreError::NoSpace`]; txns that only delete or
    /// read, watches, keepalives, revokes and compaction pass, and [`MetaStore::alarms`]
    /// reports it.
    pub fn set_nospace(&self, on: bool) {
        self.lock().nospace = on;
    }

    /// Fault injection: the whole store goes away (`true`) and comes back (`false`), as an
    /// etcd cluster does when it crashes, restarts or loses quorum. Meanwhile every call fails
    /// with [`StoreError::Unavailable`], every watch stream ends, and no lease expires (etcd
    /// has no leader to expire them); on return every lease gets a whole TTL again, as a newly
    /// elected etcd leader grants. So a client that keeps renewing finds its lease alive.
    pub fn set_outage(&self, on: bool) {
        let now = Instant::now();
        {
            let mut state = self.lock();
            if state.outage == on {
                return;
            }
            state.outage = on;
            if on {
                state.watchers.clear();
            } else {
                let mut deadlines = BTreeSet::new();
                for (id, l) in &mut state.leases {
                    l.deadline = now + l.ttl;
                    deadlines.insert((l.deadline, *id));
                }
                state.deadlines = deadlines;
            }
        }
        self.shared.reaper_wake.notify_one();
    }

    /// Number of live keys (for metrics and benchmarks).
    pub fn len(&self) -> usize {
        self.lock().kvs.len()
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.shared.lock()
    }
}

impl Default for EmbeddedStore {
    fn default() -> Self {
        Self::new()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written: every mutation
        // is computed first and applied without fallible steps. So a poisoned lock is usable.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Expires leases when their deadline passes, even when nobody calls the store.
async fn reap_leases(shared: Weak<Shared>, wake: Arc<Notify>) {
    loop {
        let next = {
            let Some(shared) = shared.upgrade() else {
                return;
            };
            let mut state = shared.lock();
            state.expire_due(Instant::now(), &shared);
            // During an outage nothing expires: wait to be woken when it ends.
            (!state.outage)
                .then(|| state.deadlines.first().map(|&(deadline, _)| deadline))
                .flatten()
        };
        match next {
            Some(deadline) => {
                tokio::select! {
                    biased;
                    () = tokio::time::sleep_until(deadline) => {}
                    () = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
    }
}

/// One change made by a txn, before it becomes a watch event.
struct Change {
    kind: EventKind,
    kv: KeyValue,
    prev: Option<KeyValue>,
}

impl State {
    /// `Unavailable` while the store is away ([`EmbeddedStore::set_outage`]).
    fn available(&self) -> StoreResult<()> {
        if self.outage {
            return Err(StoreError::Unavailable {
                endpoints: "embedded".into(),
                message: "the store is away (simulated outage: no leader)".into(),
            });
        }
        Ok(())
    }

    fn expire_due(&mut self, now: Instant, shared: &Shared) {
        if self.outage {
            return; // no leader, no expiry
        }
        while let Some(&(deadline, id)) = self.deadlines.first() {
            if deadline > now {
                break;
            }
            self.deadlines.pop_first();
            if let Some(lease) = self.leases.remove(&id) {
                tracing::debug!(
                    lease = id,
                    keys = lease.keys.len(),
                    "embedded store: lease expired"
                );
                self.delete_lease_keys(lease, shared);
            }
        }
    }

    /// Deletes a dead lease's keys in one revision.
    fn delete_lease_keys(&mut self, lease: LeaseState, shared: &Shared) {
        let mut changes = Vec::with_capacity(lease.keys.len());
        let rev = self.revision + 1;
        for key in lease.keys {
            if let Some(prev) = self.kvs.remove(&key) {
                changes.push(Change {
                    kind: EventKind::Delete,
                    kv: tombstone(&key, rev),
                    prev: Some(prev),
                });
            }
        }
        self.commit(changes, shared);
    }

    /// Sends a progress notification at the current revision to every watch that has not been
    /// told about it yet (etcd answers a progress request likewise). Called on each lease
    /// renewal, so a node's watch hears of every revision its keepalive answers name.
    fn progress_all(&mut self) {
        let rev = self.revision;
        for w in &mut self.watchers {
            if w.delivered < rev && rev >= w.start_revision {
                w.delivered = rev;
                let _ = w.tx.send(Ok(WatchBatch::progress(rev)));
            }
        }
    }

    /// Advances the revision if anything changed, records history and notifies watchers.
    fn commit(&mut self, changes: Vec<Change>, shared: &Shared) {
        if changes.is_empty() {
            return;
        }
        self.revision += 1;
        let rev = self.revision;
        let events: Arc<[WatchEvent]> = changes
            .into_iter()
            .map(|c| WatchEvent {
                kind: c.kind,
                kv: c.kv,
                prev_kv: c.prev,
            })
            .collect();
        self.watchers.retain_mut(|w| {
            if w.tx.is_closed() {
                return false;
            }
            if rev < w.start_revision {
                return true;
            }
            let matching: Vec<WatchEvent> = events
                .iter()
                .filter(|e| w.keys.contains(&e.kv.key))
                .cloned()
                .collect();
            if matching.is_empty() {
                return true;
            }
            w.delivered = rev;
            w.tx.send(Ok(WatchBatch::of_events(matching))).is_ok()
        });
        let at = Instant::now();
        self.observers.retain(|o| {
            o.send(Observed {
                revision: rev,
                at,
                events: events.clone(),
            })
            .is_ok()
        });
        self.history.push_back((rev, events));
        if let Some(keep) = shared.history_revisions {
            let keep = Revision::try_from(keep).unwrap_or(Revision::MAX);
            let floor = rev.saturating_sub(keep);
            if floor > self.compact_revision {
                self.compact_to(floor);
            }
        }
    }

    fn compact_to(&mut self, revision: Revision) {
        while self.history.front().is_some_and(|(r, _)| *r < revision) {
            self.history.pop_front();
        }
        self.compact_revision = revision;
    }

    fn compare_holds(&self, c: &Compare) -> bool {
        let kv = self.kvs.get(&c.key);
        let ord = match &c.target {
            // etcd fails every value compare on a missing key, whatever the operator: a
            // missing value is not the empty value.
            CompareTarget::Value(v) => match kv {
                Some(kv) => kv.value.as_slice().cmp(v.as_slice()),
                None => return false,
            },
            CompareTarget::ModRevision(r) => kv.map_or(0, |kv| kv.mod_revision).cmp(r),
            CompareTarget::CreateRevision(r) => kv.map_or(0, |kv| kv.create_revision).cmp(r),
            CompareTarget::Version(v) => kv.map_or(0, |kv| kv.version).cmp(v),
        };
        match c.op {
            CompareOp::Equal => ord.is_eq(),
            CompareOp::NotEqual => ord.is_ne(),
            CompareOp::Less => ord.is_lt(),
            CompareOp::Greater => ord.is_gt(),
        }
    }

    /// Refuses what etcd refuses before touching anything: a key written twice in one branch,
    /// and puts on leases that do not exist.
    fn validate(&self, ops: &[TxnOp]) -> StoreResult<()> {
        let mut puts: HashSet<&str> = HashSet::new();
        for op in ops {
            if let TxnOp::Put { key, lease, .. } = op {
                if !puts.insert(key.as_str()) {
                    return Err(StoreError::InvalidArgument(format!(
                        "duplicate key {key:?} given in txn request"
                    )));
                }
                if let Some(id) = lease {
                    if !self.leases.contains_key(id) {
                        return Err(StoreError::LeaseNotFound(*id));
                    }
                }
            }
        }
        for op in ops {
            let overlaps = match op {
                TxnOp::Delete { key } => puts.contains(key.as_str()),
                TxnOp::DeletePrefix { prefix } => {
                    puts.iter().any(|k| k.starts_with(prefix.as_str()))
                }
                _ => false,
            };
            if overlaps {
                return Err(StoreError::InvalidArgument(
                    "duplicate key given in txn request: a key is both put and deleted".into(),
                ));
            }
        }
        Ok(())
    }

    fn apply(&mut self, ops: Vec<TxnOp>, shared: &Shared) -> (Vec<OpResponse>, Revision) {
        let rev = self.revision + 1;
        let mut changes = Vec::new();
        let mut responses = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => {
                    let prev = self.kvs.get(&key).cloned();
                    let (create_revision, version) = match &prev {
                        Some(p) => (p.create_revision, p.version + 1),
                        None => (rev, 1),
                    };
                    if let Some(old) = prev.as_ref().and_then(|p| p.lease) {
                        if Some(old) != lease {
                            if let Some(l) = self.leases.get_mut(&old) {
                                l.keys.remove(&key);
                            }
                        }
                    }
                    if let Some(id) = lease {
                        if let Some(l) = self.leases.get_mut(&id) {
                            l.keys.insert(key.clone());
                        }
                    }
                    let kv = KeyValue {
                        key: key.clone(),
                        value,
                        create_revision,
                        mod_revision: rev,
                        version,
                        lease,
                    };
                    self.kvs.insert(key, kv.clone());
                    changes.push(Change {
                        kind: EventKind::Put,
                        kv,
                        prev,
                    });
                    responses.push(OpResponse::Put);
                }
                TxnOp::Delete { key } => {
                    let deleted = self.delete_key(&key, rev, &mut changes);
                    responses.push(OpResponse::Delete {
                        deleted: u64::from(deleted),
                    });
                }
                TxnOp::DeletePrefix { prefix } => {
                    let keys: Vec<String> = self
                        .kvs
                        .range::<str, _>((
                            std::ops::Bound::Included(prefix.as_str()),
                            std::ops::Bound::Unbounded,
                        ))
                        .take_while(|(k, _)| k.starts_with(&prefix))
                        .map(|(k, _)| k.clone())
                        .collect();
                    let mut deleted = 0;
                    for key in keys {
                        if self.delete_key(&key, rev, &mut changes) {
                            deleted += 1;
                        }
                    }
                    responses.push(OpResponse::Delete { deleted });
                }
                TxnOp::Get { key } => responses.push(OpResponse::Get {
                    kv: self.kvs.get(&key).cloned(),
                }),
            }
        }
        self.commit(changes, shared);
        (responses, self.revision)
    }

    fn delete_key(&mut self, key: &str, rev: Revision, changes: &mut Vec<Change>) -> bool {
        let Some(prev) = self.kvs.remove(key) else {
            return false;
        };
        if let Some(l) = prev.lease.and_then(|id| self.leases.get_mut(&id)) {
            l.keys.remove(key);
        }
        changes.push(Change {
            kind: EventKind::Delete,
            kv: tombstone(key, rev),
            prev: Some(prev),
        });
        true
    }
}

fn tombstone(key: &str, rev: Revision) -> KeyValue {
    KeyValue {
        key: key.to_owned(),
        value: Vec::new(),
        create_revision: 0,
        mod_revision: rev,
        version: 0,
        lease: None,
    }
}

fn key_range<'a>(
    kvs: &'a BTreeMap<String, KeyValue>,
    keys: &'a KeyRange,
) -> impl Iterator<Item = &'a KeyValue> + 'a {
    kvs.range::<str, _>((
        std::ops::Bound::Included(keys.start()),
        std::ops::Bound::Unbounded,
    ))
    .take_while(move |(k, _)| keys.contains(k))
    .map(|(_, v)| v)
}

#[async_trait]
impl MetaStore for EmbeddedStore {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        let mut state = self.lock();
        state.available()?;
        state.expire_due(Instant::now(), &self.shared);
        Ok(state.kvs.get(key).cloned())
    }

    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse> {
        let mut state = self.lock();
        state.available()?;
        state.expire_due(Instant::now(), &self.shared);
        Ok(RangeResponse {
            kvs: key_range(&state.kvs, keys).cloned().collect(),
            revision: state.revision,
        })
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        txn.check(&self.shared.limits)?;
        let mut state = self.lock();
        state.available()?;
        state.expire_due(Instant::now(), &self.shared);
        state.validate(&txn.then)?;
        state.validate(&txn.otherwise)?;
        // etcd's quota check: a txn costs the puts of its larger branch; one with any put is
        // refused, one that only deletes or reads passes.
        if state.nospace
            && txn
                .then
                .iter()
                .chain(&txn.otherwise)
                .any(|op| matches!(op, TxnOp::Put { .. }))
        {
            return Err(StoreError::NoSpace);
        }
        let succeeded = txn.compares.iter().all(|c| state.compare_holds(c));
        let ops = if succeeded { txn.then } else { txn.otherwise };
        let (responses, revision) = state.apply(ops, &self.shared);
        Ok(TxnResponse {
            succeeded,
            revision,
            responses,
        })
    }

    async fn watch_keys(
        &self,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream> {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut state = self.lock();
        state.available()?;
        state.expire_due(Instant::now(), &self.shared);
        let start = if from_revision <= 0 {
            state.revision + 1
        } else {
            from_revision
        };
        if start < state.compact_revision {
            // The receiver gets the error as its only item; the sender is dropped right after.
            let _ = tx.send(Err(StoreError::Compacted {
                compact_revision: state.compact_revision,
            }));
        } else {
            // Replay and registration happen under one lock, so no revision falls in between.
            let mut batch: Vec<WatchEvent> = Vec::new();
            for (rev, events) in &state.history {
                if *rev < start {
                    continue;
                }
                if batch.len() >= REPLAY_BATCH_EVENTS {
                    let _ = tx.send(Ok(WatchBatch::of_events(std::mem::take(&mut batch))));
                }
                batch.extend(events.iter().filter(|e| keys.contains(&e.kv.key)).cloned());
            }
            if !batch.is_empty() {
                let _ = tx.send(Ok(WatchBatch::of_events(batch)));
            }
            let delivered = state.revision;
            state.watchers.push(Watcher {
                keys: keys.clone(),
                start_revision: start,
                delivered,
                tx,
            });
        }
        drop(state);
        Ok(Box::pin(futures_util::stream::poll_fn(move |cx| {
            rx.poll_recv(cx)
        })))
    }

    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        // Whole seconds, rounded up, as etcd does.
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let ttl = Duration::from_secs(secs).max(self.shared.min_lease_ttl);
        let now = Instant::now();
        let id = {
            let mut state = self.lock();
            state.available()?;
            if state.nospace {
                return Err(StoreError::NoSpace);
            }
            state.expire_due(now, &self.shared);
            state.next_lease += 1;
            let id = state.next_lease;
            state.leases.insert(
                id,
                LeaseState {
                    ttl,
                    deadline: now + ttl,
                    keys: BTreeSet::new(),
                },
            );
            state.deadlines.insert((now + ttl, id));
            id
        };
        self.shared.reaper_wake.notify_one();
        Ok(Lease { id, ttl })
    }

    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision> {
        let now = Instant::now();
        let mut state = self.lock();
        state.available()?;
        state.expire_due(now, &self.shared);
        let Some(l) = state.leases.get_mut(&lease) else {
            return Err(StoreError::LeaseNotFound(lease));
        };
        let old = l.deadline;
        l.deadline = now + l.ttl;
        let new = l.deadline;
        state.deadlines.remove(&(old, lease));
        state.deadlines.insert((new, lease));
        let revision = state.revision;
        state.progress_all();
        Ok(revision)
    }

    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        let mut state = self.lock();
        state.available()?;
        state.expire_due(Instant::now(), &self.shared);
        let Some(l) = state.leases.remove(&lease) else {
            return Err(StoreError::LeaseNotFound(lease));
        };
        state.deadlines.remove(&(l.deadline, lease));
        state.delete_lease_keys(l, &self.shared);
        Ok(())
    }

    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        let mut state = self.lock();
        state.available()?;
        if revision > state.revision {
            return Err(StoreError::FutureRevision {
                requested: revision,
                current: state.revision,
            });
        }
        if revision <= state.compact_revision {
            return Err(StoreError::Compacted {
                compact_revision: state.compact_revision,
            });
        }
        state.compact_to(revision);
        Ok(())
    }

    async fn alarms(&self) -> StoreResult<Vec<Alarm>> {
        Ok(if self.lock().nospace {
            vec![Alarm {
                member: 0,
                kind: AlarmKind::NoSpace,
            }]
        } else {
            Vec::new()
        })
    }

    fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    fn describe(&self) -> String {
        "embedded".to_owned()
    }
}
