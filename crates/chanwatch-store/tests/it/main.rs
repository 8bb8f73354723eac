//! Integration tests of chanwatch-store: the conformance suite, instantiated once per backend.
//!
//! Every case in `suite.rs` runs twice: as `embedded::<case>` on the in-process store under a
//! paused tokio clock, and as `etcd::<case>` against a real etcd process started by
//! `chanwatch-testkit` on loopback ports (a fresh process per case, killed at the end).

mod faults;
mod liveness;
mod members;
mod secure;
mod suite;

use std::sync::Arc;

use chanwatch_store::{EmbeddedStore, EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::EtcdFixture;

/// A store under test and whatever keeps it alive.
pub struct Harness {
    /// The store.
    pub store: Arc<dyn MetaStore>,
    _etcd: Option<EtcdFixture>,
}

async fn embedded() -> anyhow::Result<Harness> {
    Ok(Harness {
        store: Arc::new(EmbeddedStore::new()),
        _etcd: None,
    })
}

async fn etcd() -> anyhow::Result<Harness> {
    let fixture = EtcdFixture::start().await?;
    let store = EtcdStore::connect(EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        ..EtcdConfig::default()
    })
    .await?;
    Ok(Harness {
        store: Arc::new(store),
        _etcd: Some(fixture),
    })
}

macro_rules! conformance {
    ($backend:ident, $make:path, #[$runtime:meta], [$($case:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[$runtime]
                async fn $case() -> anyhow::Result<()> {
                    let harness = $make().await?;
                    crate::suite::$case(harness.store.clone()).await
                }
            )*
        }
    };
}

macro_rules! all_backends {
    ($($case:ident),* $(,)?) => {
        conformance!(embedded, crate::embedded, #[tokio::test(start_paused = true)], [$($case),*]);
        conformance!(etcd, crate::etcd, #[tokio::test(flavor = "multi_thread", worker_threads = 2)], [$($case),*]);
    };
}

all_backends!(
    txn_compares_pick_the_branch,
    txn_that_writes_nothing_keeps_the_revision,
    compare_targets_match_etcd_for_missing_keys,
    range_returns_sorted_keys_and_its_revision,
    a_key_range_lists_and_watches_only_its_half_open_span,
    delete_prefix_removes_only_the_prefix,
    duplicate_key_in_one_branch_is_refused,
    watch_delivers_ordered_events_with_their_values,
    one_txn_is_one_batch,
    watch_from_an_old_revision_replays_history,
    watch_after_compaction_fails_with_compacted,
    lease_expiry_deletes_attached_keys,
    keepalive_keeps_a_lease_alive,
    revoke_deletes_attached_keys,
    put_on_a_dead_lease_is_refused,
    txn_over_the_op_limit_is_refused,
    concurrent_cas_increments_are_unique,
    a_quiet_watch_reports_progress_up_to_a_keepalive_revision,
    a_client_of_its_own_sees_every_write_and_its_own_progress,
);
