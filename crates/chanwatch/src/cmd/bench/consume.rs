//! `chanwatch bench consume`: the consumer handler's throughput on one node against the floor
//! of a bare reader of the same stream, in the same run.
//!
//! Owns: pre-filling a log, the bare readers (a `Log::read` loop; for NATS also a bare
//! `async-nats` JetStream consumer), timing the handler until every committed position
//! reaches the end, and what it reports. Must not: assert on timings.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use bytes::Bytes;
use chanwatch_core::{ChannelState, Checkpoint, Keys};
use chanwatch_node::handler::consumer::{ConsumerOptions, StreamConsumer};
use chanwatch_store::{EmbeddedStore, MetaStore};
use chanwatch_stream::{Log, Position};
use futures_util::StreamExt;
use serde_json::json;

use super::meter::{self, round3};
use super::{median, BenchConsumeArgs};
use crate::inproc::InProc;

/// Which log a run uses, made fresh for it.
pub(crate) enum Backend {
    File(std::path::PathBuf),
    Nats { url: String, stream: String },
}

impl Backend {
    /// A fresh log for run `run` of bench `what`: a sub-dir of the `file:` dir (or of the
    /// temp dir when no log was given), or a stream of its own on the NATS server.
    pub(crate) fn fresh(log: Option<&str>, what: &str, run: usize) -> Result<Self> {
        let tag = format!("{what}-{}-{run}", std::process::id());
        match log {
            Some(url) if url.starts_with("nats://") => Ok(Backend::Nats {
                url: url.to_owned(),
                stream: format!("CWBENCH_{}", tag.replace('-', "_")),
            }),
            Some(url) => {
                let dir = url.strip_prefix("file:").with_context(|| {
                    format!("--log {url}: expected file:DIR or nats://HOST:PORT")
                })?;
                Ok(Backend::File(std::path::Path::new(dir).join(tag)))
            }
            None => Ok(Backend::File(
                std::env::temp_dir().join(format!("chanwatch-bench-{tag}")),
            )),
        }
    }

    /// Opens it.
    pub(crate) async fn open(&self) -> Result<Arc<dyn Log>> {
        Ok(match self {
            Backend::File(dir) => {
                chanwatch_stream::open(&format!("file:{}", dir.display()), "unused").await?
            }
            Backend::Nats { url, stream } => chanwatch_stream::open(url, stream).await?,
        })
    }

    /// `file` or `nats`.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Backend::File(_) => "file",
            Backend::Nats { .. } => "nats",
        }
    }

    /// Removes what the run left: the dir, or the stream.
    pub(crate) async fn remove(&self) {
        match self {
            Backend::File(dir) => {
                let _ = std::fs::remove_dir_all(dir);
            }
            Backend::Nats { url, stream } => {
                if let Ok(client) = async_nats::connect(url.as_str()).await {
                    let _ = async_nats::jetstream::new(client)
                        .delete_stream(stream)
                        .await;
                }
            }
        }
    }
}

/// A payload as `produce` writes them: the sequence number, then filler.
pub(crate) fn payload(seq: u64, len: usize) -> Bytes {
    let mut p = seq.to_be_bytes().to_vec();
    p.resize(len.max(8), (seq % 251) as u8);
    Bytes::from(p)
}

fn channel_names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("ch{i:06}")).collect()
}

/// Appends `per_channel` messages to each channel, one task per channel; returns each
/// channel's end.
async fn prefill(
    log: &Arc<dyn Log>,
    names: &[String],
    per_channel: usize,
    len: usize,
) -> Result<Vec<Position>> {
    let mut tasks = Vec::new();
    for name in names {
        let (log, name) = (log.clone(), name.clone());
        tasks.push(tokio::spawn(async move {
            let mut end = Position::START;
            for seq in 1..=per_channel as u64 {
                end = log.append(&name, payload(seq, len)).await?;
            }
            anyhow::Ok(end)
        }));
    }
    let mut ends = Vec::new();
    for t in tasks {
        ends.push(t.await??);
    }
    Ok(ends)
}

