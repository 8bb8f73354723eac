//! The work a node does for a channel, behind the [`ChannelHandler`] trait, and the built-in
//! handlers: [`SimulatedLoad`] (the default: a load that takes `--load-delay`, and for
//! black-box tests fails or hangs for channels matching [`NamePatterns`]), [`AuditLog`] (writes
//! the handler log around another handler), [`StreamConsumer`] (`consumer`: reads a channel of a
//! `chanwatch_stream::Log` from its checkpoint and commits fenced checkpoints), [`ExecHandler`]
//! (`exec`: one supervised child process per channel, talking to the node through the
//! [agent API](crate::agent)); [`OwnershipLog`] records when each node ran each channel (the
//! single-ownership audit of `demo`) and, with the `testing` feature, the test fixture
//! `RecordingHandler` records into one.
//!
//! Must not: touch the store. A handler reports progress through its [`ChannelContext`].

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_core::node::NodeEvent;
use chanwatch_core::{ChannelInfo, ChannelName, Epoch, NodeId, Progress};
use chanwatch_store::Clock;
use tokio::sync::mpsc;

pub use crate::checkpoint::CommitError;

/// What a runner tells the node loop: an event for the node machine, from the run
/// `generation` (so that a late report of an earlier run of the same channel is ignored).
#[derive(Debug)]
pub(crate) struct RunnerEvent {
    pub(crate) generation: u64,
    pub(crate) event: NodeEvent,
}

/// Given to [`ChannelHandler::load`]: the assignment and a way to report progress.
#[derive(Debug, Clone)]
pub struct ChannelContext {
    /// The node running the channel.
    pub node: NodeId,
    /// The assignment (channel, epoch, vchannel info).
    pub info: ChannelInfo,
    pub(crate) clock: Clock,
    pub(crate) events: mpsc::UnboundedSender<RunnerEvent>,
    pub(crate) last_progress: Arc<Mutex<Option<tokio::time::Instant>>>,
    pub(crate) progress_interval: Duration,
    /// The runner this context belongs to: a late [`ChannelContext::fail`] of an earlier run
    /// of the same channel is ignored.
    pub(crate) generation: u64,
    /// How this run reads its resume point and commits (none in contexts made outside a node, e.g. handler tests).
    pub(crate) committer: Option<crate::checkpoint::Committer>,
}

impl ChannelContext {
    /// Reports load progress (0-100). Written to the store at most once per
    /// `--progress-interval`; the coordinator's watch timeout counts from the last write.
    pub fn progress(&self, percent: u8) {
        let now = self.clock.now();
        let mut last = self
            .last_progress
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.is_some_and(|t| now.duration_since(t) < self.progress_interval) {
            return;
        }
        *last = Some(now);
        let _ = self.events.send(RunnerEvent {
            generation: self.generation,
            event: NodeEvent::Progress {
                channel: self.info.channel.clone(),
                epoch: self.info.epoch,
                progress: Progress {
                    percent: percent.min(100),
                    updated_at_ms: self.clock.unix_ms(),
                },
            },
        });
    }

    /// Where to resume: the channel's last committed checkpoint — its `position` and the
    /// `state` committed with it — or `None` (no checkpoint yet: start from the beginning).
    /// Read from the store on first use in this run (retried until the store answers), then
    /// remembered; a handler that never checkpoints never pays for the read.
    ///
    /// # Errors
    /// [`CommitError::Unavailable`] when the stored checkpoint does not decode (fix or delete
    /// the key), or the context belongs to no node.
    pub async fn resume(&self) -> Result<Option<chanwatch_core::Checkpoint>, CommitError> {
        match &self.committer {
            Some(c) => c.resume().await.map_err(CommitError::Unavailable),
            None => Err(CommitError::Unavailable(
                "this context belongs to no node (a test context)".into(),
            )),
        }
    }

    /// Commits how far this run has consumed, and the handler's state as of there, by fenced
    /// txn (DESIGN §4): it lands only while this run still owns the channel — the assignment
    /// it started under unchanged, the node's session alive, and no other commit since this
    /// run's last one. Group-committed with the node's other writes; returns once answered.
    /// Cancel-safe: a commit dropped before its answer may still land, and the run's next
    /// commit first reads the checkpoint to learn whether it did (so its own write cannot
    /// fence it).
    ///
    /// # Errors
    /// [`CommitError::Fenced`]: stop consuming (the node stops the run too);
    /// [`CommitError::Unavailable`]: nothing known to have landed (the store did not answer or
    /// the node is paused), commit again later; [`CommitError::TooLarge`]: the state is over
    /// 64 KiB.
    pub async fn commit(
        &self,
        position: impl Into<String>,
        state: Option<serde_json::Value>,
    ) -> Result<(), CommitError> {
        let started = self.clock.now();
        let result = match &self.committer {
            Some(c) => c.commit(position.into(), state).await,
            None => Err(CommitError::Unavailable(
                "this context belongs to no node (a test context)".into(),
            )),
        };
        if let Some(c) = &self.committer {
            c.observe(self.clock.now().saturating_duration_since(started));
        }
        result
    }

