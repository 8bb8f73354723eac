//! `ctl get channel`, `ctl describe channel|node`, `ctl events` (its follow loop is in
//! `events`), `ctl undrain`, `ctl completion`, and how `ctl` reaches the cluster
//! (`--timeout`, `--admin URL`: a `standalone` has no etcd, so reads go through its admin API).
//!
//! Owns: running those commands (their variants of `ctl`'s one `Command`; `get`'s and
//! `describe`'s own subcommands, `GetWhat` and `DescribeWhat`) and their presentation. Must
//! not: write to etcd (undrain is the leader's txn, asked over its API).

use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use anyhow::{bail, Result};
use chanwatch_core::planner::{ChannelRow, NodeRow};
use chanwatch_core::{ChannelName, ChannelOwner, ChannelState, Keys, NodeId, VChannelInfo};
use chanwatch_store::MetaStore;
use clap::{Args as ClapArgs, CommandFactory, Subcommand};

use super::channels::{self, Filter, Line};
use super::leader::{admin_url, ChannelDetail, Event, HistoryInfo, Leader, NodeDetail, Source};
use super::output::{emit, machine, Columns, Format};
use super::{age, live, now_ms, report_corrupt, snapshot, Command};
use crate::flags::{humantime_secs, EtcdArgs};

/// How `ctl` reaches the cluster (global: before or after the subcommand).
#[derive(Debug, Clone, ClapArgs)]
pub struct ReachArgs {
    /// How long to wait for a leader to answer — during a leader change, or from a frozen
    /// leader — before giving up; one line on stderr says it is waiting.
    #[arg(long, env = "CHANWATCH_CTL_TIMEOUT", value_parser = humantime_secs, default_value = "20s", global = true)]
    pub timeout: Duration,
    /// Talk to this admin API (`http://host:port` or `host:port`) instead of finding the
    /// leader in etcd, and read through it too: for `standalone`, which has no etcd.
    #[arg(long = "admin", env = "CHANWATCH_CTL_ADMIN", global = true)]
    pub admin: Option<String>,
}

/// `ctl get …`.
#[derive(Debug, Subcommand)]
pub enum GetWhat {
    /// One channel, as a row of `ctl channels`.
    Channel {
        /// Channel name.
        #[arg(value_parser = super::channel_name)]
        name: ChannelName,
    },
}

/// `ctl describe …`.
#[derive(Debug, Subcommand)]
pub enum DescribeWhat {
    /// A channel: assignment, epoch, state, vchannel, checkpoint, last transitions.
    Channel {
        /// Channel name.
        #[arg(value_parser = super::channel_name)]
        name: ChannelName,
    },
    /// A node: session, drain mark, channels, last events.
    Node {
        /// Node ID (the ID column of `ctl nodes`).
        #[arg(value_parser = super::node_id)]
        node: NodeId,
    },
}

/// The leader's API, and etcd unless `--admin` was given.
pub async fn reach(
    reach: &ReachArgs,
    etcd: &EtcdArgs,
    keys: &Keys,
    token: Option<String>,
) -> Result<(Leader, Option<Arc<dyn MetaStore>>)> {
    let (source, store) = match &reach.admin {
        Some(url) => (Source::Admin(admin_url(url)), None),
        None => {
            let store = etcd.connect_under(keys).await?;
            (Source::Etcd(store.clone()), Some(store))
        }
    };
    let leader = Leader {
        source,
        keys: keys.clone(),
        token,
        timeout: reach.timeout,
        followed: Default::default(),
    };
    Ok((leader, store))
}

/// `ctl completion SHELL`: the script for the whole `chanwatch` command.
pub fn completion(shell: clap_complete::Shell) -> Result<()> {
    let mut out = Vec::new();
    clap_complete::generate(
        shell,
        &mut crate::cli::Cli::command(),
        "chanwatch",
        &mut out,
    );
    emit(&String::from_utf8_lossy(&out))
}

