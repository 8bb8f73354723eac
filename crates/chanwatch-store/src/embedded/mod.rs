//! The embedded backend: an in-process MVCC key-value store with etcd's semantics.
//!
//! Owns: the store's handle, its one lock, the lease reaper and the [`MetaStore`] calls. The
//! MVCC state behind the lock — keys, revision, history, leases — and what a txn does to it
//! are in `state`; the open watches and who hears of each revision are in `watchers`
//! (indexed by prefix; progress only to the renewing client's watches, see
//! [`EmbeddedStore::client`]).
//!
//! Must not: block the async runtime. All state sits behind one `std::sync::Mutex` that is
//! never held across an `.await`; watch delivery is a non-blocking send to each watcher's
//! unbounded queue, so no event is ever dropped for a slow consumer (as in etcd, a slow
//! consumer costs memory, bounded by the history retention).
//!
//! Lease deadlines follow tokio time (see [`crate::Clock`]): under `tokio::time::pause()` a
//! test moves time and leases expire exactly when they would.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{mpsc, Notify};
use tokio::time::Instant;

use crate::error::{StoreError, StoreResult};
use crate::types::{
    Alarm, AlarmKind, KeyRange, KeyValue, Lease, LeaseId, Limits, RangeResponse, Revision, Txn,
    TxnOp, TxnResponse, WatchBatch, WatchEvent,
};
use crate::{MetaStore, WatchStream};

mod state;
mod watchers;

use state::{key_range, LeaseState, State};
use watchers::{ClientId, Watcher};

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

/// The embedded store. Cheap to clone; clones share the data and are one client (as clones
/// of an etcd client share its connection); [`client`](Self::client) makes another.
///
/// Must be created inside a tokio runtime: a background task expires leases on time. The
/// task stops when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct EmbeddedStore {
    shared: Arc<Shared>,
    /// Which client this handle is: a keepalive through it sends progress notifications to
    /// the watches opened through this client only.
    client: ClientId,
}

#[derive(Debug)]
struct Shared {
    state: Mutex<State>,
    limits: Limits,
    history_revisions: Option<u64>,
    min_lease_ttl: Duration,
    /// Wakes the lease reaper when the earliest deadline may have moved.
    reaper_wake: Arc<Notify>,
    /// The last client id handed out (see [`EmbeddedStore::client`]).
    clients: AtomicU64,
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
            clients: AtomicU64::new(0),
        });
        tokio::spawn(reap_leases(Arc::downgrade(&shared), reaper_wake));
        EmbeddedStore { shared, client: 0 }
    }

    /// Another client of the same store, as a second connection to etcd is: the same keys,
    /// leases and watches, but a lease renewal through one client sends progress
    /// notifications only to the watches opened through that client (etcd answers a progress
    /// request on the stream that asked). Give each in-process node a client of its own: then
    /// a renewal costs a message to that node's watch, not one to every watch in the process.
    #[must_use]
    pub fn client(&self) -> Self {
        EmbeddedStore {
            shared: self.shared.clone(),
            client: self.shared.clients.fetch_add(1, Ordering::Relaxed) + 1,
        }
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
            state.watchers.add(Watcher {
                keys: keys.clone(),
                start_revision: start,
                delivered,
                client: self.client,
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
        state.watchers.progress(self.client, revision);
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

    fn new_client(&self) -> Option<Arc<dyn MetaStore>> {
        Some(Arc::new(self.client()))
    }
}
