//! A planned restart, the node's part (DESIGN §5): the one write that tells the coordinator
//! this node is leaving, and the log lines of a departure.
//!
//! Owns: rewriting the node's own session value with `leaving: true` — on its own lease,
//! guarded by the session's create revision, so it can never revive a session that is gone.
//! The decisions (when to announce, when done, when to give up) are
//! [`chanwatch_core::node::leave::Departure`]'s; the session loop drives both.
//! Must not: write any other key.

use std::sync::Arc;

use chanwatch_core::{Keys, NodeSession};
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use tracing::warn;

use crate::register::Registered;

/// Writes the session of `reg` again with `leaving: true`. `Some(revision)` once it landed
/// (`Some(0)` when our session key is gone: nothing can be put under us either); `None` when
/// it is to be tried again.
pub(crate) async fn announce_leaving(
    store: Arc<dyn MetaStore>,
    keys: Keys,
    reg: Registered,
) -> Option<i64> {
    let key = keys.session(reg.id);
    let kv = match store.get(&key).await {
        Ok(Some(kv)) if kv.create_revision == reg.session_revision => kv,
        Ok(_) => {
            warn!(node = %reg.id, "node: leaving: our session key is gone; nothing to announce");
            return Some(0);
        }
        Err(e) => {
            warn!(node = %reg.id, error = %e, "node: leaving: cannot read our session yet; retrying until the shutdown timeout");
            return None;
        }
    };
    let mut session = match NodeSession::decode(&kv.value) {
        Ok(s) => s,
        Err(e) => {
            warn!(node = %reg.id, error = %e, "node: leaving: our session value does not decode; cannot announce, waiting for the shutdown timeout");
            return None;
        }
    };
    session.set_leaving(true);
    let txn = Txn::new()
        .when([Compare::create_revision(&key, reg.session_revision)])
        .and_then([TxnOp::put_with_lease(&key, session.encode(), reg.lease)]);
    match store.txn(txn).await {
        Ok(r) if r.succeeded => Some(r.revision),
        Ok(_) => {
            warn!(node = %reg.id, "node: leaving: our session changed under us; not announcing");
            None
        }
        Err(e) => {
            warn!(node = %reg.id, error = %e, "node: leaving: cannot write our session yet; retrying until the shutdown timeout");
            None
        }
    }
}
