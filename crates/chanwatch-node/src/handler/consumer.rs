//! The stream consumer handler (DESIGN §7): runs each channel by reading it from a
//! [`chanwatch_stream::Log`], folding every message into a small [`StreamState`], and
//! committing `(position, state)` by fenced txn through the run's [`ChannelContext`].
//!
//! Owns: the per-run consuming task, when it commits (every `commit_every` messages or
//! `commit_interval`, whichever comes first; one commit in flight while reading goes on), what it does on each [`CommitError`], and the
//! fold itself ([`StreamState`], [`payload_hash`], [`payload_seq`]) that `produce` and `audit`
//! share so that all three agree on what "the same messages" means.
//! Counts in the node's metrics the messages it folds and how far each run is behind its
//! channel's end (`chanwatch_node_consumer_lag_positions`: 0 after a read that was not a full
//! batch — it reached the end — otherwise `Log::end` minus the position, asked at most once per
//! `commit_interval`).
//! Must not: touch the store (commits go through the context), or decide ownership.
//!
//! ## Why the committed state is exactly-once
//!
//! The state and the position it is "as of" land in one fenced txn; a run resumes from the
//! committed position (reads are exclusive of it) with the committed state. Whatever a run
//! folded after its last landed commit is thrown away with the run, and the next owner
//! re-reads those messages — so every message up to the committed position is folded into
//! the committed state exactly once, whatever failed in between.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, ChannelName, NodeId};
use chanwatch_stream::{Log, Position};
use serde_json::{json, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::{ChannelContext, ChannelHandler, CommitError};

/// The length of the sequence number at the front of every payload `produce` writes
/// (big-endian `u64`).
pub const SEQ_BYTES: usize = 8;

/// The sequence number a payload carries in its first [`SEQ_BYTES`] bytes (big-endian), or
/// `None` for a shorter payload.
pub fn payload_seq(payload: &[u8]) -> Option<u64> {
    let head: [u8; SEQ_BYTES] = payload.get(..SEQ_BYTES)?.try_into().ok()?;
    Some(u64::from_be_bytes(head))
}

/// A 64-bit FNV-1a hash of a payload: stable across processes, builds and platforms (the
/// digest is compared between `produce`, the consumer and `audit`).
pub fn payload_hash(payload: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in payload {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// What the consumer keeps per channel: how many messages it folded, the highest sequence
/// number found in them, and an order-independent digest (the wrapping sum of each payload's
/// [`payload_hash`]). Folding a message twice changes `count` and `digest`; missing one does
/// too — which is what `audit` checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamState {
    /// Messages folded.
    pub count: u64,
    /// The highest sequence number seen (0 when none carried one).
    pub max_seq: u64,
    /// Wrapping sum of the payloads' hashes.
    pub digest: u64,
}

impl StreamState {
    /// Folds one message in.
    pub fn fold(&mut self, payload: &[u8]) {
        self.count += 1;
        if let Some(seq) = payload_seq(payload) {
            self.max_seq = self.max_seq.max(seq);
        }
        self.digest = self.digest.wrapping_add(payload_hash(payload));
    }

    /// The checkpoint form: `{"count", "max_seq", "digest"}` (the digest as a hex string, so
    /// that no JSON reader rounds it).
    pub fn to_json(&self) -> Value {
        json!({
            "count": self.count,
            "max_seq": self.max_seq,
            "digest": format!("{:016x}", self.digest),
        })
    }

    /// Reads the checkpoint form back.
    ///
    /// # Errors
    /// A value that is not what [`StreamState::to_json`] writes, saying which field.
    pub fn from_json(v: &Value) -> Result<Self, String> {
        let num = |k: &str| {
            v.get(k)
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("checkpoint state has no unsigned `{k}`: {v}"))
        };
        let digest = v
            .get("digest")
            .and_then(Value::as_str)
            .and_then(|s| u64::from_str_radix(s, 16).ok())
            .ok_or_else(|| format!("checkpoint state has no hex `digest`: {v}"))?;
        Ok(StreamState {
            count: num("count")?,
            max_seq: num("max_seq")?,
            digest,
        })
    }
}

/// When the consumer commits.
#[derive(Debug, Clone, Copy)]
pub struct ConsumerOptions {
    /// Commit after this many messages folded since the last commit (default 100).
    pub commit_every: u64,
    /// Commit this long after the last commit when anything was folded (default 1 s).
    pub commit_interval: Duration,
    /// Largest batch read at once (default 256).
    pub batch: usize,
}

impl Default for ConsumerOptions {
    fn default() -> Self {
        ConsumerOptions {
            commit_every: 100,
            commit_interval: Duration::from_secs(1),
            batch: 256,
        }
    }
}

/// One running channel.
struct Run {
    paused: watch::Sender<bool>,
    stop: watch::Sender<bool>,
    task: JoinHandle<()>,
    /// Where the run's in-memory fold is (not necessarily committed).
    folded: Arc<Mutex<(Position, StreamState)>>,
}

/// The consumer handler: see the module docs. One instance serves every channel (and every
/// node of an in-process cluster); runs are keyed by node and channel.
pub struct StreamConsumer {
    log: Arc<dyn Log>,
    options: ConsumerOptions,
    runs: Mutex<HashMap<(NodeId, ChannelName), Run>>,
}

impl std::fmt::Debug for StreamConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StreamConsumer")
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl StreamConsumer {
    /// A consumer of `log`.
    pub fn new(log: Arc<dyn Log>, options: ConsumerOptions) -> Self {
        StreamConsumer {
            log,
            options,
            runs: Mutex::default(),
        }
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<(NodeId, ChannelName), Run>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How far the run of `channel` on `node` has read and folded (in memory; what it last
    /// committed may be behind), or `None` when it does not run here.
    pub fn folded(&self, node: NodeId, channel: &ChannelName) -> Option<(Position, StreamState)> {
        let runs = self.runs();
        let run = runs.get(&(node, channel.clone()))?;
        let folded = *run
            .folded
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        Some(folded)
    }

    async fn stop_run(&self, node: NodeId, channel: &ChannelName) {
        let run = self.runs().remove(&(node, channel.clone()));
        let Some(mut run) = run else { return };
        let paused = *run.paused.borrow();
        let _ = run.stop.send(true);
        if paused {
            // A paused node commits nothing (its commits are held): no last commit, or a node
            // fencing itself would wait here while its margin runs out (found by the
            // simulation's data plane). The next owner resumes from the last landed commit.
            run.task.abort();
            return;
        }
        // The last commit attempt gets a bounded time; release must be quick.
        if tokio::time::timeout(Duration::from_secs(1), &mut run.task)
            .await
            .is_err()
        {
            run.task.abort();
        }
    }
}

#[async_trait]
impl ChannelHandler for StreamConsumer {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let channel = ctx.info.channel.clone();
        chanwatch_stream::check_channel(channel.as_str()).map_err(|e| e.to_string())?;
        let resumed = ctx.resume().await.map_err(|e| e.to_string())?;
        let (at, state) = match resumed {
            None => (Position::START, StreamState::default()),
            Some(cp) => {
                let at: Position = cp
                    .position
                    .parse()
                    .map_err(|e| format!("checkpoint of {channel}: {e}"))?;
                let state = match &cp.state {
                    Some(v) => StreamState::from_json(v)?,
                    None => StreamState::default(),
                };
                (at, state)
            }
        };
        // A run left over under the same key (should not happen: the runner releases first).
        self.stop_run(ctx.node, &channel).await;
        let (paused, paused_rx) = watch::channel(false);
        let (stop, stop_rx) = watch::channel(false);
        let folded = Arc::new(Mutex::new((at, state)));
        let task = tokio::spawn(consume(
            self.log.clone(),
            self.options,
            ctx.clone(),
            folded.clone(),
            paused_rx,
            stop_rx,
        ));
        self.runs().insert(
            (ctx.node, channel),
            Run {
                paused,
                stop,
                task,
                folded,
            },
        );
        Ok(())
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        self.stop_run(node, &info.channel).await;
    }

    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(run) = self.runs().get(&(node, info.channel.clone())) {
            let _ = run.paused.send(true);
        }
    }

    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(run) = self.runs().get(&(node, info.channel.clone())) {
            let _ = run.paused.send(false);
        }
    }
}