    /// The clock, for handlers that wait.
    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// Reports the running channel broken: the node stops it (`release`), then writes
    /// `WatchFailed` with `reason`, and the coordinator moves it elsewhere (cause `failed`).
    /// Called while the load runs, it waits for the load: a load that then succeeds is
    /// stopped all the same, not acknowledged `Watched` (a load that fails says its own
    /// error), and its progress no longer counts — also when a pause made the node load the
    /// channel again (the same run). A `ToRelease` meanwhile is acknowledged `Released`, as
    /// for a running channel. Ignored once this run has ended.
    pub fn fail(&self, reason: impl Into<String>) {
        let _ = self.events.send(RunnerEvent {
            generation: self.generation,
            event: NodeEvent::Broke {
                channel: self.info.channel.clone(),
                epoch: self.info.epoch,
                reason: reason.into(),
            },
        });
    }
}

/// The work of one channel on a node.
///
/// The runner calls [`load`](ChannelHandler::load) to load the channel; it returns once the
/// channel runs (the handler keeps consuming in the background) or with the reason it could
/// not. The runner cancels a load by dropping the future. After a successful load or a
/// cancellation, [`release`](ChannelHandler::release) stops consuming; the node acknowledges
/// `Released` only after it returns, so moves are break-before-make.
#[async_trait]
pub trait ChannelHandler: Send + Sync + 'static {
    /// Loads the channel.
    ///
    /// # Errors
    /// The reason the channel cannot be loaded; it is written to the store as `WatchFailed`.
    async fn load(&self, ctx: ChannelContext) -> Result<(), String>;

    /// Stops consuming the channel. Must be quick and must not fail.
    async fn release(&self, node: NodeId, info: &ChannelInfo);

    /// The node cannot reach the store (or cannot see its assignments): stop every external
    /// effect of this running channel and commit nothing, but keep what is loaded, so that
    /// [`resume`](ChannelHandler::resume) continues warm (DESIGN §3). No default: a wrapper
    /// that forgot to pass it on would keep a channel running while the node is fenced
    /// (the simulation caught exactly that in its own wrapper).
    async fn pause(&self, node: NodeId, info: &ChannelInfo);

    /// The store answers again and the node's session survived: continue where
    /// [`pause`](ChannelHandler::pause) stopped.
    async fn resume(&self, node: NodeId, info: &ChannelInfo);
}

/// Channel names to match, for test switches: comma-separated globs in which `*` matches any
/// run of characters and every other character only itself (`p1*,*-bad`). Empty matches
/// nothing.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamePatterns(Vec<String>);

impl std::str::FromStr for NamePatterns {
    type Err = std::convert::Infallible;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(NamePatterns(
            s.split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .map(str::to_owned)
                .collect(),
        ))
    }
}

impl NamePatterns {
    /// Whether no pattern is set.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether `name` matches one of the patterns.
    pub fn matches(&self, name: &str) -> bool {
        self.0.iter().any(|p| glob(p, name))
    }
}

