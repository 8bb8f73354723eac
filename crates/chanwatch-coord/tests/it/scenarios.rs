//! The scenarios of the control plane, written once for every backend.
//!
//! Over 600 lines because it is a flat list of independent scenarios, each one test (run on
//! the embedded store and on etcd by `main.rs`); split it by theme when it grows further.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_coord::ApiError;
use chanwatch_core::{ChannelName, ChannelState, VChannelInfo};
use chanwatch_node::handler::Behaviour;
use chanwatch_store::{Compare, Txn, TxnOp};

use crate::cluster::{retry_not_ready, Backend, Cluster, TTL, WATCH_TIMEOUT};

const SETTLE: Duration = Duration::from_secs(20);

fn no_double_ownership(c: &Cluster) -> Result<()> {
    let overlaps = c.handler.overlaps();
    ensure!(
        overlaps.is_empty(),
        "channels ran on two nodes at once: {overlaps:#?}"
    );
    Ok(())
}

pub async fn assign_balances_30_channels_over_3_nodes_10_10_10(c: Cluster) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let nodes = [c.spawn_node(), c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 3).await?;
    c.add_channels(&coord, "ch", 30).await?;
    let view = c
        .wait_until(SETTLE, "30 channels Watched", |v| {
            v.all_watched_on_live_nodes(30)
        })
        .await?;
    ensure!(view.counts() == [10, 10, 10], "counts {:?}", view.counts());
    ensure!(
        view.channels.iter().all(|r| r.epoch == 1),
        "a channel was moved needlessly"
    );
    no_double_ownership(&c)
}

pub async fn a_killed_nodes_channels_and_only_its_are_watched_elsewhere_within_ttl_plus_2s(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let mut nodes = vec![c.spawn_node(), c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 3).await?;
    c.add_channels(&coord, "ch", 30).await?;
    let before = c
        .wait_until(SETTLE, "30 Watched", |v| v.all_watched_on_live_nodes(30))
        .await?;

    let victim = nodes.remove(0);
    let dead = c.kill_node(victim).context("victim had an id")?;
    let moved: Vec<ChannelName> = before.on(dead);
    let started = tokio::time::Instant::now();
    let after = c
        .wait_until(
            TTL + Duration::from_secs(2),
            "the dead node's channels Watched elsewhere",
            |v| v.nodes.len() == 2 && v.all_watched_on_live_nodes(30),
        )
        .await?;
    let took = started.elapsed();
    for row in &after.channels {
        let was = before
            .channels
            .iter()
            .find(|b| b.channel == row.channel)
            .context("channel vanished")?;
        if moved.contains(&row.channel) {
            ensure!(
                row.epoch == was.epoch + 1,
                "{} moved with epoch {} -> {}",
                row.channel,
                was.epoch,
                row.epoch
            );
        } else {
            ensure!(
                row.node == was.node && row.epoch == was.epoch,
                "{} moved although its node lives",
                row.channel
            );
        }
    }
    eprintln!(
        "failover of {} channels took {took:?} after the kill (ttl {TTL:?})",
        moved.len()
    );
    // The coordinator measured it too: exactly one failover, every moved channel counted.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    while coord.metrics.failover_seconds.get_sample_count() < 1 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "no failover duration was recorded"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    ensure!(coord.metrics.failover_seconds.get_sample_count() == 1);
    ensure!(coord.metrics.reassignments_of("failover") == moved.len() as u64);
    no_double_ownership(&c)
}

pub async fn all_nodes_dead_parks_everything_in_remaining_and_a_new_node_gets_all(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let nodes = vec![c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 8).await?;
    c.wait_until(SETTLE, "8 Watched", |v| v.all_watched_on_live_nodes(8))
        .await?;
    for n in nodes {
        c.kill_node(n);
    }
    c.wait_until(SETTLE, "all 8 in remaining", |v| {
        v.nodes.is_empty() && v.channels.len() == 8 && v.channels.iter().all(|r| r.node.is_none())
    })
    .await?;
    // A channel registered while no node lives is parked too.
    retry_not_ready(|| {
        coord.handle.add_channel(
            ChannelName::new("late").expect("valid"),
            VChannelInfo::default(),
        )
    })
    .await?;
    let fresh = c.spawn_node();
    let id = c.wait_node_id(&fresh).await?;
    let view = c
        .wait_until(SETTLE, "the new node watches all 9", |v| {
            v.all_watched_on_live_nodes(9)
        })
        .await?;
    ensure!(view.channels.iter().all(|r| r.node == Some(id.0)));
    no_double_ownership(&c)
}

