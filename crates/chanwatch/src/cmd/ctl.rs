//! `chanwatch ctl`: reads state straight from etcd and sends changes to the leader's admin
//! API (its address is in `{root}/coord/leader`); with `--admin URL` (a `standalone`, which
//! has no etcd) it reads through that API too. One object at a time (`get`, `describe`),
//! the event feed (`events`), `undrain` and `completion` are in `describe` and `events`.
//!
//! Owns: its flags (`Args`, `Command`: the one list of its commands, whose value parsers check
//! the input as the command line is parsed, before any network call; `describe` runs its
//! share of the same `Command`), and presentation (`-o table|wide|json|yaml`, in `output`; the
//! channel lines with their checkpoints in `channels`). The leader's API, typed, is in
//! `leader`; what the nodes say about themselves in `live`.
//! Must not: write to etcd: only the coordinator writes assignments.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, bail, Result};
use chanwatch_core::planner::{NodeRow, Planner, PlannerConfig, Transition};
use chanwatch_core::{ChannelName, ChannelOwner, ChannelState, Keys, NodeId, VChannelInfo};
use chanwatch_store::KeyValue;
use clap::{Args as ClapArgs, Subcommand};

use crate::flags::{EtcdArgs, RootArg};
use leader::{BalancePlan, Leader};
use output::{emit, machine, Columns, Format, OutputArgs};

mod bulk;
mod channels;
mod describe;
mod events;
pub(crate) mod leader;
mod live;
mod output;
mod status;

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
    #[command(flatten)]
    pub output: OutputArgs,
    #[command(flatten)]
    pub reach: describe::ReachArgs,
    #[command(subcommand)]
    pub what: Command,
}

