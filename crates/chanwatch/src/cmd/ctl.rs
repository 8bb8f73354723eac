//! `chanwatch ctl`: reads state straight from etcd and sends changes to the leader's admin
//! API (its address is in `{root}/coord/leader`).
//!
//! Owns: its flags (`Args`, `Command`), checking input before any network call, and
//! presentation (tables, `--json`). The leader's API, typed, is in `leader`; what the nodes
//! say about themselves in `live`.
//! Must not: write to etcd: only the coordinator writes assignments.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Result};
use chanwatch_core::planner::{ChannelRow, NodeRow, Planner, PlannerConfig, Transition};
use chanwatch_core::{ChannelName, ChannelOwner, ChannelState, Keys, NodeId, VChannelInfo};
use clap::{Args as ClapArgs, Subcommand};

use crate::flags::{EtcdArgs, RootArg};
use leader::{BalancePlan, Leader};

mod leader;
mod live;

/// Flags of `ctl`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Bearer token for the leader's admin API, when it requires one.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    #[command(subcommand)]
    pub what: Command,
}

/// What `ctl` does.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List channels: channel, node (or remaining), state, epoch, age, and whether the node
    /// says it has paused them (asked over its admin HTTP; etcd cannot know).
    Channels {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// List live nodes, their channel counts and status (running, PAUSED, ? when the node
    /// did not answer its `/status`).
    Nodes {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Register a channel; the leader assigns it to the least-loaded node.
    AddChannel {
        /// Channel name: 1-255 characters of [A-Za-z0-9._-].
        name: String,
        /// What a node needs to restore it, as JSON (at most 64 KiB), e.g.
        /// '{"collection_id":7,"seek_position":"..."}'.
        #[arg(long)]
        vchannel: Option<String>,
    },
    /// Remove a channel; its node stops it at once.
    RemoveChannel {
        /// Channel name.
        name: String,
    },
    /// Move a channel to a node (break-before-make).
    Move {
        /// Channel name.
        name: String,
        /// Target node ID.
        #[arg(long)]
        to: u64,
    },
    /// Move every channel off a node and stop assigning to it.
    Drain {
        /// Node ID.
        node: u64,
    },
    /// Even out channels over nodes (max - min <= 1).
    Balance {
        /// Print the plan (channel, from, to) without moving anything.
        #[arg(long)]
        dry_run: bool,
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// A `ctl` command with its input validated and parsed, before any network call.
enum Checked {
    Channels {
        json: bool,
    },
    Nodes {
        json: bool,
    },
    Add {
        name: ChannelName,
        /// Boxed: up to 64 KiB of JSON, parsed.
        vchannel: Option<Box<VChannelInfo>>,
    },
    Remove {
        name: ChannelName,
    },
    Move {
        name: ChannelName,
        to: NodeId,
    },
    Drain {
        node: NodeId,
    },
    Balance {
        dry_run: bool,
        json: bool,
    },
}

impl Checked {
    fn new(what: Command) -> Result<Self> {
        let name = |n: String| ChannelName::new(n).map_err(|e| anyhow!("{e}"));
        Ok(match what {
            Command::Channels { json } => Checked::Channels { json },
            Command::Nodes { json } => Checked::Nodes { json },
            Command::AddChannel { name: n, vchannel } => Checked::Add {
                name: name(n)?,
                vchannel: vchannel
                    .map(|v| VChannelInfo::from_json(v.as_bytes()).map(Box::new))
                    .transpose()
                    .map_err(|e| anyhow!("--vchannel: {e}"))?,
            },
            Command::RemoveChannel { name: n } => Checked::Remove { name: name(n)? },
            Command::Move { name: n, to } => Checked::Move {
                name: name(n)?,
                to: NodeId(to),
            },
            Command::Drain { node } => Checked::Drain { node: NodeId(node) },
            Command::Balance { dry_run, json } => Checked::Balance { dry_run, json },
        })
    }
}

/// Runs one `ctl` command.
///
/// # Errors
/// Bad input (before any network call), etcd unreachable, no leader, or the leader's refusal.
pub async fn run(args: Args) -> Result<()> {
    let keys = args.root.keys()?;
    // Validate input before touching the network.
    let what = Checked::new(args.what)?;
    let store = args.etcd.connect_under(&keys).await?;
    let leader = Leader {
        store: store.clone(),
        keys: keys.clone(),
        token: args.admin_token,
    };
    match what {
        Checked::Channels { json } => {
            let (state, _) = snapshot(&*store, &keys).await?;
            let rows = state.channel_rows();
            let live = live::ask(&state.node_rows()).await;
            if json {
                let out = live::channels_json(&rows, &live);
                println!("{}", serde_json::to_string_pretty(&out)?);
            } else {
                print_channels(&rows, &live);
            }
            report_corrupt(&state);
        }
        Checked::Nodes { json } => {
            let (state, _) = snapshot(&*store, &keys).await?;
            let rows = state.node_rows();
            let live = live::ask(&rows).await;
            if json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&live::nodes_json(&rows, &live))?
                );
            } else {
                print_nodes(&rows, &live);
            }
        }
        Checked::Add { name, vchannel } => {
            print_transitions(&leader.add_channel(&name, vchannel.as_deref()).await?);
        }
        Checked::Remove { name } => print_transitions(&leader.remove_channel(&name).await?),
        Checked::Move { name, to } => print_transitions(&leader.move_channel(&name, to).await?),
        Checked::Drain { node } => {
            leader.drain(node).await?;
            println!("node {node} is draining: its channels move off, break-before-make");
        }
        Checked::Balance { dry_run, json } => {
            let plan = leader.balance(dry_run).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&plan.moves)?);
            } else {
                print_balance(&plan);
            }
        }
    }
    Ok(())
}

