//! Fault injection: a [`MetaStore`] wrapper whose calls can be made to fail on demand.
//!
//! Owns: switches that tests and simulations flip to make keepalives or txns fail the way an
//! unreachable etcd makes them fail (`Unavailable`, retryable).
//! Must not: change the semantics of calls that are let through.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::error::{StoreError, StoreResult};
use crate::types::{KeyValue, Lease, LeaseId, Limits, RangeResponse, Revision, Txn, TxnResponse};
use crate::{MetaStore, WatchStream};

/// Switches of a [`FaultyStore`]. Cheap to clone; clones share the switches.
#[derive(Debug, Clone, Default)]
pub struct Faults {
    keepalive: Arc<AtomicBool>,
    txn: Arc<AtomicBool>,
}

impl Faults {
    /// Makes every keepalive fail (`true`) or pass (`false`).
    pub fn fail_keepalives(&self, on: bool) {
        self.keepalive.store(on, Ordering::SeqCst);
    }
    /// Makes every txn fail (`true`) or pass (`false`).
    pub fn fail_txns(&self, on: bool) {
        self.txn.store(on, Ordering::SeqCst);
    }
}

/// A store that forwards to `inner` unless a fault switch is on.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: S,
    faults: Faults,
}

impl<S: MetaStore> FaultyStore<S> {
    /// Wraps `inner`; the returned [`Faults`] flips the switches.
    pub fn new(inner: S) -> (Self, Faults) {
        let faults = Faults::default();
        (
            FaultyStore {
                inner,
                faults: faults.clone(),
            },
            faults,
        )
    }
}

fn injected(what: &str) -> StoreError {
    StoreError::Unavailable {
        endpoints: "fault injection".into(),
        message: format!("{what} failed on purpose"),
    }
}

#[async_trait]
impl<S: MetaStore> MetaStore for FaultyStore<S> {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        self.inner.get(key).await
    }
    async fn range(&self, prefix: &str) -> StoreResult<RangeResponse> {
        self.inner.range(prefix).await
    }
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        if self.faults.txn.load(Ordering::SeqCst) {
            return Err(injected("txn"));
        }
        self.inner.txn(txn).await
    }
    async fn watch(&self, prefix: &str, from_revision: Revision) -> StoreResult<WatchStream> {
        self.inner.watch(prefix, from_revision).await
    }
    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        self.inner.grant(ttl).await
    }
    async fn keepalive(&self, lease: LeaseId) -> StoreResult<()> {
        if self.faults.keepalive.load(Ordering::SeqCst) {
            return Err(injected("keepalive"));
        }
        self.inner.keepalive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.inner.revoke(lease).await
    }
    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        self.inner.compact(revision).await
    }
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    fn describe(&self) -> String {
        format!("faulty {}", self.inner.describe())
    }
}
