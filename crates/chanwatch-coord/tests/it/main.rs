//! Integration tests of the control plane: coordinators and nodes as tasks over one store.
//!
//! Every scenario in `scenarios.rs` runs twice: `embedded::<scenario>` on the embedded store
//! under a paused tokio clock (deterministic, fast), and `etcd::<scenario>` against a real
//! etcd process on loopback ports, in real time.

mod api;
mod browser;
mod cluster;
mod scenarios;

macro_rules! scenarios {
    ($backend:ident, $make:path, #[$runtime:meta], [$($case:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[$runtime]
                async fn $case() -> anyhow::Result<()> {
                    let cluster = $make().await?;
                    crate::scenarios::$case(cluster).await
                }
            )*
        }
    };
}

macro_rules! all_backends {
    ($($case:ident),* $(,)?) => {
        scenarios!(embedded, crate::cluster::Cluster::embedded, #[tokio::test(start_paused = true)], [$($case),*]);
        scenarios!(etcd, crate::cluster::Cluster::etcd, #[tokio::test(flavor = "multi_thread", worker_threads = 2)], [$($case),*]);
    };
}

all_backends!(
    assign_balances_30_channels_over_3_nodes_10_10_10,
    a_killed_nodes_channels_and_only_its_are_watched_elsewhere_within_ttl_plus_2s,
    all_nodes_dead_parks_everything_in_remaining_and_a_new_node_gets_all,
    a_joining_node_gets_balanced_with_no_channel_run_by_two_nodes_at_once,
    a_slow_load_reporting_progress_is_not_reassigned_but_a_hung_one_is,
    a_failed_load_is_moved_to_another_node,
    delete_during_a_load_cancels_it,
    a_broken_watch_after_compaction_forces_a_relist_with_no_lost_channel,
    a_killed_leader_is_replaced_by_the_standby_with_no_assignment_lost,
    a_deposed_leader_cannot_write,
    a_corrupt_value_is_reported_and_left_alone_while_the_rest_works,
    a_node_that_cannot_renew_its_lease_fences_itself_before_it_expires,
    a_node_shut_down_gracefully_hands_its_channels_over_before_its_ttl,
    a_drain_moves_everything_off_and_survives_a_leader_failover,
);

/// Scenarios that need exact simulated time run on the embedded store only.
mod embedded_only {
    #[tokio::test(start_paused = true)]
    async fn a_node_whose_keepalives_fail_stops_its_channels_before_its_lease_expires(
    ) -> anyhow::Result<()> {
        crate::scenarios::a_node_whose_keepalives_fail_stops_its_channels_before_its_lease_expires()
            .await
    }
}
