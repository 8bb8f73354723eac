//! Registration: a fresh node ID by compare-and-swap on the counter, a lease, and the leased
//! session key.
//!
//! Owns: the ID allocation and the session value. Must not: serve the session (see
//! `session.rs`) or retry by itself (the runtime's loop retries with [`REGISTER_BACKOFF`]).

use chanwatch_core::{NodeId, NodeSession};
use chanwatch_store::{Backoff, Clock, Compare, MetaStore, StoreError, Txn, TxnOp};
use std::time::Duration;

use crate::config::NodeConfig;

/// The wait before registration attempt `n` (from 1): 100 ms doubling to 5 s, less a jitter
/// the runtime seeds with the clock's Unix time and `n`, so that nodes that failed together
/// (an etcd restart, a NOSPACE alarm disarmed) do not retry together, and a simulation with a
/// paused clock still replays the same waits.
pub(crate) const REGISTER_BACKOFF: Backoff =
    Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// A registered session.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Registered {
    pub(crate) id: NodeId,
    pub(crate) lease: i64,
    /// Create revision of the session key: acks compare it, so a node whose session is gone
    /// can never ack.
    pub(crate) session_revision: i64,
    /// When the lease was asked for: it cannot expire before `granted_at + ttl`.
    pub(crate) granted_at: tokio::time::Instant,
}

/// Allocates a fresh ID by compare-and-swap on the counter, then puts the session.
pub(crate) async fn register(
    store: &dyn MetaStore,
    config: &NodeConfig,
    clock: &Clock,
) -> Result<Registered, StoreError> {
    let counter = config.keys.node_id_counter();
    let id = loop {
        let current = store.get(&counter).await?;
        let (last, compare) = match &current {
            Some(kv) => {
                let text = String::from_utf8_lossy(&kv.value);
                let last: NodeId = text.trim().parse().map_err(|_| {
                    StoreError::InvalidArgument(format!(
                        "{counter} holds {text:?}, not a node id; fix or delete the key"
                    ))
                })?;
                (last.0, Compare::mod_revision(&counter, kv.mod_revision))
            }
            None => (0, Compare::absent(&counter)),
        };
        let next = last + 1;
        let resp = store
            .txn(
                Txn::new()
                    .when([compare])
                    .and_then([TxnOp::put(&counter, next.to_string())]),
            )
            .await?;
        if resp.succeeded {
            break NodeId(next);
        }
    };
    // The lease runs from when etcd granted it, which is no earlier than this: the watchdog
    // counts from here, not from when the session began serving (a slow registration
    // otherwise gave the node more time than its lease had; found by the simulation).
    let granted_at = clock.now();
    let lease = store.grant(config.session_ttl).await?;
    let session = NodeSession {
        id,
        admin_addr: config.admin_addr.clone(),
        version: env!("CARGO_PKG_VERSION").to_owned(),
        started_at_ms: clock.unix_ms(),
        capacity: config.capacity,
        name: config.name.clone(),
        extra: Default::default(),
    };
    let key = config.keys.session(id);
    let put = Txn::new()
        .when([Compare::absent(&key)])
        .and_then([TxnOp::put_with_lease(&key, session.encode(), lease.id)]);
    let session_revision = match store.txn(put).await {
        Ok(resp) if resp.succeeded => resp.revision,
        // Refused: the key exists. Ours, if an earlier answer was lost on the way.
        Ok(_) => match store.get(&key).await {
            Ok(Some(kv)) if kv.lease == Some(lease.id) => kv.create_revision,
            _ => {
                let _ = store.revoke(lease.id).await;
                return Err(StoreError::InvalidArgument(format!(
                    "{key} already exists although the id was just allocated; someone else writes node ids"
                )));
            }
        },
        // No answer: the put may have landed. Whatever happened, this session will not be
        // served, so revoke its lease now: a session key nobody keeps alive would otherwise
        // look like a live node for a whole TTL (chaos saw one end as a "fenced" node).
        Err(e) => {
            let _ = store.revoke(lease.id).await;
            return Err(e);
        }
    };
    Ok(Registered {
        id,
        lease: lease.id,
        session_revision,
        granted_at,
    })
}