pub async fn a_joining_node_gets_balanced_with_no_channel_run_by_two_nodes_at_once(
    c: Cluster,
) -> Result<()> {
    // Loads take a while, so moves overlap in time if break-before-make were broken.
    c.handler.set_default(Behaviour::Load {
        delay: Duration::from_millis(100),
    });
    let coord = c.spawn_coord("c1");
    let first = [c.spawn_node(), c.spawn_node()];
    for n in &first {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 21).await?;
    c.wait_until(SETTLE, "21 Watched", |v| v.all_watched_on_live_nodes(21))
        .await?;
    let joiner = c.spawn_node();
    let id = c.wait_node_id(&joiner).await?;
    let view = c
        .wait_until(SETTLE, "balanced over 3 nodes", |v| {
            v.nodes.len() == 3 && v.all_watched_on_live_nodes(21) && v.counts() == [7, 7, 7]
        })
        .await?;
    ensure!(view.on(id).len() == 7);
    no_double_ownership(&c)
}

pub async fn a_slow_load_reporting_progress_is_not_reassigned_but_a_hung_one_is(
    c: Cluster,
) -> Result<()> {
    c.handler.set(
        "slow",
        Behaviour::Slow {
            delay: WATCH_TIMEOUT * 2,
        },
    );
    c.handler.set("hung", Behaviour::Hang);
    let coord = c.spawn_coord("c1");
    let nodes = [c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    for name in ["slow", "hung"] {
        retry_not_ready(|| {
            coord.handle.add_channel(
                ChannelName::new(name).expect("valid"),
                VChannelInfo::default(),
            )
        })
        .await?;
    }
    // The hung one is reassigned for timeout; the slow one loads for 2x the timeout without
    // being reassigned (balance may move it once it is Watched, which is fine).
    let started = tokio::time::Instant::now();
    let view = c
        .wait_until(WATCH_TIMEOUT * 3, "hung reassigned", |v| {
            v.channels
                .iter()
                .any(|r| r.channel.as_str() == "hung" && r.epoch >= 2)
        })
        .await?;
    let hung = view
        .channels
        .iter()
        .find(|r| r.channel.as_str() == "hung")
        .context("hung")?;
    ensure!(hung.reason.as_deref() == Some("timeout"), "{hung:?}");
    tokio::time::sleep_until(started + WATCH_TIMEOUT * 2 + Duration::from_secs(1)).await;
    let first = c
        .handler
        .intervals()
        .into_iter()
        .find(|i| i.channel.as_str() == "slow" && i.epoch.0 == 1)
        .context("slow never ran at epoch 1")?;
    let ran = first
        .end_ms
        .unwrap_or(u64::MAX)
        .saturating_sub(first.start_ms);
    ensure!(
        ran >= (WATCH_TIMEOUT * 2).as_millis() as u64,
        "the slow load was cut off after {ran} ms: it was reassigned while making progress"
    );
    // A timed-out load is released first (break-before-make), so not even the hung channel
    // may overlap its successor.
    let overlaps = c.handler.overlaps();
    ensure!(
        overlaps.is_empty(),
        "channels ran on two nodes at once: {overlaps:#?}"
    );
    Ok(())
}

pub async fn a_failed_load_is_moved_to_another_node(c: Cluster) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let a = c.spawn_node();
    let a_id = c.wait_node_id(&a).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 1).await?;
    c.handler.set("flaky", Behaviour::Fail);
    retry_not_ready(|| {
        coord.handle.add_channel(
            ChannelName::new("flaky").expect("valid"),
            VChannelInfo::default(),
        )
    })
    .await?;
    c.wait_until(SETTLE, "flaky WatchFailed", |v| {
        v.channels
            .iter()
            .any(|r| r.state == ChannelState::WatchFailed)
    })
    .await?;
    c.handler.set(
        "flaky",
        Behaviour::Load {
            delay: Duration::ZERO,
        },
    );
    let b = c.spawn_node();
    let b_id = c.wait_node_id(&b).await?;
    let view = c
        .wait_until(SETTLE, "flaky Watched on the other node", |v| {
            v.all_watched_on_live_nodes(1)
        })
        .await?;
    ensure!(
        view.channels[0].node == Some(b_id.0),
        "stayed on the failing node {a_id}"
    );
    Ok(())
}

