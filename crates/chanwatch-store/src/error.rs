//! The one error type of the store layer.
//!
//! Each variant says whether retrying can help. Callers in the runtimes branch on
//! [`StoreError::is_retryable`] and on `Compacted` (relist), never on message text.

use thiserror::Error;

use crate::types::{LeaseId, Revision};

/// What went wrong talking to a [`crate::MetaStore`].
#[derive(Debug, Error)]
pub enum StoreError {
    /// The store could not be reached or did not answer in time. Retryable with back-off.
    #[error(
        "store unavailable at {endpoints}: {message}; check that etcd is running and reachable"
    )]
    Unavailable {
        /// The endpoints tried.
        endpoints: String,
        /// What the transport said.
        message: String,
    },
    /// A watch or read asked for a revision that compaction removed. Not retryable as is:
    /// relist the current state and watch from the list's revision.
    #[error(
        "revision was compacted (compact revision {compact_revision}); relist and watch again"
    )]
    Compacted {
        /// The store's compaction revision at the time of the refusal.
        compact_revision: Revision,
    },
    /// `compact` was asked for a revision the store has not reached. Fatal for that call.
    #[error("revision {requested} is in the future (current revision {current})")]
    FutureRevision {
        /// The requested revision.
        requested: Revision,
        /// The store's current revision.
        current: Revision,
    },
    /// The lease does not exist (expired, revoked or never granted). Fatal for the lease: grant
    /// a new one and re-register.
    #[error("lease {0} not found (expired or revoked); register again with a new lease")]
    LeaseNotFound(LeaseId),
    /// A txn held more operations than the store accepts. Fatal for that txn: split it.
    #[error("txn has {ops} operations in one list; the limit is {max} (etcd --max-txn-ops); split the change")]
    TooManyOps {
        /// The largest of the compare / then / else list lengths.
        ops: usize,
        /// The configured limit.
        max: usize,
    },
    /// A request was larger than the store accepts. Fatal for that request: split it.
    #[error(
        "request is {bytes} bytes; the limit is {max} (etcd --max-request-bytes); split the change"
    )]
    RequestTooLarge {
        /// Approximate encoded size of the request.
        bytes: usize,
        /// The configured limit.
        max: usize,
    },
    /// A request the store refused as malformed. Fatal: a bug in the caller.
    #[error("invalid request: {0}")]
    InvalidArgument(String),
    /// etcd raised its NOSPACE alarm: its database reached `--quota-backend-bytes`, and it
    /// refuses every write but deletes (no txn with a put, no lease grant) until an
    /// operator frees space and disarms the alarm. Reads, keepalives and revokes still work.
    /// Retryable: wait with back-off; it passes once the alarm is disarmed.
    #[error(
        "etcd is out of space (alarm NOSPACE): compact, defrag, `etcdctl alarm disarm` \
         (then raise --quota-backend-bytes if it fills again); waiting"
    )]
    NoSpace,
    /// etcd refused the auth token: it expired, or etcd restarted (simple tokens live in
    /// etcd's memory). Retryable: the client authenticates again with its password.
    #[error("etcd refused the auth token ({0}): it expired or etcd restarted; re-authenticating and retrying")]
    AuthTokenExpired(String),
    /// The store refused the credentials (wrong user or password, or none given while etcd
    /// has auth on). Fatal until the configuration is fixed.
    #[error(
        "store refused the credentials: {0}; check --etcd-user / --etcd-password and TLS files"
    )]
    Unauthenticated(String),
    /// The user is authenticated but its roles do not allow this access. Fatal until an
    /// operator grants the permission (docs/OPERATING.md, "etcd users and roles").
    #[error(
        "etcd user {user:?} may not access {key:?} (permission denied); grant its role that \
         key's prefix with `etcdctl role grant-permission ROLE --prefix=true read|readwrite PREFIX` \
         (docs/OPERATING.md, \"etcd users and roles\")"
    )]
    PermissionDenied {
        /// The etcd user (empty when none was given).
        user: String,
        /// The key or prefix the refused request named (the first key of a txn).
        key: String,
    },
    /// Configuration is unusable (bad endpoint URL, unreadable TLS file). Fatal.
    #[error("bad store configuration: {0}")]
    Config(String),
    /// A watch stream ended (the store closed it or the connection broke). Retryable: watch
    /// again from the last revision seen + 1.
    #[error("watch stream closed: {0}; watch again from the last revision seen")]
    WatchClosed(String),
    /// Any other error reported by the backend. Treated as retryable.
    #[error("store error: {0}")]
    Backend(String),
}

impl StoreError {
    /// Whether retrying the same call later can succeed.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            StoreError::Unavailable { .. }
                | StoreError::WatchClosed(_)
                | StoreError::Backend(_)
                | StoreError::NoSpace
                | StoreError::AuthTokenExpired(_)
        )
    }

    /// Whether the error says the configuration is wrong (endpoint, TLS files, credentials,
    /// roles): at start-up a process should exit with it; once running, it should log it and
    /// keep retrying, since an operator may fix etcd's side meanwhile.
    pub fn is_config(&self) -> bool {
        matches!(
            self,
            StoreError::Config(_)
                | StoreError::Unauthenticated(_)
                | StoreError::PermissionDenied { .. }
        )
    }
}

/// Result of a store call.
pub type StoreResult<T> = Result<T, StoreError>;
