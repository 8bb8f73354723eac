//! The exec handler (DESIGN §7): workers in any language. For every channel the
//! node starts, it spawns one child process — a guard shell that runs COMMAND as shell text
//! (quote as in a shell; `exec` is not needed: the guard keeps the whole tree in hand) — with
//! the channel's assignment and resume point in its environment, and supervises it; the child
//! talks to its node through the local [agent API](crate::agent).
//!
//! Just over 600 lines: spawning, supervising and stopping a worker share the one child record
//! and its signals; the agent API is `agent.rs`.
//!
//! | variable | value |
//! |---|---|
//! | `CHANWATCH_CHANNEL`, `CHANWATCH_EPOCH`, `CHANWATCH_NODE` | the assignment: channel name, epoch, node ID (decimal) |
//! | `CHANWATCH_VCHANNEL` | the assignment's vchannel info, JSON |
//! | `CHANWATCH_RESUME_POSITION` | the last committed checkpoint's position; empty: start from the beginning |
//! | `CHANWATCH_RESUME_STATE` | the state committed with it, JSON; empty when none |
//! | `CHANWATCH_AGENT_URL`, `CHANWATCH_AGENT_TOKEN` | where the agent API is, and this child's bearer token |
//! | `CHANWATCH_AGENT_SOCKET` | the same API on a Unix socket (path; empty when the node could not make one): cheaper per request for a worker that can use it |
//!
//! Supervision:
//! - **load** is done when the child calls `POST /ready` (or at once with `ready_on_start`);
//!   a child that exits first fails the load (`WatchFailed`).
//! - **any exit** of a running child, and `POST /fail`, fail the channel (`WatchFailed`): the
//!   coordinator moves it elsewhere and avoids this node for it during its back-off — the node
//!   never respawns a worker on its own, so a worker that keeps crashing is not run in a loop.
//! - **release** sends `SIGTERM` to the child's process group (every child is its group's
//!   leader), `SIGKILL` after `stop_grace`, and returns once the child is gone — so the next
//!   owner starts only after this one stopped (break-before-make).
//! - **pause** turns `GET /state` to `paused` (the child must stop its external effects;
//!   `/commit` answers 503 meanwhile); a pause that ends in a stop (the lease was lost) is a
//!   release without grace: `SIGKILL` at once, since a paused worker can commit nothing and a
//!   node fencing itself must be done before its margin runs out. The same for a worker
//!   released before its load completed (a cancelled load, or one a pause caught), and for
//!   every worker of a session that fenced itself without a pause first (the store said its
//!   lease is gone: another node may start the channel any moment, and no commit can land).
//! - **the node's death**, even by `kill -9`: each child is a guard shell (`GUARD_SCRIPT`)
//!   spawned with `PR_SET_PDEATHSIG = SIGUSR2` from spawner threads that live as long as the
//!   process; when the node dies the kernel signals the guard, which kills the worker's whole
//!   process group — whatever the command forked, with or without `exec`.
//!
//! The child inherits the node's environment except the node's own `CHANWATCH_*` variables
//! (they may hold etcd credentials or the admin token): only those of the table are set.
//!
//! stdout and stderr of each child go to the node's log, line by line, with the channel,
//! epoch and pid.
//!
//! Owns: the child processes, their supervision and environment. Must not: touch the store
//! (commits go through the run's context, via the agent).

use std::collections::HashMap;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, ChannelName, NodeId};
use tokio::io::{AsyncBufReadExt, AsyncRead, BufReader};
use tokio::sync::{oneshot, watch};
use tracing::{info, warn};

use super::{ChannelContext, ChannelHandler};
use crate::agent::{random_token, Agent, AgentChild, Registration};

mod sys;

/// Settings of an [`ExecHandler`].
#[derive(Debug, Clone)]
pub struct ExecOptions {
    /// The worker command, shell text, run under a guard shell once per channel.
    pub command: String,
    /// How long a released worker gets between `SIGTERM` and `SIGKILL` (default 10 s).
    pub stop_grace: Duration,
    /// Count the load done as soon as the worker is spawned, without waiting for
    /// `POST /ready`.
    pub ready_on_start: bool,
}

