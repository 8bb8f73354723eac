//! Fenced checkpoints (DESIGN §2, §4): where a run resumes, and how a handler commits its
//! position and state so that only the current owner's commit can land.
//!
//! Owns: reading `{root}/worker/checkpoint/{channel}` on a run's first use of it (retried until the
//! store answers: a run must not start from the beginning because the store was slow; a
//! handler that never checkpoints never reads), the per-run
//! `Committer` that builds each commit's guard — (i) the assignment key's create revision
//! the run started under, (ii) the session (added by the ack writer), (iii) the checkpoint's
//! mod revision this run last saw, or its absence — and reconciling after a commit whose
//! outcome is unknown. The writes themselves are group-committed with the acks (`acks.rs`).
//!
//! Counts every commit by result (`ok`, `fenced`, `unavailable`, `too_large`) and its latency,
//! and keeps the run's checkpoint time in the node's oldest-checkpoint-age gauge.
//!
//! Must not: decide when to commit (the handler does), or write anything but the checkpoint.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chanwatch_core::{ChannelName, Checkpoint, Epoch};
use chanwatch_store::{Clock, Compare, MetaStore, TxnOp};
use serde_json::Value;
use tokio::sync::{mpsc, oneshot};

/// Why a commit did not land.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitError {
    /// This run no longer owns the channel (it moved, was removed, the session ended, or a
    /// newer commit landed): stop consuming — the node stops the channel too.
    #[error("fenced: {0}; stop consuming this channel")]
    Fenced(String),
    /// The store did not answer, or the node is paused: nothing is known to have landed. Try
    /// again later (the next commit reconciles first).
    #[error("the commit may not have landed: {0}; commit again later")]
    Unavailable(String),
    /// The state is larger than a checkpoint may hold.
    #[error("the checkpoint state is {0} bytes encoded, over the limit of {max}; keep less state", max = Checkpoint::MAX_STATE_BYTES)]
    TooLarge(usize),
}

/// One commit for the session's writer: the guard and the put, and where the answer goes.
#[derive(Debug)]
pub(crate) struct CommitRequest {
    pub(crate) channel: ChannelName,
    /// Guards (i) and (iii); the writer adds the session guard.
    pub(crate) compares: Vec<Compare>,
    pub(crate) put: TxnOp,
    /// The mod revision the checkpoint landed at, or why not.
    pub(crate) reply: oneshot::Sender<Result<i64, CommitError>>,
}

/// What this run knows of the checkpoint key.
#[derive(Debug, Default)]
struct Seen {
    /// The checkpoint as read by this run (`None` until read; then `Some(None)` when absent).
    read: Option<Option<Checkpoint>>,
    /// Its mod revision as last read or written by this run (`None`: absent).
    mod_revision: Option<i64>,
    /// The bytes of a commit whose outcome is unknown: the next commit first reads the key
    /// and adopts its revision if it holds exactly these.
    uncertain: Option<Vec<u8>>,
}

/// What every run of a session shares: the store, the way to the session's writer, the key
/// layout, the clock and the node's metrics.
#[derive(Clone)]
pub(crate) struct CommitShared {
    pub(crate) store: Arc<dyn MetaStore>,
    pub(crate) tx: mpsc::UnboundedSender<CommitRequest>,
    pub(crate) keys: chanwatch_core::Keys,
    pub(crate) node: chanwatch_core::NodeId,
    pub(crate) clock: Clock,
    pub(crate) metrics: Arc<crate::metrics::NodeMetrics>,
    /// A planted `UnguardedCommit` (feature `planted-bugs`) drops guard (i).
    pub(crate) planted: crate::config::Planted,
}

/// A run's way to read its resume point and commit; lives in its
/// [`ChannelContext`](crate::ChannelContext). Costs nothing until a handler uses it.
#[derive(Clone)]
pub(crate) struct Committer {
    shared: Arc<CommitShared>,
    channel: ChannelName,
    epoch: Epoch,
    assignment_create_revision: i64,
    seen: Arc<Mutex<Seen>>,
    /// This run's checkpoint time in the oldest-age gauge; leaves it with the last clone.
    age: Arc<crate::metrics::CheckpointAge>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer")
            .field("channel", &self.channel)
            .field("epoch", &self.epoch)
            .field(
                "assignment_create_revision",
                &self.assignment_create_revision,
            )
            .finish_non_exhaustive()
    }
}

