//! Integration tests of the control plane: coordinators and nodes as tasks over one store.
//!
//! Every scenario in `scenarios.rs` runs twice: `embedded::<scenario>` on the embedded store
//! under a paused tokio clock (deterministic, fast), and `etcd::<scenario>` against a real
//! etcd process on loopback ports, in real time.

mod api;
mod browser;
mod bulk;
mod burst;
mod cluster;
mod events;
mod leader;
mod library;
mod placement;
mod scenarios;
mod scope;
mod summary;
mod upkeep;

/// One test per case on one backend; each calls `$module::$case(cluster)`.
macro_rules! scenarios {
    ($backend:ident, $make:path, #[$runtime:meta], $module:ident, [$($case:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[$runtime]
                async fn $case() -> anyhow::Result<()> {
                    let cluster = $make().await?;
                    crate::$module::$case(cluster).await
                }
            )*
        }
    };
}

/// Every case of `$module` on the embedded store (paused clock) and on real etcd.
macro_rules! on_both_backends {
    ($module:ident, $($case:ident),* $(,)?) => {
        scenarios!(embedded, crate::cluster::Cluster::embedded, #[tokio::test(start_paused = true)], $module, [$($case),*]);
        scenarios!(etcd, crate::cluster::Cluster::etcd, #[tokio::test(flavor = "multi_thread", worker_threads = 2)], $module, [$($case),*]);
    };
}

macro_rules! all_backends {
    ($($case:ident),* $(,)?) => {
        on_both_backends!(scenarios, $($case),*);
    };
}

all_backends!(
    assign_balances_30_channels_over_3_nodes_10_10_10,
    a_killed_nodes_channels_and_only_its_are_watched_elsewhere_within_ttl_plus_2s,
    all_nodes_dead_parks_everything_in_remaining_and_a_new_node_gets_all,
    a_joining_node_gets_balanced_with_no_channel_run_by_two_nodes_at_once,
    a_slow_load_reporting_progress_is_not_reassigned_but_a_hung_one_is,
    a_failed_load_is_moved_to_another_node,
    a_running_channel_that_breaks_is_stopped_before_it_moves,
    delete_during_a_load_cancels_it,
    a_broken_watch_after_compaction_forces_a_relist_with_no_lost_channel,
    a_killed_leader_is_replaced_by_the_standby_with_no_assignment_lost,
    a_deposed_leader_cannot_write,
    a_corrupt_value_is_reported_and_left_alone_while_the_rest_works,
    a_node_that_cannot_renew_its_lease_fences_itself_before_it_expires,
    a_node_shut_down_gracefully_hands_its_channels_over_before_its_ttl,
    a_drain_moves_everything_off_and_survives_a_leader_failover,
);

/// Leader honesty (a leader whose key is gone must stop acting as leader), on both backends.
mod leader_key {
    on_both_backends!(
        leader,
        a_leader_whose_key_is_deleted_steps_down_at_once_and_one_leader_remains,
        a_leader_key_with_no_lease_is_deleted_and_never_blocks_an_election,
    );
}

/// The leader's compaction (DESIGN §8), on both backends.
mod compaction {
    on_both_backends!(
        upkeep,
        the_leader_compacts_every_interval_alone_and_nodes_keep_their_assignments,
    );
}

/// What the coordinator's list-watch covers, on both backends.
mod watch_scope {
    on_both_backends!(scope, checkpoint_commits_never_reach_the_coordinators_watch);
}

/// Scenarios that need exact simulated time run on the embedded store only.
mod embedded_only {
    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_key_is_overwritten_in_place_cannot_write() -> anyhow::Result<()> {
        crate::scenarios::a_leader_whose_key_is_overwritten_in_place_cannot_write().await
    }

    #[tokio::test(start_paused = true)]
    async fn an_operators_lease_revoke_stops_the_nodes_channels_before_they_run_elsewhere(
    ) -> anyhow::Result<()> {
        crate::scenarios::an_operators_lease_revoke_stops_the_nodes_channels_before_they_run_elsewhere()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_whose_watch_stalls_pauses_by_itself_and_nothing_moves() -> anyhow::Result<()> {
        crate::scenarios::a_node_whose_watch_stalls_pauses_by_itself_and_nothing_moves().await
    }

    #[tokio::test(start_paused = true)]
    async fn an_etcd_outage_pauses_channels_and_they_resume_in_place() -> anyhow::Result<()> {
        crate::scenarios::an_etcd_outage_pauses_channels_and_they_resume_in_place().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_drained_node_with_a_stalled_watch_is_fenced_before_its_channels_move(
    ) -> anyhow::Result<()> {
        crate::scenarios::a_drained_node_with_a_stalled_watch_is_fenced_before_its_channels_move()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_whose_keepalives_fail_stops_its_channels_before_its_lease_expires(
    ) -> anyhow::Result<()> {
        crate::scenarios::a_node_whose_keepalives_fail_stops_its_channels_before_its_lease_expires()
            .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_whose_watch_stalls_relists_by_itself_and_sees_the_acks() -> anyhow::Result<()>
    {
        crate::scope::a_leader_whose_watch_stalls_relists_by_itself_and_sees_the_acks().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_coordinator_waits_out_nospace_and_auth_errors_and_then_leads() -> anyhow::Result<()>
    {
        crate::leader::a_coordinator_waits_out_nospace_and_auth_errors_and_then_leads().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_leader_that_cannot_list_resigns_so_a_standby_leads() -> anyhow::Result<()> {
        crate::leader::a_leader_that_cannot_list_resigns_so_a_standby_leads().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_configuration_error_at_start_up_stops_the_coordinator() -> anyhow::Result<()> {
        crate::leader::a_configuration_error_at_start_up_stops_the_coordinator().await
    }

    #[tokio::test(start_paused = true)]
    async fn a_request_flood_beside_a_node_kill_fails_over_within_ttl_plus_1s_and_assigns_nothing_to_the_dead_node(
    ) -> anyhow::Result<()> {
        let cluster = crate::leader::embedded_with_latency();
        crate::leader::a_request_flood_beside_a_node_kill_fails_over_within_ttl_plus_1s_and_assigns_nothing_to_the_dead_node(cluster).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_list_being_written_leaves_the_leader_serving_and_its_names_refused_elsewhere(
    ) -> anyhow::Result<()> {
        crate::bulk::a_list_being_written_leaves_the_leader_serving_and_its_names_refused_elsewhere(
        )
        .await
    }

    #[tokio::test(start_paused = true)]
    async fn a_failover_found_by_a_relist_is_logged_and_measured() -> anyhow::Result<()> {
        crate::leader::a_failover_found_by_a_relist_is_logged_and_measured().await
    }
}

/// Real etcd, real time.
mod etcd_only {
    /// The small-quota test (without compaction etcd reaches NOSPACE, with it never), two runs
    /// of `CHANWATCH_UPKEEP_SECS` (default 60) of churn each: run with `--ignored --nocapture` to see the numbers.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore = "two minutes of churn on real etcd; .ci/run runs it on its own"]
    async fn a_small_quota_without_auto_compaction_fills_only_without_compaction(
    ) -> anyhow::Result<()> {
        crate::upkeep::a_small_quota_without_auto_compaction_fills_only_without_compaction().await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_request_flood_beside_a_node_kill_fails_over_within_ttl_plus_1s_and_assigns_nothing_to_the_dead_node(
    ) -> anyhow::Result<()> {
        let cluster = crate::cluster::Cluster::etcd().await?;
        crate::leader::a_request_flood_beside_a_node_kill_fails_over_within_ttl_plus_1s_and_assigns_nothing_to_the_dead_node(cluster).await
    }
}