impl ExecOptions {
    /// Options for `command` with the defaults: 10 s grace, wait for `/ready`.
    pub fn new(command: impl Into<String>) -> Self {
        ExecOptions {
            command: command.into(),
            stop_grace: Duration::from_secs(10),
            ready_on_start: false,
        }
    }
}

/// Why an [`ExecHandler`] cannot start.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The command is empty or blank.
    #[error("the exec command is empty: give the command to run per channel (e.g. --exec 'python3 worker.py')")]
    EmptyCommand,
    /// The agent's address cannot be bound.
    #[error("cannot bind the agent API on {addr}: {source}; pick another address (--agent)")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why.
        source: std::io::Error,
    },
}

/// One running worker.
struct Run {
    pgid: u32,
    child: Arc<AgentChild>,
    stopping: Arc<AtomicBool>,
    /// Whether its load completed (`/ready`).
    loaded: Arc<AtomicBool>,
    /// `Some(how it ended)` once the process was reaped.
    exited: watch::Receiver<Option<String>>,
    /// Held until the worker is gone: its token works until then (a last commit on SIGTERM).
    _registration: Registration,
}

/// The exec handler: see the module docs. One instance (and one agent listener) serves every
/// channel of every node that shares it; runs are keyed by node and channel.
pub struct ExecHandler {
    options: ExecOptions,
    /// The log the agent's `GET /read` serves (`--log`), if any.
    log: Option<Arc<dyn chanwatch_stream::Log>>,
    agent: Agent,
    runs: Mutex<HashMap<(NodeId, ChannelName), Run>>,
}

impl std::fmt::Debug for ExecHandler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExecHandler")
            .field("options", &self.options)
            .field("agent", &self.agent.url())
            .finish_non_exhaustive()
    }
}

impl ExecHandler {
    /// A handler whose agent API listens on `addr` (e.g. `127.0.0.1:0`: a free port). Must be
    /// called inside a tokio runtime (the agent is served on it).
    ///
    /// # Errors
    /// An empty command, an address that cannot be bound.
    pub async fn bind(options: ExecOptions, addr: &str) -> Result<Self, ExecError> {
        let bind = |source| ExecError::Bind {
            addr: addr.to_owned(),
            source,
        };
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(bind)?;
        Self::with_listener(options, listener).map_err(|e| match e {
            ExecError::Bind { source, .. } => bind(source),
            e => e,
        })
    }

    /// A handler whose agent API serves `listener`.
    ///
    /// # Errors
    /// An empty command; a listener without a local address.
    pub fn with_listener(
        options: ExecOptions,
        listener: tokio::net::TcpListener,
    ) -> Result<Self, ExecError> {
        if options.command.trim().is_empty() {
            return Err(ExecError::EmptyCommand);
        }
        let mut agent = Agent::serve(listener).map_err(|source| ExecError::Bind {
            addr: "?".into(),
            source,
        })?;
        // The same API on a Unix socket, cheaper per request; the URL works without it.
        if let Err(e) = agent.serve_unix(&std::env::temp_dir()) {
            warn!(error = %e, dir = %std::env::temp_dir().display(), "exec: cannot make the agent's Unix socket; workers get CHANWATCH_AGENT_URL only");
        }
        Ok(ExecHandler {
            options,
            log: None,
            agent,
            runs: Mutex::default(),
        })
    }

    /// Lets workers read their channel of `log` through the agent (`GET /read`), for logs a
    /// worker cannot read itself (NATS without a client library).
    #[must_use]
    pub fn with_log(mut self, log: Arc<dyn chanwatch_stream::Log>) -> Self {
        self.log = Some(log);
        self
    }

    /// The agent API's base URL (`CHANWATCH_AGENT_URL`).
    pub fn agent_url(&self) -> &str {
        self.agent.url()
    }

    /// Requests the agent accepted so far from running workers (their token; any endpoint,
    /// whatever came of them).
    pub fn agent_requests(&self) -> u64 {
        self.agent.accepted()
    }