/// What `ctl` does.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List channels, in natural order: channel, node (or remaining), state, epoch, age, and
    /// whether the node says it has paused them (asked over its admin HTTP; etcd cannot
    /// know). `-o wide` adds weight, group, pinned, the vchannel info and the checkpoint's
    /// position, epoch and age.
    Channels {
        /// Only the channels of this node (an ID, or `remaining`).
        #[arg(long, env = "CHANWATCH_CTL_NODE", value_parser = owner)]
        node: Option<ChannelOwner>,
        /// Only the channels in this state (ToWatch, Watched, WatchFailed, ToRelease,
        /// Released; any case).
        #[arg(long, env = "CHANWATCH_CTL_STATE", value_parser = state)]
        state: Option<ChannelState>,
    },
    /// List live nodes, their channel counts and status (running, PAUSED, ? when the node
    /// did not answer its `/status`).
    Nodes,
    /// Register a channel; the leader assigns it to the least-loaded node.
    AddChannel {
        /// Channel name: 1-255 characters of [A-Za-z0-9._-].
        #[arg(value_parser = channel_name)]
        name: ChannelName,
        /// What a node needs to restore it, as JSON (at most 64 KiB), e.g.
        /// '{"collection_id":7,"seek_position":"..."}'.
        // Boxed: up to 64 KiB of JSON, parsed.
        #[arg(long, env = "CHANWATCH_CTL_VCHANNEL", value_parser = vchannel)]
        vchannel: Option<Box<VChannelInfo>>,
        /// Its relative load (1 to 1000000; default 1): a node's load is the weights of its
        /// channels over its --capacity.
        #[arg(long, env = "CHANWATCH_CTL_WEIGHT", allow_negative_numbers = true, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
        weight: Option<u32>,
        /// A group (e.g. the collection) whose channels placement spreads across nodes.
        #[arg(long, env = "CHANWATCH_CTL_GROUP", value_parser = group)]
        group: Option<String>,
    },
    /// Pin a channel: balance never moves it (drains and failovers still do). Moves nothing.
    Pin {
        /// Channel name.
        #[arg(value_parser = channel_name)]
        name: ChannelName,
    },
    /// Unpin a channel: balance may move it again.
    Unpin {
        /// Channel name.
        #[arg(value_parser = channel_name)]
        name: ChannelName,
    },
    /// Remove a channel; its node stops it at once.
    RemoveChannel {
        /// Channel name.
        #[arg(value_parser = channel_name)]
        name: ChannelName,
    },
    /// Move a channel to a node (break-before-make).
    Move {
        /// Channel name.
        #[arg(value_parser = channel_name)]
        name: ChannelName,
        /// Target node ID (the ID column of `ctl nodes`).
        #[arg(long, env = "CHANWATCH_CTL_TO", value_parser = node_id)]
        to: NodeId,
    },
    /// Move every channel off a node and stop assigning to it.
    Drain {
        /// Node ID (the ID column of `ctl nodes`).
        #[arg(value_parser = node_id)]
        node: NodeId,
    },
    /// Even out load over nodes (weights over capacity, until the spread is within one
    /// channel's weight); runs even with the coordinator's --auto-balance=false.
    Balance {
        /// Print the plan (channel, from, to) without moving anything.
        #[arg(long, env = "CHANWATCH_CTL_DRY_RUN")]
        dry_run: bool,
    },
    /// One object as a row (`-o json|yaml` for every field).
    #[command(subcommand)]
    Get(describe::GetWhat),
    /// One object in detail: a channel's assignment, vchannel, checkpoint and last
    /// transitions; a node's session, channels, drain mark and last events.
    #[command(subcommand)]
    Describe(describe::DescribeWhat),
    /// The leader's events: transitions (with cause) and node events, oldest first.
    Events {
        /// Keep printing events as they come (and across a leader change), until Ctrl-C.
        #[arg(long, short = 'f', env = "CHANWATCH_CTL_FOLLOW")]
        follow: bool,
        /// Only events from this sequence number on.
        #[arg(long, default_value_t = 0, env = "CHANWATCH_CTL_SINCE")]
        since: u64,
    },
    /// Let a drained node take channels again (balance may then fill it).
    Undrain {
        /// Node ID (the ID column of `ctl nodes`).
        #[arg(value_parser = node_id)]
        node: NodeId,
    },
    /// Print a shell completion script: `source <(chanwatch ctl completion bash)`.
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// The control plane at a glance: leader and standbys, each etcd endpoint (health,
    /// version, raft leader and term, db size against the quota), alarms, drains, paused
    /// nodes, channels by state, the last compaction.
    Status {
        /// The quota to show for an etcd member that does not say its own (etcd before 3.6,
        /// behind https): etcd's `--quota-backend-bytes`, in bytes (etcd's default: 2 GiB).
        #[arg(long, env = "CHANWATCH_QUOTA_BACKEND_BYTES", default_value_t = status::DEFAULT_QUOTA)]
        quota_backend_bytes: u64,
    },
    /// Register many channels from a file: one name or one JSON channel object
    /// (`{"name":…,"vchannel":{…}}`) per line; blank lines and `#` comments are skipped. The
    /// whole file is checked first (nothing is registered if any line is bad; each is named),
    /// then sent in lists of up to 10,000.
    AddChannels {
        /// The file; `-` reads stdin.
        #[arg(long, env = "CHANWATCH_CTL_FROM_FILE")]
        from_file: String,
    },
}