/// How a commit went, for the loop.
enum Committed {
    Landed,
    Later,
    Stop,
}

async fn commit(ctx: &ChannelContext, at: Position, state: &StreamState) -> Committed {
    match ctx.commit(at.to_string(), Some(state.to_json())).await {
        Ok(()) => Committed::Landed,
        Err(CommitError::Unavailable(e)) => {
            tracing::debug!(channel = %ctx.info.channel, error = %e, "consumer: commit not landed; retrying later");
            Committed::Later
        }
        // Someone else owns the channel now (or will): stop, and say so. A run that stops
        // consuming must not look like one that runs: when the node has not seen a move (a
        // fence it cannot explain, e.g. an earlier commit of this run that landed late after
        // an etcd outage), the channel is reported broken and moves, resuming from its
        // checkpoint; when it has, the report is ignored (the chaos run found a channel whose
        // consumer had stopped while its node still ran it: the audit's "behind").
        Err(CommitError::Fenced(e)) => {
            tracing::warn!(channel = %ctx.info.channel, reason = %e, "consumer: fenced; stopping");
            ctx.fail(format!("the consumer's checkpoint commit was fenced: {e}"));
            Committed::Stop
        }
        // Cannot happen with this state's size; report the channel broken if it does.
        Err(e @ CommitError::TooLarge(_)) => {
            ctx.fail(e.to_string());
            Committed::Stop
        }
    }
}

