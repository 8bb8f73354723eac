//! A burst of session losses is planned once it is over (the leader's loss hold, decided by
//! the core's `Pacer`): on the embedded store under a paused clock — deterministic — five of
//! six nodes are killed and their leases revoked 1 ms apart. Judged from the store and the
//! leader's metrics: every channel of the dead nodes moves exactly once (one epoch more),
//! onto the survivor; no other channel moves; no txn of the leader is refused. The same burst
//! with the hold planted away (`PlannerBug::NoLossHold`) must fail that judge — a check that
//! cannot fail proves nothing.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_core::planner::PlannerBug;

use crate::cluster::Cluster;

const NODES: usize = 6;
const CHANNELS: usize = 60;

/// What a burst did: each dead node's channel's epochs before and after, and the leader's
/// refused txns.
struct Burst {
    moved: BTreeMap<String, (u64, u64)>,
    others_moved: Vec<String>,
    refused: u64,
}

impl Burst {
    /// `Err` with what went wrong, if anything.
    fn judge(&self) -> Result<()> {
        let twice: Vec<_> = self
            .moved
            .iter()
            .filter(|(_, (before, after))| *after != before + 1)
            .collect();
        ensure!(
            twice.is_empty(),
            "channels of the dead nodes not moved exactly once (epoch before, after): {twice:?}"
        );
        ensure!(
            self.others_moved.is_empty(),
            "the survivor's channels moved: {:?}",
            self.others_moved
        );
        ensure!(
            self.refused == 0,
            "{} txns of the leader refused",
            self.refused
        );
        Ok(())
    }
}

async fn burst(hold: bool) -> Result<Burst> {
    let c = Cluster::embedded().await?;
    let coord = c.spawn_coord_on("c1", c.store.clone(), |config| {
        if !hold {
            config.planner.planted_bug = Some(PlannerBug::NoLossHold);
        }
    });
    let mut nodes = Vec::new();
    for _ in 0..NODES {
        let n = c.spawn_node();
        c.wait_node_id(&n).await?;
        nodes.push(n);
    }
    c.wait_leader_ready(&coord).await?;
    c.wait_coord_nodes(&coord, NODES).await?;
    c.add_channels(&coord, "b-", CHANNELS).await?;
    let before = c
        .wait_until(Duration::from_secs(30), "every channel Watched", |v| {
            v.all_watched_on_live_nodes(CHANNELS) && v.counts().iter().all(|n| *n > 0)
        })
        .await?;
    let survivor = nodes[0].id().context("the survivor registered")?;
    let mut leases = Vec::new();
    for n in nodes.drain(1..) {
        let id = n.id().context("registered")?;
        let session = c
            .store
            .get(&c.keys.session(id))
            .await?
            .context("a session")?;
        leases.push(session.lease.context("a session under a lease")?);
        c.kill_node(n);
    }
    let refused_before = coord.metrics.txns_of("refused");
    // The burst: each revoke its own store write, 1 ms apart, as etcd expires leases it
    // finds together.
    for lease in leases {
        c.store.revoke(lease).await?;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let after = c
        .wait_until(
            Duration::from_secs(30),
            "every channel Watched on the survivor",
            |v| {
                v.all_watched_on_live_nodes(CHANNELS)
                    && v.channels.iter().all(|r| r.node == Some(survivor.0))
            },
        )
        .await?;
    let epochs = |v: &crate::cluster::View| -> BTreeMap<String, (Option<u64>, u64)> {
        v.channels
            .iter()
            .map(|r| (r.channel.to_string(), (r.node, r.epoch)))
            .collect()
    };
    let (before, after) = (epochs(&before), epochs(&after));
    let mut moved = BTreeMap::new();
    let mut others_moved = Vec::new();
    for (name, (node, epoch)) in &before {
        let now = after.get(name).map_or(0, |(_, e)| *e);
        if *node == Some(survivor.0) {
            if now != *epoch {
                others_moved.push(name.clone());
            }
        } else {
            moved.insert(name.clone(), (*epoch, now));
        }
    }
    ensure!(!moved.is_empty(), "the dead nodes held no channel");
    Ok(Burst {
        moved,
        others_moved,
        refused: coord.metrics.txns_of("refused") - refused_before,
    })
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_session_losses_moves_each_channel_of_the_dead_nodes_once_with_no_refused_txn(
) -> Result<()> {
    burst(true).await?.judge()
}

/// The planted bug: the leader plans at the first loss of the burst. The judge above must
/// fail it.
#[tokio::test(start_paused = true)]
async fn with_the_loss_hold_planted_away_the_same_burst_fails_the_judge() -> Result<()> {
    let b = burst(false).await?;
    let verdict = b.judge();
    ensure!(
        verdict.is_err(),
        "the judge passed a leader that plans at the first loss of a burst ({} channels, {} refused)",
        b.moved.len(),
        b.refused
    );
    println!(
        "caught: {:#}",
        verdict.err().map_or(String::new(), |e| format!("{e:#}"))
    );
    Ok(())
}
