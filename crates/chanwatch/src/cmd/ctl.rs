//! `chanwatch ctl`: reads state straight from etcd and sends changes to the leader's admin
//! API (its address is in `{root}/coord/leader`).
//!
//! Owns: its flags (`Args`, `Command`), checking input before any network call, and
//! presentation (`-o table|wide|json|yaml`, in `output`; the channel lines with their
//! checkpoints in `channels`). The leader's API, typed, is in `leader`; what the nodes say
//! about themselves in `live`.
//! Must not: write to etcd: only the coordinator writes assignments.

use std::collections::BTreeMap;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{anyhow, Result};
use chanwatch_core::planner::{NodeRow, Planner, PlannerConfig, Transition};
use chanwatch_core::{ChannelName, ChannelOwner, ChannelState, Keys, NodeId, VChannelInfo};
use chanwatch_store::KeyValue;
use clap::{Args as ClapArgs, Subcommand};

use crate::flags::{EtcdArgs, RootArg};
use leader::{BalancePlan, Leader};
use output::{emit, machine, Columns, Format, OutputArgs};

mod bulk;
mod channels;
mod leader;
mod live;
mod output;

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
    #[command(subcommand)]
    pub what: Command,
}

/// What `ctl` does.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// List channels, in natural order: channel, node (or remaining), state, epoch, age, and
    /// whether the node says it has paused them (asked over its admin HTTP; etcd cannot
    /// know). `-o wide` adds the vchannel info and the checkpoint's position, epoch and age.
    Channels {
        /// Only the channels of this node (an ID, or `remaining`).
        #[arg(long)]
        node: Option<String>,
        /// Only the channels in this state (ToWatch, Watched, WatchFailed, ToRelease,
        /// Released; any case).
        #[arg(long)]
        state: Option<String>,
    },
    /// List live nodes, their channel counts and status (running, PAUSED, ? when the node
    /// did not answer its `/status`).
    Nodes,
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
    },
    /// Register many channels from a file: one name or one JSON channel object
    /// (`{"name":…,"vchannel":{…}}`) per line; blank lines and `#` comments are skipped. The
    /// whole file is checked first (nothing is registered if any line is bad; each is named),
    /// then sent in lists of up to 10,000.
    AddChannels {
        /// The file; `-` reads stdin.
        #[arg(long)]
        from_file: String,
    },
}

/// A `ctl` command with its input validated and parsed, before any network call.
enum Checked {
    Channels {
        filter: channels::Filter,
    },
    Nodes,
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
    },
    AddMany(bulk::File),
}

impl Checked {
    fn new(what: Command) -> Result<Self> {
        let name = |n: String| ChannelName::new(n).map_err(|e| anyhow!("{e}"));
        Ok(match what {
            Command::Channels { node, state } => Checked::Channels {
                filter: channels::Filter {
                    owner: node.as_deref().map(parse_owner).transpose()?,
                    state: state.as_deref().map(parse_state).transpose()?,
                },
            },
            Command::Nodes => Checked::Nodes,
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
            Command::Balance { dry_run } => Checked::Balance { dry_run },
            Command::AddChannels { from_file } => Checked::AddMany(bulk::read(&from_file)?),
        })
    }
}

fn parse_owner(raw: &str) -> Result<ChannelOwner> {
    if raw == chanwatch_core::keys::REMAINING {
        return Ok(ChannelOwner::Remaining);
    }
    raw.parse()
        .map(|n| ChannelOwner::Node(NodeId(n)))
        .map_err(|_| anyhow!("--node {raw:?}: expected a node ID (a number) or `remaining`"))
}