/// Runs one of this module's commands (`get`, `describe`, `events`, `undrain`); the text to
/// print.
///
/// # Errors
/// Another command (a bug), etcd or the leader unreachable, or the leader's refusal.
pub async fn run(
    what: Command,
    leader: &Leader,
    store: Option<&dyn MetaStore>,
    format: Format,
) -> Result<String> {
    match what {
        Command::Get(GetWhat::Channel { name }) => {
            let lines = match store {
                Some(store) => {
                    let keys = &leader.keys;
                    let (state, kvs) = snapshot(Some(store), keys).await?;
                    report_corrupt(&state);
                    let rows: Vec<ChannelRow> = state
                        .channel_rows()
                        .into_iter()
                        .filter(|r| r.channel == name)
                        .collect();
                    let nodes: Vec<NodeRow> = state
                        .node_rows()
                        .into_iter()
                        .filter(|n| rows.iter().any(|r| r.node == Some(n.id)))
                        .collect();
                    let live = live::ask(&nodes).await;
                    channels::lines(keys, &kvs, rows, &live, &Filter::default(), now_ms())
                }
                None => {
                    let mut lines = remote_lines(leader, &Filter::default()).await?;
                    lines.retain(|l| l.row.channel == name);
                    lines
                }
            };
            get_channel(&name, &lines, format)
        }
        Command::Describe(DescribeWhat::Channel { name }) => {
            let d = leader.channel_detail(&name).await?;
            Ok(machine(format, &d)?.unwrap_or_else(|| describe_channel(&d, now_ms())))
        }
        Command::Describe(DescribeWhat::Node { node }) => {
            let d = leader.node_detail(node).await?;
            Ok(machine(format, &d)?.unwrap_or_else(|| describe_node(&d, now_ms())))
        }
        Command::Events {
            follow: true,
            since,
        } => {
            super::events::follow(leader, since, format).await?;
            Ok(String::new())
        }
        Command::Events {
            follow: false,
            since,
        } => {
            let list = leader.events(since).await?;
            if let Some(text) = machine(format, &list.events)? {
                return Ok(text);
            }
            let mut out = history_note(&list.history);
            for e in &list.events {
                out += &event_line(e);
            }
            out += &format!("{} event(s)\n", list.events.len());
            Ok(out)
        }
        Command::Undrain { node } => {
            let was = leader.undrain(node).await?;
            Ok(machine(
                format,
                &serde_json::json!({ "undrained": node.0, "was_draining": was }),
            )?
            .unwrap_or_else(|| {
                if was {
                    format!("node {node} takes channels again (balance may fill it)\n")
                } else {
                    format!("node {node} was not draining: nothing to do\n")
                }
            }))
        }
        other => bail!("{other:?} is not handled here (a bug)"),
    }
}

/// `get channel`: its line(s) as the channels table, or the line as one object.
fn get_channel(name: &ChannelName, lines: &[Line], format: Format) -> Result<String> {
    // Two lines only while a second key awaits dedupe: the newest epoch is the channel.
    let Some(newest) = lines.iter().max_by_key(|l| l.row.epoch) else {
        bail!("channel {name} does not exist");
    };
    Ok(match machine(format, newest)? {
        Some(text) => text,
        None => channels::table(lines, format == Format::Wide, age, now_ms()),
    })
}

/// `ctl channels` with `--admin`: rows and checkpoints from the admin API (no vchannel: the
/// list does not carry it, so it is `null` in `-o json`/`yaml` and `-` in `-o wide`;
/// `describe channel` shows it).
pub async fn remote_channels(leader: &Leader, filter: &Filter, format: Format) -> Result<String> {
    let lines = remote_lines(leader, filter).await?;
    Ok(match machine(format, &lines)? {
        Some(text) => text,
        None => format!(
            "{}{} channel(s)\n",
            channels::table(&lines, format == Format::Wide, age, now_ms()),
            lines.len()
        ),
    })
}

async fn remote_lines(leader: &Leader, filter: &Filter) -> Result<Vec<Line>> {
    let remote = leader.channel_rows().await?;
    let nodes = leader.node_rows().await?;
    let live = live::ask(&nodes).await;
    let mut checkpoints: std::collections::HashMap<ChannelName, channels::CheckpointLine> =
        std::collections::HashMap::new();
    let mut rows = Vec::with_capacity(remote.len());
    for r in remote {
        if let Some(cp) = r.checkpoint {
            checkpoints.insert(r.row.channel.clone(), cp);
        }
        rows.push(r.row);
    }
    let keys = &leader.keys;
    let mut lines = channels::lines(keys, &[], rows, &live, filter, now_ms());
    for l in &mut lines {
        l.checkpoint = checkpoints.get(&l.row.channel).cloned();
    }
    Ok(lines)
}

