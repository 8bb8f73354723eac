//! Group commit of a session's writes — acknowledgements and checkpoint commits — one txn for
//! many when it can, one per write when the shared one is refused.
//!
//! Owns: chunking writes to the store's limits, the write in flight and booking its outcomes
//! (acks go to the node machine, commits answer their run). Must not: decide what to ack (the
//! node machine does) or when to commit (the handler does), or run channels.

use chanwatch_core::node::NodeEvent;
use chanwatch_core::{ChannelInfo, ChannelName, ChannelState};
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use tokio::sync::oneshot;
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::checkpoint::{CommitError, CommitRequest};
use crate::session::Session;

pub(crate) mod hold;

/// What a write is for.
// Built and consumed within one write; boxing the assignment would add an allocation per ack.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum What {
    /// An acknowledgement of this assignment value.
    Ack(ChannelInfo),
    /// A checkpoint commit of a channel's run, answered here.
    Commit(ChannelName, oneshot::Sender<Result<i64, CommitError>>),
}

/// One write: its guards (besides the session's) and its put.
#[derive(Debug)]
pub(crate) struct AckWrite {
    pub(crate) what: What,
    /// For an ack the key's mod revision (none only under a planted bug); for a commit the
    /// assignment's create revision and the checkpoint's last seen revision.
    pub(crate) compares: Vec<Compare>,
    pub(crate) put: TxnOp,
}

/// How one acknowledgement write ended.
#[derive(Debug)]
pub(crate) enum AckOutcome {
    Committed(i64),
    /// A compare failed: the assignment changed (or the session ended) meanwhile.
    Refused,
    Failed(String),
}

/// Writes acks in one shared txn (one compare per key, plus the session guard), and falls
/// back to one txn per ack when the shared one fails, so that one changed assignment cannot
/// hold back the others (DESIGN.md §4).
pub(crate) async fn write_acks(
    store: &dyn MetaStore,
    session: Option<&Compare>,
    chunk: Vec<AckWrite>,
) -> Vec<(What, AckOutcome)> {
    if chunk.len() > 1 {
        let compares = session
            .cloned()
            .into_iter()
            .chain(chunk.iter().flat_map(|w| w.compares.iter().cloned()));
        let puts = chunk.iter().map(|w| w.put.clone());
        match store.txn(Txn::new().when(compares).and_then(puts)).await {
            Ok(r) if r.succeeded => {
                return chunk
                    .into_iter()
                    .map(|w| (w.what, AckOutcome::Committed(r.revision)))
                    .collect();
            }
            Ok(_) => debug!(
                acks = chunk.len(),
                "node: a batched ack's compare failed; acking one by one"
            ),
            Err(e) => warn!(error = %e, "node: batched ack failed; acking one by one"),
        }
    }
    let mut out = Vec::with_capacity(chunk.len());
    for w in chunk {
        let compares = session.cloned().into_iter().chain(w.compares);
        let outcome = match store.txn(Txn::new().when(compares).and_then([w.put])).await {
            Ok(r) if r.succeeded => AckOutcome::Committed(r.revision),
            Ok(_) => AckOutcome::Refused,
            Err(e) => AckOutcome::Failed(e.to_string()),
        };
        out.push((w.what, outcome));
    }
    out
}

/// Writes `chunks` — up to [`PIPELINE`] txns in flight when no key is written in two of them,
/// else one after another, in order — and answers each txn's commits as soon as it lands,
/// not after the last txn: their runs commit again while the rest travels (a node with a
/// thousand committing workers wrote 8–9 txns per write, and every worker waited for all of
/// them). Returns the acks' outcomes, for the session to book once all landed.
async fn write_chunks(
    store: &dyn MetaStore,
    session: Option<&Compare>,
    chunks: Vec<Vec<AckWrite>>,
    node: chanwatch_core::NodeId,
) -> Vec<(What, AckOutcome)> {
    use futures_util::StreamExt;
    let mut seen = std::collections::HashSet::new();
    let apart = chunks.iter().flatten().all(|w| match &w.put {
        TxnOp::Put { key, .. } => seen.insert(key.as_str()),
        _ => true,
    });
    let in_flight = if apart { PIPELINE } else { 1 };
    let mut acks = Vec::new();
    let mut written = futures_util::stream::iter(chunks)
        .map(|chunk| async move {
            let mut acks = Vec::new();
            for (what, outcome) in write_acks(store, session, chunk).await {
                match what {
                    What::Commit(channel, reply) => answer(node, &channel, reply, outcome),
                    ack @ What::Ack(_) => acks.push((ack, outcome)),
                }
            }
            acks
        })
        .buffered(in_flight);
    while let Some(a) = written.next().await {
        acks.extend(a);
    }
    acks
}