/// A commit on its way: the position it carries, and its answer.
type InFlight = (Position, Pin<Box<dyn Future<Output = Committed> + Send>>);

/// The answer of the commit in flight (never, when there is none).
async fn answer(in_flight: &mut Option<InFlight>) -> (Position, Committed) {
    match in_flight.as_mut() {
        Some((at, commit)) => (*at, commit.await),
        None => std::future::pending().await,
    }
}

/// What one turn of the loop got.
enum Step {
    Read(chanwatch_stream::LogResult<Vec<chanwatch_stream::Message>>),
    Answered(Position, Committed),
    Stop,
    Paused,
}

/// One run: read, fold, commit, until stopped or fenced. At most one commit is in flight and
/// reading goes on while it is: awaited between reads, each commit's round trip stalled the
/// reader (`chanwatch bench consume`: 0.65 of a bare reader's throughput with a commit per
/// 256-message batch). Each commit carries the position and the state as of one instant, and
/// the next starts only after its answer, so landed positions still only grow.
async fn consume(
    log: Arc<dyn Log>,
    options: ConsumerOptions,
    ctx: ChannelContext,
    folded: Arc<Mutex<(Position, StreamState)>>,
    mut paused: watch::Receiver<bool>,
    mut stop: watch::Receiver<bool>,
) {
    let (mut at, mut state) = *folded
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let clock = ctx.clock();
    let channel = ctx.info.channel.to_string();
    let mut committed_at = at;
    // Folded since the last commit started.
    let mut pending: u64 = 0;
    // After a commit that did not land, the next waits a whole interval (no retry storm).
    let mut backing_off = false;
    let mut last_commit = clock.now();
    let mut in_flight: Option<InFlight> = None;
    let wait = options
        .commit_interval
        .clamp(Duration::from_millis(10), Duration::from_millis(500));
    // Metrics only in a node's contexts (a handler test's context has none).
    let metrics = ctx.committer.as_ref().map(|c| c.metrics().clone());
    let mut lag = metrics
        .as_ref()
        .map(|m| crate::metrics::GaugeShare::new(m.consumer_lag.clone()));
    let mut lag_asked: Option<tokio::time::Instant> = None;
    // Starts a commit of what is folded now, when none is in flight and one is due.
    macro_rules! maybe_commit {
        () => {
            let due = clock.now().saturating_duration_since(last_commit) >= options.commit_interval;
            if in_flight.is_none()
                && at != committed_at
                && ((pending >= options.commit_every && !backing_off) || due)
            {
                let (ctx, snapshot) = (ctx.clone(), state);
                in_flight = Some((
                    at,
                    Box::pin(async move { commit(&ctx, at, &snapshot).await }),
                ));
                pending = 0;
            }
        };
    }
    loop {
        if *stop.borrow() {
            break;
        }
        if *paused.borrow() {
            // Hold everything (state stays in memory; a commit in flight is held by the
            // paused node) until resumed or stopped.
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => {}
                _ = paused.wait_for(|p| !p) => {}
            }
            continue;
        }
        // The read is never cancelled for a commit's answer (a NATS read dropped mid-fetch
        // loses its cursor): answers are booked while it runs.
        let read = log.read(&channel, at, options.batch, wait);
        tokio::pin!(read);
        let step = loop {
            // Biased: with several ready at once (a paused clock), the same one wins every
            // time, so a simulation replays exactly.
            let step = tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => Step::Stop,
                _ = paused.wait_for(|p| *p) => Step::Paused,
                (landed_at, c) = answer(&mut in_flight), if in_flight.is_some() => Step::Answered(landed_at, c),
                r = &mut read => Step::Read(r),
            };
            let Step::Answered(landed_at, c) = step else {
                break step;
            };
            in_flight = None;
            last_commit = clock.now();
            match c {
                Committed::Landed => {
                    committed_at = landed_at;
                    backing_off = false;
                }
                Committed::Later => backing_off = true,
                Committed::Stop => return,
            }
            // What was folded before this read may be due now (the read may wait long on
            // a quiet channel).
            maybe_commit!();
        };
        match step {
            Step::Stop => break,
            Step::Paused | Step::Answered(..) => continue,
            Step::Read(Ok(batch)) => {
                for m in &batch {
                    state.fold(&m.payload);
                    at = m.position;
                }
                pending += batch.len() as u64;
                *folded
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = (at, state);
                if let (Some(m), Some(lag)) = (&metrics, &mut lag) {
                    m.consumer_messages.inc_by(batch.len() as u64);
                    if batch.len() < options.batch.max(1) {
                        lag.set(0); // it read up to the end
                    } else if lag_asked.map_or(true, |t| {
                        clock.now().saturating_duration_since(t) >= options.commit_interval
                    }) {
                        lag_asked = Some(clock.now());
                        if let Ok(end) = log.end(&channel).await {
                            let behind = end.raw().saturating_sub(at.raw());
                            lag.set(i64::try_from(behind).unwrap_or(i64::MAX));
                        }
                    }
                }
            }
            Step::Read(Err(e)) if e.is_retryable() => {
                tracing::debug!(%channel, error = %e, "consumer: log unavailable; retrying");
                clock.sleep(Duration::from_millis(200)).await;
            }
            Step::Read(Err(e)) => {
                ctx.fail(format!("cannot read the log: {e}"));
                return;
            }
        }
        maybe_commit!();
    }
    if *paused.borrow() {
        return;
    }
    // Released: the commit in flight gets its answer, then one last attempt, so that the next
    // owner re-reads less.
    if let Some((landed_at, commit)) = in_flight.take() {
        match commit.await {
            Committed::Landed => committed_at = landed_at,
            Committed::Later => {}
            Committed::Stop => return,
        }
    }
    if at != committed_at {
        let _ = commit(&ctx, at, &state).await;
    }
}

#[cfg(test)]
mod tests;
