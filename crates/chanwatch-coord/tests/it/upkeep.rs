//! The leader's upkeep (DESIGN.md §8): compaction every `--compact-interval`, one coordinator
//! per interval, and watchers that keep working across it; and (ignored: a minute per run)
//! a small etcd quota without auto-compaction that only compaction keeps from NOSPACE.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_core::{ChannelName, Keys, VChannelInfo};
use chanwatch_store::{
    AlarmKind, EtcdConfig, EtcdStore, MetaStore, Revision, StoreError, Txn, TxnOp,
};
use chanwatch_testkit::{EtcdFixture, EtcdOptions};
use futures_util::StreamExt;

use crate::cluster::{Backend, Cluster, Coord, TTL};

const INTERVAL: Duration = Duration::from_secs(2);
const SETTLE: Duration = Duration::from_secs(20);

/// The revision `{root}/coord/compact` names (0 when absent).
async fn compact_record(c: &Cluster) -> Result<Revision> {
    Ok(match c.store.get(&c.keys.compact()).await? {
        Some(kv) => String::from_utf8(kv.value)?.parse()?,
        None => 0,
    })
}

/// Whether history before `rev` is gone (a watch from below it is refused).
async fn compacted_below(store: &dyn MetaStore, rev: Revision) -> Result<bool> {
    let mut w = store.watch("none/", rev - 1).await?;
    Ok(matches!(
        w.next().await,
        Some(Err(StoreError::Compacted { .. }))
    ))
}

