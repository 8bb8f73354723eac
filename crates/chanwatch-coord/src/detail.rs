//! One object at a time, for `ctl get` / `ctl describe`: a channel (its assignment, vchannel,
//! checkpoint and recent history) and a node (its session, channels, drain mark and recent
//! history), read from the leader's view and its event history; and undrain.
//!
//! Owns: [`ChannelDetail`], [`NodeDetail`], the handle's requests that build them, and the
//! term's side of undrain (running the txn the planner's `undrain` decides, like every other
//! write through the term's `run_one`, guarded by the leader key). Must not: write anything
//! else, or decide anything (whether and what to undrain is the planner's; which node to
//! fill is balance's).

use chanwatch_core::planner::{ChannelRow, Planner};
use chanwatch_core::{ChannelName, NodeId, NodeSession, VChannelInfo};
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::checkpoints::CheckpointRow;
use crate::events::{Event, HistoryInfo};
use crate::handle::{ApiError, CoordHandle, Request};
use crate::term::Term;

/// A read of the leader's view, run by the term between two plans (or refused with the
/// reason on a standby).
pub(crate) struct ViewFn(pub(crate) Box<ReadView>);

/// What a [`ViewFn`] runs: the view, or why there is none.
type ReadView = dyn FnOnce(Result<&Planner, ApiError>) + Send;

impl std::fmt::Debug for ViewFn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ViewFn")
    }
}

/// `GET /api/v1/channels/{name}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelDetail {
    /// The channel.
    pub channel: ChannelName,
    /// Its assignment (two rows only while a second key for it awaits dedupe).
    pub assignments: Vec<ChannelRow>,
    /// What a node needs to restore it.
    pub vchannel: VChannelInfo,
    /// Its checkpoint, `null` when none was committed (or no data plane runs).
    pub checkpoint: Option<CheckpointRow>,
    /// Its last transitions in this leader's history, oldest first.
    pub history: Vec<Event>,
    /// Whose history that is.
    pub history_info: HistoryInfo,
}

/// `GET /api/v1/nodes/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeDetail {
    /// The node's session as it wrote it.
    pub session: NodeSession,
    /// Whether it carries a drain mark (`{root}/coord/drain/{id}`).
    pub draining: bool,
    /// Its channels.
    pub channels: Vec<ChannelRow>,
    /// Its last events in this leader's history (its own, and moves to or from it).
    pub history: Vec<Event>,
    /// Whose history that is.
    pub history_info: HistoryInfo,
}

impl CoordHandle {
    /// Runs `read` on the leader's view (also the summary's reads).
    pub(crate) async fn view<T: Send + 'static>(
        &self,
        read: impl FnOnce(&Planner) -> T + Send + 'static,
    ) -> Result<T, ApiError> {
        self.ask_with(|reply: oneshot::Sender<Result<T, ApiError>>| {
            Request::View(ViewFn(Box::new(move |view| {
                drop(reply.send(view.map(read)));
            })))
        })
        .await
    }

    /// One channel: assignment, vchannel, checkpoint (read from the store) and history.
    ///
    /// # Errors
    /// Unknown channel, not leader, or the store did not answer the checkpoint read.
    pub async fn channel_detail(&self, name: ChannelName) -> Result<ChannelDetail, ApiError> {
        let n = name.clone();
        let found = self
            .view(move |p| {
                let vchannel = p.entry(&n)?.info.vchannel.clone();
                let rows: Vec<ChannelRow> = p
                    .channel_rows()
                    .into_iter()
                    .filter(|r| r.channel == n)
                    .collect();
                Some((rows, vchannel))
            })
            .await?;
        let (assignments, vchannel) = found.ok_or_else(|| {
            ApiError::Admin(chanwatch_core::planner::AdminError::UnknownChannel(
                name.clone(),
            ))
        })?;
        let r = self.reads();
        let cp = r
            .store
            .get(&r.keys.checkpoint(&name))
            .await
            .map_err(|e| ApiError::Store(e.to_string()))?;
        let now = r.clock.unix_ms();
        let checkpoint = cp
            .and_then(|kv| chanwatch_core::Checkpoint::decode(&kv.value).ok())
            .map(|c| CheckpointRow {
                channel: name.to_string(),
                epoch: c.epoch.0,
                position: c.position,
                updated_at_ms: c.updated_at_ms,
                age_ms: now.saturating_sub(c.updated_at_ms),
            });
        let events = self.events();
        Ok(ChannelDetail {
            history: events.channel(&name),
            history_info: events.info(),
            channel: name,
            assignments,
            vchannel,
            checkpoint,
        })
    }

    /// One live node: session, drain mark, channels and history.
    ///
    /// # Errors
    /// Unknown node (no live session) or not leader.
    pub async fn node_detail(&self, node: NodeId) -> Result<NodeDetail, ApiError> {
        let found = self
            .view(move |p| {
                let session = p.nodes().get(&node)?.clone();
                let channels = p
                    .channel_rows()
                    .into_iter()
                    .filter(|r| r.node == Some(node.0))
                    .collect();
                Some((session, p.draining().contains(&node), channels))
            })
            .await?;
        let (session, draining, channels) = found.ok_or(ApiError::Admin(
            chanwatch_core::planner::AdminError::UnknownNode(node),
        ))?;
        let events = self.events();
        Ok(NodeDetail {
            session,
            draining,
            channels,
            history: events.node_history(node),
            history_info: events.info(),
        })
    }

    /// Takes away a node's drain mark (deletes `{root}/coord/drain/{id}` in a txn guarded by
    /// the leader key): it takes channels again, and balance may fill it. `Ok(false)` when it
    /// was not draining.
    ///
    /// # Errors
    /// A node with neither a drain mark nor a live session (unknown), not leader, or the store
    /// failed.
    pub async fn undrain(&self, node: NodeId) -> Result<bool, ApiError> {
        self.ask_with(|reply| Request::Undrain { node, reply })
            .await
    }
}

impl Term<'_> {
    /// Serves [`Request::Undrain`]: deletes the node's drain mark in a txn guarded by the
    /// leader key (nothing when it has none, and an unknown-node answer when it has no
    /// session either), then plans at once so balance may fill it.
    /// `Err` only when leadership was lost.
    pub(crate) async fn undrain(
        &mut self,
        node: NodeId,
        reply: oneshot::Sender<Result<bool, ApiError>>,
    ) -> Result<(), String> {
        let planned = match self.state.undrain(node) {
            Ok(Some(txn)) => Ok(txn),
            Ok(None) => {
                drop(reply.send(Ok(false)));
                return Ok(());
            }
            Err(e) => {
                drop(reply.send(Err(ApiError::Admin(e))));
                return Ok(());
            }
        };
        let (tx, rx) = oneshot::channel();
        self.run_one(planned, tx).await?;
        let result = match rx.await {
            Ok(Ok(_)) => {
                tracing::info!(node = %node, "coord: node undrained; it takes channels again");
                Ok(true)
            }
            Ok(Err(e)) => Err(e),
            Err(_) => Err(ApiError::Store("undrain request dropped".into())),
        };
        drop(reply.send(result));
        self.replan = true;
        Ok(())
    }
}
