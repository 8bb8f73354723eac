//! A channel's runner: one task per assignment that loads through the handler, reports the
//! outcome, follows the session's pause signal (pause / resume warm) and releases on stop.
//!
//! Owns: the handler calls for one channel and the `channels_running` gauge's share. Must not
//! touch the store — it reports to the session through [`RunnerEvent`]s (a handler's resume
//! read and commits go through its context's committer).

use std::sync::Arc;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use chanwatch_core::node::NodeEvent;

use crate::handler::{ChannelContext, ChannelHandler, RunnerEvent};

pub(crate) struct Runner {
    pub(crate) generation: u64,
    pub(crate) cancel: CancellationToken,
    /// The session's pause state, passed on by the event loop in channel order: one waiter
    /// per channel (tokio's watch wakes several waiters in a random order, which would make
    /// the simulation's runs differ).
    pub(crate) pause: watch::Sender<Option<String>>,
    pub(crate) task: JoinHandle<()>,
}

/// Counts a runner in `chanwatch_node_channels_running` for as long as its task lives,
/// including when the task is aborted.
pub(crate) struct RunningGuard(pub(crate) Arc<crate::metrics::NodeMetrics>);
impl Drop for RunningGuard {
    fn drop(&mut self) {
        self.0.running.dec();
    }
}

pub(crate) async fn run_channel(
    _guard: RunningGuard,
    handler: Arc<dyn ChannelHandler>,
    ctx: ChannelContext,
    cancel: CancellationToken,
    mut pause: watch::Receiver<Option<String>>,
    generation: u64,
) {
    let node = ctx.node;
    let info = ctx.info.clone();
    let events = ctx.events.clone();
    let stopped = |events: &mpsc::UnboundedSender<RunnerEvent>| {
        let _ = events.send(RunnerEvent {
            generation,
            event: NodeEvent::Stopped {
                channel: info.channel.clone(),
            },
        });
    };
    // Load, again after each pause that caught the load in progress (a paused node must not
    // even load: a load may be the start of its effects).
    loop {
        if !unpaused(&mut pause, &cancel).await {
            stopped(&events);
            return;
        }
        let load = handler.load(ctx.clone());
        let loaded = tokio::select! {
            biased;
            () = cancel.cancelled() => None,
            true = until_paused(&mut pause) => {
                handler.release(node, &info).await;
                continue;
            }
            r = load => Some(r),
        };
        let Some(result) = loaded else { break };
        let ok = result.is_ok();
        let _ = events.send(RunnerEvent {
            generation,
            event: NodeEvent::LoadDone {
                channel: info.channel.clone(),
                epoch: info.epoch,
                result,
            },
        });
        if !ok {
            break;
        }
        // Running: pause and resume warm until released.
        loop {
            let paused = tokio::select! {
                biased;
                () = cancel.cancelled() => false,
                true = until_paused(&mut pause) => true,
            };
            if !paused {
                break;
            }
            handler.pause(node, &info).await;
            if !unpaused(&mut pause, &cancel).await {
                break;
            }
            handler.resume(node, &info).await;
        }
        break;
    }
    handler.release(node, &info).await;
    stopped(&events);
}

async fn until_running(pause: &mut watch::Receiver<Option<String>>) -> bool {
    pause.wait_for(Option::is_none).await.is_ok()
}

/// Waits until the node is paused; false if the session is gone.
async fn until_paused(pause: &mut watch::Receiver<Option<String>>) -> bool {
    pause.wait_for(Option::is_some).await.is_ok()
}

/// Waits until the node is not paused; false when the runner is cancelled first.
async fn unpaused(pause: &mut watch::Receiver<Option<String>>, cancel: &CancellationToken) -> bool {
    tokio::select! {
        biased;
        () = cancel.cancelled() => false,
        r = until_running(pause) => r,
    }
}