/// Runs one `ctl` command. Its input was checked as the flags were parsed (the value parsers
/// below), before any network call.
///
/// # Errors
/// Bad input (before any network call), etcd unreachable, no leader, or the leader's refusal.
pub async fn run(args: Args) -> Result<()> {
    let keys = args.root.keys()?;
    let format = args.output.format();
    let what = match args.what {
        Command::Completion { shell } => return describe::completion(shell),
        // A file's lines are checked before any network call, like the flags.
        Command::AddChannels { from_file } => {
            let file = bulk::read(&from_file)?;
            let (leader, store) =
                match describe::reach(&args.reach, &args.etcd, &keys, args.admin_token).await {
                    Ok(reached) => reached,
                    // Its bad lines are known without etcd: they come first.
                    Err(e) => {
                        bulk::refuse_bad(&file)?;
                        return Err(e);
                    }
                };
            match store.as_deref() {
                Some(store) => bulk::check_registered(&file, store, &keys).await?,
                None => bulk::refuse_bad(&file)?,
            }
            let text = bulk::send(
                &file,
                &leader,
                format != Format::Table && format != Format::Wide,
            )
            .await?;
            return emit(&text);
        }
        other => other,
    };
    let (leader, store) = describe::reach(&args.reach, &args.etcd, &keys, args.admin_token).await?;
    let text = match what {
        what @ (Command::Get(_)
        | Command::Describe(_)
        | Command::Events { .. }
        | Command::Undrain { .. }) => {
            describe::run(what, &leader, store.as_deref(), format).await?
        }
        // `--admin`: no etcd; reads go through the admin API.
        Command::Channels { node, state } if store.is_none() => {
            let filter = channels::Filter { owner: node, state };
            describe::remote_channels(&leader, &filter, format).await?
        }
        Command::Nodes if store.is_none() => describe::remote_nodes(&leader, format).await?,
        Command::Channels { node, state } => {
            let filter = channels::Filter { owner: node, state };
            let (state, kvs) = snapshot(store.as_deref(), &keys).await?;
            let live = live::ask(&state.node_rows()).await;
            let now = now_ms();
            let lines = channels::lines(&keys, &kvs, state.channel_rows(), &live, &filter, now);
            report_corrupt(&state);
            match machine(format, &lines)? {
                Some(text) => text,
                None => {
                    let table = channels::table(&lines, format == Format::Wide, age, now);
                    format!(
                        "{table}{} channel(s)\n{}{}",
                        lines.len(),
                        paused_lines(&live),
                        channels::parked_lines(&lines)
                    )
                }
            }
        }
        Command::Nodes => {
            let (state, _) = snapshot(store.as_deref(), &keys).await?;
            let rows = state.node_rows();
            let live = live::ask(&rows).await;
            match machine(format, &live::nodes_json(&rows, &live))? {
                Some(text) => text,
                None => nodes_table(&rows, &live, format == Format::Wide),
            }
        }
        Command::AddChannel {
            name,
            vchannel,
            weight,
            group,
        } => transitions(
            format,
            &leader
                .add_channel_with(&name, vchannel.as_deref(), weight, group.as_deref())
                .await?,
        )?,
        Command::Pin { name } => pin(&leader, format, &name, true).await?,
        Command::Unpin { name } => pin(&leader, format, &name, false).await?,
        Command::RemoveChannel { name } => transitions(format, &leader.remove_channel(&name).await?)?,
        Command::Move { name, to } => move_started(format, &name, to, &leader.move_channel(&name, to).await?)?,
        Command::Drain { node } => {
            leader.drain(node).await?;
            machine(format, &serde_json::json!({ "draining": node.0 }))?.unwrap_or_else(|| {
                format!("node {node} is draining: its channels move off, break-before-make\n")
            })
        }
        Command::Balance { dry_run } => {
            let plan = leader.balance(dry_run).await?;
            match machine(format, &plan.moves)? {
                Some(text) => text,
                None => balance_table(&plan),
            }
        }
        Command::Status {
            quota_backend_bytes,
        } => status::render(
            &status::gather(
                store.as_ref().ok_or_else(|| {
                    anyhow!("ctl status reads etcd (its members, alarms and db size): give --endpoints, not --admin")
                })?,
                &keys,
                &args.etcd,
                quota_backend_bytes,
            )
            .await?,
            format,
            now_ms(),
        )?,
        Command::Completion { .. } | Command::AddChannels { .. } => {
            bail!("ctl: {what:?} is run above (a bug)")
        }
    };
    emit(&text)?;
    Ok(())
}

/// `ctl pin` (`pinned`) or `ctl unpin`.
async fn pin(leader: &Leader, format: Format, name: &ChannelName, pinned: bool) -> Result<String> {
    let done = leader.pin(name, pinned).await?;
    let word = if pinned { "pinned" } else { "unpinned" };
    Ok(machine(
        format,
        &serde_json::json!({ "channel": name, "pinned": pinned }),
    )?
    .unwrap_or_else(|| {
        if done.transitions.is_empty() {
            format!("channel {name} was already {word}\n")
        } else {
            format!("channel {name} {word}; nothing moved\n")
        }
    }))
}