async fn snapshot(store: &dyn chanwatch_store::MetaStore, keys: &Keys) -> Result<(Planner, i64)> {
    let list = store.range(&keys.all_prefix()).await?;
    let mut state = Planner::new(keys.clone(), PlannerConfig::default());
    state.reset(
        list.kvs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
    );
    Ok((state, list.revision))
}

fn report_corrupt(state: &Planner) {
    for (key, why) in state.corrupt() {
        eprintln!("warning: {key} does not decode ({why}); the coordinator leaves it alone");
    }
}

fn print_transitions(transitions: &[Transition]) {
    let owner = |o: Option<ChannelOwner>| o.map_or_else(|| "-".to_owned(), |o| o.to_string());
    for t in transitions {
        println!(
            "{} {}: node {} -> {} ({}, epoch {})",
            t.cause.as_str(),
            t.channel,
            owner(t.from),
            owner(t.to),
            t.state.map_or("deleted", ChannelState::as_str),
            t.epoch
        );
    }
}

fn print_balance(plan: &BalancePlan) {
    if plan.moves.is_empty() {
        println!("balanced: nothing to move");
        return;
    }
    println!("{:<32} {:>8} {:>8}", "CHANNEL", "FROM", "TO");
    for m in &plan.moves {
        println!("{:<32} {:>8} {:>8}", m.channel.as_str(), m.from, m.to);
    }
    println!(
        "{} move(s){}",
        plan.moves.len(),
        if plan.dry_run {
            " planned (dry run: nothing moved)"
        } else {
            " started"
        }
    );
}

fn age(ms: u64) -> String {
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    let secs = now.saturating_sub(ms) / 1000;
    match secs {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn print_channels(rows: &[ChannelRow], live: &BTreeMap<u64, live::Live>) {
    println!(
        "{:<32} {:>10} {:<12} {:>6} {:>6} {:<8}",
        "CHANNEL", "NODE", "STATE", "EPOCH", "AGE", "NODE SAYS"
    );
    for r in rows {
        let node = r
            .node
            .map_or_else(|| "remaining".to_owned(), |n| n.to_string());
        let says = r
            .node
            .and_then(|n| live.get(&n))
            .map_or("", live::Live::cell);
        println!(
            "{:<32} {:>10} {:<12} {:>6} {:>6} {:<8}",
            r.channel.as_str(),
            node,
            r.state.as_str(),
            r.epoch,
            age(r.start_time_ms),
            says
        );
    }
    println!("{} channel(s)", rows.len());
    print_paused(live);
}

fn print_nodes(rows: &[NodeRow], live: &BTreeMap<u64, live::Live>) {
    println!(
        "{:>8} {:<24} {:>8} {:>8} {:<8} {:<8}",
        "ID", "ADMIN", "CHANNELS", "AGE", "STATUS", ""
    );
    for r in rows {
        println!(
            "{:>8} {:<24} {:>8} {:>8} {:<8} {:<8}",
            r.id,
            r.admin_addr,
            r.channels,
            age(r.started_at_ms),
            live.get(&r.id).map_or("", live::Live::cell),
            if r.draining { "draining" } else { "" }
        );
    }
    println!("{} node(s)", rows.len());
    print_paused(live);
}

/// One line per node that is paused or did not say, with why (the table has no room).
fn print_paused(live: &BTreeMap<u64, live::Live>) {
    for (id, l) in live {
        match l {
            live::Live::Paused(why) => println!("node {id} has paused its channels: {why}"),
            live::Live::Unknown(why) => println!("node {id}: status unknown ({why})"),
            live::Live::Running => {}
        }
    }
}
