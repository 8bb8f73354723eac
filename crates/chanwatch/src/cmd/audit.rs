//! `chanwatch audit`: checks that the consumer's committed state of every produced channel is
//! exactly the messages up to its committed position — none lost, none folded twice — and
//! that every channel caught up with what was produced.
//!
//! Owns: its flags (`Args`), reading the committed checkpoints (from etcd, or from a
//! standalone's `GET /api/v1/checkpoints` with `--admin`), re-reading the log up to each
//! committed position, and the verdict (a table, then one JSON line; non-zero exit on any
//! lost, duplicated or behind channel).
//! Must not: write anything.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chanwatch_core::{ChannelName, Checkpoint};
use chanwatch_node::handler::StreamState;
use chanwatch_stream::{Log, Position};
use clap::Args as ClapArgs;

use super::produce::{Produced, ProducedChannel};
use crate::flags::{humantime_secs, EtcdArgs, LogArgs, RootArg};

/// Flags of `audit`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub log: LogArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Read the checkpoints from a `standalone`'s admin API (e.g. http://127.0.0.1:9870)
    /// instead of etcd.
    #[arg(long, env = "CHANWATCH_AUDIT_ADMIN")]
    pub admin: Option<String>,
    /// The file `produce --out` wrote.
    #[arg(long, env = "CHANWATCH_AUDIT_PRODUCED")]
    pub produced: PathBuf,
    /// How long to wait for every channel's committed position to reach what was produced.
    #[arg(long, env = "CHANWATCH_AUDIT_WAIT", value_parser = humantime_secs, default_value = "60s")]
    pub wait: Duration,
}

/// Where the committed checkpoints are read from.
enum Source {
    Etcd(
        std::sync::Arc<dyn chanwatch_store::MetaStore>,
        chanwatch_core::Keys,
    ),
    Admin(reqwest::Client, String),
}