    /// The pid of the worker of `channel` on `node`, while one runs.
    pub fn worker_pid(&self, node: NodeId, channel: &ChannelName) -> Option<u32> {
        self.runs().get(&(node, channel.clone())).map(|r| r.pgid)
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, HashMap<(NodeId, ChannelName), Run>> {
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Stops the worker of `key`, if any: SIGTERM to its group, SIGKILL after the grace;
    /// returns once it was reaped.
    async fn stop(&self, key: &(NodeId, ChannelName)) {
        let Some(run) = self.runs().remove(key) else {
            return;
        };
        run.stopping.store(true, Ordering::SeqCst);
        let channel = key.1.as_str();
        let mut exited = run.exited.clone();
        if exited.borrow().is_some() {
            return;
        }
        let clock = run.child.ctx.clock();
        let grace = self.options.stop_grace;
        // A paused worker can commit nothing (503), so a grace buys it nothing, and a node
        // that fences itself must not wait out its margin here: SIGKILL at once. So is a
        // worker whose load did not complete (cancelled, or caught by a pause, which the
        // handler is not told of during a load). The same when the session fenced itself
        // (its lease is gone: another node may start the channel any moment, and no commit
        // can land), also when that happens during the grace of an orderly release (the
        // coordinator moved the channel off a session that had just ended).
        let committer = run.child.ctx.committer.clone();
        let fenced = committer
            .as_ref()
            .is_some_and(crate::checkpoint::Committer::session_closed);
        let paused =
            run.child.paused.load(Ordering::SeqCst) || !run.loaded.load(Ordering::SeqCst) || fenced;
        let session_closed = async {
            match &committer {
                Some(c) => c.until_session_closed().await,
                None => std::future::pending().await,
            }
        };
        let mut fenced_in_grace = false;
        let stopped = !paused && {
            sys::signal_group(run.pgid, libc::SIGTERM);
            // The whole group, not only the direct child: under a guard shell the worker's
            // own processes may outlive the shells in front of them by their grace.
            let gone = async {
                let _ = exited.wait_for(Option::is_some).await;
                while sys::signal_group(run.pgid, 0) {
                    clock.sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::select! {
                () = gone => true,
                () = clock.sleep(grace) => false,
                () = session_closed => {
                    fenced_in_grace = true;
                    false
                }
            }
        };
        if paused || fenced_in_grace {
            info!(%channel, pid = run.pgid, fenced = fenced || fenced_in_grace, "exec: released while paused, loading or fenced; SIGKILL to the worker's process group");
            sys::signal_group(run.pgid, libc::SIGKILL);
            let _ = exited.wait_for(Option::is_some).await;
        } else if !stopped {
            warn!(%channel, pid = run.pgid, ?grace, "exec: the worker did not exit within the stop grace of SIGTERM; SIGKILL to its process group");
            sys::signal_group(run.pgid, libc::SIGKILL);
            let _ = exited.wait_for(Option::is_some).await;
        }
        let how = exited.borrow().clone().unwrap_or_default();
        info!(%channel, pid = run.pgid, %how, "exec: worker stopped");
    }
}

#[async_trait]
impl ChannelHandler for ExecHandler {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let key = (ctx.node, ctx.info.channel.clone());
        // A run left over under the same key (should not happen: the runner releases first).
        self.stop(&key).await;
        let resumed = ctx
            .resume()
            .await
            .map_err(|e| format!("cannot read the checkpoint: {e}"))?;
        let token = random_token().map_err(|e| format!("cannot make an agent token: {e}"))?;
        let child = Arc::new(AgentChild {
            log: self.log.clone(),
            ..AgentChild::new(ctx.clone())
        });
        let registration = self.agent.register(token.clone(), child.clone());
        let (position, state) = match resumed {
            Some(cp) => (
                cp.position,
                cp.state.map(|s| s.to_string()).unwrap_or_default(),
            ),
            None => (String::new(), String::new()),
        };
        let mut cmd = std::process::Command::new("/bin/sh");
        // The node's own settings (etcd credentials, the admin token) are not the worker's.
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("CHANWATCH_") {
                cmd.env_remove(&key);
            }
        }
        let launch = Launch::of(&self.options.command);
        cmd.arg("-c")
            .args(&launch.args)
            .env("CHANWATCH_CHANNEL", ctx.info.channel.as_str())
            .env("CHANWATCH_EPOCH", ctx.info.epoch.0.to_string())
            .env("CHANWATCH_NODE", ctx.node.0.to_string())
            .env(
                "CHANWATCH_VCHANNEL",
                serde_json::to_string(&ctx.info.vchannel).unwrap_or_else(|_| "{}".into()),
            )
            .env("CHANWATCH_RESUME_POSITION", position)
            .env("CHANWATCH_RESUME_STATE", state)
            .env("CHANWATCH_AGENT_URL", self.agent.url())
            .env(
                "CHANWATCH_AGENT_SOCKET",
                self.agent
                    .socket()
                    .map(|p| p.as_os_str())
                    .unwrap_or_default(),
            )
            .env("CHANWATCH_AGENT_TOKEN", &token)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .process_group(0);
        sys::die_with_node(&mut cmd, launch.death_signal);
        let spawning = std::time::Instant::now();
        let mut proc = spawn(cmd)
            .await
            .map_err(|e| format!("cannot start `{}`: {e}", self.options.command))?;
        let pid = proc.id().unwrap_or(0);
        tracing::debug!(pid, took = ?spawning.elapsed(), "exec: spawned");
        let channel = ctx.info.channel.to_string();
        let epoch = ctx.info.epoch.0;
        if let Some(out) = proc.stdout.take() {
            pump(out, channel.clone(), epoch, pid, "stdout");
        }
        if let Some(err) = proc.stderr.take() {
            pump(err, channel.clone(), epoch, pid, "stderr");
        }
        let (exited_tx, exited) = watch::channel(None);
        let stopping = Arc::new(AtomicBool::new(false));
        let loaded = Arc::new(AtomicBool::new(false));
        tokio::spawn(supervise(
            proc,
            pid,
            ctx.clone(),
            exited_tx,
            stopping.clone(),
            loaded.clone(),
        ));
        self.runs().insert(
            key,
            Run {
                pgid: pid,
                child: child.clone(),
                stopping,
                loaded: loaded.clone(),
                exited: exited.clone(),
                _registration: registration,
            },
        );
        info!(%channel, epoch, pid, "exec: worker started");
        if !self.options.ready_on_start {
            let mut ready = child.ready.subscribe();
            let mut failed = child.failed.subscribe();
            let mut ended = exited.clone();
            // The load ends with `/ready`, the worker's exit, or its `/fail` (the node then
            // acks `WatchFailed` and the release kills the worker: its load never completed).
            // In that order of precedence when several came at once: the worker's own reason
            // first, then its exit; a `/fail` or an exit that comes just after `/ready` reaches
            // the node through `ctx.fail`, which fails the channel once this load returned.
            let early = tokio::select! {
                biased;
                why = async { failed.wait_for(Option::is_some).await.map(|w| w.clone()).ok().flatten() } => {
                    Some(format!("{} (POST /fail before POST /ready)", why.unwrap_or_default()))
                }
                how = async { ended.wait_for(Option::is_some).await.map(|h| h.clone()).ok().flatten() } => {
                    Some(format!("the worker exited before POST /ready ({})", how.unwrap_or_default()))
                }
                _ = ready.wait_for(|r| *r) => None,
            };
            if let Some(why) = early {
                return Err(why);
            }
        }
        loaded.store(true, Ordering::SeqCst);
        let how = exited.borrow().clone();
        if let Some(how) = how {
            return Err(format!("the worker exited ({how})"));
        }
        Ok(())
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        self.stop(&(node, info.channel.clone())).await;
    }

    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(run) = self.runs().get(&(node, info.channel.clone())) {
            run.child.paused.store(true, Ordering::SeqCst);
            info!(channel = %info.channel, pid = run.pgid, "exec: worker told to pause (GET /state: paused)");
        }
    }

    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(run) = self.runs().get(&(node, info.channel.clone())) {
            run.child.paused.store(false, Ordering::SeqCst);
            info!(channel = %info.channel, pid = run.pgid, "exec: worker resumed (GET /state: running)");
        }
    }
}

