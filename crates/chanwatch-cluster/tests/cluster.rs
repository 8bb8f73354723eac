//! The in-process cluster harness: processes start, die, stop and freeze as their handles say,
//! on the embedded store and the system clock.

use std::error::Error;
use std::sync::Arc;
use std::time::Duration;

use chanwatch_cluster::{Cluster, InProcError, Timings};
use chanwatch_core::Keys;
use chanwatch_node::SimulatedLoad;
use chanwatch_store::{Clock, EmbeddedStore, MetaStore};

type Result<T = ()> = std::result::Result<T, Box<dyn Error>>;

const TTL: Duration = Duration::from_secs(3);
const WAIT: Duration = Duration::from_secs(10);

fn timings() -> Timings {
    Timings {
        session_ttl: TTL,
        watch_timeout: Duration::from_secs(4),
        resync_interval: Duration::from_secs(1),
        tick: Duration::from_millis(100),
        progress_interval: Duration::from_millis(300),
    }
}

fn cluster() -> Cluster {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    Cluster::new(
        store,
        Keys::default(),
        Clock::system(),
        &timings(),
        Arc::new(SimulatedLoad::default()),
    )
}

#[tokio::test]
async fn timings_become_the_planner_timers_and_the_session_ttl_of_every_process() {
    let t = timings();
    let c = cluster();
    let coord = c.coord_config("a");
    assert_eq!(coord.id, "a");
    assert_eq!(coord.session_ttl, TTL);
    assert_eq!(coord.tick, t.tick);
    assert_eq!(coord.resync_interval, t.resync_interval);
    assert_eq!(coord.planner.watch_timeout_ms, 4_000);
    assert_eq!(coord.planner.release_timeout_ms, 4_000);
    assert_eq!(coord.planner.fence_wait_ms, 3_000);
    assert_eq!(coord.planner.failed_node_backoff_ms, 4_000);
    assert_eq!(c.node_config.session_ttl, TTL);
    assert_eq!(c.node_config.progress_interval, t.progress_interval);
}

#[tokio::test]
async fn every_coordinator_gets_metrics_of_its_own_and_every_node_shares_one_set() {
    let c = cluster();
    let (a, b) = (c.coord_config("a"), c.coord_config("b"));
    assert!(!Arc::ptr_eq(&a.metrics, &b.metrics));
    assert!(!Arc::ptr_eq(&a.metrics, &c.coord_config.metrics));
    assert!(Arc::ptr_eq(
        &c.node_config.clone().metrics,
        c.node_metrics()
    ));
}

#[tokio::test]
async fn a_killed_node_leaves_its_session_and_a_stopped_node_revokes_it() -> Result {
    let c = cluster();
    let (killed, stopped) = (c.spawn_node(), c.spawn_node());
    let killed_id = killed.wait_id(WAIT).await?;
    let stopped_id = stopped.wait_id(WAIT).await?;
    killed.kill();
    stopped.stop().await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(c.store.get(&c.keys.session(killed_id)).await?.is_some());
    assert!(c.store.get(&c.keys.session(stopped_id)).await?.is_none());
    Ok(())
}

#[tokio::test]
async fn a_frozen_node_does_not_register_until_thawed() -> Result {
    let c = cluster();
    let node = c.spawn_node();
    node.pause(true);
    assert!(node.paused());
    match node.wait_id(Duration::from_millis(500)).await {
        Err(InProcError::NotRegistered { .. }) => {}
        other => return Err(format!("a frozen node registered: {other:?}").into()),
    }
    node.pause(false);
    node.wait_id(WAIT).await?;
    node.stop().await;
    Ok(())
}

#[tokio::test]
async fn a_stopped_leader_hands_over_at_once_and_a_killed_one_after_its_ttl() -> Result {
    let c = cluster();
    let a = c.spawn_coord("a")?;
    a.wait_ready(WAIT).await?;
    let b = c.spawn_coord("b")?;
    // Stopped: its lease is revoked, the standby leads well within one TTL.
    let started = std::time::Instant::now();
    a.stop().await;
    b.wait_ready(WAIT).await?;
    let stopped_handover = started.elapsed();
    assert!(stopped_handover < TTL, "took {stopped_handover:?}");
    // Killed: the lease stays until its TTL runs out.
    let d = c.spawn_coord("d")?;
    let started = std::time::Instant::now();
    b.kill();
    d.wait_ready(WAIT).await?;
    let killed_handover = started.elapsed();
    assert!(killed_handover >= TTL / 2, "took {killed_handover:?}");
    assert!(!d.is_finished());
    d.stop().await;
    Ok(())
}
