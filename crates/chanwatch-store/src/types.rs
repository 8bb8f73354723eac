//! Plain data of the store API: key-values, compares, txn operations and results, watch
//! events, leases and limits.
//!
//! Owns: the vocabulary shared by the trait and both backends, modelled on etcd's v3 API so
//! the etcd backend is a thin translation.
//!
//! Must not: know about channels or the key layout.

use std::time::Duration;

/// A store revision: a global counter that grows by one with every write txn.
pub type Revision = i64;

/// A lease identifier handed out by [`crate::MetaStore::grant`].
pub type LeaseId = i64;

/// The keys a range read or a watch covers: every key starting with a prefix, or every key
/// in `[start, end)` (etcd's range end). A process that must not see a busy sub-prefix (the
/// coordinator and the checkpoints) watches a range that ends before it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyRange {
    start: String,
    /// `None`: every key starting with `start`.
    end: Option<String>,
}

impl KeyRange {
    /// Every key starting with `prefix`.
    pub fn prefix(prefix: impl Into<String>) -> Self {
        Self {
            start: prefix.into(),
            end: None,
        }
    }

    /// Every key `k` with `start <= k < end` (byte order).
    pub fn between(start: impl Into<String>, end: impl Into<String>) -> Self {
        Self {
            start: start.into(),
            end: Some(end.into()),
        }
    }

    /// The first key covered.
    pub fn start(&self) -> &str {
        &self.start
    }

    /// The end (exclusive), or `None` for a prefix.
    pub fn end(&self) -> Option<&str> {
        self.end.as_deref()
    }

    /// Whether `key` is covered.
    pub fn contains(&self, key: &str) -> bool {
        match &self.end {
            None => key.starts_with(&self.start),
            Some(end) => key >= self.start.as_str() && key < end.as_str(),
        }
    }
}

impl std::fmt::Display for KeyRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.end {
            None => write!(f, "{}*", self.start),
            Some(end) => write!(f, "[{}, {})", self.start, end),
        }
    }
}

impl From<&str> for KeyRange {
    fn from(prefix: &str) -> Self {
        Self::prefix(prefix)
    }
}

impl From<String> for KeyRange {
    fn from(prefix: String) -> Self {
        Self::prefix(prefix)
    }
}

/// One key with its value and MVCC metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyValue {
    /// The key.
    pub key: String,
    /// The value (empty for a DELETE event's `kv`).
    pub value: Vec<u8>,
    /// Revision of the txn that created this key (since its last delete).
    pub create_revision: Revision,
    /// Revision of the txn that last wrote this key.
    pub mod_revision: Revision,
    /// Number of writes since creation (1 after the first put; 0 in a DELETE event).
    pub version: i64,
    /// Lease the key is attached to, if any.
    pub lease: Option<LeaseId>,
}

/// The result of a range read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeResponse {
    /// Matching keys in key order.
    pub kvs: Vec<KeyValue>,
    /// The store revision the read was served at: watch from `revision + 1` to see every later
    /// change and none twice.
    pub revision: Revision,
}

/// How a compare relates the key's field to the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CompareOp {
    /// Equal.
    Equal,
    /// Not equal.
    NotEqual,
    /// Field < target.
    Less,
    /// Field > target.
    Greater,
}

/// Which field of a key a compare looks at, and the target value.
///
/// As in etcd, a missing key has create revision, mod revision and version 0, and every value
/// compare on it fails (whatever the operator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareTarget {
    /// The value bytes.
    Value(Vec<u8>),
    /// The mod revision.
    ModRevision(Revision),
    /// The create revision (0 when the key does not exist).
    CreateRevision(Revision),
    /// The version (0 when the key does not exist).
    Version(i64),
}

/// One condition of a txn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Compare {
    /// The key compared.
    pub key: String,
    /// The relation.
    pub op: CompareOp,
    /// Field and target.
    pub target: CompareTarget,
}

