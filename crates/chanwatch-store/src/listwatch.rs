//! List-then-watch of one prefix or key range, as an explicit state machine (STYLE.md §4).
//!
//! Owns: keeping a consumer's view of a prefix complete. It lists the prefix at a revision,
//! hands over the whole list as one [`Update::Reset`], then watches from the next revision
//! and hands over each batch (a list is handed over even when the watch after it cannot be
//! created: it is a consistent view, and the loop lists again after the back-off). On `Compacted`, a broken stream or any store error it backs off
//! (jittered, capped), lists again and sends a new `Reset`: a consumer replaces its view at
//! once and never patches it across a gap. It never gives up and never panics.
//!
//! Must not: interpret keys or values. It runs in its own task so the consumer can `select!`
//! on the receiver without losing state; the task stops when the [`ListWatch`] is dropped.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{mpsc, Notify};
use tracing::warn;

use crate::backoff::Backoff;
use crate::error::StoreError;
use crate::types::{KeyRange, KeyValue, Revision, WatchEvent};
use crate::{MetaStore, WatchStream};

/// The wait before listing again: 100 ms after a failure, doubling up to 5 s.
const BACKOFF: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

/// What the consumer receives.
#[derive(Debug)]
pub enum Update {
    /// The whole prefix as of `revision`: replace the view.
    Reset {
        /// Every key under the prefix.
        kvs: Vec<KeyValue>,
        /// The revision the list was read at.
        revision: Revision,
    },
    /// Changes after the last update, in revision order.
    Events(Vec<WatchEvent>),
}

/// The phases of the loop.
enum Phase {
    /// List the prefix (first time, or after a failure or a relist request); `attempt`
    /// counts consecutive failures for the back-off.
    List { attempt: u32 },
    /// Stream events from `next_revision` on.
    Watch {
        stream: WatchStream,
        /// The revision after the last one delivered.
        next_revision: Revision,
    },
    /// Wait before listing again.
    Backoff { attempt: u32 },
}

/// Handle of a running list-watch. Drop it to stop the task.
#[derive(Debug)]
pub struct ListWatch {
    rx: mpsc::Receiver<Update>,
    relist: Arc<Notify>,
    task: tokio::task::JoinHandle<()>,
    restarts: Arc<std::sync::atomic::AtomicU64>,
    blind: Blind,
    reached: Reached,
}

/// The revision up to which the consumer has been handed every change (lists, events and the
/// watch's progress notifications), never going back.
type Reached = Arc<tokio::sync::watch::Sender<Revision>>;

/// Since when the consumer's view may be stale (`None`: watching, up to date).
type Blind = Arc<tokio::sync::watch::Sender<Option<tokio::time::Instant>>>;

impl Drop for ListWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl ListWatch {
    /// Starts listing and watching `keys`: a prefix (`String`, `&str`) or a [`KeyRange`].
    pub fn spawn(store: Arc<dyn MetaStore>, keys: impl Into<KeyRange>) -> Self {
        let keys = keys.into();
        let (tx, rx) = mpsc::channel(64);
        let relist = Arc::new(Notify::new());
        let restarts = Arc::new(std::sync::atomic::AtomicU64::new(0));
        // Blind until the first list has arrived.
        let blind: Blind =
            Arc::new(tokio::sync::watch::channel(Some(tokio::time::Instant::now())).0);
        let reached: Reached = Arc::new(tokio::sync::watch::channel(0).0);
        let task = tokio::spawn(run(
            store,
            keys,
            tx,
            relist.clone(),
            restarts.clone(),
            Marks {
                blind: blind.clone(),
                reached: reached.clone(),
            },
        ));
        ListWatch {
            rx,
            relist,
            task,
            restarts,
            blind,
            reached,
        }
    }

    /// The next update. Cancel-safe. `None` only if the task is gone.
    pub async fn next(&mut self) -> Option<Update> {
        self.rx.recv().await
    }

    /// The next update if one is already waiting.
    pub fn try_next(&mut self) -> Option<Update> {
        self.rx.try_recv().ok()
    }