/// `*`-only glob match, iterative with one backtrack point (linear in practice).
fn glob(pattern: &str, name: &str) -> bool {
    let (p, n) = (pattern.as_bytes(), name.as_bytes());
    let (mut pi, mut ni) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ni < n.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ni));
            pi += 1;
        } else if pi < p.len() && p[pi] == n[ni] {
            pi += 1;
            ni += 1;
        } else if let Some((sp, sn)) = star {
            pi = sp + 1;
            ni = sn + 1;
            star = Some((sp, sn + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

/// The default handler: a load that takes `load_delay`, reporting progress along the way.
/// For black-box tests (`chanwatch node --fail-load/--hang-load`), loads of matching
/// channels fail at once or never finish.
#[derive(Debug, Clone, Default)]
pub struct SimulatedLoad {
    /// How long a load takes.
    pub load_delay: Duration,
    /// For tests: loads of these channels fail at once (`WatchFailed`).
    pub fail_load: NamePatterns,
    /// For tests: loads of these channels never finish and report no progress (the
    /// coordinator's watch timeout applies).
    pub hang_load: NamePatterns,
    /// For tests: these channels load, run for `fail_running_after`, then report themselves
    /// broken ([`ChannelContext::fail`]).
    pub fail_running: NamePatterns,
    /// How long a `fail_running` channel runs before it breaks.
    pub fail_running_after: Duration,
}

#[async_trait]
impl ChannelHandler for SimulatedLoad {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        const STEPS: u32 = 10;
        let channel = ctx.info.channel.as_str();
        if self.fail_load.matches(channel) {
            return Err(format!(
                "simulated load failure (--fail-load matches {channel})"
            ));
        }
        if self.hang_load.matches(channel) {
            std::future::pending::<()>().await;
        }
        if !self.load_delay.is_zero() {
            for step in 0..STEPS {
                ctx.progress(u8::try_from(step * 100 / STEPS).unwrap_or(100));
                ctx.clock().sleep(self.load_delay / STEPS).await;
            }
        }
        if self.fail_running.matches(channel) {
            let after = self.fail_running_after;
            let reason = format!(
                "simulated failure of a running channel (--fail-running matches {channel})"
            );
            let ctx = ctx.clone();
            // Outlives a release at worst by `after`; a report for an ended run is ignored.
            tokio::spawn(async move {
                ctx.clock().sleep(after).await;
                ctx.fail(reason);
            });
        }
        Ok(())
    }

    async fn release(&self, _node: NodeId, _info: &ChannelInfo) {}

    /// A simulated load has no effects to stop.
    async fn pause(&self, _node: NodeId, _info: &ChannelInfo) {}

    async fn resume(&self, _node: NodeId, _info: &ChannelInfo) {}
}

/// Wraps a handler and appends one line per run boundary to a file, so that single ownership
/// can be audited across processes (the chaos test reads these files):
/// `start {node} {channel} {epoch} {unix_ms}` when a load begins,
/// `stop {node} {channel} {epoch} {unix_ms}` when it fails, is cancelled or is released, and
/// `pause` / `resume` (same fields) around a stretch during which the node could not reach
/// the store: a paused channel does not run.
/// Each line is one `write` call, so a process killed with `SIGKILL` loses no line it wrote.
/// Each run gets exactly one `stop`: a failed or cancelled load is followed by the runner's
/// `release`, and only the first of the two writes the line.
#[derive(Debug)]
pub struct AuditLog<H> {
    inner: H,
    file: Mutex<std::fs::File>,
    /// Runs with a `start` line and no `stop` yet. Without it a failed or cancelled load
    /// wrote `stop` twice: once when the load ended, again on the release that follows.
    open: Mutex<std::collections::BTreeSet<(NodeId, ChannelName, Epoch)>>,
    clock: Clock,
}

impl<H: ChannelHandler> AuditLog<H> {
    /// Appends to `path` (created if missing).
    ///
    /// # Errors
    /// When the file cannot be opened for appending.
    pub fn open(inner: H, path: &std::path::Path, clock: Clock) -> std::io::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(AuditLog {
            inner,
            file: Mutex::new(file),
            open: Mutex::default(),
            clock,
        })
    }

    fn open_runs(
        &self,
    ) -> std::sync::MutexGuard<'_, std::collections::BTreeSet<(NodeId, ChannelName, Epoch)>> {
        self.open
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn start(&self, node: NodeId, info: &ChannelInfo) {
        self.open_runs()
            .insert((node, info.channel.clone(), info.epoch));
        self.line("start", node, info);
    }

    /// Writes `stop` if the run has a `start` without one.
    fn stop(&self, node: NodeId, info: &ChannelInfo) {
        let was_open = self
            .open_runs()
            .remove(&(node, info.channel.clone(), info.epoch));
        if was_open {
            self.line("stop", node, info);
        }
    }

    fn line(&self, what: &str, node: NodeId, info: &ChannelInfo) {
        use std::io::Write;
        let line = format!(
            "{what} {node} {} {} {}\n",
            info.channel,
            info.epoch.0,
            self.clock.unix_ms()
        );
        let mut f = self
            .file
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Err(e) = f.write_all(line.as_bytes()) {
            tracing::warn!(error = %e, "node: cannot append to the handler log");
        }
    }
}

/// Writes the `stop` line when a load ends without success, even if its future is dropped.
struct StopOnDrop<'a, H: ChannelHandler> {
    log: &'a AuditLog<H>,
    node: NodeId,
    info: ChannelInfo,
    armed: bool,
}

impl<H: ChannelHandler> Drop for StopOnDrop<'_, H> {
    fn drop(&mut self) {
        if self.armed {
            self.log.stop(self.node, &self.info);
        }
    }
}

#[async_trait]
impl<H: ChannelHandler> ChannelHandler for AuditLog<H> {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let (node, info) = (ctx.node, ctx.info.clone());
        self.start(node, &info);
        let mut guard = StopOnDrop {
            log: self,
            node,
            info,
            armed: true,
        };
        let result = self.inner.load(ctx).await;
        guard.armed = result.is_err();
        result
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        self.inner.release(node, info).await;
        self.stop(node, info);
    }

    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        self.inner.pause(node, info).await;
        self.line("pause", node, info);
    }

    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        self.line("resume", node, info);
        self.inner.resume(node, info).await;
    }
}

pub mod consumer;
pub use consumer::{ConsumerOptions, StreamConsumer, StreamState};
pub mod exec;
pub use exec::{ExecError, ExecHandler, ExecOptions};

pub mod ownership;
pub use ownership::{Interval, OwnershipLog};
#[cfg(any(test, feature = "testing"))]
mod recording;
#[cfg(any(test, feature = "testing"))]
pub use recording::{Behaviour, RecordingHandler};

#[cfg(test)]
mod tests;
