//! The handle users hold: [`CoordHandle`], what it asks the coordinator ([`Request`]), what
//! it answers ([`CoordStatus`], [`ApiError`]).
//!
//! Owns: the request channel into the coordinator loop, the status it publishes, its
//! metrics registry, and stopping it (on [`CoordHandle::stop`], or when the last clone of the
//! handle is dropped).
//! Must not: decide or write anything — every request is served by the leader's term
//! (`term.rs`); a standby refuses them with [`ApiError::NotLeader`].

use std::sync::{Arc, Mutex, PoisonError};

use chanwatch_core::planner::{
    AdminError, ChannelRow, NodeRow, Placement, PlannedMove, Transition,
};
use chanwatch_core::{ChannelName, NodeId, VChannelInfo};
use serde::Serialize;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::{CoordError, CoordMetrics};

/// What the coordinator shows to the outside.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CoordStatus {
    /// This process holds the leader key.
    pub leader: bool,
    /// Leader and its startup recovery is done.
    pub ready: bool,
    /// The current leader's admin address, if known.
    pub leader_addr: Option<String>,
    /// Times this process became leader.
    pub terms: u64,
}

/// Why an admin request was refused. The HTTP API maps each to a status code.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// Bad request content (4xx): what is wrong.
    #[error(transparent)]
    Admin(#[from] AdminError),
    /// This process is not the leader (503): where the leader is.
    #[error("this coordinator is not the leader{}", .leader_addr.as_ref().map(|a| format!("; the leader's admin API is at {a}")).unwrap_or_else(|| "; no leader is known yet, retry shortly".into()))]
    NotLeader {
        /// The leader's admin address, if known.
        leader_addr: Option<String>,
    },
    /// The change could not be written (503, retry). (`ctl` tells it from a standby's 503 by
    /// the start of this message: keep it.)
    #[error("the store refused or failed the change: {0}; retry")]
    Store(String),
}

