//! `chanwatch demo`: a scripted tour on the embedded store. Each step prints the cluster as a
//! table of nodes and their channels, then checks the invariants of DESIGN.md §6 and stops
//! with an error if one breaks. Every node consumes its channels from an embedded log
//! ([`stream`]); one step produces messages while a node is killed and checks that each
//! channel's committed state is exactly what was produced.
//!
//! Owns: the script and its presentation.
//! Must not: decide anything; the coordinator and nodes do.

use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};
use chanwatch_core::planner::{ChannelRow, NodeRow, Planner, PlannerConfig};
use chanwatch_core::{ChannelName, ChannelState, NodeId, VChannelInfo};
use chanwatch_node::handler::StreamConsumer;
use chanwatch_node::OwnershipLog;
use chanwatch_store::Clock;

use crate::inproc::{InProc, NodeProc, Timings};

mod stream;

const CHANNELS: usize = 12;
const SETTLE: Duration = Duration::from_secs(15);
/// Channels the data-plane step produces to.
const STREAMED: usize = 4;

struct Snapshot {
    channels: Vec<ChannelRow>,
    nodes: Vec<NodeRow>,
}

struct Tour {
    cluster: InProc,
    ownership: OwnershipLog,
    /// The data plane every node runs, its runs recorded in `ownership`.
    log: stream::TempLog,
    nodes: Vec<NodeProc>,
    colour: bool,
    step: usize,
    /// Channels registered so far.
    registered: usize,
    epochs: BTreeMap<ChannelName, u64>,
    started: Instant,
}

impl Tour {
    async fn snapshot(&self) -> Result<Snapshot> {
        let list = self
            .cluster
            .store
            .range(&self.cluster.keys.all_prefix())
            .await?;
        let mut state = Planner::new(self.cluster.keys.clone(), PlannerConfig::default());
        state.reset(
            list.kvs
                .iter()
                .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
        );
        Ok(Snapshot {
            channels: state.channel_rows(),
            nodes: state.node_rows(),
        })
    }