/// `ctl nodes` with `--admin`.
pub async fn remote_nodes(leader: &Leader, format: Format) -> Result<String> {
    let rows = leader.node_rows().await?;
    let live = live::ask(&rows).await;
    Ok(match machine(format, &live::nodes_json(&rows, &live))? {
        Some(text) => text,
        None => super::nodes_table(&rows, &live, format == Format::Wide),
    })
}

/// A Unix ms time as RFC 3339 UTC with milliseconds.
pub fn time(ms: u64) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(ms)).to_string()
}

fn ago(ms: u64, now: u64) -> String {
    format!("{} ({} ago)", time(ms), age(now.saturating_sub(ms)))
}

/// "history since this leader took over at …": events are the leader's own.
pub fn history_note(h: &HistoryInfo) -> String {
    format!(
        "# history since this leader ({}) took over at {}\n",
        h.leader,
        time(h.since_ms)
    )
}

/// One event as one line (`ctl events`, `describe`).
pub fn event_line(e: &Event) -> String {
    let dash = |o: &Option<String>| o.clone().unwrap_or_else(|| "-".into());
    let what = match (&e.channel, e.node) {
        // A release names no target (the move's second half does): say what it is.
        (Some(c), _) if e.state == Some(ChannelState::ToRelease) => format!(
            "{:<9} {c}: releasing on {} (ToRelease, epoch {})",
            e.cause,
            dash(&e.from),
            e.epoch.unwrap_or(0)
        ),
        (Some(c), _) => format!(
            "{:<9} {c}: {} -> {} ({}, epoch {})",
            e.cause,
            dash(&e.from),
            dash(&e.to),
            e.state.map_or("deleted", |s| s.as_str()),
            e.epoch.unwrap_or(0)
        ),
        (None, Some(n)) => format!("node {n} {}", e.cause),
        (None, None) => e.cause.clone(),
    };
    let detail = e
        .detail
        .as_ref()
        .map(|d| format!(" — {d}"))
        .unwrap_or_default();
    format!("{}  #{:<5} {what}{detail}\n", time(e.time_ms), e.seq)
}

fn field(out: &mut String, name: &str, value: impl std::fmt::Display) {
    *out += &format!("{:<13}{value}\n", format!("{name}:"));
}

/// `describe channel`, for a person.
pub fn describe_channel(d: &ChannelDetail, now: u64) -> String {
    let mut out = String::new();
    field(&mut out, "Channel", &d.channel);
    for r in &d.assignments {
        let owner = r.node.map_or_else(
            || ChannelOwner::Remaining.to_string(),
            |n| format!("node {n}"),
        );
        field(&mut out, "Assigned to", owner);
        field(&mut out, "State", r.state.as_str());
        field(&mut out, "Epoch", r.epoch);
        field(&mut out, "Since", ago(r.start_time_ms, now));
        if let Some(why) = &r.reason {
            field(&mut out, "Reason", why);
        }
        if let Some(p) = r.progress {
            field(&mut out, "Progress", format!("{p}%"));
        }
    }
    let v = if d.vchannel == VChannelInfo::default() {
        "-".to_owned()
    } else {
        serde_json::to_string(&d.vchannel).unwrap_or_default()
    };
    field(&mut out, "VChannel", v);
    match &d.checkpoint {
        Some(cp) => field(
            &mut out,
            "Checkpoint",
            format!(
                "position {}, epoch {}, written {}",
                cp.position,
                cp.epoch,
                ago(cp.updated_at_ms, now)
            ),
        ),
        None => field(&mut out, "Checkpoint", "none"),
    }
    out += &history("Transitions", &d.history, &d.history_info);
    out
}

