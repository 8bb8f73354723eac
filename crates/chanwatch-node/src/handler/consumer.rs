//! The stream consumer handler (issue 12, DESIGN §7): runs each channel by reading it from a
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
mod tests {
    use super::*;

    fn payload(seq: u64, rest: &[u8]) -> Vec<u8> {
        let mut p = seq.to_be_bytes().to_vec();
        p.extend_from_slice(rest);
        p
    }

    #[test]
    fn the_fold_counts_tracks_the_highest_sequence_and_ignores_order() {
        let msgs: Vec<_> = (1..=5).map(|i| payload(i, &[i as u8; 3])).collect();
        let mut forward = StreamState::default();
        msgs.iter().for_each(|m| forward.fold(m));
        let mut backward = StreamState::default();
        msgs.iter().rev().for_each(|m| backward.fold(m));
        assert_eq!(forward, backward);
        assert_eq!((forward.count, forward.max_seq), (5, 5));
    }

    #[test]
    fn a_message_folded_twice_or_missed_changes_the_state() {
        let msgs: Vec<_> = (1..=4).map(|i| payload(i, b"xyz")).collect();
        let mut once = StreamState::default();
        msgs.iter().for_each(|m| once.fold(m));
        let mut twice = once;
        twice.fold(&msgs[2]);
        assert_ne!(once, twice);
        let mut missed = StreamState::default();
        msgs[..3].iter().for_each(|m| missed.fold(m));
        assert_ne!(once, missed);
        assert_ne!(once.digest, missed.digest);
    }

    #[test]
    fn the_state_round_trips_through_its_checkpoint_form_exactly() {
        let s = StreamState {
            count: 7,
            max_seq: 9,
            digest: u64::MAX - 3,
        };
        assert_eq!(StreamState::from_json(&s.to_json()), Ok(s));
        assert!(StreamState::from_json(&json!({"count": 1})).is_err());
    }

    /// A run whose commits are answered only when this test says so: the run's first commit
    /// stays in flight while the run reads to the end of the channel; no second commit starts
    /// before the first is answered; the next one carries the end.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reading_goes_on_while_a_commit_is_in_flight() {
        use crate::checkpoint::{CommitShared, Committer};
        use chanwatch_core::{Checkpoint, Epoch, Keys, VChannelInfo};
        use chanwatch_store::{Clock, EmbeddedStore, TxnOp};
        use chanwatch_stream::{FileLog, FileLogOptions};
        use tokio::sync::mpsc;

        let dir = tempfile::tempdir().expect("temp dir");
        let log = Arc::new(FileLog::open(dir.path(), FileLogOptions::default()).expect("log"));
        for seq in 1..=1000 {
            log.append("c-0", payload(seq, b"x").into())
                .await
                .expect("append");
        }
        let (tx, mut commits) = mpsc::unbounded_channel();
        let shared = Arc::new(CommitShared {
            store: Arc::new(EmbeddedStore::new()),
            tx,
            keys: Keys::default(),
            node: NodeId(1),
            clock: Clock::system(),
            metrics: Arc::new(crate::metrics::NodeMetrics::new()),
            planted_bug: None,
        });
        let channel = ChannelName::new("c-0").expect("valid");
        let info = ChannelInfo::new(channel.clone(), Epoch(1), 0, VChannelInfo::default());
        let (events, _events) = mpsc::unbounded_channel();
        let ctx = ChannelContext {
            node: NodeId(1),
            info: info.clone(),
            clock: Clock::system(),
            events,
            last_progress: Arc::default(),
            progress_interval: Duration::from_secs(5),
            generation: 1,
            committer: Some(Committer::new(shared, channel.clone(), Epoch(1), 1)),
        };
        let consumer = StreamConsumer::new(
            log,
            ConsumerOptions {
                commit_every: 100,
                commit_interval: Duration::from_secs(60),
                batch: 100,
            },
        );
        consumer.load(ctx).await.expect("load");
        let first = tokio::time::timeout(Duration::from_secs(10), commits.recv())
            .await
            .expect("a first commit")
            .expect("open");
        let end = Position::from_raw(1000);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while consumer.folded(NodeId(1), &channel).map(|f| f.0) != Some(end) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "reading stalled behind the unanswered commit at {:?}",
                consumer.folded(NodeId(1), &channel).map(|f| f.0)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(
            commits.try_recv().is_err(),
            "a second commit started while the first was in flight"
        );
        first
            .reply
            .send(Ok(5))
            .expect("the run waits for its answer");
        let second = tokio::time::timeout(Duration::from_secs(10), commits.recv())
            .await
            .expect("a second commit")
            .expect("open");
        let TxnOp::Put { value, .. } = &second.put else {
            panic!("a commit is a put: {:?}", second.put);
        };
        let cp = Checkpoint::decode(value).expect("a checkpoint");
        assert_eq!(cp.position, "1000");
        let state = StreamState::from_json(cp.state.as_ref().expect("state")).expect("state");
        assert_eq!((state.count, state.max_seq), (1000, 1000));
        second.reply.send(Ok(6)).expect("answered");
        consumer.release(NodeId(1), &info).await;
    }

    #[test]
    fn the_hash_and_the_sequence_are_stable() {
        assert_eq!(payload_hash(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(payload_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(payload_seq(&payload(42, b"r")), Some(42));
        assert_eq!(payload_seq(b"short"), None);
    }
}
