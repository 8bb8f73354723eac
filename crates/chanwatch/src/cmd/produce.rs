//! `chanwatch produce`: appends sequence-numbered messages to channels of a log at a steady
//! rate, and writes what it produced per channel to a JSON file for `audit`.
//!
//! Owns: its flags (`Args`), the payload format (a big-endian `u64` sequence number, 1, 2, 3…
//! per channel, then random bytes; the consumer's fold reads the number back), pacing, and the
//! produced record ([`Produced`], read back by `audit`).
//! Must not: write to etcd (with `--all` it only reads the registered channels).

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use chanwatch_node::handler::StreamState;
use chanwatch_stream::{Log, Position};
use clap::Args as ClapArgs;
use serde::{Deserialize, Serialize};

use crate::flags::{humantime_secs, EtcdArgs, LogArgs, RootArg};

/// Flags of `produce`.
#[derive(Debug, ClapArgs)]
pub struct Args {
    #[command(flatten)]
    pub log: LogArgs,
    /// Channels to produce to (repeat, or comma-separate).
    #[arg(
        long = "channel",
        env = "CHANWATCH_PRODUCE_CHANNEL",
        value_delimiter = ',',
        required_unless_present = "all"
    )]
    pub channels: Vec<String>,
    /// Produce to every channel registered in etcd (`--endpoints`, `--root`).
    #[arg(long, env = "CHANWATCH_PRODUCE_ALL", conflicts_with = "channels")]
    pub all: bool,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub root: RootArg,
    /// Messages per second, over all channels together.
    #[arg(long, env = "CHANWATCH_PRODUCE_RATE", default_value_t = 1000.0)]
    pub rate: f64,
    /// How long to produce.
    #[arg(long, env = "CHANWATCH_PRODUCE_DURATION", value_parser = humantime_secs, default_value = "10s")]
    pub duration: Duration,
    /// Bytes of each payload after the sequence number (random).
    #[arg(long, env = "CHANWATCH_PRODUCE_PAYLOAD_BYTES", default_value_t = 24)]
    pub payload_bytes: usize,
    /// Where to write what was produced (JSON, read by `audit --produced`).
    #[arg(long, env = "CHANWATCH_PRODUCE_OUT")]
    pub out: PathBuf,
}

/// What was produced to one channel.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducedChannel {
    /// Messages appended.
    pub count: u64,
    /// The last sequence number appended.
    pub max_seq: u64,
    /// The fold's digest of every payload appended (hex).
    pub digest: String,
    /// The position of the last message appended (decimal).
    pub last_position: String,
}

/// The file `produce --out` writes and `audit --produced` reads.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Produced {
    /// The log URL produced to.
    pub log: String,
    /// Per channel.
    pub channels: BTreeMap<String, ProducedChannel>,
}

/// A payload: `seq` big-endian, then `extra` pseudo-random bytes (also what `demo` produces).
pub(crate) fn payload(seq: u64, extra: usize, rng: &mut u64) -> bytes::Bytes {
    let mut p = Vec::with_capacity(8 + extra);
    p.extend_from_slice(&seq.to_be_bytes());
    while p.len() < 8 + extra {
        // xorshift64: random enough for payloads, no dependency.
        *rng ^= *rng << 13;
        *rng ^= *rng >> 7;
        *rng ^= *rng << 17;
        let take = (8 + extra - p.len()).min(8);
        p.extend_from_slice(&rng.to_le_bytes()[..take]);
    }
    bytes::Bytes::from(p)
}