/// Adds one channel every 250 ms for `for_` through whichever of `coords` leads, so that
/// revisions move between compactions (leadership may move: etcd restarts in these tests).
async fn churn(coords: &[&Coord], prefix: &str, for_: Duration) -> Result<usize> {
    let until = tokio::time::Instant::now() + for_;
    let mut n = 0;
    while tokio::time::Instant::now() < until {
        let name = ChannelName::new(format!("{prefix}{n:03}"))?;
        let deadline = tokio::time::Instant::now() + SETTLE;
        loop {
            let leader = coords.iter().find(|co| co.proc.status.borrow().ready);
            if let Some(leader) = leader {
                match leader
                    .handle
                    .add_channel(name.clone(), VChannelInfo::default())
                    .await
                {
                    Ok(_) => break,
                    Err(e) if tokio::time::Instant::now() >= deadline => {
                        anyhow::bail!("adding {name} kept failing: {e}")
                    }
                    Err(_) => {}
                }
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "no coordinator led for {SETTLE:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        n += 1;
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(n)
}

fn compactor(c: &Cluster, id: &str) -> Coord {
    c.spawn_coord_on(id, c.store.clone(), |config| {
        config.compact_interval = INTERVAL;
    })
}

/// Whole intervals in `d`: the most compactions one term (or a chain of terms) may run.
fn intervals(d: Duration) -> Result<u64> {
    Ok(u64::try_from(d.as_millis() / INTERVAL.as_millis())?)
}

pub async fn the_leader_compacts_every_interval_alone_and_nodes_keep_their_assignments(
    mut c: Cluster,
) -> Result<()> {
    let began = tokio::time::Instant::now();
    let c1 = compactor(&c, "c1");
    c.wait_leader_ready(&c1).await?;
    let c2 = compactor(&c, "c2");
    let nodes = [c.spawn_node(), c.spawn_node()];
    for n in &nodes {
        c.wait_node_id(n).await?;
    }
    c.wait_coord_nodes(&c1, 2).await?;
    c.add_channels(&c1, "ch", 10).await?;
    let mut channels = 10 + churn(&[&c1, &c2], "a", INTERVAL * 3).await?;
    c.wait_until(SETTLE, "every channel Watched", |v| {
        v.all_watched_on_live_nodes(channels)
    })
    .await?;
    let total = |a: &Coord, b: &Coord| a.metrics.compactions.get() + b.metrics.compactions.get();
    let most = intervals(began.elapsed())?;
    let done = total(&c1, &c2);
    ensure!(
        (2..=most).contains(&done),
        "{done} compactions in {:?} (interval {INTERVAL:?}): expected 2..={most}",
        began.elapsed()
    );
    let to = compact_record(&c).await?;
    ensure!(to > 0, "{} was not written", c.keys.compact());
    // The leader reads etcd's db size (the embedded store has none).
    let db_bytes = c1.metrics.db_bytes().max(c2.metrics.db_bytes());
    match c.backend {
        Backend::Embedded(_) => ensure!(db_bytes == 0, "db size {db_bytes} on the embedded store"),
        Backend::Etcd(_) => ensure!(db_bytes > 0, "the leader did not read etcd's db size"),
    }
    ensure!(
        compacted_below(c.store.as_ref(), to).await?,
        "history before {to} is still there"
    );

    // Every watch breaks and must relist: resuming from an old revision is refused now.
    match &mut c.backend {
        Backend::Embedded(store) => store.break_watches(),
        Backend::Etcd(fixture) => fixture.restart().await?,
    }
    channels += churn(&[&c1, &c2], "b", INTERVAL).await?;
    c.wait_until(SETTLE, "every channel Watched after the relists", |v| {
        v.all_watched_on_live_nodes(channels)
    })
    .await?;

    // A failover: the survivor compacts, once per interval at most, never in its first.
    let (gone, survivor) = if c1.proc.status.borrow().leader {
        (c1, c2)
    } else {
        (c2, c1)
    };
    let killed = gone.metrics.clone();
    gone.proc.kill();
    // A round in flight when the task was aborted may still finish; none starts after.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let by_killed = killed.compactions.get();
    let before = survivor.metrics.compactions.get();
    survivor
        .proc
        .wait_ready(TTL + Duration::from_secs(10))
        .await
        .context("the standby did not take over")?;
    let took_over = tokio::time::Instant::now();
    channels += churn(&[&survivor], "c", INTERVAL * 3).await?;
    c.wait_until(SETTLE, "every channel Watched after the failover", |v| {
        v.all_watched_on_live_nodes(channels)
    })
    .await?;
    let by_survivor = survivor.metrics.compactions.get() - before;
    let most = intervals(took_over.elapsed())? + 1;
    ensure!(
        (1..=most).contains(&by_survivor),
        "the new leader compacted {by_survivor} times in {:?}: expected 1..={most}",
        took_over.elapsed()
    );
    ensure!(
        killed.compactions.get() == by_killed,
        "the killed leader compacted"
    );
    let done = by_killed + survivor.metrics.compactions.get();
    let most = intervals(began.elapsed())?;
    ensure!(
        done <= most,
        "{done} compactions by both in {:?}: more than one per interval",
        began.elapsed()
    );
    let after = compact_record(&c).await?;
    ensure!(
        after > to,
        "the new leader did not move {} on",
        c.keys.compact()
    );
    ensure!(compacted_below(c.store.as_ref(), after).await?);
    Ok(())
}

/// What one run of the quota test saw.
struct QuotaRun {
    nospace_after: Option<Duration>,
    max_db_bytes: i64,
    compactions: u64,
    puts: u64,
}

/// A coordinator, 2 nodes and 20 channels on an etcd with an 8 MiB quota and no
/// auto-compaction, then `for_` of churn: 2 KiB checkpoint values rewritten 100 times a
/// second (~200 KB/s of history), and a channel added and removed every 200 ms.
async fn quota_run(compact_interval: Duration, for_: Duration) -> Result<QuotaRun> {
    let fixture = EtcdFixture::start_with(EtcdOptions {
        quota_backend_bytes: Some(8 << 20),
        ..EtcdOptions::default()
    })
    .await?;
    let store = Arc::new(
        EtcdStore::connect(EtcdConfig {
            endpoints: vec![fixture.endpoint().to_owned()],
            ..EtcdConfig::default()
        })
        .await?,
    );
    let c = Cluster::with_stores(Backend::Etcd(fixture), store.clone());
    let coord = c.spawn_coord_on("c1", store.clone(), |config| {
        config.compact_interval = compact_interval;
    });
    c.wait_leader_ready(&coord).await?;
    let _nodes = [c.spawn_node(), c.spawn_node()];
    c.wait_coord_nodes(&coord, 2).await?;
    c.add_channels(&coord, "ch", 20).await?;
    let keys = Keys::default();
    let value = vec![b'x'; 2048];
    let started = tokio::time::Instant::now();
    let mut run = QuotaRun {
        nospace_after: None,
        max_db_bytes: 0,
        compactions: 0,
        puts: 0,
    };
    let mut i = 0u64;
    let mut next_status = started;
    while started.elapsed() < for_ {
        let key = format!("{}churn{:02}", keys.checkpoints_prefix(), i % 50);
        if store
            .txn(Txn::new().and_then([TxnOp::put(key, value.clone())]))
            .await
            .is_ok()
        {
            run.puts += 1;
        }
        if i % 20 == 0 {
            let name = ChannelName::new(format!("churn{:05}", i / 20))?;
            let _ = coord
                .handle
                .add_channel(name, VChannelInfo::default())
                .await;
            if i >= 100 {
                let old = ChannelName::new(format!("churn{:05}", i / 20 - 5))?;
                let _ = coord.handle.remove_channel(old).await;
            }
        }
        if tokio::time::Instant::now() >= next_status {
            next_status += Duration::from_secs(1);
            if let Some(s) = store.status().await? {
                run.max_db_bytes = run.max_db_bytes.max(s.db_size);
            }
            let nospace = store
                .alarms()
                .await?
                .iter()
                .any(|a| a.kind == AlarmKind::NoSpace);
            if nospace && run.nospace_after.is_none() {
                run.nospace_after = Some(started.elapsed());
            }
        }
        i += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    run.compactions = coord.metrics.compactions.get();
    Ok(run)
}

/// An 8 MiB quota and `CHANWATCH_UPKEEP_SECS` (default 60) of churn per run: NOSPACE never
/// with compaction every 5 s, and sooner or later without it.
pub async fn a_small_quota_without_auto_compaction_fills_only_without_compaction() -> Result<()> {
    let secs: u64 = std::env::var("CHANWATCH_UPKEEP_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(60);
    let for_ = Duration::from_secs(secs);
    let with = quota_run(Duration::from_secs(5), for_).await?;
    let without = quota_run(Duration::ZERO, for_).await?;
    for (name, r) in [
        ("--compact-interval 5s", &with),
        ("--compact-interval 0", &without),
    ] {
        println!(
            "{name}: {secs} s of churn, {} puts, {} compactions, max db {:.1} MiB of 8 MiB, NOSPACE {}",
            r.puts,
            r.compactions,
            r.max_db_bytes as f64 / f64::from(1 << 20),
            r.nospace_after
                .map_or("never".to_owned(), |t| format!("after {:.1} s", t.as_secs_f64()))
        );
    }
    ensure!(
        with.nospace_after.is_none(),
        "NOSPACE with compaction every 5 s"
    );
    ensure!(
        without.nospace_after.is_some(),
        "no NOSPACE without compaction: churn longer (CHANWATCH_UPKEEP_SECS)"
    );
    Ok(())
}