impl Compare {
    /// `key`'s mod revision is `rev` (the key is unchanged since it was read).
    pub fn mod_revision(key: impl Into<String>, rev: Revision) -> Self {
        Compare {
            key: key.into(),
            op: CompareOp::Equal,
            target: CompareTarget::ModRevision(rev),
        }
    }
    /// `key`'s create revision is `rev` (the same incarnation of the key still exists).
    pub fn create_revision(key: impl Into<String>, rev: Revision) -> Self {
        Compare {
            key: key.into(),
            op: CompareOp::Equal,
            target: CompareTarget::CreateRevision(rev),
        }
    }
    /// `key`'s value equals `value`.
    pub fn value(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        Compare {
            key: key.into(),
            op: CompareOp::Equal,
            target: CompareTarget::Value(value.into()),
        }
    }
    /// `key`'s version relates to `version` by `op`.
    pub fn version(key: impl Into<String>, op: CompareOp, version: i64) -> Self {
        Compare {
            key: key.into(),
            op,
            target: CompareTarget::Version(version),
        }
    }
    /// `key` exists.
    pub fn exists(key: impl Into<String>) -> Self {
        Self::version(key, CompareOp::Greater, 0)
    }
    /// `key` does not exist.
    pub fn absent(key: impl Into<String>) -> Self {
        Self::version(key, CompareOp::Equal, 0)
    }
}

/// One operation of a txn branch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TxnOp {
    /// Write `value` to `key`, attached to `lease` if given.
    Put {
        /// The key.
        key: String,
        /// The value.
        value: Vec<u8>,
        /// Lease to attach; `None` detaches any previous lease.
        lease: Option<LeaseId>,
    },
    /// Delete `key` if it exists.
    Delete {
        /// The key.
        key: String,
    },
    /// Delete every key starting with `prefix`.
    DeletePrefix {
        /// The prefix.
        prefix: String,
    },
    /// Read `key` as of this txn.
    Get {
        /// The key.
        key: String,
    },
}

impl TxnOp {
    /// A put without a lease.
    pub fn put(key: impl Into<String>, value: impl Into<Vec<u8>>) -> Self {
        TxnOp::Put {
            key: key.into(),
            value: value.into(),
            lease: None,
        }
    }
    /// A put attached to `lease`.
    pub fn put_with_lease(
        key: impl Into<String>,
        value: impl Into<Vec<u8>>,
        lease: LeaseId,
    ) -> Self {
        TxnOp::Put {
            key: key.into(),
            value: value.into(),
            lease: Some(lease),
        }
    }
    /// A single-key delete.
    pub fn delete(key: impl Into<String>) -> Self {
        TxnOp::Delete { key: key.into() }
    }
    /// A prefix delete.
    pub fn delete_prefix(prefix: impl Into<String>) -> Self {
        TxnOp::DeletePrefix {
            prefix: prefix.into(),
        }
    }
    /// A single-key read.
    pub fn get(key: impl Into<String>) -> Self {
        TxnOp::Get { key: key.into() }
    }

    fn approx_bytes(&self) -> usize {
        // Field tags, lengths and the lease ID of the protobuf encoding: a small constant.
        const OVERHEAD: usize = 16;
        OVERHEAD
            + match self {
                TxnOp::Put { key, value, .. } => key.len() + value.len(),
                TxnOp::Delete { key } | TxnOp::Get { key } => key.len(),
                TxnOp::DeletePrefix { prefix } => 2 * prefix.len(),
            }
    }
}

/// A transaction: if every compare holds, run `then`, else run `otherwise`, atomically at one
/// new revision (a txn that writes nothing does not advance the revision).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Txn {
    /// Conditions, all of which must hold for `then` to run.
    pub compares: Vec<Compare>,
    /// Operations when all compares hold.
    pub then: Vec<TxnOp>,
    /// Operations when a compare fails.
    pub otherwise: Vec<TxnOp>,
}

