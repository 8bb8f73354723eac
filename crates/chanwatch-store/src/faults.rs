//! Fault injection: a [`MetaStore`] wrapper whose calls can be made to fail on demand.
//!
//! Owns: switches that tests and simulations flip to make keepalives or txns fail the way an
//! unreachable etcd makes them fail (`Unavailable`, retryable), to cut one client off
//! (partition: every call fails and its watch streams end), to delay keepalives, to hold
//! every call of one client (a frozen process or a stalled connection), to add network
//! latency (deterministic, from a seed), to expire the client's auth token, and a hook that
//! attributes commits.
//! Must not: change the semantics of calls that are let through, or wake waiting calls in an
//! order that changes from run to run (the simulation replays a seed byte for byte; see
//! `Switch`).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use crate::error::{StoreError, StoreResult};
use crate::types::{
    Alarm, KeyRange, KeyValue, Lease, LeaseId, Limits, RangeResponse, Revision, StoreStatus, Txn,
    TxnResponse,
};
use crate::{MetaStore, WatchStream};

/// Called with the revision of every txn that wrote something through the wrapper.
pub type CommitHook = Arc<dyn Fn(Revision) + Send + Sync>;

/// Switches of a [`FaultyStore`]. Cheap to clone; clones share the switches.
#[derive(Clone, Default)]
pub struct Faults {
    keepalive: Arc<AtomicBool>,
    txn: Arc<AtomicBool>,
    keepalive_delay_ms: Arc<AtomicU64>,
    hold: Arc<Switch>,
    partition: Arc<Switch>,
    stall_watches: Arc<Switch>,
    auth_expired: Arc<AtomicBool>,
    /// Most latency per call in µs (0: none), and the seed and counter that pick each one.
    latency_us: Arc<AtomicU64>,
    latency_seed: Arc<AtomicU64>,
    calls: Arc<AtomicU64>,
    on_commit: Arc<Mutex<Option<CommitHook>>>,
}

impl std::fmt::Debug for Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Faults")
            .field("keepalive", &self.keepalive)
            .field("txn", &self.txn)
            .field("keepalive_delay_ms", &self.keepalive_delay_ms)
            .field("hold", &self.hold.is_on())
            .field("partition", &self.partition.is_on())
            .field("stall_watches", &self.stall_watches.is_on())
            .field("latency_us", &self.latency_us)
            .finish_non_exhaustive()
    }
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
    /// Delays every keepalive by `d` before it is sent (a slow network to the store).
    pub fn delay_keepalives(&self, d: Duration) {
        let ms = crate::millis(d);
        self.keepalive_delay_ms.store(ms, Ordering::SeqCst);
    }
    /// While on, every call waits (is neither sent nor failed) until it is turned off: what
    /// a frozen process (`SIGSTOP`) or a stalled connection looks like from the store.
    pub fn hold(&self, on: bool) {
        self.hold.set(on);
    }
    /// While on, every call fails as if the store were unreachable, and every open watch
    /// stream ends: a network partition between this client and the store.
    pub fn partition(&self, on: bool) {
        self.partition.set(on);
    }
    /// While on, every watch stream of this client delivers nothing (no events, no error)
    /// while every other call works: a stalled watch stream behind a proxy, or a watch
    /// starved on an overloaded connection. What was held is delivered when it ends.
    pub fn stall_watches(&self, on: bool) {
        self.stall_watches.set(on);
    }
    /// While on, every call but a keepalive fails with [`StoreError::AuthTokenExpired`], as
    /// calls with a token etcd no longer knows do until the client authenticates again (etcd
    /// renews leases without a token).
    pub fn expire_auth(&self, on: bool) {
        self.auth_expired.store(on, Ordering::SeqCst);
    }
    /// Delays every call by up to `max` before it is sent (zero: no delay). Each delay is
    /// picked from `seed` and a call counter, so a simulation replays the same delays.
    pub fn latency(&self, max: Duration, seed: u64) {
        self.latency_seed.store(seed, Ordering::SeqCst);
        let us = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        self.latency_us.store(us, Ordering::SeqCst);
    }
    /// Whether calls are being held.
    pub fn held(&self) -> bool {
        self.hold.is_on()
    }
    /// Calls `hook` with the revision of every txn that wrote through this wrapper, so a
    /// checker can tell who made each revision.
    pub fn on_commit(&self, hook: CommitHook) {
        *self
            .on_commit
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(hook);
    }

    /// What every call goes through first: latency, then a hold, then a partition.
    async fn gate(&self) -> StoreResult<()> {
        let max = self.latency_us.load(Ordering::SeqCst);
        if max > 0 {
            use std::hash::{Hash, Hasher};
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            let mut h = std::collections::hash_map::DefaultHasher::new();
            (self.latency_seed.load(Ordering::SeqCst), n).hash(&mut h);
            tokio::time::sleep(Duration::from_micros(h.finish() % (max + 1))).await;
        }
        self.hold.wait_until(false).await;
        if self.partition.is_on() {
            return Err(injected("every call (partition)"));
        }
        Ok(())
    }

    fn auth(&self) -> StoreResult<()> {
        if self.auth_expired.load(Ordering::SeqCst) {
            return Err(StoreError::AuthTokenExpired(
                "etcdserver: invalid auth token (fault injection)".into(),
            ));
        }
        Ok(())
    }
}