/// How a worker's command is started: `/bin/sh -c ARGS…` and the signal the kernel sends the
/// node's direct child when the node dies (`PR_SET_PDEATHSIG`).
///
/// A simple command (`python3 worker.py DIR`: words only) runs as `exec COMMAND`: the worker
/// itself is the node's direct child and its group's leader, so the node's death kills it
/// (`SIGKILL`), a release's `SIGTERM` reaches it and nothing else, and the stop grace and the
/// exit status are its own. Anything else (`cd d && ./w`, a pipeline, a loop) runs under the
/// guard shell [`GUARD_SCRIPT`], which the node's death reaches as `SIGUSR2`: its trap kills the
/// whole process group, whatever the command forked.
struct Launch {
    args: Vec<String>,
    death_signal: libc::c_int,
}

impl Launch {
    fn of(command: &str) -> Launch {
        if is_simple(command) {
            let first = command.split_whitespace().next().unwrap_or_default();
            let script = if first == "exec" {
                command.to_owned()
            } else {
                format!("exec {command}")
            };
            Launch {
                args: vec![script],
                death_signal: libc::SIGKILL,
            }
        } else {
            Launch {
                args: vec![
                    GUARD_SCRIPT.to_owned(),
                    "chanwatch-worker".to_owned(),
                    command.to_owned(),
                ],
                death_signal: libc::SIGUSR2,
            }
        }
    }
}