/// Requests from a [`CoordHandle`] to the coordinator loop.
// One request at a time crosses a bounded channel; boxing the vchannel would buy nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub(crate) enum Request {
    /// List channels.
    Channels(oneshot::Sender<Result<Vec<ChannelRow>, ApiError>>),
    /// List nodes.
    Nodes(oneshot::Sender<Result<Vec<NodeRow>, ApiError>>),
    /// Register a channel.
    Add {
        /// Its name.
        name: ChannelName,
        /// Its vchannel info.
        vchannel: VChannelInfo,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Remove a channel.
    Remove {
        /// Its name.
        name: ChannelName,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Move a channel to a node.
    Move {
        /// The channel.
        name: ChannelName,
        /// The target.
        to: NodeId,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Drain a node.
    Drain {
        /// The node.
        node: NodeId,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<(), ApiError>>,
    },
    /// Show (dry run) or start a balance.
    Balance {
        /// Only show the plan.
        dry_run: bool,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<PlannedMove>, ApiError>>,
    },
    /// Read the leader's view (`detail.rs`: one channel, one node).
    View(crate::detail::ViewFn),
    /// Take a node's drain mark away.
    Undrain {
        /// The node.
        node: NodeId,
        /// Where the answer goes: whether it was draining.
        reply: oneshot::Sender<Result<bool, ApiError>>,
    },
    /// Register a channel with a weight and group.
    AddPlaced {
        /// Its name.
        name: ChannelName,
        /// Its vchannel info.
        vchannel: VChannelInfo,
        /// Its weight and group.
        placement: Placement,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Pin or unpin a channel.
    Pin {
        /// The channel.
        name: ChannelName,
        /// Pinned (`true`) or not.
        pinned: bool,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, ApiError>>,
    },
    /// Register a checked list of channels, packed.
    AddMany {
        /// The new channels' values (state, epoch and start time are set by the planner).
        infos: Vec<chanwatch_core::ChannelInfo>,
        /// Where the answer goes.
        reply: oneshot::Sender<Result<Vec<Transition>, crate::BulkError>>,
    },
}

/// Talks to a running coordinator: its status, the admin requests (what the HTTP API
/// serves), its metrics, and stopping it. Cheap to clone; when the last clone is dropped the
/// coordinator stops as [`CoordHandle::stop`] stops it (without waiting).
///
/// Made by [`crate::Coordinator::builder`]; every request is answered by the leader only
/// (a standby answers [`ApiError::NotLeader`] with the leader's address).
#[derive(Debug, Clone)]
pub struct CoordHandle {
    tx: mpsc::Sender<Request>,
    status: watch::Receiver<CoordStatus>,
    shared: Arc<Shared>,
}

/// What every clone of a handle shares; dropping the last clone stops the coordinator.
#[derive(Debug)]
struct Shared {
    stop: CancellationToken,
    /// Closed (its sender dropped) when the coordinator has ended.
    ended: watch::Receiver<()>,
    /// How a coordinator started by `spawn` ended, until someone asks.
    outcome: Arc<Mutex<Option<CoordError>>>,
    metrics: Arc<CoordMetrics>,
    registry: prometheus::Registry,
    /// What [`CoordHandle::checkpoints`] reads through: the coordinator's store, key layout
    /// and clock.
    reads: Reads,
    /// The leader's event history (`events.rs`).
    events: Arc<crate::events::EventLog>,
    /// What the nodes last said about pausing (`probe.rs`), for summaries.
    probe: Arc<crate::probe::NodeProbe>,
}

/// The store, keys and clock a handle reads checkpoints with.
pub(crate) struct Reads {
    pub(crate) store: Arc<dyn chanwatch_store::MetaStore>,
    pub(crate) keys: chanwatch_core::Keys,
    pub(crate) clock: chanwatch_store::Clock,
}

impl std::fmt::Debug for Reads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reads")
            .field("keys", &self.keys)
            .finish_non_exhaustive()
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// The coordinator's side of a handle: what the election loop and the term need.
#[derive(Debug)]
pub(crate) struct HandleEnds {
    pub(crate) requests: mpsc::Receiver<Request>,
    pub(crate) status: watch::Sender<CoordStatus>,
    /// Cancelled by [`CoordHandle::stop`] or by dropping the last handle.
    pub(crate) stop: CancellationToken,
    /// Dropped when the coordinator has ended (after `outcome` is set).
    pub(crate) ended: watch::Sender<()>,
    pub(crate) outcome: Arc<Mutex<Option<CoordError>>>,
    /// The event history the term records into.
    pub(crate) events: Arc<crate::events::EventLog>,
}

impl CoordHandle {
    /// A handle and the coordinator's ends of it.
    pub(crate) fn pair(
        metrics: Arc<CoordMetrics>,
        registry: prometheus::Registry,
        reads: Reads,
    ) -> (Self, HandleEnds) {
        let (tx, requests) = mpsc::channel(256);
        let (status_tx, status) = watch::channel(CoordStatus::default());
        let (ended_tx, ended) = watch::channel(());
        let stop = CancellationToken::new();
        let outcome = Arc::new(Mutex::new(None));
        let events = Arc::new(crate::events::EventLog::new(reads.clock));
        let handle = CoordHandle {
            tx,
            status,
            shared: Arc::new(Shared {
                stop: stop.clone(),
                ended,
                outcome: outcome.clone(),
                metrics,
                registry,
                reads,
                events: events.clone(),
                probe: Arc::default(),
            }),
        };
        let ends = HandleEnds {
            requests,
            status: status_tx,
            stop,
            ended: ended_tx,
            outcome,
            events,
        };
        (handle, ends)
    }

    /// The leader's event history (empty on a standby until it leads).
    pub fn events(&self) -> &Arc<crate::events::EventLog> {
        &self.shared.events
    }

    /// The nodes' pause probe (`probe.rs`).
    pub(crate) fn probe(&self) -> &Arc<crate::probe::NodeProbe> {
        &self.shared.probe
    }

    /// What reads go through: store, keys, clock.
    pub(crate) fn reads(&self) -> &Reads {
        &self.shared.reads
    }

    /// Sends `req` and waits for its answer on `rx` (for requests defined elsewhere).
    pub(crate) async fn ask_with<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Request,
    ) -> Result<T, ApiError> {
        self.ask(make).await
    }

    /// The latest status.
    pub fn status(&self) -> CoordStatus {
        self.status.borrow().clone()
    }

    /// A receiver that sees every status change (e.g. `wait_for(|s| s.ready)`).
    pub fn watch_status(&self) -> watch::Receiver<CoordStatus> {
        self.status.clone()
    }

    /// The coordinator's metrics.
    pub fn metrics(&self) -> &Arc<CoordMetrics> {
        &self.shared.metrics
    }

    /// The registry the coordinator's metrics are registered in (the one given to
    /// [`crate::CoordinatorBuilder::registry`], or its own); serve it with
    /// [`crate::metrics::render`], or register more metrics in it.
    pub fn registry(&self) -> &prometheus::Registry {
        &self.shared.registry
    }

    /// Stops the coordinator and waits until it has: a leader resigns (revokes its lease,
    /// so a standby takes over at once). Requests sent meanwhile are refused.
    ///
    /// # Errors
    /// See [`CoordHandle::stopped`].
    pub async fn stop(&self) -> Result<(), CoordError> {
        self.shared.stop.cancel();
        self.stopped().await
    }

    /// Waits until the coordinator has ended — after [`CoordHandle::stop`], or by itself on a
    /// configuration error at start-up (no other error stops it).
    ///
    /// # Errors
    /// The [`CoordError`] a coordinator started by [`crate::CoordinatorBuilder::spawn`] ended
    /// with, returned to the first caller only. One you run yourself
    /// ([`crate::Coordinator::run`]) returns its error from `run`.
    pub async fn stopped(&self) -> Result<(), CoordError> {
        let mut ended = self.shared.ended.clone();
        // Nothing is ever sent: this returns when the coordinator's end is dropped.
        while ended.changed().await.is_ok() {}
        let outcome = self
            .shared
            .outcome
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        outcome.map_or(Ok(()), Err)
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, ApiError>>) -> Request,
    ) -> Result<T, ApiError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(make(reply))
            .await
            .map_err(|_| ApiError::Store("the coordinator is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Store("the coordinator dropped the request".into()))?
    }

    /// Every channel with its owner and state.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn channels(&self) -> Result<Vec<ChannelRow>, ApiError> {
        self.ask(Request::Channels).await
    }

    /// Every channel's checkpoint, read from the store with one range of
    /// `{root}/worker/checkpoint/` (not from the coordinator's view, which leaves them out). Any
    /// coordinator answers, a standby too.
    ///
    /// # Errors
    /// [`ApiError::Store`] when the store does not answer.
    pub async fn checkpoints(&self) -> Result<crate::checkpoints::Checkpoints, ApiError> {
        let r = &self.shared.reads;
        crate::checkpoints::read(&*r.store, &r.keys, r.clock)
            .await
            .map_err(ApiError::Store)
    }

    /// Every live node.
    ///
    /// # Errors
    /// [`ApiError::NotLeader`] on a standby.
    pub async fn nodes(&self) -> Result<Vec<NodeRow>, ApiError> {
        self.ask(Request::Nodes).await
    }

    /// Registers a channel.
    ///
    /// # Errors
    /// Already exists, not leader, or the store failed.
    pub async fn add_channel(
        &self,
        name: ChannelName,
        vchannel: VChannelInfo,
    ) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Add {
            name,
            vchannel,
            reply,
        })
        .await
    }

    /// Removes a channel.
    ///
    /// # Errors
    /// Unknown channel, not leader, or the store failed.
    pub async fn remove_channel(&self, name: ChannelName) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Remove { name, reply }).await
    }

    /// Moves a channel to a node, break-before-make.
    ///
    /// # Errors
    /// Unknown channel or node, draining target, busy, not leader, or the store failed.
    pub async fn move_channel(
        &self,
        name: ChannelName,
        to: NodeId,
    ) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Move { name, to, reply }).await
    }

    /// Drains a node.
    ///
    /// # Errors
    /// Unknown node or not leader.
    pub async fn drain(&self, node: NodeId) -> Result<(), ApiError> {
        self.ask(|reply| Request::Drain { node, reply }).await
    }

    /// Registers a channel with a weight and group (DESIGN §5): on the least-loaded node
    /// with room, or under `remaining` with the reason.
    ///
    /// # Errors
    /// Already exists, a bad weight or group, not leader, or the store failed.
    pub async fn add_channel_with(
        &self,
        name: ChannelName,
        vchannel: VChannelInfo,
        placement: Placement,
    ) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::AddPlaced {
            name,
            vchannel,
            placement,
            reply,
        })
        .await
    }

    /// Pins (`true`) or unpins a channel: balance never moves a pinned channel. Moves
    /// nothing; the answer is the rewrite (empty when it already was so).
    ///
    /// # Errors
    /// Unknown channel, not leader, or the store failed.
    pub async fn pin(&self, name: ChannelName, pinned: bool) -> Result<Vec<Transition>, ApiError> {
        self.ask(|reply| Request::Pin {
            name,
            pinned,
            reply,
        })
        .await
    }

    /// The balance plan; unless `dry_run`, balance runs (it also runs on its own, unless
    /// `--auto-balance=false`: then this asks for one).
    ///
    /// # Errors
    /// Not leader.
    pub async fn balance(&self, dry_run: bool) -> Result<Vec<PlannedMove>, ApiError> {
        self.ask(|reply| Request::Balance { dry_run, reply }).await
    }

    /// Registers a list of channels (at most [`crate::MAX_BULK_CHANNELS`]) in packed txns:
    /// all of them, or none when any is already registered. Names, sizes and duplicates
    /// within the list are the caller's to check first.
    ///
    /// # Errors
    /// [`crate::BulkError`]: entries refused, not leader, or a store failure (possibly
    /// after part of the list was written: it says which).
    pub async fn add_channels(
        &self,
        infos: Vec<chanwatch_core::ChannelInfo>,
    ) -> Result<Vec<Transition>, crate::BulkError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Request::AddMany { infos, reply })
            .await
            .map_err(|_| ApiError::Store("the coordinator is shutting down".into()))?;
        rx.await
            .map_err(|_| ApiError::Store("the coordinator dropped the request".into()))?
    }
}

/// Answers a request with `err` without doing it.
pub(crate) fn refuse(req: Request, err: ApiError) {
    match req {
        Request::Channels(r) => drop(r.send(Err(err))),
        Request::Nodes(r) => drop(r.send(Err(err))),
        Request::Add { reply, .. }
        | Request::Remove { reply, .. }
        | Request::Move { reply, .. }
        | Request::AddPlaced { reply, .. }
        | Request::Pin { reply, .. } => {
            drop(reply.send(Err(err)));
        }
        Request::Drain { reply, .. } => drop(reply.send(Err(err))),
        Request::Balance { reply, .. } => drop(reply.send(Err(err))),
        Request::View(f) => (f.0)(Err(err)),
        Request::Undrain { reply, .. } => drop(reply.send(Err(err))),
        Request::AddMany { reply, .. } => drop(reply.send(Err(err.into()))),
    }
}