impl Source {
    async fn checkpoints(&self, channels: &[String]) -> Result<BTreeMap<String, Checkpoint>> {
        let mut out = BTreeMap::new();
        match self {
            Source::Etcd(store, keys) => {
                for c in channels {
                    let key = keys.checkpoint(&ChannelName::new(c.as_str())?);
                    if let Some(kv) = store.get(&key).await? {
                        out.insert(c.clone(), Checkpoint::decode(&kv.value)?);
                    }
                }
            }
            Source::Admin(client, base) => {
                let url = format!("{}/api/v1/checkpoints", base.trim_end_matches('/'));
                let body = client
                    .get(&url)
                    .send()
                    .await?
                    .error_for_status()?
                    .text()
                    .await?;
                let all: BTreeMap<String, serde_json::Value> = serde_json::from_str(&body)
                    .with_context(|| format!("{url} answered {body}"))?;
                for (name, v) in all {
                    if channels.contains(&name) {
                        out.insert(name, serde_json::from_value(v)?);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// One channel's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Exact,
    Lost,
    Duplicated,
    Behind,
}

/// Folds the log of `channel` up to `upto` (inclusive) and, on the way, up to `mid`.
async fn fold_upto(
    log: &dyn Log,
    channel: &str,
    mid: Position,
    upto: Position,
) -> Result<(StreamState, StreamState)> {
    let (mut at, mut state, mut at_mid) = (Position::START, StreamState::default(), None);
    if mid == Position::START {
        at_mid = Some(state);
    }
    while at < upto {
        let batch = log.read(channel, at, 4096, Duration::ZERO).await?;
        if batch.is_empty() {
            if at == Position::START {
                bail!("{channel}: the log holds nothing for this channel, but its checkpoint or produce says {upto}: is --log right?");
            }
            bail!("{channel}: the log ends at {at}, before {upto}");
        }
        for m in batch {
            if m.position > upto {
                break;
            }
            state.fold(&m.payload);
            at = m.position;
            if at == mid {
                at_mid = Some(state);
            }
        }
    }
    let at_mid = at_mid
        .with_context(|| format!("{channel}: committed position {mid} is no message's position"))?;
    Ok((at_mid, state))
}

fn judge(committed: StreamState, expected: StreamState, caught_up: bool) -> Verdict {
    if committed.count > expected.count {
        Verdict::Duplicated
    } else if committed != expected {
        Verdict::Lost
    } else if !caught_up {
        Verdict::Behind
    } else {
        Verdict::Exact
    }
}

/// Waits, compares, prints; fails on any channel not exact.
///
/// # Errors
/// An unreadable `--produced`, an unreachable store or log, or any lost, duplicated or behind
/// channel.
pub async fn run(args: Args) -> Result<()> {
    let text = std::fs::read_to_string(&args.produced)
        .with_context(|| format!("cannot read --produced {}", args.produced.display()))?;
    let produced: Produced = serde_json::from_str(&text).with_context(|| {
        format!(
            "--produced {} is not produce's output",
            args.produced.display()
        )
    })?;
    let keys = args.root.keys()?;
    let default_log = Some(produced.log.clone());
    let log = args.log.open(&keys, default_log).await?;
    let source = match &args.admin {
        // `127.0.0.1:9870` as ctl takes it (the bare form waited its whole --wait, then
        // said "relative URL without a base").
        Some(url) => Source::Admin(reqwest::Client::new(), super::ctl::leader::admin_url(url)),
        None => Source::Etcd(args.etcd.connect_under(&keys).await?, keys.clone()),
    };
    let names: Vec<String> = produced.channels.keys().cloned().collect();
    let target = |p: &ProducedChannel| p.last_position.parse::<Position>();
    let position = |cp: Option<&Checkpoint>| {
        cp.and_then(|c| c.position.parse::<Position>().ok())
            .unwrap_or(Position::START)
    };

    let started = Instant::now();
    let mut said = false;
    let checkpoints = loop {
        let cps = source.checkpoints(&names).await;
        let why = match &cps {
            Ok(cps) => {
                let behind = produced
                    .channels
                    .iter()
                    .filter(|(c, p)| target(p).map_or(true, |t| position(cps.get(*c)) < t))
                    .count();
                if behind == 0 {
                    break cps.clone();
                }
                format!("{behind} channel(s) not committed up to what produce wrote yet")
            }
            Err(e) => format!("{e:#}"),
        };
        if started.elapsed() >= args.wait {
            break cps?;
        }
        // Said once, so a long --wait is not silence.
        if !said {
            eprintln!(
                "waiting up to {} s (--wait): {why}",
                args.wait.as_secs_f64()
            );
            said = true;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    if !produced.channels.is_empty()
        && produced
            .channels
            .keys()
            .all(|c| !checkpoints.contains_key(c))
    {
        eprintln!(
            "note: no channel has a checkpoint{}: is --root (or --admin) right?",
            match &args.admin {
                Some(a) => format!(" at {a}"),
                None => format!(" under {}", keys.checkpoints_prefix()),
            }
        );
    }

    let mut counts: BTreeMap<&str, u64> = BTreeMap::new();
    println!(
        "{:<24} {:>10} {:>10} {:>10} {:>10}  verdict",
        "channel", "committed", "produced", "count", "expected"
    );
    for (name, p) in &produced.channels {
        let last = target(p)?;
        let cp = checkpoints.get(name);
        let at = position(cp);
        let committed = match cp.and_then(|c| c.state.as_ref()) {
            Some(v) => StreamState::from_json(v).map_err(anyhow::Error::msg)?,
            None => StreamState::default(),
        };
        let (expected, all) = fold_upto(&*log, name, at, at.max(last)).await?;
        if at <= last && (all.count != p.count || format!("{:016x}", all.digest) != p.digest) {
            tracing::warn!(channel = %name, "the log does not hold what produce recorded");
        }
        let verdict = judge(committed, expected, at >= last);
        *counts
            .entry(match verdict {
                Verdict::Exact => "exact",
                Verdict::Lost => "lost",
                Verdict::Duplicated => "duplicated",
                Verdict::Behind => "behind",
            })
            .or_default() += 1;
        println!(
            "{name:<24} {:>10} {:>10} {:>10} {:>10}  {verdict:?}",
            at.to_string(),
            last.to_string(),
            committed.count,
            expected.count
        );
    }
    let get = |k: &str| counts.get(k).copied().unwrap_or(0);
    println!(
        "{}",
        serde_json::json!({
            "channels": produced.channels.len(),
            "exact": get("exact"),
            "lost": get("lost"),
            "duplicated": get("duplicated"),
            "behind": get("behind"),
        })
    );
    let bad = get("lost") + get("duplicated") + get("behind");
    if bad > 0 {
        bail!(
            "audit failed: {} lost, {} duplicated, {} behind",
            get("lost"),
            get("duplicated"),
            get("behind")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_verdict_names_what_went_wrong() {
        let s = |count, digest| StreamState {
            count,
            max_seq: count,
            digest,
        };
        assert_eq!(judge(s(3, 9), s(3, 9), true), Verdict::Exact);
        assert_eq!(judge(s(3, 9), s(3, 9), false), Verdict::Behind);
        assert_eq!(judge(s(4, 9), s(3, 9), true), Verdict::Duplicated);
        assert_eq!(judge(s(2, 9), s(3, 9), true), Verdict::Lost);
        assert_eq!(judge(s(3, 8), s(3, 9), true), Verdict::Lost);
    }
}
