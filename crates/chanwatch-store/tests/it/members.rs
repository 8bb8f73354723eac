//! The etcd backend against a 3-member cluster: when a member dies, lease renewals move to
//! another member at once instead of landing on the dead one by chance.
//!
//! Found by the chaos run: a restart of one member of three paused nodes whose sessions it did
//! not threaten (their renewals kept going to the restarting member), and once cost a session.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::EtcdCluster;

/// Leases renewed in the test: each starts its renewals on some member, so a dead member
/// holds the streams of several of them.
const LEASES: usize = 12;

/// The index of the member that leads now.
async fn leader(cluster: &EtcdCluster) -> Result<usize> {
    for _ in 0..50 {
        for (i, endpoint) in cluster.endpoints().iter().enumerate() {
            let Ok(mut c) = etcd_client::Client::connect([endpoint], None).await else {
                continue;
            };
            let Ok(status) = c.status().await else {
                continue;
            };
            if status.header().map(|h| h.member_id()) == Some(status.leader()) {
                return Ok(i);
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("no member leads")
}

/// Renews `lease` every 500 ms until a renewal is answered (each given 1.5 s, as a node's
/// keeper gives up on one); returns how many failed first.
async fn failures_until_renewed(store: &EtcdStore, lease: i64) -> Result<usize> {
    for failures in 0..20 {
        match tokio::time::timeout(Duration::from_millis(1_500), store.keepalive(lease)).await {
            Ok(Ok(_)) => return Ok(failures),
            Ok(Err(e)) if !e.is_retryable() => return Err(e).context("a renewal failed for good"),
            _ => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
    anyhow::bail!("lease {lease} was not renewed in 20 tries")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_move_off_a_member_that_died_at_the_first_failure() -> Result<()> {
    let mut cluster = EtcdCluster::start(3).await?;
    let store = EtcdStore::connect(EtcdConfig {
        endpoints: cluster.endpoints(),
        request_timeout: Duration::from_secs(3),
        ..EtcdConfig::default()
    })
    .await?;
    let mut leases = Vec::new();
    for _ in 0..LEASES {
        let lease = store.grant(Duration::from_secs(10)).await?.id;
        store.keepalive(lease).await?;
        leases.push(lease);
    }
    // Each follower in turn (a leader's death leaves every member without a leader for a
    // while, which no client can help): killed, every lease renewed, started again.
    let first = leader(&cluster).await?;
    for victim in (0..3).filter(|i| *i != first) {
        ensure!(
            leader(&cluster).await? != victim,
            "member {victim} leads now; the test kills followers only"
        );
        cluster.kill_member(victim);
        let mut failed = Vec::new();
        for &lease in &leases {
            failed.push(failures_until_renewed(&store, lease).await?);
        }
        // A lease whose stream was on the dead member fails once (the stream ended), then
        // goes to the next member, which answers. Before, each new stream went to a member
        // drawn at random: a third of the tries failed again on the dead one.
        ensure!(
            failed.iter().all(|f| *f <= 1),
            "with member {victim} dead, failed renewals before one was answered, per lease: \
             {failed:?} (at most 1 each: a renewal must not go to the dead member twice)"
        );
        cluster.start_member(victim).await?;
    }
    Ok(())
}