pub async fn a_running_channel_that_breaks_is_stopped_before_it_moves(c: Cluster) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let a = c.spawn_node();
    let b = c.spawn_node();
    c.wait_node_id(&a).await?;
    c.wait_node_id(&b).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.handler.set(
        "brk",
        Behaviour::BreakAfter {
            after: Duration::from_secs(2),
        },
    );
    retry_not_ready(|| {
        coord.handle.add_channel(
            ChannelName::new("brk").expect("valid"),
            VChannelInfo::default(),
        )
    })
    .await?;
    // It loads, runs, breaks: its node stops it, then acks WatchFailed, and it moves.
    c.wait_until(SETTLE, "brk moved after breaking", |v| {
        v.channels.iter().any(|r| r.epoch >= 2)
    })
    .await?;
    ensure!(
        coord.metrics.reassignments_of("failed") >= 1,
        "the move after a break counts as cause=failed"
    );
    let runs: Vec<_> = c
        .handler
        .intervals()
        .into_iter()
        .filter(|i| i.channel.as_str() == "brk")
        .collect();
    ensure!(
        runs.first().is_some_and(|r| r.end_ms.is_some()),
        "the broken run was stopped: {runs:?}"
    );
    let overlaps = c.handler.overlaps();
    ensure!(
        overlaps.is_empty(),
        "a broken channel ran beside its next owner: {overlaps:#?}"
    );
    Ok(())
}

pub async fn delete_during_a_load_cancels_it(c: Cluster) -> Result<()> {
    c.handler.set("doomed", Behaviour::Hang);
    let coord = c.spawn_coord("c1");
    let n = c.spawn_node();
    c.wait_node_id(&n).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 1).await?;
    let name = ChannelName::new("doomed")?;
    retry_not_ready(|| {
        coord
            .handle
            .add_channel(name.clone(), VChannelInfo::default())
    })
    .await?;
    let deadline = tokio::time::Instant::now() + SETTLE;
    while !c.handler.running().contains_key(&name) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the load never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    retry_not_ready(|| coord.handle.remove_channel(name.clone())).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while c.handler.running().contains_key(&name) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the load was not cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    ensure!(c.view().await?.channels.is_empty());
    Ok(())
}

pub async fn a_broken_watch_after_compaction_forces_a_relist_with_no_lost_channel(
    mut c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let nodes = vec![c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 10).await?;
    c.wait_until(SETTLE, "10 Watched", |v| v.all_watched_on_live_nodes(10))
        .await?;
    let rev = c.store.range("none/").await?.revision;
    c.store.compact(rev).await?;
    // Break every watch: nobody can resume from an old revision now; they must relist.
    match &mut c.backend {
        Backend::Embedded(store) => store.break_watches(),
        Backend::Etcd(fixture) => fixture.restart().await?,
    }
    // Changes made while watches are broken must not be lost.
    c.add_channels(&coord, "after", 4).await?;
    c.wait_until(SETTLE, "14 Watched after the relist", |v| {
        v.all_watched_on_live_nodes(14)
    })
    .await?;
    no_double_ownership(&c)
}

