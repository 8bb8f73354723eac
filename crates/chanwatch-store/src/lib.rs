//! # chanwatch-store
//!
//! One narrow trait, [`MetaStore`], over the coordination store, with two backends:
//!
//! * [`etcd::EtcdStore`] — real etcd through the `etcd-client` crate (multi-machine);
//! * [`embedded::EmbeddedStore`] — in-process MVCC store with etcd's semantics and a clock
//!   driven by tokio time (standalone, demo, tests and simulation).
//!
//! This crate owns: the store vocabulary ([`types`]), the error type ([`StoreError`]), the
//! clock ([`Clock`]) and the two backends. It must not know about channels, nodes or the key
//! layout: those live in `chanwatch-core`.
//!
//! ## What every implementation guarantees
//!
//! The conformance suite (`tests/it/suite.rs`, run once per backend; test names start with
//! the backend) proves each line below on both backends:
//!
//! | guarantee | proven by |
//! |---|---|
//! | A txn is atomic: all compares are evaluated on one snapshot, then exactly one branch runs, at one new revision (no revision if it wrote nothing). | `txn_compares_pick_the_branch`, `txn_that_writes_nothing_keeps_the_revision` |
//! | Compares on value, mod revision, create revision, version and existence behave as etcd's (a missing key has version/create/mod revision 0). | `txn_compares_pick_the_branch`, `compare_targets_match_etcd_for_missing_keys` |
//! | `range` returns keys in key order and the revision it was read at. | `range_returns_sorted_keys_and_its_revision` |
//! | Delete-prefix removes exactly the keys under the prefix. | `delete_prefix_removes_only_the_prefix` |
//! | Watch events arrive in revision order, none dropped, each with the value after the change (no previous value: see `WatchEvent::kv`); a revision's events never split across batches. | `watch_delivers_ordered_events_with_their_values`, `one_txn_is_one_batch` |
//! | A watch from an old revision replays history from there. | `watch_from_an_old_revision_replays_history` |
//! | A watch from a compacted revision fails with `Compacted { compact_revision }`; compacting a future revision fails. | `watch_after_compaction_fails_with_compacted` |
//! | Lease expiry deletes every attached key in one revision and emits DELETEs; keepalive keeps them; revoke deletes at once; keepalive of a dead lease is `LeaseNotFound`. | `lease_expiry_deletes_attached_keys`, `keepalive_keeps_a_lease_alive`, `revoke_deletes_attached_keys` |
//! | A txn over `max_txn_ops` is refused with `TooManyOps`, one over the request size with `RequestTooLarge`, and nothing is written. | `txn_over_the_op_limit_is_refused` |
//! | Concurrent compare-and-swap increments from many tasks give unique, gap-free values. | `concurrent_cas_increments_are_unique` |
//! | A client of its own (`new_client`; the embedded store's `client()`, else the store itself) sees every write of others, one batch per txn, only under its range; its keepalive brings its quiet watch up to the keepalive's revision. | `a_client_of_its_own_sees_every_write_and_its_own_progress` |
//!
//! Watch streams end (yield `None`) or yield an error when the watch breaks; a consumer then
//! watches again from the last revision it saw + 1, or relists on `Compacted`.
//!
//! ## What the etcd backend does when etcd fails
//!
//! `tests/it/liveness.rs` proves each line on a real etcd:
//!
//! | guarantee | proven by |
//! |---|---|
//! | A full quota is `NoSpace` (retryable, says what to do), the alarm shows in `alarms()`, grants are refused, reads and delete-only txns pass; all passes again after compact, defrag, disarm. The embedded store simulates it (`set_nospace`). | `nospace_is_named_truly_retryable_and_listed_as_an_alarm`, `the_embedded_store_can_simulate_nospace_as_etcd_behaves` |
//! | A token etcd no longer knows (expired, or etcd restarted) costs a retry at most: the client authenticates again, for watches too. | `an_auth_etcd_restart_and_an_expired_token_only_delay_calls` |
//! | A user whose role allows only the root prefix connects; outside it, calls fail with `PermissionDenied` naming the user and the key; a wrong password names the user. | `a_user_limited_to_the_root_prefix_can_connect_and_is_refused_by_name_outside` |

pub mod alarms;
pub mod backoff;
pub mod clock;
pub mod embedded;
pub mod error;
pub mod etcd;
mod etcd_error;
mod etcd_members;
#[cfg(any(test, feature = "testing"))]
pub mod faults;
pub mod layer;
mod lease;
pub mod listwatch;
pub mod types;

use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use futures_util::Stream;

pub use alarms::follow_alarms;
pub use backoff::Backoff;
pub use clock::{millis, Clock};
pub use embedded::{EmbeddedOptions, EmbeddedStore, Observed};
pub use error::{StoreError, StoreResult};
pub use etcd::{EtcdConfig, EtcdStore, MemberStatus, TlsFiles};
/// Test fixtures (feature `testing`): a store wrapper that injects faults.
#[cfg(any(test, feature = "testing"))]
pub use faults::{CommitHook, Faults, FaultyStore};
pub use layer::{Layer, Layered};
pub use lease::{fence_margin, keep_lease, Renewal, UnreachedRenewals, MIN_SESSION_TTL};
pub use listwatch::{ListWatch, Update};
pub use types::{
    Alarm, AlarmKind, Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, Lease,
    LeaseId, Limits, OpResponse, RangeResponse, Revision, StoreStatus, Txn, TxnOp, TxnResponse,
    WatchBatch, WatchEvent,
};