/// An on/off fault switch that calls wait on. Its waiters wake in the order they began to
/// wait (a [`Notify`]'s `notify_waiters` wakes its list in order), so a run of the simulation
/// replays the same task order. A `tokio::sync::watch` would not do: it spreads its waiters
/// over eight lists picked by the runtime's RNG, which tokio seeds from the OS (seeding it
/// needs `tokio_unstable`), so when a stall ended, the held calls went on in a different
/// order each run and drew different latencies from the shared call counter.
#[derive(Debug, Default)]
struct Switch {
    on: AtomicBool,
    flipped: Notify,
}

impl Switch {
    fn set(&self, on: bool) {
        if self.on.swap(on, Ordering::SeqCst) != on {
            self.flipped.notify_waiters();
        }
    }

    fn is_on(&self) -> bool {
        self.on.load(Ordering::SeqCst)
    }

    /// Returns once the switch is `on` (at once if it already is).
    async fn wait_until(&self, on: bool) {
        loop {
            let flipped = self.flipped.notified();
            tokio::pin!(flipped);
            // Registered before the check, so a flip right after it is not missed.
            flipped.as_mut().enable();
            if self.is_on() == on {
                return;
            }
            flipped.await;
        }
    }
}

/// A store that forwards to `inner` unless a fault switch is on.
#[derive(Debug)]
pub struct FaultyStore<S> {
    inner: Arc<S>,
    faults: Faults,
}

impl<S: MetaStore> FaultyStore<S> {
    /// Wraps `inner`; the returned [`Faults`] flips the switches.
    pub fn new(inner: S) -> (Self, Faults) {
        let faults = Faults::default();
        (
            FaultyStore {
                inner: Arc::new(inner),
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
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.get(key).await
    }
    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse> {
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.range_keys(keys).await
    }
    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        if self.faults.partition.is_on() || self.faults.txn.load(Ordering::SeqCst) {
            return Err(injected("txn"));
        }
        self.faults.auth()?;
        // Once sent, a txn is on the wire: latency and a stalled connection delay it, but a
        // caller that stops waiting does not take it back; it may still land later, as with
        // a real network. So it travels in a task of its own.
        let faults = self.faults.clone();
        let inner = self.inner.clone();
        let delivery = tokio::spawn(async move {
            faults.gate().await?;
            let writes = |ops: &[crate::types::TxnOp]| {
                ops.iter()
                    .any(|op| !matches!(op, crate::types::TxnOp::Get { .. }))
            };
            let (then_writes, otherwise_writes) = (writes(&txn.then), writes(&txn.otherwise));
            let resp = inner.txn(txn).await?;
            if (resp.succeeded && then_writes) || (!resp.succeeded && otherwise_writes) {
                let hook = faults
                    .on_commit
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .clone();
                if let Some(hook) = hook {
                    hook(resp.revision);
                }
            }
            Ok(resp)
        });
        delivery
            .await
            .unwrap_or_else(|_| Err(injected("txn delivery task")))
    }
    async fn watch_keys(
        &self,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream> {
        self.faults.gate().await?;
        self.faults.auth()?;
        let stream = self.inner.watch_keys(keys, from_revision).await?;
        let stall = self.faults.stall_watches.clone();
        // Each item waits for the stall to end before it is handed on.
        let stream = futures_util::StreamExt::then(stream, move |item| {
            let stall = stall.clone();
            async move {
                stall.wait_until(false).await;
                item
            }
        });
        let cut = self.faults.partition.clone();
        let partitioned = async move { cut.wait_until(true).await };
        // Ends when a partition begins, as a stream on a broken connection does.
        Ok(Box::pin(futures_util::StreamExt::take_until(
            stream,
            partitioned,
        )))
    }
    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.grant(ttl).await
    }
    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision> {
        let delay = self.faults.keepalive_delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        self.faults.gate().await?;
        if self.faults.keepalive.load(Ordering::SeqCst) {
            return Err(injected("keepalive"));
        }
        self.inner.keepalive(lease).await
    }
    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.revoke(lease).await
    }
    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.compact(revision).await
    }
    async fn alarms(&self) -> StoreResult<Vec<Alarm>> {
        self.faults.gate().await?;
        self.faults.auth()?;
        self.inner.alarms().await
    }
    /// Not subject to faults: only a gauge reads it, and a simulation's seed must replay the
    /// same whether or not the coordinator reads its store's size.
    async fn status(&self) -> StoreResult<Option<StoreStatus>> {
        self.inner.status().await
    }
    fn limits(&self) -> &Limits {
        self.inner.limits()
    }
    fn describe(&self) -> String {
        format!("faulty {}", self.inner.describe())
    }
}