pub async fn a_killed_leader_is_replaced_by_the_standby_with_no_assignment_lost(
    c: Cluster,
) -> Result<()> {
    let leader = c.spawn_coord("c1");
    c.wait_leader_ready(&leader).await?;
    let standby = c.spawn_coord("c2");
    let nodes = [c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_coord_nodes(&leader, 2).await?;
    c.add_channels(&leader, "ch", 10).await?;
    let before = c
        .wait_until(SETTLE, "10 Watched", |v| v.all_watched_on_live_nodes(10))
        .await?;
    // A standby refuses writes and says where the leader is.
    let err = standby
        .handle
        .add_channel(ChannelName::new("x")?, VChannelInfo::default())
        .await;
    ensure!(
        matches!(&err, Err(ApiError::NotLeader { leader_addr: Some(a) }) if a == "c1.invalid:1"),
        "{err:?}"
    );

    leader.proc.kill();
    let started = tokio::time::Instant::now();
    let mut status = standby.proc.status.clone();
    tokio::time::timeout(TTL + Duration::from_secs(2), status.wait_for(|s| s.ready))
        .await
        .context("the standby did not take over within ttl + 2 s")??;
    let took = started.elapsed();
    ensure!(
        took <= TTL + Duration::from_secs(1),
        "takeover took {took:?} (> ttl + 1 s)"
    );
    let after = c.view().await?;
    ensure!(
        after.channels == before.channels,
        "assignments changed across the leader failover"
    );
    // The new leader works.
    c.add_channels(&standby, "new", 2).await?;
    c.wait_until(SETTLE, "12 Watched", |v| v.all_watched_on_live_nodes(12))
        .await?;
    eprintln!("standby took over {took:?} after the leader was killed (ttl {TTL:?})");
    Ok(())
}

pub async fn a_deposed_leader_cannot_write(c: Cluster) -> Result<()> {
    let coord = c.spawn_coord("c1");
    c.wait_leader_ready(&coord).await?;
    let n = c.spawn_node();
    c.wait_node_id(&n).await?;
    // Someone else takes the leader key (as if our lease had expired and a standby won).
    let key = c.keys.leader();
    let resp = c
        .store
        .txn(
            Txn::new()
                .when([Compare::exists(&key)])
                .and_then([TxnOp::delete(&key)]),
        )
        .await?;
    ensure!(resp.succeeded);
    // With a lease, as a standby's campaign writes it: a key with no lease would be cleared.
    let usurper = c.store.grant(Duration::from_secs(60)).await?;
    c.store
        .txn(Txn::new().and_then([TxnOp::put_with_lease(
            &key,
            br#"{"id":"usurper","admin_addr":"u:1","started_at_ms":0}"#.to_vec(),
            usurper.id,
        )]))
        .await?;
    let r = coord
        .handle
        .add_channel(ChannelName::new("nope")?, VChannelInfo::default())
        .await;
    ensure!(r.is_err(), "a deposed leader's write succeeded: {r:?}");
    ensure!(
        c.view().await?.channels.is_empty(),
        "a deposed leader wrote a channel"
    );
    let mut status = coord.proc.status.clone();
    tokio::time::timeout(SETTLE, status.wait_for(|s| !s.leader))
        .await
        .context("it never stepped down")??;
    Ok(())
}

/// Embedded only: someone overwrites the leader key in place (`etcdctl put` of the key, with
/// a lease of its own) while the leader's watch is stalled, so it cannot notice and step down.
/// The create revision stays the same, so only a txn guard on the key's *mod* revision refuses
/// its next write. CI once saw a write of a deposed leader land this way: it re-won between a
/// delete and a put that then overwrote its new key (`a_deposed_leader_cannot_write`).
pub async fn a_leader_whose_key_is_overwritten_in_place_cannot_write() -> Result<()> {
    use chanwatch_store::{EmbeddedStore, FaultyStore, MetaStore};
    use std::sync::Arc;
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(
        Backend::Embedded(inner.clone()),
        Arc::new(inner.clone()) as Arc<dyn MetaStore>,
    );
    let (faulty, faults) = FaultyStore::new(inner);
    let coord = c.spawn_coord_on("c1", Arc::new(faulty), |_| {});
    c.wait_leader_ready(&coord).await?;
    let n = c.spawn_node();
    c.wait_node_id(&n).await?;
    c.wait_coord_nodes(&coord, 1).await?;
    faults.stall_watches(true);
    let key = c.keys.leader();
    let usurper = c.store.grant(Duration::from_secs(60)).await?;
    c.store
        .txn(Txn::new().and_then([TxnOp::put_with_lease(
            &key,
            br#"{"id":"usurper","admin_addr":"u:1","started_at_ms":0}"#.to_vec(),
            usurper.id,
        )]))
        .await?;
    let r = coord
        .handle
        .add_channel(ChannelName::new("nope")?, VChannelInfo::default())
        .await;
    ensure!(
        r.is_err(),
        "a leader whose key was overwritten wrote: {r:?}"
    );
    ensure!(
        c.view().await?.channels.is_empty(),
        "a deposed leader wrote a channel"
    );
    faults.stall_watches(false);
    Ok(())
}

pub async fn a_corrupt_value_is_reported_and_left_alone_while_the_rest_works(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let n = c.spawn_node();
    let id = c.wait_node_id(&n).await?;
    c.wait_leader_ready(&coord).await?;
    let bad_key = format!(
        "{}{}",
        c.keys.owner_prefix(chanwatch_core::ChannelOwner::Node(id)),
        "broken"
    );
    // A value that decodes but names another channel than its key (DESIGN.md §2).
    let mismatched_key = format!(
        "{}{}",
        c.keys.owner_prefix(chanwatch_core::ChannelOwner::Node(id)),
        "bad2"
    );
    let other = chanwatch_core::ChannelInfo::new(
        ChannelName::new("other").expect("valid"),
        chanwatch_core::Epoch(1),
        0,
        VChannelInfo::default(),
    );
    c.store
        .txn(Txn::new().and_then([
            TxnOp::put(&bad_key, b"{not json".to_vec()),
            TxnOp::put(&mismatched_key, other.encode()),
        ]))
        .await?;
    c.add_channels(&coord, "ok", 3).await?;
    let view = c
        .wait_until(SETTLE, "3 good channels Watched", |v| {
            v.channels.len() == 3 && v.channels.iter().all(|r| r.state == ChannelState::Watched)
        })
        .await?;
    ensure!(
        view.corrupt == [mismatched_key.clone(), bad_key.clone()],
        "{:?}",
        view.corrupt
    );
    let ran: Vec<String> = c
        .handler
        .intervals()
        .iter()
        .map(|i| i.channel.to_string())
        .filter(|ch| !ch.starts_with("ok"))
        .collect();
    ensure!(
        ran.is_empty(),
        "the node ran {ran:?} from a key whose value names another channel"
    );
    let raw = c
        .store
        .get(&bad_key)
        .await?
        .context("the corrupt key was deleted")?;
    ensure!(
        raw.value == b"{not json",
        "the corrupt value was overwritten"
    );
    Ok(())
}

pub async fn a_node_that_cannot_renew_its_lease_fences_itself_before_it_expires(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let n = c.spawn_node();
    let first = c.wait_node_id(&n).await?;
    c.wait_leader_ready(&coord).await?;
    c.add_channels(&coord, "ch", 3).await?;
    c.wait_until(SETTLE, "3 Watched", |v| v.all_watched_on_live_nodes(3))
        .await?;
    // Revoke the node's lease behind its back: its next keepalive learns the lease is gone.
    let session = c
        .store
        .get(&c.keys.session(first))
        .await?
        .context("session")?;
    c.store
        .revoke(session.lease.context("session has a lease")?)
        .await?;
    // It stops every channel, registers under a new id and gets the channels back.
    let mut status = n.proc.status.clone();
    let s = tokio::time::timeout(SETTLE, status.wait_for(|s| s.fences >= 1 && s.id.is_some()))
        .await??;
    let second = s.id.context("new id")?;
    ensure!(
        second > first,
        "re-registered under {second}, not a fresh id after {first}"
    );
    let view = c
        .wait_until(SETTLE, "3 Watched on the new id", |v| {
            v.all_watched_on_live_nodes(3)
        })
        .await?;
    ensure!(view.channels.iter().all(|r| r.node == Some(second.0)));
    for i in c.handler.intervals().iter().filter(|i| i.node == first) {
        ensure!(
            i.end_ms.is_some(),
            "the fenced session still runs {}",
            i.channel
        );
    }
    no_double_ownership(&c)
}

pub async fn a_node_shut_down_gracefully_hands_its_channels_over_before_its_ttl(
    c: Cluster,
) -> Result<()> {
    let coord = c.spawn_coord("c1");
    let mut nodes = vec![c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 6).await?;
    c.wait_until(SETTLE, "6 Watched", |v| v.all_watched_on_live_nodes(6))
        .await?;
    // A graceful stop revokes the lease: no waiting for the TTL.
    nodes.remove(0).proc.stop().await;
    c.wait_until(
        TTL - Duration::from_secs(1),
        "6 Watched on the remaining node",
        |v| v.nodes.len() == 1 && v.all_watched_on_live_nodes(6),
    )
    .await?;
    no_double_ownership(&c)
}

pub async fn a_drain_moves_everything_off_and_survives_a_leader_failover(c: Cluster) -> Result<()> {
    let leader = c.spawn_coord("c1");
    c.wait_leader_ready(&leader).await?;
    let standby = c.spawn_coord("c2");
    let nodes = [c.spawn_node(), c.spawn_node()];
    let a = c.wait_node_id(&nodes[0]).await?;
    c.wait_node_id(&nodes[1]).await?;
    c.wait_coord_nodes(&leader, 2).await?;
    c.add_channels(&leader, "ch", 6).await?;
    c.wait_until(SETTLE, "6 Watched", |v| v.all_watched_on_live_nodes(6))
        .await?;
    // A manual move is break-before-make too.
    let first = c
        .view()
        .await?
        .on(a)
        .first()
        .cloned()
        .context("node a has a channel")?;
    let b = c
        .view()
        .await?
        .nodes
        .iter()
        .map(|n| n.id)
        .find(|id| *id != a.0)
        .context("node b")?;
    retry_not_ready(|| {
        leader
            .handle
            .move_channel(first.clone(), chanwatch_core::NodeId(b))
    })
    .await?;
    retry_not_ready(|| leader.handle.drain(a)).await?;
    let view = c
        .wait_until(SETTLE, "node a drained", |v| {
            v.all_watched_on_live_nodes(6)
                && v.on(a).is_empty()
                && v.nodes.iter().any(|n| n.id == a.0 && n.draining)
        })
        .await?;
    ensure!(
        view.channels
            .iter()
            .find(|r| r.channel == first)
            .and_then(|r| r.node)
            == Some(b)
    );
    leader.proc.kill();
    let mut status = standby.proc.status.clone();
    tokio::time::timeout(SETTLE, status.wait_for(|s| s.ready)).await??;
    c.add_channels(&standby, "new", 2).await?;
    c.wait_until(SETTLE, "8 Watched, none on the drained node", |v| {
        v.all_watched_on_live_nodes(8) && v.on(a).is_empty()
    })
    .await?;
    no_double_ownership(&c)
}

/// Embedded only (a paused clock makes the timing exact): a node whose keepalives fail stops
/// every channel before its lease can expire, and only then do the channels move.
pub async fn a_node_whose_keepalives_fail_stops_its_channels_before_its_lease_expires() -> Result<()>
{
    use chanwatch_store::{EmbeddedStore, FaultyStore, MetaStore};
    use std::sync::Arc;
    let inner = EmbeddedStore::new();
    let (faulty, faults) = FaultyStore::new(inner.clone());
    let c = Cluster::with_stores(
        Backend::Embedded(inner),
        Arc::new(faulty) as Arc<dyn MetaStore>,
    );
    let coord = c.spawn_coord("c1");
    let sick = c.spawn_node();
    let sick_id = c.wait_node_id(&sick).await?;
    c.wait_leader_ready(&coord).await?;
    c.add_channels(&coord, "ch", 3).await?;
    c.wait_until(SETTLE, "3 Watched", |v| v.all_watched_on_live_nodes(3))
        .await?;
    // From now on nobody can renew a lease: the sick node must fence itself first.
    faults.fail_keepalives(true);
    let session_key = c.keys.session(sick_id);
    let t0 = c.clock.unix_ms();
    let deadline = tokio::time::Instant::now() + TTL * 2;
    while c.store.get(&session_key).await?.is_some() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the sick node's lease never expired"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let expired_at = c.clock.unix_ms();
    for i in c.handler.intervals().iter().filter(|i| i.node == sick_id) {
        let end = i
            .end_ms
            .context("a channel still runs on the node whose lease expired")?;
        ensure!(
            end < expired_at,
            "{} stopped at {end}, not before the lease expired at {expired_at}",
            i.channel
        );
        ensure!(end >= t0, "stopped before the fault began");
    }
    Ok(())
}

/// Embedded only (paused clock): a node whose watch silently stops delivering (keepalives and
/// txns still work) is drained. It never sees the release requests; the leader must not move
/// the channels beside it: it fences the node by revoking its lease, and the channels move
/// only once the node has surely stopped them (before, the blind owner
/// ran them beside the new owner for ~6 s).
pub async fn a_drained_node_with_a_stalled_watch_is_fenced_before_its_channels_move() -> Result<()>
{
    use chanwatch_store::{EmbeddedStore, FaultyStore, MetaStore};
    use std::sync::Arc;
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(
        Backend::Embedded(inner.clone()),
        Arc::new(inner.clone()) as Arc<dyn MetaStore>,
    );
    let coord = c.spawn_coord("c1");
    let (faulty, faults) = FaultyStore::new(inner);
    // A node that never notices by itself (no watchdog: since watch progress, a node with a
    // stalled watch pauses and relists on its own, see the test above): only the
    // coordinator's fence stands between its channels and a second owner.
    let blind = c.spawn_node_with(
        Arc::new(faulty),
        Some(chanwatch_node::PlantedBug::NoFencing),
    );
    let blind_id = c.wait_node_id(&blind).await?;
    let healthy = c.spawn_node();
    c.wait_node_id(&healthy).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 6).await?;
    c.wait_until(SETTLE, "6 Watched on both nodes", |v| {
        v.all_watched_on_live_nodes(6) && !v.on(blind_id).is_empty()
    })
    .await?;
    let held = c.view().await?.on(blind_id);
    faults.stall_watches(true);
    retry_not_ready(|| coord.handle.drain(blind_id)).await?;
    // Past the release timeout the leader revokes the blind node's session.
    let session = c.keys.session(blind_id);
    let deadline = tokio::time::Instant::now() + WATCH_TIMEOUT + TTL;
    while c.store.get(&session).await?.is_some() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the blind node was not fenced"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Its channels move once it has surely stopped them; it comes back under a new ID
    // (still blind until the stall ends: then it takes channels again).
    c.wait_until(TTL * 3, "the blind node's channels moved", |v| {
        v.on(blind_id).is_empty()
            && held.iter().all(|ch| {
                v.channels
                    .iter()
                    .any(|r| &r.channel == ch && r.node.is_some())
            })
    })
    .await?;
    faults.stall_watches(false);
    c.wait_until(SETTLE, "6 Watched on live nodes", |v| {
        v.all_watched_on_live_nodes(6) && v.on(blind_id).is_empty()
    })
    .await?;
    ensure!(
        c.store.get(&c.keys.fence(blind_id)).await?.is_none(),
        "the fence mark is removed once the node owns nothing"
    );
    for ch in &held {
        let runs: Vec<_> = c
            .handler
            .intervals()
            .into_iter()
            .filter(|i| &i.channel == ch && i.node == blind_id)
            .collect();
        ensure!(
            runs.iter().all(|i| i.end_ms.is_some()),
            "{ch} still runs on the blind node"
        );
    }
    no_double_ownership(&c)
}