/// `describe node`, for a person.
pub fn describe_node(d: &NodeDetail, now: u64) -> String {
    let mut out = String::new();
    let s = &d.session;
    field(&mut out, "Node", s.id);
    field(
        &mut out,
        "Admin",
        if s.admin_addr.is_empty() {
            "-"
        } else {
            &s.admin_addr
        },
    );
    field(&mut out, "Version", &s.version);
    field(&mut out, "Started", ago(s.started_at_ms, now));
    field(
        &mut out,
        "Draining",
        if d.draining {
            "yes (undo with `ctl undrain`)"
        } else {
            "no"
        },
    );
    field(&mut out, "Channels", d.channels.len());
    if !d.channels.is_empty() {
        let mut rows = d.channels.clone();
        rows.sort_by(|a, b| super::output::natural(a.channel.as_str(), b.channel.as_str()));
        let mut t = Columns::new(&["CHANNEL", "STATE", "EPOCH", "AGE"], &[2, 3]);
        for r in &rows {
            t.row(vec![
                r.channel.to_string(),
                r.state.as_str().to_owned(),
                r.epoch.to_string(),
                age(now.saturating_sub(r.start_time_ms)),
            ]);
        }
        for line in t.render().lines() {
            out += &format!("  {line}\n");
        }
    }
    out += &history("Events", &d.history, &d.history_info);
    out
}

/// The last events of one object, under a title that says whose history it is.
fn history(title: &str, events: &[Event], info: &HistoryInfo) -> String {
    let mut out = format!(
        "{title} (last {}; history since this leader, {}, took over at {}):\n",
        events.len(),
        info.leader,
        time(info.since_ms)
    );
    if events.is_empty() {
        out += "  none since then\n";
    }
    for e in events {
        out += "  ";
        out += &event_line(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(json: &str) -> Event {
        serde_json::from_str(json).expect("an event")
    }

    #[test]
    fn an_event_is_one_line_with_time_sequence_cause_and_owners() {
        let e = event(
            r#"{"seq":7,"time_ms":1700000000123,"leader":"c1","kind":"transition",
                "cause":"manual","channel":"orders-2","from":"1","to":"3","state":"ToWatch","epoch":4}"#,
        );
        assert_eq!(
            event_line(&e),
            "2023-11-14T22:13:20.123Z  #7     manual    orders-2: 1 -> 3 (ToWatch, epoch 4)\n"
        );
        let r = event(
            r#"{"seq":6,"time_ms":1700000000123,"leader":"c1","kind":"transition",
                "cause":"drain","channel":"orders-2","from":"1","to":"1","state":"ToRelease","epoch":3}"#,
        );
        assert_eq!(
            event_line(&r),
            "2023-11-14T22:13:20.123Z  #6     drain     orders-2: releasing on 1 (ToRelease, epoch 3)\n"
        );
        let n = event(
            r#"{"seq":8,"time_ms":1700000000123,"leader":"c1","kind":"node","cause":"left",
                "node":3,"detail":"session gone"}"#,
        );
        assert_eq!(
            event_line(&n),
            "2023-11-14T22:13:20.123Z  #8     node 3 left — session gone\n"
        );
    }

    #[test]
    fn describe_channel_says_whose_history_it_shows() {
        let d: ChannelDetail = serde_json::from_str(
            r#"{"channel":"orders-2","assignments":[{"channel":"orders-2","node":3,"state":"Watched",
                "epoch":4,"start_time_ms":1700000000000}],"vchannel":{"collection_id":7},
                "checkpoint":{"channel":"orders-2","epoch":4,"position":"99","updated_at_ms":1700000001000,"age_ms":1000},
                "history":[{"seq":7,"time_ms":1700000000123,"leader":"c1","kind":"transition",
                "cause":"manual","channel":"orders-2","from":"1","to":"3","state":"ToWatch","epoch":4}],
                "history_info":{"leader":"c1","since_ms":1699999990000,"first_seq":1,"last_seq":7}}"#,
        )
        .expect("a detail");
        let out = describe_channel(&d, 1_700_000_002_000);
        for want in [
            "Channel:     orders-2\n",
            "Assigned to: node 3\n",
            "State:       Watched\n",
            "Epoch:       4\n",
            "VChannel:    {\"collection_id\":7}\n",
            "Checkpoint:  position 99, epoch 4, written 2023-11-14T22:13:21.000Z (1s ago)\n",
            "history since this leader, c1, took over at 2023-11-14T22:13:10.000Z",
            "manual    orders-2: 1 -> 3",
        ] {
            assert!(out.contains(want), "{want:?} not in\n{out}");
        }
    }
}