/// How many txns of one write may be in flight at once when no key is written twice in it:
/// etcd applies them one after another, but raft batches their entries and the node prepares
/// the next while one is applied (`bench exec`, 1,000 in-process committers on etcd: 50,500
/// → 66,900 commits/s).
const PIPELINE: usize = 4;

impl Session {
    /// Sends what is queued for acknowledgement, unless a write is already in flight: then
    /// it goes when that one returns, together with whatever queued meanwhile (group
    /// commit). The event loop does not wait for the store, so it keeps starting channels
    /// while acks travel; with the loop blocked on each ack, a node under a burst of
    /// assignments started its next channels only one ack round trip later, and ack
    /// latency grew with the burst (the `ack` bench).
    ///
    /// Acks of loads alone (`Watched` and progress reports; no commit queued, less than a txn
    /// of them) also wait while a plan round's puts are still coming ([`hold`]): the
    /// session's loop calls again at `hold_until`. A progress report followed in the queue
    /// by another ack of its channel is dropped: nothing waits for its outcome, and the later
    /// ack compares the revision it would have changed.
    pub(crate) fn send_acks(&mut self) {
        if self.ack_in_flight || (self.ack_queue.is_empty() && self.commit_queue.is_empty()) {
            return;
        }
        // One compare slot is the session guard. Values (and checkpoint states) are capped at
        // 64 KiB, so a byte budget of half the request limit also bounds a chunk.
        let max_ops = self.store.limits().max_txn_ops.saturating_sub(1).max(2);
        let max_bytes = self.store.limits().max_request_bytes / 2;
        self.hold_until = None;
        let loads_only = self
            .ack_queue
            .iter()
            .all(|(info, _)| matches!(info.state, ChannelState::Watched | ChannelState::ToWatch));
        if self.commit_queue.is_empty() && loads_only && self.ack_queue.len() < max_ops {
            if let Some(until) = self.round_hold.wait_until(self.clock.now()) {
                self.hold_until = Some(until);
                return;
            }
        }
        self.round_hold.sent();
        // A paused node claims nothing: `Watched` waits for the resume. Saying it has stopped
        // a channel (`Released`, `WatchFailed`) is true paused or not, and lets the channel
        // move without a fence when the node can write but not watch (a stalled watch).
        let paused = self.pause.borrow().is_some();
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.ack_queue)
            .into_iter()
            .partition(|(info, _)| !paused || info.state != ChannelState::Watched);
        self.ack_queue = later;
        // Commits are effects: a paused node holds them until it resumes.
        let commits = if paused {
            Vec::new()
        } else {
            std::mem::take(&mut self.commit_queue)
        };
        if now.is_empty() && commits.is_empty() {
            return;
        }
        let unguarded = planted!(self.planted, UnguardedAck);
        let session = (!unguarded).then(|| self.session_guard());
        // In channel order: runners woken together (a resume) queue their acks in whatever
        // order the scheduler woke them (tokio's watch wakes its waiters through randomly
        // chosen shards), and a simulation must replay the same txns.
        let mut later = std::collections::HashSet::new();
        let mut queue: Vec<_> = now
            .into_iter()
            .rev()
            .filter(|(info, _)| {
                let superseded =
                    info.state == ChannelState::ToWatch && later.contains(&info.channel);
                later.insert(info.channel.clone());
                !superseded
            })
            .collect();
        queue.reverse();
        queue.sort_by(|a, b| a.0.channel.cmp(&b.0.channel));
        let mut writes: Vec<(usize, AckWrite)> = Vec::with_capacity(queue.len() + commits.len());
        for (info, expect) in queue {
            let key = self.key(&info.channel);
            let value = info.encode();
            let compares = if unguarded {
                Vec::new()
            } else {
                vec![Compare::mod_revision(&key, expect)]
            };
            let put = TxnOp::put(key, value.clone());
            writes.push((
                value.len(),
                AckWrite {
                    what: What::Ack(info),
                    compares,
                    put,
                },
            ));
        }
        let mut commits = commits;
        commits.sort_by(|a, b| a.channel.cmp(&b.channel));
        // A commit whose run is gone (its reply dropped) has no one to tell and nothing to
        // keep: the next run resumes from what is in the store.
        for c in commits.into_iter().filter(|c| !c.reply.is_closed()) {
            let CommitRequest {
                channel,
                compares,
                put,
                reply,
            } = c;
            let len = match &put {
                TxnOp::Put { value, .. } => value.len(),
                _ => 0,
            };
            writes.push((
                len,
                AckWrite {
                    what: What::Commit(channel, reply),
                    compares,
                    put,
                },
            ));
        }
        let chunks = chunk(writes, max_ops, max_bytes);
        debug!(
            node = %self.reg.id,
            writes = chunks.iter().map(Vec::len).sum::<usize>(),
            txns = chunks.len(),
            "node: writing acks and commits"
        );
        self.ack_in_flight = true;
        let store = self.store.clone();
        let done = self.acks_done_tx.clone();
        let node = self.reg.id;
        self.ack_task = Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let acks = write_chunks(store.as_ref(), session.as_ref(), chunks, node).await;
            let _ = done.send(acks);
        })));
    }

    /// Books the outcomes of one ack write and sends what queued meanwhile.
    pub(crate) async fn acks_done(&mut self, outcomes: Vec<(What, AckOutcome)>) {
        self.ack_in_flight = false;
        let mut cmds = Vec::new();
        for (what, outcome) in outcomes {
            let info = match what {
                What::Ack(info) => info,
                What::Commit(channel, reply) => {
                    answer(self.reg.id, &channel, reply, outcome);
                    continue;
                }
            };
            let committed = match outcome {
                AckOutcome::Committed(rev) => {
                    self.metrics.acks("committed", 1);
                    debug!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack committed");
                    self.observe_ack(&info);
                    Some(rev)
                }
                AckOutcome::Refused => {
                    self.metrics.acks("refused", 1);
                    info!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack refused: the assignment changed meanwhile");
                    None
                }
                AckOutcome::Failed(e) => {
                    self.metrics.acks("error", 1);
                    self.retry_acks
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    warn!(node = %self.reg.id, channel = %info.channel, error = %e, "node: ack failed; retrying after a relist");
                    None
                }
            };
            cmds.extend(self.machine.step(NodeEvent::AckDone {
                channel: info.channel,
                committed,
            }));
        }
        self.execute_or_fence(cmds).await;
        self.send_acks();
    }

    /// While the session stops every channel (a shutdown): answers the commits of a write
    /// (acks are no longer booked: the node machine is done) and sends what queued.
    pub(crate) fn commits_done_stopping(&mut self, outcomes: Vec<(What, AckOutcome)>) {
        self.ack_in_flight = false;
        for (what, outcome) in outcomes {
            if let What::Commit(channel, reply) = what {
                answer(self.reg.id, &channel, reply, outcome);
            }
        }
        self.send_acks();
    }

    fn observe_ack(&mut self, info: &ChannelInfo) {
        if info.state == chanwatch_core::ChannelState::Watched {
            if let Some(seen) = self.seen_at.remove(&info.channel) {
                let secs = self
                    .clock
                    .now()
                    .saturating_duration_since(seen)
                    .as_secs_f64();
                self.metrics.ack_latency.observe(secs);
            }
        }
    }
}