/// Everything under `{root}/` in one range read (checkpoints included), and the planner's
/// view of it.
async fn snapshot(
    store: Option<&dyn chanwatch_store::MetaStore>,
    keys: &Keys,
) -> Result<(Planner, Vec<KeyValue>)> {
    let store = store.ok_or_else(|| anyhow!("this needs etcd; drop --admin"))?;
    let list = store.range(&keys.all_prefix()).await?;
    if list.kvs.is_empty() {
        // An empty answer under a mistyped --root looked like an empty cluster.
        eprintln!(
            "note: etcd holds nothing under {}: no coordinator or node has run with this \
             --root (check --root, CHANWATCH_ROOT or the config file)",
            keys.all_prefix()
        );
    }
    let mut state = Planner::new(keys.clone(), PlannerConfig::default());
    state.reset(
        list.kvs
            .iter()
            .map(|kv| (kv.key.as_str(), kv.value.as_slice(), kv.mod_revision)),
    );
    Ok((state, list.kvs))
}

fn report_corrupt(state: &Planner) {
    for (key, why) in state.corrupt() {
        eprintln!("warning: {key} does not decode ({why}); the coordinator leaves it alone");
    }
}

/// Transitions: one line each for a person, the typed list for `-o json|yaml`.
fn transitions(format: Format, transitions: &[Transition]) -> Result<String> {
    if let Some(text) = machine(format, transitions)? {
        return Ok(text);
    }
    let owner = |o: Option<ChannelOwner>| o.map_or_else(|| "-".to_owned(), |o| o.to_string());
    Ok(transitions
        .iter()
        .map(|t| {
            format!(
                "{} {}: node {} -> {} ({}, epoch {})\n",
                t.cause.as_str(),
                t.channel,
                owner(t.from),
                owner(t.to),
                t.state.map_or("deleted", ChannelState::as_str),
                t.epoch
            )
        })
        .collect())
}

/// A started move: `X: node A -> node B` (A is the owner before, B the target asked for; the
/// transition written first is the release on A, which names A twice), then where it
/// stands. `-o json|yaml`: `{channel, from, to, transitions}`.
fn move_started(
    format: Format,
    name: &ChannelName,
    to: NodeId,
    written: &[Transition],
) -> Result<String> {
    let from = written
        .iter()
        .find(|t| &t.channel == name)
        .and_then(|t| t.from);
    let owner = |o: Option<ChannelOwner>| match o {
        Some(ChannelOwner::Node(n)) => format!("node {n}"),
        Some(ChannelOwner::Remaining) => "remaining".to_owned(),
        None => "-".to_owned(),
    };
    let from_json = match from {
        Some(ChannelOwner::Node(n)) => serde_json::json!(n.0),
        Some(ChannelOwner::Remaining) => serde_json::json!(chanwatch_core::keys::REMAINING),
        None => serde_json::Value::Null,
    };
    let doc = serde_json::json!({
        "channel": name,
        "from": from_json,
        "to": to.0,
        "transitions": written,
    });
    if let Some(text) = machine(format, &doc)? {
        return Ok(text);
    }
    let how = match written.iter().find(|t| &t.channel == name) {
        Some(t) if t.state == Some(ChannelState::ToRelease) => format!(
            "started: {} releases it first (epoch {}), then node {to} takes it",
            owner(t.from),
            t.epoch
        ),
        Some(t) => format!(
            "{}, epoch {}",
            t.state.map_or("deleted", ChannelState::as_str),
            t.epoch
        ),
        None => "nothing written".to_owned(),
    };
    Ok(format!(
        "{name}: {} -> {} ({how})\n",
        owner(from),
        owner(Some(ChannelOwner::Node(to)))
    ))
}