impl Txn {
    /// An empty txn (it succeeds and does nothing).
    pub fn new() -> Self {
        Self::default()
    }
    /// Adds conditions.
    #[must_use]
    pub fn when(mut self, compares: impl IntoIterator<Item = Compare>) -> Self {
        self.compares.extend(compares);
        self
    }
    /// Adds operations to the success branch.
    #[must_use]
    pub fn and_then(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.then.extend(ops);
        self
    }
    /// Adds operations to the failure branch.
    #[must_use]
    pub fn or_else(mut self, ops: impl IntoIterator<Item = TxnOp>) -> Self {
        self.otherwise.extend(ops);
        self
    }

    /// Approximate encoded size in bytes, for the request-size limit.
    pub fn approx_bytes(&self) -> usize {
        let compares: usize = self
            .compares
            .iter()
            .map(|c| {
                16 + c.key.len()
                    + match &c.target {
                        CompareTarget::Value(v) => v.len(),
                        _ => 8,
                    }
            })
            .sum();
        let ops: usize = self
            .then
            .iter()
            .chain(&self.otherwise)
            .map(TxnOp::approx_bytes)
            .sum();
        compares + ops
    }

    /// Checks the txn against `limits` the way etcd does: each of the compare, then and else
    /// lists may hold at most `max_txn_ops` entries, and the request must fit `max_request_bytes`.
    ///
    /// # Errors
    /// [`crate::StoreError::TooManyOps`] or [`crate::StoreError::RequestTooLarge`].
    pub fn check(&self, limits: &Limits) -> crate::StoreResult<()> {
        let ops = self
            .compares
            .len()
            .max(self.then.len())
            .max(self.otherwise.len());
        if ops > limits.max_txn_ops {
            return Err(crate::StoreError::TooManyOps {
                ops,
                max: limits.max_txn_ops,
            });
        }
        let bytes = self.approx_bytes();
        if bytes > limits.max_request_bytes {
            return Err(crate::StoreError::RequestTooLarge {
                bytes,
                max: limits.max_request_bytes,
            });
        }
        Ok(())
    }
}

/// The result of one operation of the branch that ran.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpResponse {
    /// A put ran.
    Put,
    /// A delete or prefix delete ran and removed `deleted` keys.
    Delete {
        /// Number of keys removed.
        deleted: u64,
    },
    /// A get ran.
    Get {
        /// The key, if it existed.
        kv: Option<KeyValue>,
    },
}

/// The result of a txn.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TxnResponse {
    /// Whether every compare held (the `then` branch ran).
    pub succeeded: bool,
    /// The store revision after the txn (unchanged if it wrote nothing).
    pub revision: Revision,
    /// One response per operation of the branch that ran.
    pub responses: Vec<OpResponse>,
}

/// Kind of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// The key was written.
    Put,
    /// The key was deleted (explicitly or by lease expiry).
    Delete,
}

/// One change of one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchEvent {
    /// Put or delete.
    pub kind: EventKind,
    /// The key after the change. For a delete: key, `mod_revision` = the delete's revision,
    /// empty value, version 0.
    ///
    /// There is no previous value: nothing in chanwatch reads one, and etcd reads it from its
    /// backend once per event and watcher that asks (`prev_kv`). The coordinator's watch sees
    /// every assignment write, so asking cost etcd a read per write: registering 50,000
    /// channels took 8.9 s with it and 2.2 s without (`docs/BENCHMARKS.md`).
    pub kv: KeyValue,
}

/// Events of one or more whole revisions, in revision order — or, with no events, a progress
/// notification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WatchBatch {
    /// The events, ordered by `kv.mod_revision`; a revision's events are never split across
    /// batches. Empty in a progress notification.
    pub events: Vec<WatchEvent>,
    /// The watch has delivered every event of its prefix up to this revision: the last event's
    /// revision, or, in a progress notification, the store's revision when it was sent. A
    /// consumer that compares it with the revision of a keepalive answer learns whether its
    /// watch is keeping up (a silently stalled watch never reaches it).
    pub revision: Revision,
}