/// The channels registered under `--root` in etcd, waiting while etcd is down or electing
/// a leader (only a configuration error ends it).
async fn registered(args: &Args) -> Result<Vec<String>> {
    let keys = args.root.keys()?;
    let store = args.etcd.connect_waiting(&keys).await?;
    let mut wait = Duration::from_millis(200);
    let list = loop {
        match store.range(&keys.channels_prefix()).await {
            Ok(list) => break list,
            Err(e) if e.is_retryable() => {
                tracing::warn!(error = %e, ?wait, "produce: cannot list the channels yet; retrying");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => bail!("cannot list the channels under {}: {e}", keys.root()),
        }
    };
    let mut names = std::collections::BTreeSet::new();
    for kv in list.kvs {
        if let Ok(k) = keys.parse_channel(&kv.key) {
            names.insert(k.channel.to_string());
        }
    }
    Ok(names.into_iter().collect())
}

/// Appends one message, retrying while the log is unavailable (a retried append may store
/// the message twice; `audit` compares against the log itself, so it still judges truly).
async fn append(log: &dyn Log, channel: &str, payload: bytes::Bytes) -> Result<Position> {
    let mut tries = 0;
    loop {
        match log.append(channel, payload.clone()).await {
            Ok(p) => return Ok(p),
            Err(e) if e.is_retryable() && tries < 100 => {
                tries += 1;
                tracing::warn!(%channel, error = %e, "produce: append failed; retrying");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => bail!("appending to {channel}: {e}"),
        }
    }
}

/// Produces, then writes `--out` and prints one JSON summary line.
///
/// # Errors
/// No channels, a log that cannot be opened or appended to, an unwritable `--out`.
pub async fn run(args: Args) -> Result<()> {
    let channels = if args.all {
        registered(&args).await?
    } else {
        args.channels.clone()
    };
    if channels.is_empty() {
        bail!("no channels to produce to: give --channel NAME or register channels first");
    }
    if args.rate.is_nan() || args.rate <= 0.0 {
        bail!("--rate must be above 0");
    }
    let keys = args.root.keys()?;
    let url = args.log.url(None)?;
    let log = args.log.open(&keys, None).await?;
    let mut states = vec![StreamState::default(); channels.len()];
    let mut last = vec![Position::START; channels.len()];
    let mut rng: u64 = u64::from(std::process::id())
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_nanos() as u64)
        | 1;
    let started = Instant::now();
    let mut sent: u64 = 0;
    let mut next = 0usize;
    while started.elapsed() < args.duration {
        let due = (started.elapsed().as_secs_f64() * args.rate) as u64;
        if sent >= due {
            tokio::time::sleep(Duration::from_millis(5)).await;
            continue;
        }
        // Behind the rate (appends slower than asked): catch up, but never past --duration.
        while sent < due && (sent % 64 != 0 || started.elapsed() < args.duration) {
            let i = next;
            next = (next + 1) % channels.len();
            let seq = states[i].count + 1;
            let p = payload(seq, args.payload_bytes, &mut rng);
            last[i] = append(&*log, &channels[i], p.clone()).await?;
            states[i].fold(&p);
            sent += 1;
        }
    }
    let took = started.elapsed();
    let produced = Produced {
        log: url,
        channels: channels
            .iter()
            .zip(states.iter().zip(&last))
            .map(|(name, (s, at))| {
                (
                    name.clone(),
                    ProducedChannel {
                        count: s.count,
                        max_seq: s.max_seq,
                        digest: format!("{:016x}", s.digest),
                        last_position: at.to_string(),
                    },
                )
            })
            .collect(),
    };
    let json = serde_json::to_string_pretty(&produced)?;
    std::fs::write(&args.out, json)
        .with_context(|| format!("cannot write --out {}", args.out.display()))?;
    println!(
        "{}",
        serde_json::json!({
            "channels": channels.len(),
            "messages": sent,
            "seconds": took.as_secs_f64(),
            "msgs_per_s": sent as f64 / took.as_secs_f64().max(1e-9),
        })
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The chaos run's producer died at start-up when its first etcd read met a leader
    /// election ("etcdserver: leader changed"): `--all` must wait for etcd, not exit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn produce_all_waits_for_an_etcd_that_is_down_when_it_starts() {
        use clap::Parser;
        let mut etcd = chanwatch_testkit::EtcdFixture::start()
            .await
            .expect("etcd starts");
        etcd.etcdctl(&["put", "chanwatch/channel/remaining/ch-a", "x"])
            .expect("a registered channel");
        etcd.kill();
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("produced.json");
        let cli = crate::cli::Cli::try_parse_from([
            "chanwatch".to_owned(),
            "produce".to_owned(),
            format!("--log=file:{}", dir.path().join("log").display()),
            "--all".to_owned(),
            format!("--endpoints={}", etcd.endpoint()),
            "--connect-timeout=1s".to_owned(),
            "--rate=100".to_owned(),
            "--duration=300ms".to_owned(),
            format!("--out={}", out.display()),
        ])
        .expect("parses");
        let crate::cli::Command::Produce(args) = cli.command else {
            panic!("not the produce command");
        };
        let producing = tokio::spawn(run(args));
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(
            !producing.is_finished(),
            "produce ended while etcd was down: {:?}",
            producing.await
        );
        etcd.start_again().await.expect("etcd starts again");
        tokio::time::timeout(Duration::from_secs(60), producing)
            .await
            .expect("produce ends once etcd is back")
            .expect("joins")
            .expect("produce succeeds");
        let produced: Produced =
            serde_json::from_str(&std::fs::read_to_string(&out).expect("--out written"))
                .expect("produce's output");
        assert!(produced.channels["ch-a"].count > 0, "{produced:?}");
    }

    #[test]
    fn a_payload_carries_its_sequence_number_and_its_length() {
        let mut rng = 7;
        let p = payload(42, 24, &mut rng);
        assert_eq!(p.len(), 32);
        assert_eq!(chanwatch_node::handler::consumer::payload_seq(&p), Some(42));
        assert_ne!(payload(42, 24, &mut rng), p, "random bytes differ");
    }
}
