//! # Layers: a store in front of another
//!
//! A [`Layer`] sees every call made to the store it wraps and, by default, forwards each one
//! unchanged; a test, a bench or a fault injector overrides only the calls it counts, delays or
//! fails. [`Layered`] joins a layer to the store below it and is itself a [`MetaStore`].
//!
//! Owns: the forwarding of every [`MetaStore`] call. Must not: change what a call means when
//! the layer does not override it (a call a layer leaves alone reaches the store below as is,
//! `alarms` and `status` included).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;

use crate::{
    Alarm, KeyRange, KeyValue, Lease, LeaseId, Limits, MetaStore, RangeResponse, Revision,
    StoreResult, StoreStatus, Txn, TxnResponse, WatchStream,
};

/// What a layer does with each call; every method forwards to `inner` unless overridden.
#[async_trait]
pub trait Layer: Send + Sync + 'static {
    /// [`MetaStore::get`].
    async fn get(&self, inner: &dyn MetaStore, key: &str) -> StoreResult<Option<KeyValue>> {
        inner.get(key).await
    }
    /// [`MetaStore::range_keys`].
    async fn range_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
    ) -> StoreResult<RangeResponse> {
        inner.range_keys(keys).await
    }
    /// [`MetaStore::txn`].
    async fn txn(&self, inner: &dyn MetaStore, txn: Txn) -> StoreResult<TxnResponse> {
        inner.txn(txn).await
    }
    /// [`MetaStore::watch_keys`].
    async fn watch_keys(
        &self,
        inner: &dyn MetaStore,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream> {
        inner.watch_keys(keys, from_revision).await
    }
    /// [`MetaStore::grant`].
    async fn grant(&self, inner: &dyn MetaStore, ttl: Duration) -> StoreResult<Lease> {
        inner.grant(ttl).await
    }
    /// [`MetaStore::keepalive`].
    async fn keepalive(&self, inner: &dyn MetaStore, lease: LeaseId) -> StoreResult<Revision> {
        inner.keepalive(lease).await
    }
    /// [`MetaStore::revoke`].
    async fn revoke(&self, inner: &dyn MetaStore, lease: LeaseId) -> StoreResult<()> {
        inner.revoke(lease).await
    }
    /// [`MetaStore::compact`].
    async fn compact(&self, inner: &dyn MetaStore, revision: Revision) -> StoreResult<()> {
        inner.compact(revision).await
    }
    /// [`MetaStore::alarms`].
    async fn alarms(&self, inner: &dyn MetaStore) -> StoreResult<Vec<Alarm>> {
        inner.alarms().await
    }
    /// [`MetaStore::status`].
    async fn status(&self, inner: &dyn MetaStore) -> StoreResult<Option<StoreStatus>> {
        inner.status().await
    }
    /// [`MetaStore::describe`].
    fn describe(&self, inner: &dyn MetaStore) -> String {
        inner.describe()
    }
}

/// A [`Layer`] in front of a store: a [`MetaStore`] that routes every call through the layer.
pub struct Layered<L> {
    inner: Arc<dyn MetaStore>,
    layer: L,
}

impl<L: Layer> Layered<L> {
    /// Puts `layer` in front of `inner`.
    pub fn new(inner: Arc<dyn MetaStore>, layer: L) -> Self {
        Layered { inner, layer }
    }

    /// The layer (to arm it, or read what it counted).
    pub fn layer(&self) -> &L {
        &self.layer
    }

    /// The store below the layer.
    pub fn inner(&self) -> &Arc<dyn MetaStore> {
        &self.inner
    }
}

#[async_trait]
impl<L: Layer> MetaStore for Layered<L> {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        self.layer.get(&*self.inner, key).await
    }
    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse> {
        self.layer.range_keys(&*self.inner, keys).await
    }
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        self.layer.txn(&*self.inner, txn).await
    }
    async fn watch_keys(
        &self,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream> {
        self.layer
            .watch_keys(&*self.inner, keys, from_revision)
            .await
    }
    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        self.layer.grant(&*self.inner, ttl).await
    }
    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision> {
        self.layer.keepalive(&*self.inner, lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.layer.revoke(&*self.inner, lease).await
    }
    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        self.layer.compact(&*self.inner, revision).await
    }
    async fn alarms(&self) -> StoreResult<Vec<Alarm>> {
        self.layer.alarms(&*self.inner).await
    }
    async fn status(&self) -> StoreResult<Option<StoreStatus>> {
        self.layer.status(&*self.inner).await
    }
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    fn describe(&self) -> String {
        self.layer.describe(&*self.inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use super::*;
    use crate::embedded::EmbeddedStore;
    use crate::StoreError;

    /// Counts txns and refuses grants; forwards the rest.
    #[derive(Default)]
    struct CountsTxnsRefusesGrants(AtomicU64);

    #[async_trait]
    impl Layer for CountsTxnsRefusesGrants {
        async fn txn(&self, inner: &dyn MetaStore, txn: Txn) -> StoreResult<TxnResponse> {
            self.0.fetch_add(1, Ordering::SeqCst);
            inner.txn(txn).await
        }
        async fn grant(&self, _inner: &dyn MetaStore, _ttl: Duration) -> StoreResult<Lease> {
            Err(StoreError::Unavailable {
                endpoints: "layer".into(),
                message: "refused".into(),
            })
        }
    }

    #[tokio::test]
    async fn a_layer_takes_over_the_calls_it_overrides_and_forwards_the_rest() -> StoreResult<()> {
        let below: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
        let store = Layered::new(below.clone(), CountsTxnsRefusesGrants::default());
        store
            .txn(Txn::new().and_then([crate::TxnOp::put("k", "v")]))
            .await?;
        assert_eq!(store.layer().0.load(Ordering::SeqCst), 1);
        assert!(store.grant(Duration::from_secs(5)).await.is_err());
        // Forwarded: the read sees what the txn wrote below, and the description is the store's.
        let read = store.get("k").await?.map(|kv| kv.value);
        assert_eq!(read, Some(b"v".to_vec()));
        assert_eq!(store.describe(), below.describe());
        assert!(below.grant(Duration::from_secs(5)).await.is_ok());
        Ok(())
    }
}
