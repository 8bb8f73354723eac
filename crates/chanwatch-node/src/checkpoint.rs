//! Fenced checkpoints (DESIGN §2, §4): where a run resumes, and how a handler commits its
//! position and state so that only the current owner's commit can land.
//!
//! Owns: reading `{root}/checkpoint/{channel}` when a run starts (retried until it answers: a
//! run must not start from the beginning because the store was slow), the per-run
//! [`Committer`] that builds each commit's guard — (i) the assignment key's create revision
//! the run started under, (ii) the session (added by the ack writer), (iii) the checkpoint's
//! mod revision this run last saw, or its absence — and reconciling after a commit whose
//! outcome is unknown. The writes themselves are group-committed with the acks (`acks.rs`).
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
    /// Its mod revision as last read or written by this run (`None`: absent).
    mod_revision: Option<i64>,
    /// The bytes of a commit whose outcome is unknown: the next commit first reads the key
    /// and adopts its revision if it holds exactly these.
    uncertain: Option<Vec<u8>>,
}

/// A run's way to commit; lives in its [`ChannelContext`](crate::ChannelContext).
#[derive(Clone)]
pub(crate) struct Committer {
    store: Arc<dyn MetaStore>,
    tx: mpsc::UnboundedSender<CommitRequest>,
    channel: ChannelName,
    epoch: Epoch,
    key: String,
    assignment_key: String,
    assignment_create_revision: i64,
    clock: Clock,
    seen: Arc<Mutex<Seen>>,
    latency: prometheus::Histogram,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer")
            .field("key", &self.key)
            .field("assignment_key", &self.assignment_key)
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
    #[allow(clippy::too_many_arguments)] // each is one part of the guard or the plumbing
    pub(crate) fn new(
        store: Arc<dyn MetaStore>,
        tx: mpsc::UnboundedSender<CommitRequest>,
        channel: ChannelName,
        epoch: Epoch,
        key: String,
        assignment_key: String,
        assignment_create_revision: i64,
        clock: Clock,
        latency: prometheus::Histogram,
    ) -> Self {
        Committer {
            latency,
            store,
            tx,
            channel,
            epoch,
            key,
            assignment_key,
            assignment_create_revision,
            clock,
            seen: Arc::default(),
        }
    }

    /// Reads the checkpoint the run resumes from, trying again (every 200 ms, up to 2 s apart)
    /// until the store answers; remembers its revision for the first commit's guard.
    pub(crate) async fn resume_point(&self) -> Result<Option<Checkpoint>, String> {
        let mut wait = Duration::from_millis(200);
        loop {
            match read(&*self.store, &self.key).await {
                Ok(found) => {
                    let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
                    seen.mod_revision = found.as_ref().map(|(_, rev)| *rev);
                    return Ok(found.map(|(cp, _)| cp));
                }
                Err(e) if e.contains("does not decode") => return Err(e),
                Err(e) => {
                    tracing::debug!(key = %self.key, error = %e, "node: cannot read the checkpoint yet; retrying");
                    self.clock.sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    /// Commits `(position, state)` by fenced txn; see [`ChannelContext::commit`](crate::ChannelContext::commit).
    pub(crate) async fn commit(
        &self,
        position: String,
        state: Option<Value>,
    ) -> Result<(), CommitError> {
        let cp = Checkpoint {
            epoch: self.epoch,
            position,
            state,
            updated_at_ms: self.clock.unix_ms(),
            extra: Default::default(),
        };
        if let Some(state) = &cp.state {
            let len = serde_json::to_vec(state).map_or(0, |v| v.len());
            if len > Checkpoint::MAX_STATE_BYTES {
                return Err(CommitError::TooLarge(len));
            }
        }
        self.reconcile().await;
        let bytes = cp.encode();
        let last = self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .mod_revision;
        let compares = vec![
            Compare::create_revision(&self.assignment_key, self.assignment_create_revision),
            match last {
                Some(rev) => Compare::mod_revision(&self.key, rev),
                None => Compare::absent(&self.key),
            },
        ];
        let (reply, answer) = oneshot::channel();
        let request = CommitRequest {
            channel: self.channel.clone(),
            compares,
            put: TxnOp::put(&self.key, bytes.clone()),
            reply,
        };
        if self.tx.send(request).is_err() {
            return Err(CommitError::Fenced("the session ended".into()));
        }
        let outcome = answer
            .await
            .unwrap_or_else(|_| Err(CommitError::Fenced("the session ended".into())));
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        match outcome {
            Ok(rev) => {
                seen.mod_revision = Some(rev);
                seen.uncertain = None;
                Ok(())
            }
            Err(CommitError::Unavailable(e)) => {
                seen.uncertain = Some(bytes);
                Err(CommitError::Unavailable(e))
            }
            Err(e) => Err(e),
        }
    }

    /// Counts one commit's latency.
    pub(crate) fn observe(&self, took: Duration) {
        self.latency.observe(took.as_secs_f64());
    }

    /// After a commit whose outcome is unknown: if the key holds exactly what it wrote, that
    /// commit landed — adopt its revision, or the next guard would refuse our own write.
    async fn reconcile(&self) {
        let uncertain = self
            .seen
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .uncertain
            .clone();
        let Some(bytes) = uncertain else { return };
        if let Ok(found) = self.store.get(&self.key).await {
            let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(kv) = found.filter(|kv| kv.value == bytes) {
                seen.mod_revision = Some(kv.mod_revision);
            }
            seen.uncertain = None;
        }
    }
}
