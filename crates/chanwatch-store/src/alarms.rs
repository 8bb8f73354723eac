//! Following the store's alarms (etcd's `alarm list`), for a gauge and a log line.
//!
//! Owns: polling [`MetaStore::alarms`], logging once when an alarm appears (with what to do)
//! and once when it clears, and telling the caller the current set so it can export
//! `chanwatch_etcd_alarm{type}`. Must not: act on an alarm (callers wait on the errors the
//! alarm causes, e.g. [`crate::StoreError::NoSpace`], with their own back-off) or end on an
//! error (a poll that fails keeps the last known set).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, info, warn};

use crate::types::AlarmKind;
use crate::MetaStore;

/// What an operator does about an alarm.
fn remedy(kind: AlarmKind) -> &'static str {
    match kind {
        AlarmKind::NoSpace => {
            "etcd refuses puts and lease grants: compact, defrag, `etcdctl alarm disarm` \
             (and raise --quota-backend-bytes if it fills again)"
        }
        AlarmKind::Corrupt => {
            "a member's data differs from the others': replace that member from a snapshot, \
             then `etcdctl alarm disarm`"
        }
    }
}

/// Polls `store`'s alarms every `period` until the future is dropped. Calls `on_change` with
/// the set of alarm kinds raised, first with the first answer, then whenever it changes; logs
/// each kind once when it appears (a warning saying what to do) and once when it clears.
pub async fn follow_alarms(
    store: Arc<dyn MetaStore>,
    period: Duration,
    mut on_change: impl FnMut(&BTreeSet<AlarmKind>) + Send,
) {
    let mut known: Option<BTreeSet<AlarmKind>> = None;
    loop {
        match store.alarms().await {
            Ok(alarms) => {
                let now: BTreeSet<AlarmKind> = alarms.iter().map(|a| a.kind).collect();
                let before = known.clone().unwrap_or_default();
                for kind in now.difference(&before) {
                    warn!(alarm = %kind, store = %store.describe(), "etcd raised alarm {kind}: {}", remedy(*kind));
                }
                for kind in before.difference(&now) {
                    info!(alarm = %kind, store = %store.describe(), "etcd alarm {kind} cleared");
                }
                if known.as_ref() != Some(&now) {
                    on_change(&now);
                    known = Some(now);
                }
            }
            Err(e) => debug!(error = %e, "cannot read etcd's alarms; keeping the last known"),
        }
        tokio::time::sleep(period).await;
    }
}
