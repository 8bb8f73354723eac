//! Registration: a fresh node ID by compare-and-swap on a counter, a lease, and the leased
//! session key. The counter is the ID block's of the node's name when one is reserved
//! (`{root}/id/name/{name}`: NodeRestriction, DESIGN §2), else the cluster-wide one, whose
//! IDs then skip the key prefixes of reserved blocks.
//!
//! Owns: the ID allocation and the session value. Must not: serve the session (see
//! `session.rs`) or retry by itself (the runtime's loop retries with [`REGISTER_BACKOFF`]).

use std::collections::BTreeSet;
use std::time::Duration;

use chanwatch_core::{IdBlock, Keys, NodeId, NodeSession};
use chanwatch_store::{Backoff, Clock, Compare, MetaStore, StoreError, Txn, TxnOp};
use tracing::{debug, info};

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

/// Allocates a fresh ID (in the name's ID block, if one is reserved), then puts the session.
pub(crate) async fn register(
    store: &dyn MetaStore,
    config: &NodeConfig,
    clock: &Clock,
) -> Result<Registered, StoreError> {
    let id = match block_of(store, &config.keys, &config.name).await? {
        Some(block) => {
            let counter = config.keys.id_block_counter(block);
            let seq = next(store, &counter, |_| None).await?;
            let id = block.id(seq).ok_or_else(|| {
                StoreError::InvalidArgument(format!(
                    "ID block {block} is used up ({counter} = {seq}); reserve another block for node name {:?}",
                    config.name
                ))
            })?;
            info!(node = %id, block = %block, name = %config.name, "node: registering in the ID block reserved for our name");
            id
        }
        None => {
            let reserved = reserved_blocks(store, &config.keys).await?;
            NodeId(
                next(store, &config.keys.node_id_counter(), |n| {
                    skip_reserved(n, &reserved)
                })
                .await?,
            )
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

/// The ID block reserved for node name `name`, if any. A store that does not let us read
/// the reservation (a node role from before ID blocks) means none.
async fn block_of(
    store: &dyn MetaStore,
    keys: &Keys,
    name: &str,
) -> Result<Option<IdBlock>, StoreError> {
    if !chanwatch_core::idblock::valid_name(name) {
        return Ok(None);
    }
    let key = keys.id_name(name);
    match store.get(&key).await {
        Ok(Some(kv)) => {
            let text = String::from_utf8_lossy(&kv.value);
            text.parse().map(Some).map_err(|why| {
                StoreError::InvalidArgument(format!(
                    "{key}: {why}; write the block number reserved for this name (see deploy/config/setup-auth.sh)"
                ))
            })
        }
        Ok(None) => Ok(None),
        Err(StoreError::PermissionDenied { .. }) => {
            debug!(key, "node: may not read our name's ID block reservation; taking an ID from the cluster-wide counter");
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// The reserved ID blocks (none when the store does not let us read them).
async fn reserved_blocks(
    store: &dyn MetaStore,
    keys: &Keys,
) -> Result<BTreeSet<IdBlock>, StoreError> {
    match store.range(&keys.id_names_prefix()).await {
        Ok(r) => Ok(r
            .kvs
            .iter()
            .filter_map(|kv| String::from_utf8_lossy(&kv.value).parse().ok())
            .collect()),
        Err(StoreError::PermissionDenied { .. }) => Ok(BTreeSet::new()),
        Err(e) => Err(e),
    }
}

/// The first ID from `n` on whose key prefix no reserved block's etcd role covers (`n`
/// itself if none does), or `None` when `n` is fine.
fn skip_reserved(n: u64, reserved: &BTreeSet<IdBlock>) -> Option<u64> {
    let mut next = n;
    while let Some(b) = IdBlock::prefix_of(NodeId(next)) {
        if !reserved.contains(&b) {
            break;
        }
        // Past every ID of this length that starts with the block's four digits.
        let rest = next.to_string().len() as u32 - 4;
        next = (next / 10u64.pow(rest) + 1).saturating_mul(10u64.pow(rest));
    }
    (next != n).then_some(next)
}

/// Takes the next number of the counter at `key` by compare-and-swap (absent: 1), moved on by
/// `skip` when it names a number that must not be used.
async fn next(
    store: &dyn MetaStore,
    key: &str,
    skip: impl Fn(u64) -> Option<u64>,
) -> Result<u64, StoreError> {
    loop {
        let current = store.get(key).await?;
        let (last, compare) = match &current {
            Some(kv) => {
                let text = String::from_utf8_lossy(&kv.value);
                let last: NodeId = text.trim().parse().map_err(|_| {
                    StoreError::InvalidArgument(format!(
                        "{key} holds {text:?}, not a number; fix or delete the key"
                    ))
                })?;
                (last.0, Compare::mod_revision(key, kv.mod_revision))
            }
            None => (0, Compare::absent(key)),
        };
        let mut next = last + 1;
        if let Some(skipped) = skip(next) {
            next = skipped;
        }
        let resp = store
            .txn(
                Txn::new()
                    .when([compare])
                    .and_then([TxnOp::put(key, next.to_string())]),
            )
            .await?;
        if resp.succeeded {
            return Ok(next);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_wide_ids_skip_the_prefixes_of_reserved_blocks() {
        let reserved: BTreeSet<IdBlock> = [7, 8].into_iter().filter_map(IdBlock::new).collect();
        assert_eq!(skip_reserved(5, &reserved), None);
        assert_eq!(skip_reserved(1006, &reserved), None);
        assert_eq!(
            skip_reserved(1007, &reserved),
            Some(1009),
            "1007 and 1008 skipped"
        );
        assert_eq!(skip_reserved(10_070, &reserved), Some(10_090));
        assert_eq!(skip_reserved(10_075, &reserved), Some(10_090));
        assert_eq!(skip_reserved(100_700, &reserved), Some(100_900));
        assert_eq!(skip_reserved(1009, &reserved), None);
        assert_eq!(skip_reserved(1007, &BTreeSet::new()), None);
    }
}