/// Answers a commit of a run on `node` (the committer counts it).
fn answer(
    node: chanwatch_core::NodeId,
    channel: &ChannelName,
    reply: oneshot::Sender<Result<i64, CommitError>>,
    outcome: AckOutcome,
) {
    let answer = match outcome {
        AckOutcome::Committed(rev) => Ok(rev),
        AckOutcome::Refused => {
            info!(%node, %channel, "node: checkpoint commit refused: this run no longer owns the channel (moved, removed, session ended or a newer commit)");
            Err(CommitError::Fenced(
                "the assignment moved, the channel was removed, the session ended or a newer commit landed".into(),
            ))
        }
        AckOutcome::Failed(e) => Err(CommitError::Unavailable(e)),
    };
    let _ = reply.send(answer);
}

/// Splits writes, in order, into txns of at most `max_ops` writes and guards and `max_bytes`
/// of values. etcd refuses a txn that writes one key twice ("duplicate key given in txn
/// request"): a second write of a key (two acks of one channel, a checkpoint committed twice)
/// starts the next txn, which runs after the first has landed.
fn chunk(writes: Vec<(usize, AckWrite)>, max_ops: usize, max_bytes: usize) -> Vec<Vec<AckWrite>> {
    let mut chunks: Vec<Vec<AckWrite>> = vec![Vec::new()];
    let (mut bytes, mut guards) = (0, 0);
    let mut keys: std::collections::HashSet<String> = std::collections::HashSet::new();
    for (len, write) in writes {
        let last = chunks.last().map_or(0, Vec::len);
        let key = match &write.put {
            TxnOp::Put { key, .. } => key.clone(),
            _ => String::new(),
        };
        let full = last >= max_ops
            || guards + write.compares.len() > max_ops
            || bytes + len > max_bytes
            || keys.contains(&key);
        if last > 0 && full {
            chunks.push(Vec::new());
            (bytes, guards) = (0, 0);
            keys.clear();
        }
        keys.insert(key);
        bytes += len;
        guards += write.compares.len();
        if let Some(c) = chunks.last_mut() {
            c.push(write);
        }
    }
    chunks
}

#[cfg(test)]
mod tests;