/// Reads the checkpoint at the start of a run: `Ok(None)` when there is none yet.
pub(crate) async fn read(
    store: &dyn MetaStore,
    key: &str,
) -> Result<Option<(Checkpoint, i64)>, String> {
    match store.get(key).await {
        Ok(None) => Ok(None),
        Ok(Some(kv)) => match Checkpoint::decode(&kv.value) {
            Ok(cp) => Ok(Some((cp, kv.mod_revision))),
            // A value nobody can resume from: say so, and refuse to start from scratch.
            Err(e) => Err(format!("{key} does not decode ({e}); fix or delete it")),
        },
        Err(e) => Err(e.to_string()),
    }
}

impl Committer {
    pub(crate) fn new(
        shared: Arc<CommitShared>,
        channel: ChannelName,
        epoch: Epoch,
        assignment_create_revision: i64,
    ) -> Self {
        let age = Arc::new(shared.metrics.checkpoint_ages.track(shared.clock));
        Committer {
            shared,
            channel,
            epoch,
            assignment_create_revision,
            seen: Arc::default(),
            age,
        }
    }

    fn key(&self) -> String {
        self.shared.keys.checkpoint(&self.channel)
    }

    /// The checkpoint this run resumes from: read from the store on first use (trying again,
    /// every 200 ms up to 2 s apart, until the store answers), then remembered; its revision
    /// guards the run's first commit.
    ///
    /// # Errors
    /// The checkpoint's value does not decode (fix or delete the key).
    pub(crate) async fn resume(&self) -> Result<Option<Checkpoint>, String> {
        if let Some(read) = &self.seen.lock().unwrap_or_else(|e| e.into_inner()).read {
            return Ok(read.clone());
        }
        let key = self.key();
        let mut wait = Duration::from_millis(200);
        loop {
            match read(&*self.shared.store, &key).await {
                Ok(found) => {
                    let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(read) = &seen.read {
                        return Ok(read.clone()); // a concurrent first use read it first
                    }
                    seen.mod_revision = found.as_ref().map(|(_, rev)| *rev);
                    let cp = found.map(|(cp, _)| cp);
                    if let Some(cp) = &cp {
                        self.age.set(cp.updated_at_ms);
                    }
                    seen.read = Some(cp.clone());
                    return Ok(cp);
                }
                Err(e) if e.contains("does not decode") => return Err(e),
                Err(e) => {
                    tracing::debug!(%key, error = %e, "node: cannot read the checkpoint yet; retrying");
                    self.shared.clock.sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Commits `(position, state)` by fenced txn; see [`ChannelContext::commit`](crate::ChannelContext::commit).
    /// Counted by result in `chanwatch_node_checkpoint_commits_total`.
    pub(crate) async fn commit(
        &self,
        position: String,
        state: Option<Value>,
    ) -> Result<(), CommitError> {
        let result = self.commit_uncounted(position, state).await;
        self.shared.metrics.commits(match &result {
            Ok(()) => "ok",
            Err(CommitError::Fenced(_)) => "fenced",
            Err(CommitError::Unavailable(_)) => "unavailable",
            Err(CommitError::TooLarge(_)) => "too_large",
        });
        result
    }

    async fn commit_uncounted(
        &self,
        position: String,
        state: Option<Value>,
    ) -> Result<(), CommitError> {
        let cp = Checkpoint {
            epoch: self.epoch,
            position,
            state,
            updated_at_ms: self.shared.clock.unix_ms(),
            extra: Default::default(),
        };
        if let Some(state) = &cp.state {
            let len = serde_json::to_vec(state).map_or(0, |v| v.len());
            if len > Checkpoint::MAX_STATE_BYTES {
                return Err(CommitError::TooLarge(len));
            }
        }
        // The first commit of a run without a resume read: read now, for the guard.
        if let Err(e) = self.resume().await {
            return Err(CommitError::Unavailable(e));
        }
        if let Err(e) = self.reconcile().await {
            return Err(CommitError::Unavailable(format!(
                "the outcome of this run's previous commit is unknown and the checkpoint \
                 cannot be read to learn it: {e}"
            )));
        }
        let bytes = cp.encode();
        let key = self.key();
        let assignment_key = self.shared.keys.channel(
            chanwatch_core::ChannelOwner::Node(self.shared.node),
            &self.channel,
        );
        let last = self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .mod_revision;
        let mut compares = vec![
            Compare::create_revision(&assignment_key, self.assignment_create_revision),
            match last {
                Some(rev) => Compare::mod_revision(&key, rev),
                None => Compare::absent(&key),
            },
        ];
        if planted!(self.shared.planted, UnguardedCommit) {
            compares.remove(0);
        }
        let (reply, answer) = oneshot::channel();
        let request = CommitRequest {
            channel: self.channel.clone(),
            compares,
            put: TxnOp::put(&key, bytes.clone()),
            reply,
        };
        if self.shared.tx.send(request).is_err() {
            return Err(CommitError::Fenced("the session ended".into()));
        }
        // Uncertain until answered (marked before the first await), so that the commit is
        // cancel-safe: a caller that drops this future now (an agent worker that hangs up)
        // leaves the write to the next commit's reconcile, which adopts its revision if it
        // landed. Were it booked only on the answer, the run's next commit would be refused
        // as fenced by its own write.
        self.seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .uncertain = Some(bytes.clone());
        let mut outcome = answer
            .await
            .unwrap_or_else(|_| Err(CommitError::Fenced("the session ended".into())));
        if let Err(CommitError::Fenced(why)) = &outcome {
            // The group commit retries a batch that failed with an unknown outcome write by
            // write; if the batch landed, this write's guard saw our own write. A key holding
            // exactly what we wrote is that write; a key we cannot read leaves the outcome
            // unknown, for the next commit to reconcile (found by the chaos run: consumers
            // told "fenced" stopped for good while their node still ran the channels).
            match self.shared.store.get(&key).await {
                Ok(Some(kv)) if kv.value == bytes => outcome = Ok(kv.mod_revision),
                Ok(_) => {}
                Err(e) => {
                    outcome = Err(CommitError::Unavailable(format!(
                        "refused ({why}), and the checkpoint cannot be read to tell whether \
                         the refused write was our own: {e}"
                    )))
                }
            }
        }
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(rev) => {
                seen.mod_revision = Some(rev);
                seen.uncertain = None;
                self.age.set(cp.updated_at_ms);
                Ok(())
            }
            // Still uncertain: the next commit reconciles.
            Err(e @ CommitError::Unavailable(_)) => Err(e),
            Err(e) => {
                // Refused, and the key does not hold what this commit wrote: it did not land.
                seen.uncertain = None;
                Err(e)
            }
        }
    }

    /// Whether the session's writer takes no more commits (the session fenced itself): every
    /// commit of this run is refused from now on.
    pub(crate) fn session_closed(&self) -> bool {
        self.shared.tx.is_closed()
    }

    /// Returns once the session's writer takes no more commits.
    pub(crate) async fn until_session_closed(&self) {
        self.shared.tx.closed().await;
    }

    /// Counts one commit's latency.
    pub(crate) fn observe(&self, took: Duration) {
        self.shared
            .metrics
            .commit_latency
            .observe(took.as_secs_f64());
    }

    /// The node's metrics (the consumer counts what it reads there).
    pub(crate) fn metrics(&self) -> &crate::metrics::NodeMetrics {
        &self.shared.metrics
    }

    /// After a commit whose outcome is unknown: if the key holds exactly what it wrote, that
    /// commit landed — adopt its revision, or the next guard would refuse our own write.
    ///
    /// # Errors
    /// The key cannot be read: the earlier commit's outcome stays unknown.
    async fn reconcile(&self) -> Result<(), String> {
        let uncertain = self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .uncertain
            .clone();
        let Some(bytes) = uncertain else {
            return Ok(());
        };
        let found = self
            .shared
            .store
            .get(&self.key())
            .await
            .map_err(|e| e.to_string())?;
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(kv) = found.filter(|kv| kv.value == bytes) {
            seen.mod_revision = Some(kv.mod_revision);
        }
        seen.uncertain = None;
        Ok(())
    }
}