/// Embedded only (paused clock): a node whose watch stalls silently while its keepalives
/// succeed notices by itself, by watch progress: its watch does not
/// reach the revision its keepalive answers name, so within `ttl − margin` it pauses its
/// channels, relists (a fresh watch) and resumes. Nothing moves and it never registers again.
pub async fn a_node_whose_watch_stalls_pauses_by_itself_and_nothing_moves() -> Result<()> {
    use chanwatch_store::{EmbeddedStore, FaultyStore, MetaStore, Txn, TxnOp};
    use std::sync::Arc;
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(
        Backend::Embedded(inner.clone()),
        Arc::new(inner.clone()) as Arc<dyn MetaStore>,
    );
    let coord = c.spawn_coord("c1");
    let (faulty, faults) = FaultyStore::new(inner);
    let blind = c.spawn_node_on(Arc::new(faulty));
    let blind_id = c.wait_node_id(&blind).await?;
    let healthy = c.spawn_node();
    c.wait_node_id(&healthy).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 6).await?;
    let before = c
        .wait_until(SETTLE, "6 Watched on both nodes", |v| {
            v.all_watched_on_live_nodes(6) && !v.on(blind_id).is_empty()
        })
        .await?;
    ensure!(blind.proc.status.borrow().pauses == 0, "no pause yet");
    faults.stall_watches(true);
    // Something changes elsewhere: the keepalives' revision moves on, the watch cannot.
    c.store
        .txn(Txn::new().and_then([TxnOp::put("elsewhere/x", "1")]))
        .await?;
    let deadline = tokio::time::Instant::now() + TTL * 2;
    while blind.proc.status.borrow().pauses == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the node with a stalled watch never paused"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(TTL * 2).await;
    faults.stall_watches(false);
    let after = c
        .wait_until(SETTLE, "6 Watched", |v| v.all_watched_on_live_nodes(6))
        .await?;
    ensure!(
        after.on(blind_id) == before.on(blind_id),
        "nothing moved: {:?} -> {:?}",
        before.on(blind_id),
        after.on(blind_id)
    );
    let s = blind.proc.status.borrow().clone();
    ensure!(
        s.sessions == 1 && s.paused.is_none() && s.id == Some(blind_id),
        "one session, running again: {s:?}"
    );
    no_double_ownership(&c)
}

