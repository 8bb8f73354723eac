//! The embedded store's MVCC state: keys, history, leases, and applying a txn to them.
//!
//! Owns: what one txn, expiry or revoke does to the keys, at which revision, and handing each
//! committed revision to the watchers ([`super::watchers`]), the observers and the history.
//! Must not: lock, await or know about clients; [`super::EmbeddedStore`] holds the lock and
//! calls in.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::Instant;

use super::watchers::Watchers;
use super::{Observed, Shared};
use crate::error::{StoreError, StoreResult};
use crate::types::{
    Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, LeaseId, OpResponse,
    Revision, TxnOp, WatchEvent,
};

/// One lease.
#[derive(Debug)]
pub(super) struct LeaseState {
    pub(super) ttl: Duration,
    pub(super) deadline: Instant,
    pub(super) keys: BTreeSet<String>,
}

/// Everything behind the store's one lock.
#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) revision: Revision,
    pub(super) compact_revision: Revision,
    pub(super) kvs: BTreeMap<String, KeyValue>,
    /// Events of each revision after `compact_revision`, oldest first.
    pub(super) history: VecDeque<(Revision, Arc<[WatchEvent]>)>,
    pub(super) watchers: Watchers,
    /// Sees every revision, whatever happens to watches (see [`super::EmbeddedStore::observe`]).
    pub(super) observers: Vec<mpsc::UnboundedSender<Observed>>,
    pub(super) leases: HashMap<LeaseId, LeaseState>,
    /// Lease deadlines in order, for the reaper and for lazy expiry.
    pub(super) deadlines: BTreeSet<(Instant, LeaseId)>,
    pub(super) next_lease: LeaseId,
    /// The NOSPACE alarm is raised (see [`super::EmbeddedStore::set_nospace`]).
    pub(super) nospace: bool,
    /// No leader: every call fails and no lease expires (see [`super::EmbeddedStore::set_outage`]).
    pub(super) outage: bool,
}
/// One change made by a txn, before it becomes a watch event.
struct Change {
    kind: EventKind,
    kv: KeyValue,
}

impl State {
    /// `Unavailable` while the store is away ([`super::EmbeddedStore::set_outage`]).
    pub(super) fn available(&self) -> StoreResult<()> {
        if self.outage {
            return Err(StoreError::Unavailable {
                endpoints: "embedded".into(),
                message: "the store is away (simulated outage: no leader)".into(),
            });
        }
        Ok(())
    }

    pub(super) fn expire_due(&mut self, now: Instant, shared: &Shared) {
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
    pub(super) fn delete_lease_keys(&mut self, lease: LeaseState, shared: &Shared) {
        let mut changes = Vec::with_capacity(lease.keys.len());
        let rev = self.revision + 1;
        for key in lease.keys {
            if self.kvs.remove(&key).is_some() {
                changes.push(Change {
                    kind: EventKind::Delete,
                    kv: tombstone(&key, rev),
                });
            }
        }
        self.commit(changes, shared);
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
            })
            .collect();
        self.watchers.deliver(rev, &events);
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

    pub(super) fn compact_to(&mut self, revision: Revision) {
        while self.history.front().is_some_and(|(r, _)| *r < revision) {
            self.history.pop_front();
        }
        self.compact_revision = revision;
    }

    pub(super) fn compare_holds(&self, c: &Compare) -> bool {
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
    pub(super) fn validate(&self, ops: &[TxnOp]) -> StoreResult<()> {
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

    pub(super) fn apply(
        &mut self,
        ops: Vec<TxnOp>,
        shared: &Shared,
    ) -> (Vec<OpResponse>, Revision) {
        let rev = self.revision + 1;
        let mut changes = Vec::new();
        let mut responses = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                TxnOp::Put { key, value, lease } => {
                    let (create_revision, version, old_lease) = match self.kvs.get(&key) {
                        Some(p) => (p.create_revision, p.version + 1, p.lease),
                        None => (rev, 1, None),
                    };
                    if let Some(old) = old_lease {
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

pub(super) fn key_range<'a>(
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