    /// Waits until every channel is Watched on a live node (or parked when none lives) and
    /// `extra` holds.
    async fn settle(&self, what: &str, extra: impl Fn(&Snapshot) -> bool) -> Result<Snapshot> {
        let deadline = Instant::now() + SETTLE;
        loop {
            let s = self.snapshot().await?;
            let live: Vec<u64> = s.nodes.iter().map(|n| n.id).collect();
            let settled = s.channels.len() == self.registered
                && if live.is_empty() {
                    s.channels.iter().all(|c| c.node.is_none())
                } else {
                    s.channels.iter().all(|c| {
                        c.state == ChannelState::Watched
                            && c.node.is_some_and(|n| live.contains(&n))
                    })
                };
            if settled && extra(&s) {
                return Ok(s);
            }
            if Instant::now() > deadline {
                self.print(&s);
                bail!("step did not settle within {SETTLE:?}: {what}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn paint(&self, text: &str, state: ChannelState) -> String {
        let (mark, code) = match state {
            ChannelState::Watched => ("", "32"),
            ChannelState::ToWatch => ("*", "33"),
            ChannelState::ToRelease | ChannelState::Released => ("~", "35"),
            ChannelState::WatchFailed => ("!", "31"),
        };
        if self.colour {
            format!("\x1b[{code}m{text}{mark}\x1b[0m")
        } else {
            format!("{text}{mark}")
        }
    }

    fn bold(&self, text: &str) -> String {
        if self.colour {
            format!("\x1b[1m{text}\x1b[0m")
        } else {
            text.to_owned()
        }
    }

    fn print(&self, s: &Snapshot) {
        let mut by_owner: BTreeMap<Option<u64>, Vec<&ChannelRow>> = BTreeMap::new();
        for n in &s.nodes {
            by_owner.entry(Some(n.id)).or_default();
        }
        for c in &s.channels {
            by_owner.entry(c.node).or_default().push(c);
        }
        for (owner, rows) in &by_owner {
            let label = match owner {
                Some(id) => {
                    let draining = s.nodes.iter().any(|n| n.id == *id && n.draining);
                    format!("node {id}{}", if draining { " (draining)" } else { "" })
                }
                None => "remaining".to_owned(),
            };
            let names: Vec<String> = rows
                .iter()
                .map(|r| self.paint(&format!("{}@{}", r.channel, r.epoch), r.state))
                .collect();
            println!("  {label:<20} {:>2} | {}", rows.len(), names.join(" "));
        }
    }

    /// Prints the step and checks the invariants.
    fn check(&mut self, title: &str, s: &Snapshot, balanced: bool) -> Result<()> {
        self.step += 1;
        println!();
        println!(
            "{} {}",
            self.bold(&format!("step {}:", self.step)),
            self.bold(title)
        );
        self.print(s);
        // 1. Every registered channel has exactly one assignment key.
        let mut seen = BTreeMap::new();
        for c in &s.channels {
            *seen.entry(c.channel.clone()).or_insert(0) += 1;
        }
        ensure!(
            seen.len() == self.registered && seen.values().all(|n| *n == 1),
            "invariant 1 broken: channels and keys {seen:?}"
        );
        // 3. No two nodes ran one channel at the same instant.
        let overlaps = self.ownership.overlaps();
        ensure!(overlaps.is_empty(), "invariant 3 broken: {overlaps:?}");
        // 4. Epochs only grow.
        for c in &s.channels {
            let before = self.epochs.insert(c.channel.clone(), c.epoch).unwrap_or(0);
            ensure!(
                c.epoch >= before,
                "invariant 4 broken: {} epoch {} -> {}",
                c.channel,
                before,
                c.epoch
            );
        }
        // 5. Balanced within one after balance settles.
        if balanced {
            let counts: Vec<usize> = s
                .nodes
                .iter()
                .filter(|n| !n.draining)
                .map(|n| n.channels)
                .collect();
            let (min, max) = (
                counts.iter().min().copied().unwrap_or(0),
                counts.iter().max().copied().unwrap_or(0),
            );
            ensure!(max - min <= 1, "invariant 5 broken: counts {counts:?}");
        }
        println!(
            "  invariants hold: one key per channel, all Watched on live nodes{}, no double ownership, epochs grow{}   [{:.1}s]",
            if s.nodes.is_empty() { " (parked: no node lives)" } else { "" },
            if balanced { ", balanced" } else { "" },
            self.started.elapsed().as_secs_f64()
        );
        Ok(())
    }

    /// Waits until the leader's own view holds `n` live nodes: the store shows a session
    /// before the leader's watch has delivered it, and channels registered in between would
    /// all go to the nodes it knew (seen in CI: 6, 6 and 0 after step 2).
    async fn leader_sees(&self, n: usize) -> Result<()> {
        let deadline = Instant::now() + SETTLE;
        loop {
            if self
                .cluster
                .handle
                .nodes()
                .await
                .map_or(0, |rows| rows.len())
                == n
            {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("the leader did not see {n} nodes within {SETTLE:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn add_node(&mut self) -> Result<NodeId> {
        let n = self.cluster.spawn_node();
        let id = self.cluster.node_id(&n).await?;
        self.nodes.push(n);
        Ok(id)
    }

    fn kill(&mut self, index: usize) -> Option<NodeId> {
        let n = self.nodes.remove(index);
        let id = n.id();
        n.kill();
        if let Some(id) = id {
            self.ownership.mark_dead(id);
        }
        id
    }
}

impl Tour {
    /// The data-plane step: produce to a few channels, kill the owner of the first, keep
    /// producing, stop, wait until every committed checkpoint reaches the log's end, and check
    /// that each channel's committed state is exactly what was produced.
    async fn stream_through_a_kill(&mut self) -> Result<()> {
        const RATE: f64 = 200.0;
        let channels: Vec<String> = (0..STREAMED).map(|i| format!("orders-{i:02}")).collect();
        let producer = stream::Producer::start(self.log.log.clone(), channels.clone(), RATE);
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let s = self.snapshot().await?;
        let owner = s
            .channels
            .iter()
            .find(|c| c.channel.as_str() == channels[0])
            .and_then(|c| c.node)
            .context("the first streamed channel has no owner")?;
        let mut before = BTreeMap::new();
        for c in &channels {
            let (_, state) = stream::committed(&*self.cluster.store, &self.cluster.keys, c).await?;
            let on = s
                .channels
                .iter()
                .find(|r| r.channel.as_str() == c)
                .and_then(|r| r.node);
            before.insert(c.clone(), (state.count, on == Some(owner)));
        }
        let index = self
            .nodes
            .iter()
            .position(|n| n.id().map(|id| id.0) == Some(owner))
            .context("the owner is not a node of the tour")?;
        let dead = self.kill(index).context("node had an id")?;
        // Past the TTL and the reload, with messages still flowing.
        tokio::time::sleep(Duration::from_millis(3000)).await;
        let produced = producer.stop().await?;
        let end = stream::wait_caught_up(
            &*self.cluster.store,
            &self.cluster.keys,
            &*self.log.log,
            &channels,
            SETTLE,
        )
        .await?;
        let live = self.nodes.len();
        let s = self
            .settle("failover under load", |s| s.nodes.len() == live)
            .await?;
        self.check(
            &format!(
                "messages flow to {STREAMED} channels while node {dead} (owner of {}) is killed",
                channels[0]
            ),
            &s,
            false,
        )?;
        for (c, p) in channels.iter().zip(&produced) {
            let (b, moved) = before[c];
            let e = end[c];
            let was = if moved {
                format!(" (on node {dead})")
            } else {
                String::new()
            };
            println!(
                "  {c}{was:<14} produced {:>4}, committed {:>4} before the kill, {:>4} at the end",
                p.count, b, e.count
            );
            ensure!(
                e == *p,
                "invariant 8 broken: {c} committed {e:?} but {p:?} was produced (lost or duplicated)"
            );
        }
        println!(
            "  invariant 8 holds: every channel's committed state is what was produced, each message once (count, last sequence, digest)   [{:.1}s]",
            self.started.elapsed().as_secs_f64()
        );
        Ok(())
    }
}

/// Runs the tour.
///
/// # Errors
/// A step that does not settle or an invariant that breaks.
pub async fn run() -> Result<()> {
    let clock = Clock::system();
    let ownership = OwnershipLog::new(clock);
    let timings = Timings {
        session_ttl: Duration::from_secs(2),
        watch_timeout: Duration::from_secs(5),
        resync_interval: Duration::from_secs(2),
        tick: Duration::from_millis(100),
        progress_interval: Duration::from_millis(50),
    };
    let log = stream::TempLog::open()?;
    let both = stream::Both {
        ownership: ownership.clone(),
        load_time: Duration::from_millis(200),
        consumer: Arc::new(StreamConsumer::new(
            log.log.clone(),
            stream::consumer_options(),
        )),
    };
    let cluster = InProc::start(timings, Arc::new(both), "in-process".into())?;
    let colour = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let mut tour = Tour {
        cluster,
        ownership,
        log,
        nodes: Vec::new(),
        colour,
        step: 0,
        registered: 0,
        epochs: BTreeMap::new(),
        started: Instant::now(),
    };
    println!(
        "{}",
        tour.bold(
            "chanwatch demo: one coordinator and its nodes on the embedded store (session ttl 2s)"
        )
    );
    println!(
        "  legend: name@epoch; Watched plain/green, ToWatch *, ToRelease/Released ~, WatchFailed !"
    );
    tour.cluster.ready().await?;

    for _ in 0..3 {
        tour.add_node().await?;
    }
    let s = tour.settle("3 nodes", |s| s.nodes.len() == 3).await?;
    tour.leader_sees(3).await?;
    tour.check("3 nodes join", &s, false)?;

    for i in 0..CHANNELS {
        let name = ChannelName::new(format!("orders-{i:02}"))?;
        tour.cluster
            .handle
            .add_channel(name, VChannelInfo::default())
            .await
            .context("registering a channel")?;
        tour.registered += 1;
    }
    let s = tour.settle("12 channels Watched", |_| true).await?;
    tour.check(
        "12 channels are registered: least-loaded assignment",
        &s,
        true,
    )?;

    let dead = tour.kill(0).context("node had an id")?;
    let s = tour.settle("failover", |s| s.nodes.len() == 2).await?;
    tour.check(
        &format!("node {dead} is killed (no goodbye): its channels fail over after the ttl"),
        &s,
        false,
    )?;

    let joined = tour.add_node().await?;
    let s = tour
        .settle("balance", |s| {
            let c: Vec<usize> = s.nodes.iter().map(|n| n.channels).collect();
            s.nodes.len() == 3 && c.iter().max().unwrap_or(&0) - c.iter().min().unwrap_or(&0) <= 1
        })
        .await?;
    tour.check(
        &format!("node {joined} joins: balance moves channels to it, break-before-make"),
        &s,
        true,
    )?;

    let drained = tour.nodes[0].id().context("node id")?;
    tour.cluster.handle.drain(drained).await.context("drain")?;
    let s = tour
        .settle("drain", |s| {
            s.nodes
                .iter()
                .any(|n| n.id == drained.0 && n.draining && n.channels == 0)
        })
        .await?;
    tour.check(
        &format!("node {drained} is drained: its channels move off, nothing new goes there"),
        &s,
        true,
    )?;

    tour.stream_through_a_kill().await?;

    while !tour.nodes.is_empty() {
        tour.kill(0);
    }
    let s = tour.settle("all parked", |s| s.nodes.is_empty()).await?;
    tour.check(
        "every node dies: all channels are parked under remaining",
        &s,
        false,
    )?;

    let back = tour.add_node().await?;
    let s = tour
        .settle("unpark", |s| {
            s.nodes.len() == 1 && s.channels.iter().all(|c| c.node == Some(back.0))
        })
        .await?;
    tour.check(
        &format!("node {back} comes back: it gets every channel"),
        &s,
        false,
    )?;

    for n in tour.nodes.drain(..) {
        n.stop().await;
    }
    let summary = format!(
        "{} ({} steps, {:.1}s)",
        tour.bold("demo finished: every invariant held"),
        tour.step,
        tour.started.elapsed().as_secs_f64()
    );
    tour.cluster.shutdown().await;
    println!();
    println!("{summary}");
    Ok(())
}
