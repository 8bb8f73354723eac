//! The etcd backend against a 3-member cluster: when a member dies or hangs, lease renewals
//! move to another member at once instead of landing on that one again by chance.
//!
//! Looked for after a CI chaos run lost a node's session during a member restart: the
//! client's balancer draws a member at random for each new renewal stream, so renewals went
//! back to a dead or hung member by chance — and against a hung one each such renewal waits
//! out its timeout (two in a row pause a node with a 4 s TTL).

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore};
use chanwatch_testkit::EtcdCluster;

/// Leases renewed in the test: each starts its renewals on some member, so a dead member
/// holds the streams of several of them.
const LEASES: usize = 12;

/// The index of the member that leads now (waits up to 5 s for one).
async fn leader(cluster: &EtcdCluster) -> Result<usize> {
    for _ in 0..50 {
        if let Some(i) = cluster.leader().await {
            return Ok(i);
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

/// A fresh 3-member cluster and a store on all its members (requests time out after 3 s).
async fn three_members() -> Result<(EtcdCluster, EtcdStore)> {
    let cluster = EtcdCluster::start(3).await?;
    let store = EtcdStore::connect(EtcdConfig {
        endpoints: cluster.endpoints(),
        request_timeout: Duration::from_secs(3),
        ..EtcdConfig::default()
    })
    .await?;
    Ok((cluster, store))
}

/// Waits until every member is back in rotation: a thawed member answers its probe (sent
/// every second) within a few seconds; 10 s at most.
async fn all_back_in_rotation(store: &EtcdStore, cluster: &EtcdCluster) -> Result<()> {
    let thawed = tokio::time::Instant::now();
    while store.members_in_rotation() != cluster.endpoints() {
        ensure!(
            thawed.elapsed() < Duration::from_secs(10),
            "every member is back in rotation 10 s after the thaw: {:?}",
            store.members_in_rotation()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Of 30 reads (linearizable: a frozen member holds one for the whole request timeout), how
/// many got no answer within 1 s.
async fn slow_reads(store: &EtcdStore) -> usize {
    let mut slow = 0;
    for _ in 0..30 {
        let read = tokio::time::timeout(Duration::from_secs(1), store.get("cw/any")).await;
        if !matches!(read, Ok(Ok(_))) {
            slow += 1;
        }
    }
    slow
}

/// A new lease, renewed once (the client may first answer a stale error from a member that
/// was down: a grant is retried, as every caller retries).
async fn granted_and_renewed(store: &EtcdStore) -> Result<i64> {
    let mut last = None;
    for _ in 0..10 {
        let renewed = async {
            let lease = store.grant(Duration::from_secs(30)).await?.id;
            store.keepalive(lease).await.map(|_| lease)
        };
        match renewed.await {
            Ok(lease) => return Ok(lease),
            Err(e) if e.is_retryable() => last = Some(e),
            Err(e) => return Err(e.into()),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Err(last.map_or_else(|| anyhow::anyhow!("no lease"), Into::into))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_move_off_a_member_that_died_or_hangs_at_the_first_failure() -> Result<()> {
    let (mut cluster, store) = three_members().await?;
    // A follower each round (a leader's death leaves every member without a leader for a
    // while, which no client can help): killed, or frozen (it takes connections and answers
    // nothing, as a member cut off from the others); every lease renewed; then back.
    for (round, frozen) in [false, false, true, true].into_iter().enumerate() {
        // Fresh leases each round: their renewals start spread over the members (those of a
        // round before have moved off the members it hurt).
        let mut leases = Vec::new();
        for _ in 0..LEASES {
            leases.push(granted_and_renewed(&store).await?);
        }
        let leader = leader(&cluster).await?;
        let victim = (leader + 1 + round % 2) % 3;
        if frozen {
            cluster.freeze_member(victim)?;
        } else {
            cluster.kill_member(victim);
        }
        let mut failed = Vec::new();
        for &lease in &leases {
            failed.push(failures_until_renewed(&store, lease).await?);
        }
        // A lease whose stream was on that member fails once (the stream ended, or its
        // renewal went unanswered), then goes to the next member, which answers. Before,
        // each new stream went to a member drawn at random: a third of the tries went to the
        // bad one again.
        let how = if frozen { "frozen" } else { "dead" };
        println!("member {victim} {how}: failed renewals per lease {failed:?}");
        ensure!(
            failed.iter().all(|f| *f <= 1),
            "with member {victim} {how}, failed renewals before one was answered, per lease: \
             {failed:?} (at most 1 each: a renewal must not go to that member twice)"
        );
        if frozen {
            cluster.thaw_member(victim).await?;
        } else {
            cluster.start_member(victim).await?;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_that_hangs_gets_no_requests_once_a_renewal_found_it_and_is_put_back_later(
) -> Result<()> {
    let (cluster, store) = three_members().await?;
    // Twice as many: the frozen member must carry renewals of some lease to be found (with
    // 24 spread over 3 members, all miss one with a chance of 6 in 100,000).
    let mut leases = Vec::new();
    for _ in 0..2 * LEASES {
        leases.push(granted_and_renewed(&store).await?);
    }
    let victim = (leader(&cluster).await? + 1) % 3;
    cluster.freeze_member(victim)?;
    // The renewals whose streams were on it go unanswered once: that takes it out.
    for &lease in &leases {
        failures_until_renewed(&store, lease).await?;
    }
    // Reads (linearizable: a frozen member holds them for the whole request timeout) now go
    // to the others only. Before, the balancer sent a third of them to the frozen member.
    let slow = slow_reads(&store).await;
    ensure!(
        slow == 0,
        "{slow} of 30 reads got no answer within 1 s with member {victim} frozen (0: the \
         member that left a renewal unanswered gets no requests)"
    );
    ensure!(
        !store
            .members_in_rotation()
            .contains(&cluster.endpoints()[victim]),
        "member {victim} is out of rotation while frozen: {:?}",
        store.members_in_rotation()
    );
    // Thawed, it answers the probe (every second) and is used again.
    cluster.thaw_member(victim).await?;
    all_back_in_rotation(&store, &cluster).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_kept_in_rotation_as_the_last_one_goes_out_once_another_is_back() -> Result<()> {
    let (cluster, store) = three_members().await?;
    let mut leases = Vec::new();
    for _ in 0..6 {
        leases.push(granted_and_renewed(&store).await?);
    }
    // Every member frozen (an etcd-wide outage): renewals go unanswered on each member in
    // turn; two are taken out, the last one is kept (and probed, once a renewal there went
    // unanswered too: the rounds after the loop make sure of it — leases that all started on
    // one or two members reach the last one only in the round that ends the loop).
    for i in 0..3 {
        cluster.freeze_member(i)?;
    }
    let started = tokio::time::Instant::now();
    while store.members_in_rotation().len() > 1 {
        ensure!(
            started.elapsed() < Duration::from_secs(60),
            "with every member frozen, renewals did not leave one member in rotation in 60 s: {:?}",
            store.members_in_rotation()
        );
        for &lease in &leases {
            let _ = tokio::time::timeout(Duration::from_millis(300), store.keepalive(lease)).await;
        }
    }
    for _ in 0..2 {
        for &lease in &leases {
            let _ = tokio::time::timeout(Duration::from_millis(300), store.keepalive(lease)).await;
        }
    }
    let kept = store.members_in_rotation();
    let kept = cluster
        .endpoints()
        .iter()
        .position(|e| kept.contains(e))
        .context("the member kept in rotation is one of the cluster's")?;
    // The other two thawed: they answer their probes and are back in rotation. The kept one,
    // still frozen, must go out at its next unanswered probe. Before, it stayed in (nothing
    // probed it) and took its share of requests, each waiting out the timeout.
    let (a, b) = ((kept + 1) % 3, (kept + 2) % 3);
    let (ta, tb) = tokio::join!(cluster.thaw_member(a), cluster.thaw_member(b));
    ta?;
    tb?;
    let want: Vec<String> = cluster
        .endpoints()
        .into_iter()
        .enumerate()
        .filter(|(i, _)| *i != kept)
        .map(|(_, e)| e)
        .collect();
    let thawed = tokio::time::Instant::now();
    while store.members_in_rotation() != want {
        ensure!(
            thawed.elapsed() < Duration::from_secs(10),
            "10 s after members {a} and {b} were thawed, member {kept} (kept in rotation as the \
             last one, still frozen) should be out and they in: {:?}",
            store.members_in_rotation()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!(
        "members in rotation {:?}, {:?} after the thaw",
        store.members_in_rotation(),
        thawed.elapsed()
    );
    // And the connection sends it nothing (not only the table says so): reads (linearizable,
    // a frozen member holds them for the whole request timeout) are all answered at once.
    let slow = slow_reads(&store).await;
    ensure!(
        slow == 0,
        "{slow} of 30 reads got no answer within 1 s with member {kept} frozen and out of rotation"
    );
    // Thawed too, it answers its probe and is used again.
    cluster.thaw_member(kept).await?;
    all_back_in_rotation(&store, &cluster).await
}