/// The floor through the `Log` trait: one task per channel reading batches of 256 from the
/// start until its end, as the handler reads (without folding or committing).
async fn bare_log_read(log: &Arc<dyn Log>, names: &[String], ends: &[Position]) -> Result<f64> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for (name, end) in names.iter().zip(ends) {
        let (log, name, end) = (log.clone(), name.clone(), *end);
        tasks.push(tokio::spawn(async move {
            let mut at = Position::START;
            let mut n = 0u64;
            while at < end {
                let batch = log.read(&name, at, 256, Duration::from_millis(500)).await?;
                for m in &batch {
                    n += m.payload.len() as u64 & 1; // touch the payload
                    at = m.position;
                }
            }
            anyhow::Ok(n)
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// The floor of NATS itself: a bare `async-nats` JetStream pull consumer per channel
/// (ephemeral, filtered on the channel's subject, from the first message, no acks) streaming
/// until it has every message.
async fn bare_nats(url: &str, stream: &str, names: &[String], per_channel: usize) -> Result<f64> {
    use async_nats::jetstream::consumer;
    let client = async_nats::connect(url).await?;
    let js = async_nats::jetstream::new(client);
    let stream = js
        .get_stream(stream)
        .await
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for name in names {
        let subject = format!(
            "{}.{}",
            stream.cached_info().config.name,
            name.replace('.', "~")
        );
        let stream = stream.clone();
        tasks.push(tokio::spawn(async move {
            let c = stream
                .create_consumer(consumer::pull::Config {
                    filter_subject: subject,
                    deliver_policy: consumer::DeliverPolicy::All,
                    ack_policy: consumer::AckPolicy::None,
                    memory_storage: true,
                    ..Default::default()
                })
                .await
                .map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut messages = c.messages().await.map_err(|e| anyhow::anyhow!("{e}"))?;
            let mut n = 0;
            while n < per_channel {
                match messages.next().await {
                    Some(Ok(_)) => n += 1,
                    Some(Err(e)) => anyhow::bail!("bare consumer: {e}"),
                    None => anyhow::bail!("bare consumer ended after {n} messages"),
                }
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// One node running the consumer handler on every channel: seconds from the assignments
/// written to every channel's committed position at its end, to every channel `Watched` as
/// the coordinator counts them, and to the first run's start (the control plane's share).
async fn handler_run(
    log: Arc<dyn Log>,
    commit_every: u64,
    names: &[String],
    ends: &[Position],
    run: usize,
) -> Result<(f64, f64, f64)> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let options = ConsumerOptions {
        commit_every,
        ..ConsumerOptions::default()
    };
    let handler = Arc::new(StreamConsumer::new(log, options));
    let consumer = handler.clone();
    let keys = Keys::new(format!("bench-consume-{}-{run}", std::process::id()))?;
    let c = InProc::start_on(
        store.clone(),
        keys.clone(),
        super::system::timings(),
        handler,
        "bench".into(),
    )?;
    let node = c.spawn_node();
    let id = c.node_id(&node).await?;
    c.ready().await?;
    let t0 = Instant::now();
    super::system::seed(&c, &[id], names.len(), ChannelState::ToWatch).await?;
    let mut want = std::collections::HashMap::new();
    for (n, end) in names.iter().zip(ends) {
        want.insert(
            keys.checkpoint(&chanwatch_core::ChannelName::new(n.clone())?),
            *end,
        );
    }
    let mut watched = None;
    let mut first_run = None;
    let channels: Vec<chanwatch_core::ChannelName> = names
        .iter()
        .map(|n| chanwatch_core::ChannelName::new(n.clone()))
        .collect::<Result<_, _>>()?;
    loop {
        if first_run.is_none() && channels.iter().any(|ch| consumer.folded(id, ch).is_some()) {
            first_run = Some(t0.elapsed().as_secs_f64());
        }
        if watched.is_none()
            && c.coord_metrics.channels_in(ChannelState::Watched) >= names.len() as i64
        {
            watched = Some(t0.elapsed().as_secs_f64());
        }
        let list = store.range(&keys.checkpoints_prefix()).await?;
        let done = list
            .kvs
            .iter()
            .filter(|kv| {
                want.get(&kv.key).is_some_and(|end| {
                    Checkpoint::decode(&kv.value)
                        .ok()
                        .and_then(|cp| cp.position.parse::<Position>().ok())
                        .is_some_and(|p| p >= *end)
                })
            })
            .count();
        if done == names.len() {
            break;
        }
        ensure!(
            t0.elapsed() < Duration::from_secs(600),
            "the consumer did not catch up in 600 s ({done} of {} channels)",
            names.len()
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let secs = t0.elapsed().as_secs_f64();
    node.stop().await;
    c.shutdown().await;
    Ok((secs, watched.unwrap_or(secs), first_run.unwrap_or(0.0)))
}

/// `chanwatch bench consume`.
///
/// # Errors
/// Log or store errors, or a consumer that does not catch up.
pub async fn run(args: &BenchConsumeArgs) -> Result<()> {
    ensure!(args.channels > 0, "--channels must be at least 1");
    let per_channel = (args.messages / args.channels).max(1);
    let total = (per_channel * args.channels) as f64;
    let names = channel_names(args.channels);
    let (mut handler_rates, mut bare_rates, mut nats_rates) = (Vec::new(), Vec::new(), Vec::new());
    let mut kind = "file";
    let mut watched_secs = Vec::new();
    let mut with_assign_rates = Vec::new();
    let mut ratios = Vec::new();
    eprintln!(
        "bench consume: {} messages of {} B over {} channels, {} runs, log {}",
        total,
        args.payload.max(8),
        args.channels,
        args.runs,
        args.log.as_deref().unwrap_or("file:(temp dir)")
    );
    let machine = meter::machine();
    for run in 0..args.runs.max(1) {
        let backend = Backend::fresh(args.log.as_deref(), "consume", run)?;
        kind = backend.kind();
        let result = async {
            let log = backend.open().await?;
            let t = Instant::now();
            let ends = prefill(&log, &names, per_channel, args.payload).await?;
            let fill = t.elapsed().as_secs_f64();
            // The handler first, then the floors, each on a log handle of its own (no cursor
            // or cache carried over).
            let (handler, watched, first_run) =
                handler_run(backend.open().await?, args.commit_every, &names, &ends, run).await?;
            let bare = bare_log_read(&backend.open().await?, &names, &ends).await?;
            let nats = match &backend {
                Backend::Nats { url, stream } => {
                    Some(bare_nats(url, stream, &names, per_channel).await?)
                }
                Backend::File(_) => None,
            };
            anyhow::Ok((fill, handler, watched, first_run, bare, nats))
        }
        .await;
        backend.remove().await;
        let (fill, handler, watched, first_run, bare, nats) = result?;
        let reading = (handler - first_run).max(1e-9);
        watched_secs.push(watched);
        eprintln!(
            "  run {run}: pre-fill {:.0} msgs/s; handler {:.0} msgs/s from its first run's start ({:.0} from the assignments; {handler:.2} s, first run after {first_run:.2} s, all Watched after {watched:.2} s); bare Log::read {:.0} msgs/s{}",
            total / fill,
            total / reading,
            total / handler,
            total / bare,
            nats.map_or(String::new(), |n| format!("; bare async-nats {:.0} msgs/s", total / n)),
        );
        handler_rates.push(total / reading);
        // Paired in the run: the floor the ratio is against is the bare async-nats consumer
        // on NATS, the bare Log::read loop on the file log.
        ratios.push(match nats {
            Some(n) => n / reading,
            None => bare / reading,
        });
        with_assign_rates.push(total / handler);
        bare_rates.push(total / bare);
        if let Some(n) = nats {
            nats_rates.push(total / n);
        }
    }
    let h = median(handler_rates);
    // The median of each run's own ratio (handler and floor measured side by side).
    let ratio = median(ratios);
    let b = median(bare_rates);
    // The floor the ratio is against: for NATS the bare async-nats consumer, for the file
    // log the bare Log::read loop.
    let floor = if nats_rates.is_empty() {
        b
    } else {
        median(nats_rates.clone())
    };
    let line = json!({
        "bench": "consume",
        "log": kind,
        "machine": machine,
        "channels": args.channels,
        "messages": total,
        "payload_bytes": args.payload.max(8),
        "commit_every_messages": args.commit_every,
        "runs": args.runs.max(1),
        "handler_msgs_per_sec_median": h.round(),
        "bare_log_read_msgs_per_sec_median": b.round(),
        "bare_async_nats_msgs_per_sec_median": (!nats_rates.is_empty()).then(|| floor.round()),
        "ratio_handler_over_bare": round3(ratio),
        "ratio_handler_over_log_read": round3(h / b.max(1e-9)),
        "handler_seconds_to_watched_median": round3(median(watched_secs)),
        "handler_msgs_per_sec_from_assignments_median": median(with_assign_rates).round(),
        "note": "one node, consumer batch 256, commit every commit_every_messages or 1 s; handler time runs from the first channel's run starting (the control plane's share excluded; the other runs' later starts included) to every committed position at the end; the floor is the bare async-nats consumer on NATS, the bare Log::read loop on the file log",
    });
    println!("{line}");
    eprintln!(
        "  median: handler {h:.0} msgs/s, floor {floor:.0} msgs/s, ratio (median of the runs' own) {ratio:.2}"
    );
    Ok(())
}