/// An ordered stream of watch batches. See the crate docs for the guarantees.
pub type WatchStream = Pin<Box<dyn Stream<Item = StoreResult<WatchBatch>> + Send>>;

/// The coordination store as chanwatch uses it: etcd's v3 API, narrowed to what the
/// coordinator and nodes need.
#[async_trait]
pub trait MetaStore: Send + Sync + 'static {
    /// Reads one key.
    ///
    /// # Errors
    /// `Unavailable` (retryable) when the store cannot be reached.
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>>;

    /// Reads every key starting with `prefix`, in key order, with the revision it was read at.
    ///
    /// # Errors
    /// `Unavailable` (retryable) when the store cannot be reached.
    async fn range(&self, prefix: &str) -> StoreResult<RangeResponse> {
        self.range_keys(&KeyRange::prefix(prefix)).await
    }

    /// Reads every key of `keys`, in key order, with the revision it was read at.
    ///
    /// # Errors
    /// `Unavailable` (retryable) when the store cannot be reached.
    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse>;

    /// Runs a transaction atomically.
    ///
    /// # Errors
    /// `TooManyOps` / `RequestTooLarge` (fatal for this txn: split it), `LeaseNotFound` when a
    /// put names a dead lease, `InvalidArgument` when one branch writes a key twice,
    /// `Unavailable` (retryable; the txn may or may not have been applied — compares make a
    /// retry safe).
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse>;

    /// Watches every key starting with `prefix`, from `from_revision` (inclusive) on; see
    /// [`watch_keys`](MetaStore::watch_keys).
    ///
    /// # Errors
    /// `Unavailable` when the watch cannot be created.
    async fn watch(&self, prefix: &str, from_revision: Revision) -> StoreResult<WatchStream> {
        self.watch_keys(&KeyRange::prefix(prefix), from_revision)
            .await
    }

    /// Watches every key of `keys`, from `from_revision` (inclusive) on.
    ///
    /// A `from_revision` below the compaction revision yields `Compacted` as the stream's only
    /// item. `0` means "from the next revision". Besides event batches the stream yields
    /// progress notifications (batches without events, see [`WatchBatch::revision`]): etcd's
    /// answer to a progress request sent every [`EtcdConfig::watch_progress_interval`]; the
    /// embedded store sends one to every watch of the renewing client (see
    /// [`EmbeddedStore::client`]) that is behind whenever it renews a lease.
    ///
    /// # Errors
    /// `Unavailable` when the watch cannot be created.
    async fn watch_keys(
        &self,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream>;

    /// Grants a lease of at least `ttl` (etcd rounds up to whole seconds and has a minimum).
    ///
    /// # Errors
    /// `Unavailable` (retryable).
    async fn grant(&self, ttl: Duration) -> StoreResult<Lease>;

    /// Renews a lease to its full TTL. Returns the store's revision in the answer (`0` when
    /// the answer carries none): a watch that has not reached it is behind.
    ///
    /// # Errors
    /// `LeaseNotFound` (fatal for the lease) when it expired or was revoked; `Unavailable`
    /// (retryable).
    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision>;

    /// Revokes a lease, deleting every key attached to it in one revision.
    ///
    /// # Errors
    /// `LeaseNotFound` when it no longer exists; `Unavailable` (retryable).
    async fn revoke(&self, lease: LeaseId) -> StoreResult<()>;

    /// Drops history before `revision`; later watches from below it fail with `Compacted`.
    ///
    /// # Errors
    /// `FutureRevision` above the current revision; `Compacted` at or below the current
    /// compaction revision.
    async fn compact(&self, revision: Revision) -> StoreResult<()>;

    /// The alarms the store has raised now (etcd's `alarm list`; needs no admin role).
    /// Processes export them as `chanwatch_etcd_alarm{type}` and log when one appears or
    /// clears. The default (a store that has no alarms) returns none.
    ///
    /// # Errors
    /// `Unavailable` (retryable).
    async fn alarms(&self) -> StoreResult<Vec<Alarm>> {
        Ok(Vec::new())
    }

    /// The store's database size and revision (etcd's maintenance `status`; needs no admin
    /// role), for `chanwatch_etcd_db_bytes`. The default (a store with no database file, like
    /// the embedded one) returns `None`.
    ///
    /// # Errors
    /// `Unavailable` (retryable).
    async fn status(&self) -> StoreResult<Option<StoreStatus>> {
        Ok(None)
    }

    /// The request limits this store enforces.
    fn limits(&self) -> &Limits;

    /// A short description for logs (`embedded`, `etcd http://127.0.0.1:2379`).
    fn describe(&self) -> String;

    /// Another client of the same store, where one is cheap to make: the embedded store's
    /// [`EmbeddedStore::client`], so each in-process node renews and watches as a client of
    /// its own. `None` (the default): share this one (an etcd connection is made from its
    /// config instead).
    fn new_client(&self) -> Option<std::sync::Arc<dyn MetaStore>> {
        None
    }
}