/// Embedded only (paused clock): an operator revokes a live node's lease (`etcdctl lease
/// revoke`). The coordinator fails its channels over at once (it cannot tell a revoke from an
/// expiry), not one TTL later as after its own fence. The node stops them as fast, not at its
/// next renewal up to ttl/3 later: the failover txn deletes its keys, and the node's watch
/// delivers those deletes in the same revision as the new owner's puts.
pub async fn an_operators_lease_revoke_stops_the_nodes_channels_before_they_run_elsewhere(
) -> Result<()> {
    let c = Cluster::embedded().await?;
    let coord = c.spawn_coord("c1");
    let victim = c.spawn_node();
    let victim_id = c.wait_node_id(&victim).await?;
    let other = c.spawn_node();
    c.wait_node_id(&other).await?;
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 6).await?;
    c.wait_until(SETTLE, "6 Watched on both nodes", |v| {
        v.all_watched_on_live_nodes(6) && !v.on(victim_id).is_empty()
    })
    .await?;
    let lease = c
        .store
        .get(&c.keys.session(victim_id))
        .await?
        .and_then(|kv| kv.lease)
        .context("the session key is leased")?;
    c.store.revoke(lease).await?;
    c.wait_until(SETTLE, "6 Watched off the revoked node", |v| {
        v.all_watched_on_live_nodes(6) && v.on(victim_id).is_empty()
    })
    .await?;
    no_double_ownership(&c)
}