fn balance_table(plan: &BalancePlan) -> String {
    if plan.moves.is_empty() {
        return "balanced: nothing to move\n".into();
    }
    let mut t = Columns::new(&["CHANNEL", "FROM", "TO"], &[1, 2]);
    for m in &plan.moves {
        t.row(vec![
            m.channel.to_string(),
            m.from.to_string(),
            m.to.to_string(),
        ]);
    }
    format!(
        "{}{} move(s){}\n",
        t.render(),
        plan.moves.len(),
        if plan.dry_run {
            " planned (dry run: nothing moved)"
        } else {
            " started"
        }
    )
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A duration in ms as `42s`, `5m`, `3h`, `2d`.
fn age(ms: u64) -> String {
    match ms / 1000 {
        s if s < 120 => format!("{s}s"),
        s if s < 7200 => format!("{}m", s / 60),
        s if s < 172_800 => format!("{}h", s / 3600),
        s => format!("{}d", s / 86_400),
    }
}

fn nodes_table(rows: &[NodeRow], live: &BTreeMap<u64, live::NodeSays>, wide: bool) -> String {
    let mut header = vec![
        "ID", "NAME", "ADMIN", "CHANNELS", "AGE", "STATUS", "DRAINING",
    ];
    header.extend(["CAPACITY", "LOAD"]);
    if wide {
        header.push("WHY");
    }
    let mut t = Columns::new(&header, &[0, 3, 4, 7, 8]);
    let now = now_ms();
    for r in rows {
        let l = live.get(&r.id);
        let mut cells = vec![
            r.id.to_string(),
            r.name.clone(),
            r.admin_addr.clone(),
            r.channels.to_string(),
            age(now.saturating_sub(r.started_at_ms)),
            l.map_or("", live::cell).to_owned(),
            if r.draining { "draining" } else { "" }.to_owned(),
            r.capacity.to_string(),
            format!("{:.2}", r.load),
        ];
        if wide {
            cells.push(match l {
                Some(live::NodeSays::Paused(why) | live::NodeSays::Unknown(why)) => why.clone(),
                _ => String::new(),
            });
        }
        t.row(cells);
    }
    format!(
        "{}{} node(s)\n{}",
        t.render(),
        rows.len(),
        paused_lines(live)
    )
}

/// One line per node that is paused or did not say, with why (the table has no room).
fn paused_lines(live: &BTreeMap<u64, live::NodeSays>) -> String {
    let mut out = String::new();
    for (id, l) in live {
        match l {
            live::NodeSays::Paused(why) => {
                out += &format!("node {id} has paused its channels: {why}\n");
            }
            live::NodeSays::Unknown(why) => out += &format!("node {id}: status unknown ({why})\n"),
            live::NodeSays::Running => {}
        }
    }
    out
}

/// A node ID as `ctl` arguments take it: the number in the ID column of `ctl nodes`.
pub(crate) fn node_id(s: &str) -> Result<NodeId, String> {
    s.trim().parse().map(NodeId).map_err(|_| {
        format!("'{s}' is not a node ID: give the number in the ID column of `ctl nodes` (node names are not accepted here)")
    })
}

/// A channel name as `ctl` arguments take it.
fn channel_name(s: &str) -> Result<ChannelName, String> {
    ChannelName::new(s).map_err(|e| e.to_string())
}

/// `--node` of `ctl channels`: a node ID or `remaining`.
fn owner(raw: &str) -> Result<ChannelOwner, String> {
    if raw == chanwatch_core::keys::REMAINING {
        return Ok(ChannelOwner::Remaining);
    }
    raw.parse()
        .map(|n| ChannelOwner::Node(NodeId(n)))
        .map_err(|_| "expected a node ID (a number) or `remaining`".to_owned())
}

/// `--state` of `ctl channels`, in any case.
fn state(raw: &str) -> Result<ChannelState, String> {
    ChannelState::ALL
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(raw))
        .ok_or_else(|| {
            let names: Vec<&str> = ChannelState::ALL.iter().map(|s| s.as_str()).collect();
            format!("expected one of {}", names.join(", "))
        })
}

/// `--vchannel`: JSON, at most 64 KiB.
fn vchannel(raw: &str) -> Result<Box<VChannelInfo>, String> {
    VChannelInfo::from_json(raw.as_bytes())
        .map(Box::new)
        .map_err(|e| e.to_string())
}

/// `--group`: the rule the leader applies to a group's name.
fn group(raw: &str) -> Result<String, String> {
    chanwatch_core::planner::Placement {
        group: Some(raw.to_owned()),
        ..Default::default()
    }
    .check()
    .map(|()| raw.to_owned())
    .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests;
