//! The runners of a [`Session`]: starting one per channel, and stopping them all (on a
//! shutdown, with the lease revoked after).
//!
//! Owns: the spawn of a channel's runner with its context and committer, and the wait for
//! every release. Must not: decide which channels run (the node machine does) or write keys
//! itself (acks and commits go through the session's queues) — but for the revoke of the
//! session's lease on a shutdown.

use std::sync::{Arc, Mutex};

use chanwatch_core::{ChannelInfo, ChannelName};
use tokio::sync::watch;
use tracing::{info, warn};

use super::{Session, SessionEnd};
use crate::checkpoint::Committer;
use crate::handler::ChannelContext;
use crate::runner::{run_channel, Runner, RunningGuard};

impl Session {
    /// Starts a runner for `info`'s channel (after the previous one of it, if any, has
    /// finished releasing): its context, its committer, its pause signal.
    pub(super) async fn start(&mut self, info: ChannelInfo) {
        // One runner per channel: a restart waits for the previous one to finish releasing.
        if let Some(old) = self.runners.remove(&info.channel) {
            old.cancel.cancel();
            let _ = old.task.await;
        }
        info!(node = %self.reg.id, channel = %info.channel, epoch = %info.epoch, "node: starting channel");
        self.next_generation += 1;
        let generation = self.next_generation;
        let cancel = self.fence.child_token();
        let ctx = ChannelContext {
            node: self.reg.id,
            info: info.clone(),
            clock: self.clock,
            events: self.events_tx.clone(),
            last_progress: Arc::new(Mutex::new(None)),
            progress_interval: self.progress_interval,
            generation,
            committer: Some(Committer::new(
                self.commit_shared.clone(),
                info.channel.clone(),
                info.epoch,
                self.create_revisions
                    .get(&info.channel)
                    .copied()
                    .unwrap_or(0),
            )),
        };
        self.seen_at.insert(info.channel.clone(), self.clock.now());
        self.metrics.running.inc();
        let guard = RunningGuard(self.metrics.clone());
        let (pause, paused) = watch::channel(self.pause.borrow().clone());
        let task = tokio::spawn(tracing::Instrument::in_current_span(run_channel(
            guard,
            self.handler.clone(),
            ctx,
            cancel.clone(),
            paused,
            generation,
        )));
        self.runners.insert(
            info.channel,
            Runner {
                generation,
                cancel,
                pause,
                task,
            },
        );
    }

    /// Stops every channel and revokes the lease, so what is left moves at once.
    pub(super) async fn stop_and_revoke(mut self) -> SessionEnd {
        self.stop_all(true).await;
        if let Err(e) = self.store.revoke(self.reg.lease).await {
            warn!(error = %e, "node: lease revoke failed; it will expire by itself");
        }
        SessionEnd::Shutdown
    }

    /// Stops every runner and waits for each release. With `commits` (a shutdown, the
    /// session alive), the commits runs make meanwhile — a worker's last one on `SIGTERM` —
    /// are still written and answered: a release waits for its worker, and a commit left
    /// queued until the end of this would hold the worker until its stop grace ran out.
    pub(super) async fn stop_all(&mut self, commits: bool) {
        // Nothing waits for a round's puts any more; what is queued goes with the commits.
        self.round_hold.clear();
        let runners: Vec<(ChannelName, Runner)> =
            std::mem::take(&mut self.runners).into_iter().collect();
        for (_, r) in &runners {
            r.cancel.cancel();
        }
        let released = async move {
            for (_, r) in runners {
                let _ = r.task.await;
            }
        };
        tokio::pin!(released);
        loop {
            tokio::select! {
                () = &mut released => return,
                Some(first) = self.commits_rx.recv(), if commits => {
                    self.commit_queue.push(first);
                    while let Ok(more) = self.commits_rx.try_recv() {
                        self.commit_queue.push(more);
                    }
                    self.send_acks();
                }
                Some(outcomes) = self.acks_done_rx.recv(), if commits => {
                    self.commits_done_stopping(outcomes);
                }
            }
        }
    }
}