/// Embedded only (paused clock): the whole store goes away for 20 s (an etcd crash, restart
/// or lost quorum: no leader, so no lease expires, and a new leader extends every lease),
/// with a session TTL of 3 s. Static stability (DESIGN §6, invariant 9): every channel is
/// paused, none is reassigned, no node registers again, and every channel runs again, on the
/// node it was on, within a second of the store's return (before, every
/// node fenced, stopped everything and came back under a new ID).
pub async fn an_etcd_outage_pauses_channels_and_they_resume_in_place() -> Result<()> {
    use chanwatch_store::{EmbeddedStore, MetaStore};
    use std::sync::Arc;
    let inner = EmbeddedStore::new();
    let c = Cluster::with_stores(
        Backend::Embedded(inner.clone()),
        Arc::new(inner.clone()) as Arc<dyn MetaStore>,
    );
    let coord = c.spawn_coord("c1");
    let nodes = [c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 6).await?;
    let before = c
        .wait_until(SETTLE, "6 Watched", |v| v.all_watched_on_live_nodes(6))
        .await?;
    let placement = |v: &crate::cluster::View| {
        let mut p: Vec<(String, Option<u64>, u64)> = v
            .channels
            .iter()
            .map(|r| (r.channel.to_string(), r.node, r.epoch))
            .collect();
        p.sort();
        p
    };
    let outage_ms = 20_000;
    inner.set_outage(true);
    tokio::time::sleep(Duration::from_millis(outage_ms)).await;
    let back = c.clock.unix_ms();
    inner.set_outage(false);
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Every channel runs again: one open interval per channel, begun after the return.
    let running = c.handler.running();
    ensure!(
        running.len() == 6 && running.values().all(|n| n.len() == 1),
        "not every channel runs once a second after the store came back: {running:?}"
    );
    for i in c.handler.intervals().iter().filter(|i| i.end_ms.is_none()) {
        ensure!(
            i.start_ms >= back && i.start_ms <= back + 1_000,
            "{} resumed at {} (store back at {back})",
            i.channel,
            i.start_ms
        );
    }
    // Paused meanwhile: no interval covers the middle of the outage.
    let mid = back - outage_ms / 2;
    ensure!(
        c.handler
            .intervals()
            .iter()
            .all(|i| !(i.start_ms <= mid && i.end_ms.map_or(true, |e| e > mid))),
        "a channel ran during the outage"
    );
    for n in &nodes {
        let s = n.proc.status.borrow().clone();
        ensure!(s.sessions == 1, "a node registered again: {s:?}");
        ensure!(s.pauses >= 1 && s.paused.is_none(), "{s:?}");
    }
    // Nothing moved, then or later.
    tokio::time::sleep(TTL * 3).await;
    let after = c
        .wait_until(SETTLE, "6 Watched", |v| v.all_watched_on_live_nodes(6))
        .await?;
    ensure!(
        placement(&before) == placement(&after),
        "channels moved: {:?} -> {:?}",
        placement(&before),
        placement(&after)
    );
    no_double_ownership(&c)
}