/// Whether `command` is one simple command, which `exec` may prefix: no list or pipeline
/// operator, no grouping (conservatively: none of those characters anywhere, quoted or not),
/// and neither a keyword nor a variable assignment first (`exec VAR=x cmd` would run `VAR=x`).
/// Quotes, expansions and redirections are fine: `exec` keeps them.
fn is_simple(command: &str) -> bool {
    const KEYWORDS: [&str; 14] = [
        "if", "then", "else", "elif", "fi", "do", "done", "case", "esac", "while", "until", "for",
        "!", "function",
    ];
    let Some(first) = command.split_whitespace().next() else {
        return false;
    };
    !command.contains([';', '&', '|', '\n', '(', ')', '{', '}'])
        && !first.contains('=')
        && !KEYWORDS.contains(&first)
}

/// The shell that runs a command that is not simple ([`Launch`]), `/bin/sh -c GUARD_SCRIPT
/// chanwatch-worker COMMAND`, the node's direct child and its group's leader:
/// - the node's death reaches the whole tree: the kernel sends this shell `SIGUSR2`, and its
///   trap kills the process group, whatever the command forked;
/// - a release's `SIGTERM` to the group reaches the command's processes while this shell
///   goes on (`:` as its handler — not ignored, which the command would inherit); the node
///   waits for the whole group to be gone, up to the stop grace, not only for this shell;
/// - the command's exit status is the shell's (a signal's `128 + n`).
///
/// `wait` returns early when a trapped signal arrives; the loop waits again while the command
/// is still there. The subshell that runs the command handles `SIGTERM` with `:` too, so it
/// keeps waiting for what it runs in the foreground: a release's grace no longer leaves that
/// process orphaned (outside this shell's reach) when the subshell died of the `SIGTERM` —
/// the node's death during the grace then still kills it. (A shell *inside* the command, `sh
/// -c '…'` of the user's own, dies of `SIGTERM` as before; its children stay in the group, so
/// the grace's end still kills them, but the node's death during that grace does not.)
const GUARD_SCRIPT: &str = r#"trap 'kill -KILL 0' USR2
trap : TERM
{ trap : TERM; eval "$1"; } &
w=$!
while :; do
  wait "$w"; s=$?
  kill -0 "$w" 2>/dev/null || exit "$s"
done"#;

/// Waits for the worker to end; then kills what is left of its group, and fails the channel
/// unless the node stopped it.
async fn supervise(
    mut proc: tokio::process::Child,
    pid: u32,
    ctx: ChannelContext,
    exited: watch::Sender<Option<String>>,
    stopping: Arc<AtomicBool>,
    loaded: Arc<AtomicBool>,
) {
    let how = match proc.wait().await {
        Ok(s) => match (s.code(), s.signal()) {
            (Some(code), _) => format!("exit code {code}"),
            (None, Some(sig)) => format!("killed by signal {sig}"),
            _ => s.to_string(),
        },
        Err(e) => format!("cannot wait for it: {e}"),
    };
    // Whatever the worker forked and left behind goes with it — unless the node is stopping
    // it: then the stop waits for the group within the grace and kills what is left after.
    if !stopping.load(Ordering::SeqCst) {
        sys::signal_group(pid, libc::SIGKILL);
    }
    exited.send_replace(Some(how.clone()));
    if stopping.load(Ordering::SeqCst) {
        return;
    }
    warn!(channel = %ctx.info.channel, epoch = ctx.info.epoch.0, pid, %how, "exec: the worker exited on its own; the channel fails (WatchFailed)");
    if loaded.load(Ordering::SeqCst) {
        ctx.fail(format!("the worker exited ({how})"));
    }
}