impl WatchBatch {
    /// A batch of events; its revision is the last event's.
    #[must_use]
    pub fn of_events(events: Vec<WatchEvent>) -> Self {
        let revision = events.last().map_or(0, |e| e.kv.mod_revision);
        WatchBatch { events, revision }
    }

    /// A progress notification: nothing changed under the prefix up to `revision`.
    #[must_use]
    pub fn progress(revision: Revision) -> Self {
        WatchBatch {
            events: Vec::new(),
            revision,
        }
    }

    /// Whether this is a progress notification (no events).
    #[must_use]
    pub fn is_progress(&self) -> bool {
        self.events.is_empty()
    }
}

/// Request limits, defaulting to etcd's server defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Most entries in each of a txn's compare, then and else lists (etcd `--max-txn-ops`).
    pub max_txn_ops: usize,
    /// Largest request in bytes (etcd `--max-request-bytes`).
    pub max_request_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_txn_ops: 128,
            max_request_bytes: 1_572_864,
        }
    }
}

/// A granted lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// Its ID.
    pub id: LeaseId,
    /// The TTL the store granted (may be larger than asked: etcd has a minimum).
    pub ttl: Duration,
}

/// The store's size and revision (etcd's maintenance `status` of the member answering).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreStatus {
    /// Bytes of the backend database file: what etcd's `--quota-backend-bytes` limits.
    /// Compaction frees space inside it; only a defragmentation shrinks the file.
    pub db_size: i64,
    /// Bytes of the database in use (`db_size` less what compaction freed; 0 when the member
    /// does not say).
    pub db_size_in_use: i64,
    /// The store's revision when it answered.
    pub revision: Revision,
    /// The member's backend quota in bytes (`--quota-backend-bytes`), when it says (etcd 3.6
    /// and later; 0 before).
    pub db_size_quota: i64,
}

/// An alarm the store has raised (etcd's `alarm list`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Alarm {
    /// The member that raised it (0 for the embedded store).
    pub member: u64,
    /// What it says.
    pub kind: AlarmKind,
}

/// Kinds of store alarms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AlarmKind {
    /// The database reached its quota: writes are refused until an operator compacts,
    /// defragments and disarms the alarm.
    NoSpace,
    /// A member found its data corrupt.
    Corrupt,
}

impl AlarmKind {
    /// The name etcd uses (`NOSPACE`, `CORRUPT`), for metric labels and logs.
    pub fn name(self) -> &'static str {
        match self {
            AlarmKind::NoSpace => "NOSPACE",
            AlarmKind::Corrupt => "CORRUPT",
        }
    }

    /// Every kind, for metrics that export a series per kind.
    pub const ALL: [AlarmKind; 2] = [AlarmKind::NoSpace, AlarmKind::Corrupt];
}

impl std::fmt::Display for AlarmKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod key_range_tests {
    use super::KeyRange;

    #[test]
    fn a_prefix_covers_its_keys_only() {
        let r = KeyRange::prefix("a/b/");
        assert!(r.contains("a/b/"));
        assert!(r.contains("a/b/c"));
        assert!(!r.contains("a/b"));
        assert!(!r.contains("a/c/"));
        assert!(!r.contains("a/b0"));
    }

    #[test]
    fn a_range_is_half_open() {
        let r = KeyRange::between("r/", "r/worker/");
        assert!(r.contains("r/"));
        assert!(r.contains("r/channel/1/x"));
        assert!(r.contains("r/session/node/3"));
        assert!(!r.contains("r/worker/"));
        assert!(!r.contains("r/worker/checkpoint/x"));
        assert!(!r.contains("q/zzz"));
        assert!(!r.contains("r0"));
    }
}