    /// Asks for a fresh list (periodic reconcile). The next `Reset` reflects it.
    pub fn relist(&self) {
        self.relist.notify_one();
    }

    /// Since when the view may be stale: set when a list or watch fails, cleared when a
    /// fresh list has been handed over and the watch runs. A node fences itself when it has
    /// been blind too long, as when its keepalives fail: a coordinator that cannot reach it
    /// will eventually move its channels without its answer.
    pub fn blind_since(&self) -> tokio::sync::watch::Receiver<Option<tokio::time::Instant>> {
        self.blind.subscribe()
    }

    /// The revision up to which every change under the prefix has been handed over (or is
    /// queued for the consumer): the list's revision, then each batch's and each progress
    /// notification's. A watch that stalls silently stops it; a node compares it with the
    /// revision its keepalives are answered at.
    pub fn reached(&self) -> tokio::sync::watch::Receiver<Revision> {
        self.reached.subscribe()
    }

    /// How many times the loop had to relist after an error (for metrics).
    pub fn restarts(&self) -> u64 {
        self.restarts.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// The wait after `attempt` consecutive failures (from 0). The jitter's seed names the
/// watcher and how often it failed: it spreads the relists of many watchers after an etcd
/// restart.
fn backoff(prefix: &str, attempt: u32, restarts: u64) -> Duration {
    BACKOFF.wait(attempt.saturating_add(1), (prefix, attempt, restarts))
}

async fn run(
    store: Arc<dyn MetaStore>,
    keys: KeyRange,
    tx: mpsc::Sender<Update>,
    relist: Arc<Notify>,
    restarts: Arc<std::sync::atomic::AtomicU64>,
    marks: Marks,
) {
    let Marks { blind, reached } = marks;
    let reach = |revision: Revision| {
        reached.send_if_modified(|r| {
            let ahead = revision > *r;
            if ahead {
                *r = revision;
            }
            ahead
        });
    };
    let mut phase = Phase::List { attempt: 0 };
    let failed =
        |prefix: &str, e: &StoreError, attempt: u32, restarts: &std::sync::atomic::AtomicU64| {
            blind.send_if_modified(|b| {
                let was = b.is_none();
                b.get_or_insert_with(tokio::time::Instant::now);
                was
            });
            failed(prefix, e, attempt, restarts)
        };
    loop {
        phase = match phase {
            Phase::List { attempt } => match store.range_keys(&keys).await {
                Ok(list) => {
                    let revision = list.revision;
                    // The list is a consistent view whatever becomes of the watch: hand it
                    // over first. A node whose watches cannot be created (a stuck proxy,
                    // an isolated member) still sees a release request at each relist.
                    if tx
                        .send(Update::Reset {
                            kvs: list.kvs,
                            revision,
                        })
                        .await
                        .is_err()
                    {
                        return;
                    }
                    reach(revision);
                    match store.watch_keys(&keys, revision + 1).await {
                        Ok(stream) => {
                            blind.send_if_modified(|b| b.take().is_some());
                            Phase::Watch {
                                stream,
                                next_revision: revision + 1,
                            }
                        }
                        Err(e) => failed(keys.start(), &e, attempt, &restarts),
                    }
                }
                Err(e) => failed(keys.start(), &e, attempt, &restarts),
            },
            Phase::Backoff { attempt } => {
                tokio::select! {
                    biased;
                    () = tokio::time::sleep(backoff(keys.start(), attempt, restarts.load(std::sync::atomic::Ordering::Relaxed))) => {}
                    () = relist.notified() => {}
                }
                Phase::List {
                    attempt: attempt + 1,
                }
            }
            Phase::Watch {
                mut stream,
                next_revision,
            } => {
                tokio::select! {
                    biased;
                    () = relist.notified() => Phase::List { attempt: 0 },
                    item = stream.next() => match item {
                        Some(Ok(batch)) if batch.is_progress() => {
                            reach(batch.revision);
                            Phase::Watch { stream, next_revision }
                        }
                        Some(Ok(batch)) => {
                            let next = batch
                                .events
                                .last()
                                .map_or(next_revision, |e| e.kv.mod_revision + 1);
                            let revision = batch.revision;
                            if tx.send(Update::Events(batch.events)).await.is_err() {
                                return;
                            }
                            reach(revision);
                            Phase::Watch { stream, next_revision: next }
                        }
                        Some(Err(e)) => failed(keys.start(), &e, 0, &restarts),
                        None => failed(keys.start(), &StoreError::WatchClosed("stream ended".into()), 0, &restarts),
                    },
                }
            }
        };
    }
}

/// What the loop reports besides updates.
struct Marks {
    blind: Blind,
    reached: Reached,
}

fn failed(
    prefix: &str,
    e: &StoreError,
    attempt: u32,
    restarts: &std::sync::atomic::AtomicU64,
) -> Phase {
    restarts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    match e {
        StoreError::Compacted { compact_revision } => {
            warn!(
                prefix,
                compact_revision, "watch fell behind compaction; relisting"
            );
        }
        other => warn!(prefix, error = %other, "watch broke; backing off, then relisting"),
    }
    Phase::Backoff { attempt }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{EmbeddedStore, Txn, TxnOp};

    async fn put(store: &EmbeddedStore, k: &str) -> Revision {
        store
            .txn(Txn::new().and_then([TxnOp::put(k, "v")]))
            .await
            .map(|r| r.revision)
            .unwrap_or_default()
    }

    #[tokio::test(start_paused = true)]
    async fn lists_then_streams_then_relists_after_compaction() {
        let store = EmbeddedStore::new();
        put(&store, "p/a").await;
        let mut lw = ListWatch::spawn(Arc::new(store.clone()), "p/");
        match lw.next().await {
            Some(Update::Reset { kvs, .. }) => assert_eq!(kvs.len(), 1),
            other => panic!("expected reset, got {other:?}"),
        }
        put(&store, "p/b").await;
        match lw.next().await {
            Some(Update::Events(ev)) => assert_eq!(ev[0].kv.key, "p/b"),
            other => panic!("expected events, got {other:?}"),
        }
        // A relist request replaces the view with a fresh Reset.
        lw.relist();
        match lw.next().await {
            Some(Update::Reset { kvs, .. }) => assert_eq!(kvs.len(), 2),
            other => panic!("expected reset, got {other:?}"),
        }
        assert_eq!(lw.restarts(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn reached_follows_progress_and_stands_still_while_the_watch_stalls() {
        let store = EmbeddedStore::new();
        let (faulty, faults) = crate::FaultyStore::new(store.clone());
        let lw = ListWatch::spawn(Arc::new(faulty), "p/");
        let mut reached = lw.reached();
        let lease = store
            .grant(Duration::from_secs(30))
            .await
            .map(|l| l.id)
            .unwrap_or_default();
        let quiet_for_the_watch = put(&store, "q/elsewhere").await;
        let answered = store.keepalive(lease).await.unwrap_or_default();
        assert_eq!(answered, quiet_for_the_watch);
        let ok = tokio::time::timeout(Duration::from_secs(1), async {
            reached.wait_for(|r| *r >= answered).await.is_ok()
        })
        .await;
        assert_eq!(ok, Ok(true), "progress reaches the keepalive's revision");

        faults.stall_watches(true);
        put(&store, "q/more").await;
        let answered = store.keepalive(lease).await.unwrap_or_default();
        tokio::time::sleep(Duration::from_secs(5)).await;
        assert!(
            *reached.borrow_and_update() < answered,
            "a stalled watch does not reach the keepalive's revision"
        );
        faults.stall_watches(false);
        let ok = tokio::time::timeout(Duration::from_secs(1), async {
            reached.wait_for(|r| *r >= answered).await.is_ok()
        })
        .await;
        assert_eq!(ok, Ok(true), "held progress arrives after the stall");
    }
}