fn parse_state(raw: &str) -> Result<ChannelState> {
    ChannelState::ALL
        .into_iter()
        .find(|s| s.as_str().eq_ignore_ascii_case(raw))
        .ok_or_else(|| {
            let names: Vec<&str> = ChannelState::ALL.iter().map(|s| s.as_str()).collect();
            anyhow!("--state {raw:?}: expected one of {}", names.join(", "))
        })
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
    let format = args.output.format();
    let text = match what {
        Checked::Channels { filter } => {
            let (state, kvs) = snapshot(&*store, &keys).await?;
            let live = live::ask(&state.node_rows()).await;
            let now = now_ms();
            let lines = channels::lines(&keys, &kvs, state.channel_rows(), &live, &filter, now);
            report_corrupt(&state);
            match machine(format, &lines)? {
                Some(text) => text,
                None => {
                    let table = channels::table(&lines, format == Format::Wide, age, now);
                    format!("{table}{} channel(s)\n{}", lines.len(), paused_lines(&live))
                }
            }
        }
        Checked::Nodes => {
            let (state, _) = snapshot(&*store, &keys).await?;
            let rows = state.node_rows();
            let live = live::ask(&rows).await;
            match machine(format, &live::nodes_json(&rows, &live))? {
                Some(text) => text,
                None => nodes_table(&rows, &live, format == Format::Wide),
            }
        }
        Checked::Add { name, vchannel } => transitions(
            format,
            &leader.add_channel(&name, vchannel.as_deref()).await?,
        )?,
        Checked::Remove { name } => transitions(format, &leader.remove_channel(&name).await?)?,
        Checked::Move { name, to } => transitions(format, &leader.move_channel(&name, to).await?)?,
        Checked::Drain { node } => {
            leader.drain(node).await?;
            machine(format, &serde_json::json!({ "draining": node.0 }))?.unwrap_or_else(|| {
                format!("node {node} is draining: its channels move off, break-before-make\n")
            })
        }
        Checked::Balance { dry_run } => {
            let plan = leader.balance(dry_run).await?;
            match machine(format, &plan.moves)? {
                Some(text) => text,
                None => balance_table(&plan),
            }
        }
        Checked::AddMany(file) => {
            bulk::check_registered(&file, &*store, &keys).await?;
            bulk::send(
                &file,
                &leader,
                format != Format::Table && format != Format::Wide,
            )
            .await?
        }
    };
    emit(&text)?;
    Ok(())
}

/// Everything under `{root}/` in one range read (checkpoints included), and the planner's
/// view of it.
async fn snapshot(
    store: &dyn chanwatch_store::MetaStore,
    keys: &Keys,
) -> Result<(Planner, Vec<KeyValue>)> {
    let list = store.range(&keys.all_prefix()).await?;
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

fn nodes_table(rows: &[NodeRow], live: &BTreeMap<u64, live::Live>, wide: bool) -> String {
    let mut header = vec!["ID", "ADMIN", "CHANNELS", "AGE", "STATUS", "DRAINING"];
    if wide {
        header.push("WHY");
    }
    let mut t = Columns::new(&header, &[0, 2, 3]);
    let now = now_ms();
    for r in rows {
        let l = live.get(&r.id);
        let mut cells = vec![
            r.id.to_string(),
            r.admin_addr.clone(),
            r.channels.to_string(),
            age(now.saturating_sub(r.started_at_ms)),
            l.map_or("", live::Live::cell).to_owned(),
            if r.draining { "draining" } else { "" }.to_owned(),
        ];
        if wide {
            cells.push(match l {
                Some(live::Live::Paused(why) | live::Live::Unknown(why)) => why.clone(),
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
fn paused_lines(live: &BTreeMap<u64, live::Live>) -> String {
    let mut out = String::new();
    for (id, l) in live {
        match l {
            live::Live::Paused(why) => {
                out += &format!("node {id} has paused its channels: {why}\n");
            }
            live::Live::Unknown(why) => out += &format!("node {id}: status unknown ({why})\n"),
            live::Live::Running => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use chanwatch_core::planner::PlannedMove;

    use super::*;

    fn moved() -> Vec<Transition> {
        serde_json::from_str(
            r#"[{"channel":"orders-2","cause":"manual","from":1,"to":3,"state":"ToWatch","epoch":4}]"#,
        )
        .expect("a transition")
    }

    /// The writes print their answer in every format: a line each for a person, the typed
    /// list for machines.
    #[test]
    fn transitions_print_as_lines_json_and_yaml() -> Result<()> {
        let t = moved();
        assert_eq!(
            transitions(Format::Table, &t)?,
            "manual orders-2: node 1 -> 3 (ToWatch, epoch 4)\n"
        );
        let json: serde_json::Value = serde_json::from_str(&transitions(Format::Json, &t)?)?;
        assert_eq!(json[0]["to"], 3);
        let yaml: serde_json::Value = serde_yaml_ng::from_str(&transitions(Format::Yaml, &t)?)?;
        assert_eq!(yaml, json);
        Ok(())
    }

    #[test]
    fn a_balance_plan_is_a_table_with_a_count() -> Result<()> {
        let plan = BalancePlan {
            dry_run: true,
            moves: serde_json::from_str::<Vec<PlannedMove>>(
                r#"[{"channel":"orders-10","from":1,"to":2}]"#,
            )?,
        };
        let out = balance_table(&plan);
        assert!(
            out.starts_with("CHANNEL    FROM  TO\norders-10     1   2\n"),
            "{out}"
        );
        assert!(
            out.ends_with("1 move(s) planned (dry run: nothing moved)\n"),
            "{out}"
        );
        Ok(())
    }
}