/// Logs each line the worker writes on `stream`. Reads bytes (a line need not be UTF-8, and
/// a pipe left unread would block the worker).
fn pump(
    reader: impl AsyncRead + Unpin + Send + 'static,
    channel: String,
    epoch: u64,
    pid: u32,
    stream: &'static str,
) {
    const MAX_LINE: usize = 4096;
    tokio::spawn(async move {
        let mut reader = BufReader::new(reader);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line[..line.len().min(MAX_LINE)]);
                    let text = text.trim_end();
                    info!(%channel, epoch, pid, stream, "worker: {text}");
                }
            }
        }
    });
}

/// A job for the spawner thread.
struct SpawnJob {
    cmd: std::process::Command,
    runtime: tokio::runtime::Handle,
    reply: oneshot::Sender<std::io::Result<tokio::process::Child>>,
}

/// Spawner threads: forks with a `pre_exec` hook cannot use `posix_spawn`, so each takes a
/// few milliseconds; several threads spawn a thousand workers in parallel.
const SPAWNERS: usize = 4;

/// Spawns `cmd` from one of the spawner threads, which live as long as the process: the
/// kernel sends `PR_SET_PDEATHSIG` when the *thread* that forked a child exits, so forking
/// from a runtime worker or blocking thread (which come and go) would kill children early.
async fn spawn(cmd: std::process::Command) -> std::io::Result<tokio::process::Child> {
    type Spawners = Vec<Mutex<std::sync::mpsc::Sender<SpawnJob>>>;
    static SPAWNER: OnceLock<Spawners> = OnceLock::new();
    static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let spawners = SPAWNER.get_or_init(|| {
        (0..SPAWNERS)
            .map(|i| {
                let (tx, rx) = std::sync::mpsc::channel::<SpawnJob>();
                let started = std::thread::Builder::new()
                    .name(format!("chanwatch-exec-spawner-{i}"))
                    .spawn(move || {
                        for job in rx {
                            let _runtime = job.runtime.enter();
                            let child = tokio::process::Command::from(job.cmd)
                                .kill_on_drop(true)
                                .spawn();
                            let _ = job.reply.send(child);
                        }
                    });
                if let Err(e) = started {
                    tracing::error!(error = %e, "exec: cannot start a spawner thread; workers sent to it cannot start");
                }
                Mutex::new(tx)
            })
            .collect()
    });
    let spawner = &spawners[NEXT.fetch_add(1, Ordering::Relaxed) % spawners.len()];
    let (reply, answer) = oneshot::channel();
    let job = SpawnJob {
        cmd,
        runtime: tokio::runtime::Handle::current(),
        reply,
    };
    spawner
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .send(job)
        .map_err(|_| std::io::Error::other("the spawner thread is gone"))?;
    answer
        .await
        .map_err(|_| std::io::Error::other("the spawner thread dropped the request"))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_simple_command_is_execd_and_anything_else_runs_under_the_guard() {
        for simple in [
            "python3 worker.py /data",
            "python3 'my worker.py' \"$CHANWATCH_CHANNEL\" > /tmp/log",
            "exec python3 worker.py",
        ] {
            let l = Launch::of(simple);
            assert_eq!(l.death_signal, libc::SIGKILL, "{simple}");
            assert_eq!(l.args.len(), 1, "{simple}");
            assert!(l.args[0].starts_with("exec "), "{simple}");
            assert!(!l.args[0].starts_with("exec exec"), "{simple}");
        }
        for compound in [
            "cd /data && python3 worker.py",
            "python3 worker.py | tee log",
            "env > f; exec sh worker.sh",
            "VAR=1 python3 worker.py",
            "while :; do sleep 1; done",
            "python3 -c 'print(1)'",
            "a\nb",
            "",
        ] {
            let l = Launch::of(compound);
            assert_eq!(l.death_signal, libc::SIGUSR2, "{compound:?}");
            assert_eq!(
                l.args,
                vec![
                    GUARD_SCRIPT.to_owned(),
                    "chanwatch-worker".to_owned(),
                    compound.to_owned()
                ],
                "{compound:?}"
            );
        }
    }
}
