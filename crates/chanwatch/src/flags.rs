//! Flag groups more than one subcommand flattens into its `Args`, and the parsers they use.
//!
//! Owns: how to reach etcd (`EtcdArgs`, and connecting with them), the key root (`RootArg`),
//! who may use the admin API (`AdminAccess`: token, allowed hosts, and the refusal to serve a
//! non-loopback API without a token), the hidden switches of the built-in simulated load
//! (`TestLoadArgs`), the data plane's log and handler choice (`LogArgs`, `HandlerArgs`), and the
//! duration parser (`humantime_secs`).
//!
//! Must not: depend on anything else of the binary (it is the leaf every subcommand uses), or
//! hold a flag only one subcommand has: that belongs in the subcommand's own `Args`. Flags are
//! grouped here only where name, environment variable, default and help text are the same
//! everywhere (each `--session-ttl` says what the TTL means for its part, so it is not here).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use chanwatch_core::Keys;
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore, TlsFiles, MIN_SESSION_TTL};
use clap::Args;

/// How to reach etcd (used by every subcommand that talks to a real store).
#[derive(Debug, Clone, Args)]
pub struct EtcdArgs {
    /// etcd endpoints, comma-separated.
    #[arg(
        long,
        env = "CHANWATCH_ENDPOINTS",
        value_delimiter = ',',
        default_value = "http://127.0.0.1:2379"
    )]
    pub endpoints: Vec<String>,
    /// How long to wait for etcd to answer when connecting.
    #[arg(long, env = "CHANWATCH_CONNECT_TIMEOUT", value_parser = humantime_secs, default_value = "5s")]
    pub connect_timeout: Duration,
    /// etcd username (auth enabled).
    #[arg(long, env = "CHANWATCH_ETCD_USER", requires = "etcd_password")]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(
        long,
        env = "CHANWATCH_ETCD_PASSWORD",
        requires = "etcd_user",
        hide_env_values = true
    )]
    pub etcd_password: Option<String>,
    /// CA certificate (PEM) to verify etcd's TLS certificate.
    #[arg(long, env = "CHANWATCH_ETCD_CA")]
    pub etcd_ca: Option<PathBuf>,
    /// Client certificate (PEM) for mutual TLS.
    #[arg(long, env = "CHANWATCH_ETCD_CERT", requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// Client private key (PEM) for mutual TLS.
    #[arg(long, env = "CHANWATCH_ETCD_KEY", requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
}

impl EtcdArgs {
    pub fn config(&self) -> EtcdConfig {
        let tls = (self.etcd_ca.is_some() || self.etcd_cert.is_some()).then(|| TlsFiles {
            ca: self.etcd_ca.clone(),
            cert: self.etcd_cert.clone(),
            key: self.etcd_key.clone(),
        });
        EtcdConfig {
            endpoints: self.endpoints.clone(),
            connect_timeout: self.connect_timeout,
            user: self.etcd_user.clone().zip(self.etcd_password.clone()),
            tls,
            ..EtcdConfig::default()
        }
    }

    /// Connects to etcd.
    ///
    /// # Errors
    /// One line saying which endpoints did not answer and what to check.
    pub async fn connect(&self) -> Result<Arc<dyn MetaStore>> {
        let store = EtcdStore::connect(self.config())
            .await
            .map_err(|e| self.naming_endpoints(e))?;
        Ok(Arc::new(store))
    }

    /// Connects to etcd with a connection check that reads only under the root
    /// (`{root}/id/node`, readable by every part's role), so prefix-limited roles work.
    ///
    /// # Errors
    /// One line saying which endpoints did not answer and what to check.
    pub async fn connect_under(&self, keys: &Keys) -> Result<Arc<dyn MetaStore>> {
        let config = EtcdConfig {
            probe_key: Some(keys.node_id_counter()),
            ..self.config()
        };
        let store = EtcdStore::connect(config)
            .await
            .map_err(|e| self.naming_endpoints(e))?;
        Ok(Arc::new(store))
    }

    /// `e`, saying which endpoints unless its words do already (they said the URL twice).
    fn naming_endpoints(&self, e: chanwatch_store::StoreError) -> anyhow::Error {
        let at = self.endpoints.join(",");
        if e.to_string().contains(&at) {
            anyhow::Error::new(e)
        } else {
            anyhow::Error::new(e).context(format!("etcd at {at}"))
        }
    }

    /// Like [`Self::connect_under`], for long-running processes: while etcd is down, out of
    /// space or otherwise failing in a way that can pass, waits (logging why) and tries
    /// again; only a configuration error (bad URL, unreadable TLS file, refused credentials
    /// or role) ends it.
    ///
    /// # Errors
    /// The configuration error.
    pub async fn connect_waiting(&self, keys: &Keys) -> Result<Arc<dyn MetaStore>> {
        let config = EtcdConfig {
            probe_key: Some(keys.node_id_counter()),
            ..self.config()
        };
        let mut wait = Duration::from_millis(500);
        loop {
            match EtcdStore::connect(config.clone()).await {
                Ok(store) => return Ok(Arc::new(store)),
                Err(e) if !e.is_config() => {
                    tracing::warn!(error = %e, ?wait, "cannot connect to etcd yet; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(self.naming_endpoints(e)),
            }
        }
    }
}

/// Parses `10s`, `500ms`, `2m`, `1h 30m` (humantime syntax).
pub fn humantime_secs(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration ({e}); use e.g. 10s, 500ms, 2m"))
}

/// Parses a `--session-ttl`: a duration of at least [`MIN_SESSION_TTL`], the same rule for
/// `coord`, `node` and `standalone`.
pub fn session_ttl(s: &str) -> Result<Duration, String> {
    let ttl = humantime_secs(s)?;
    if ttl < MIN_SESSION_TTL {
        return Err(format!(
            "{s:?} is below the minimum session TTL of {MIN_SESSION_TTL:?} (a lease that short can expire between two keepalives); use {MIN_SESSION_TTL:?} or more"
        ));
    }
    Ok(ttl)
}

/// Checks a node's `--fence-margin` against its `--session-ttl`. At least the default
/// (`max(1s, ttl/5)`): less would let a node cut off from etcd run its channels too close to
/// its lease's end. At most a third of the TTL less 1s (or the default, when that is
/// larger): a keepalive comes a third of the TTL after the last one and, unanswered, is
/// given a sixth of the TTL before the next goes at once to the next etcd member; this
/// margin leaves room for two in a row that hang, a larger one might not.
///
/// # Errors
/// What is wrong and the range to use, in flag terms.
pub fn check_fence_margin(ttl: Duration, margin: Duration) -> Result<(), String> {
    let least = chanwatch_store::fence_margin(ttl);
    // In whole milliseconds, so that the error names a range one can type.
    let third_ms = u64::try_from(ttl.as_millis() / 3).unwrap_or(u64::MAX);
    let most = Duration::from_millis(third_ms.saturating_sub(1_000)).max(least);
    if margin < least || margin > most {
        return Err(format!(
            "--fence-margin {} is outside {} to {} (inclusive) for --session-ttl {}: a smaller margin lets a node cut off from etcd run its channels too close to its lease's end, and with a larger one two keepalives in a row that hang (each waits a sixth of the TTL) could pause a healthy node; give a margin in that range, or a longer --session-ttl",
            humantime::format_duration(margin),
            humantime::format_duration(least),
            humantime::format_duration(most),
            humantime::format_duration(ttl),
        ));
    }
    Ok(())
}

/// The root prefix of every key.
#[derive(Debug, Clone, Args)]
pub struct RootArg {
    /// Prefix under which chanwatch keeps all its keys.
    #[arg(long, env = "CHANWATCH_ROOT", default_value = "chanwatch")]
    pub root: String,
}

impl RootArg {
    /// The key layout under `--root`.
    ///
    /// # Errors
    /// A root that is not a valid key prefix, naming the flag.
    pub fn keys(&self) -> Result<Keys> {
        Keys::new(self.root.clone()).map_err(|e| anyhow::anyhow!("--root: {e}"))
    }
}

/// Who may use a served admin API (coordinator and standalone).
#[derive(Debug, Clone, Args)]
pub struct AdminAccess {
    /// Bearer token required for admin writes; mandatory when --admin is not loopback.
    #[arg(long, env = "CHANWATCH_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Host names the admin API answers to besides IP addresses and localhost (comma-separated,
    /// e.g. the DNS name Prometheus scrapes); any other Host header is refused (DNS rebinding).
    #[arg(long, env = "CHANWATCH_ADMIN_HOST", value_delimiter = ',')]
    pub admin_host: Vec<String>,
}

impl AdminAccess {
    /// The admin token to require of an API served on `addr`. Refuses to serve a non-loopback
    /// admin API without one: anyone who can reach it could move every channel.
    ///
    /// # Errors
    /// An empty token, or none for a non-loopback address.
    pub fn token_for(&self, addr: SocketAddr) -> Result<Option<String>> {
        match &self.admin_token {
            Some(t) if t.is_empty() => {
                anyhow::bail!("--admin-token is empty; give a secret or leave it out")
            }
            Some(t) => Ok(Some(t.clone())),
            None if addr.ip().is_loopback() => Ok(None),
            None => anyhow::bail!(
                "refusing to serve the admin API on {addr} (not loopback) without --admin-token \
                 (or CHANWATCH_ADMIN_TOKEN): anyone who reaches it could move every channel"
            ),
        }
    }
}

/// Switches for black-box tests of the built-in simulated load, hidden from `--help`.
#[derive(Debug, Clone, Default, Args)]
pub struct TestLoadArgs {
    /// FOR TESTS: loads of channels matching these comma-separated globs (`*` = any run of
    /// characters) fail at once, so the channel becomes WatchFailed.
    #[arg(
        long,
        env = "CHANWATCH_FAIL_LOAD",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub fail_load: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: loads of matching channels never finish and report no progress.
    #[arg(
        long,
        env = "CHANWATCH_HANG_LOAD",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub hang_load: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: matching channels load, run for --fail-running-after, then report
    /// themselves broken (the node stops them and acknowledges WatchFailed).
    #[arg(
        long,
        env = "CHANWATCH_FAIL_RUNNING",
        hide = true,
        value_name = "GLOB,..."
    )]
    pub fail_running: Option<chanwatch_node::NamePatterns>,
    /// FOR TESTS: how long a --fail-running channel runs before it breaks.
    #[arg(long, env = "CHANWATCH_FAIL_RUNNING_AFTER", hide = true, value_parser = humantime_secs, default_value = "1s")]
    pub fail_running_after: Duration,
}

impl TestLoadArgs {
    /// The simulated load with these switches.
    pub fn simulated_load(&self, load_delay: Duration) -> chanwatch_node::SimulatedLoad {
        chanwatch_node::SimulatedLoad {
            load_delay,
            fail_load: self.fail_load.clone().unwrap_or_default(),
            hang_load: self.hang_load.clone().unwrap_or_default(),
            fail_running: self.fail_running.clone().unwrap_or_default(),
            fail_running_after: self.fail_running_after,
        }
    }
}

/// Which log the data plane uses (`node`, `standalone`, `produce`, `audit`).
#[derive(Debug, Clone, Default, Args)]
pub struct LogArgs {
    /// The channels' log: `file:DIR` (the embedded file log) or `nats://HOST:PORT` (NATS
    /// JetStream, `nats-server -js`).
    #[arg(long = "log", env = "CHANWATCH_LOG", value_name = "URL")]
    pub log: Option<String>,
    /// The JetStream stream (one per root; subjects `{stream}.{channel}`); default: the root
    /// with every character but `[A-Za-z0-9_-]` made `_`. Unused by the file log.
    #[arg(long, env = "CHANWATCH_STREAM")]
    pub stream: Option<String>,
}

impl LogArgs {
    /// The URL given, or `default`.
    ///
    /// # Errors
    /// Neither given.
    pub fn url(&self, default: Option<String>) -> Result<String> {
        self.log
            .clone()
            .or(default)
            .context("--log is required: file:DIR or nats://HOST:PORT")
    }

    /// Opens the log (`default` when no `--log`), waiting while it cannot be reached (a NATS
    /// server not up yet) and failing at once for a bad URL.
    ///
    /// # Errors
    /// No URL, a URL of no known kind, an unusable directory.
    pub async fn open(
        &self,
        keys: &Keys,
        default: Option<String>,
    ) -> Result<Arc<dyn chanwatch_stream::Log>> {
        let url = self.url(default)?;
        let stream = self.stream.clone().unwrap_or_else(|| {
            keys.root()
                .chars()
                .map(|c| {
                    if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                        c
                    } else {
                        '_'
                    }
                })
                .collect::<String>()
                .trim_matches('_')
                .to_owned()
        });
        let stream = if stream.is_empty() {
            "chanwatch".to_owned()
        } else {
            stream
        };
        let mut wait = Duration::from_millis(200);
        loop {
            match chanwatch_stream::open(&url, &stream).await {
                Ok(log) => return Ok(log),
                Err(e) if matches!(e, chanwatch_stream::LogError::Unavailable { .. }) => {
                    tracing::warn!(%url, error = %e, "cannot reach the log yet; retrying");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(Duration::from_secs(5));
                }
                Err(e) => return Err(anyhow::anyhow!("--log {url}: {e}")),
            }
        }
    }
}

/// Which handler runs the channels.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum HandlerKind {
    /// The built-in simulated load (a timer; consumes nothing).
    #[default]
    Simulated,
    /// The stream consumer: reads each channel from `--log` at its checkpoint, folds every
    /// message, commits (position, state) by fenced txn.
    Stream,
}

/// The handler a node runs, and the stream consumer's settings (`node`, `standalone`).
#[derive(Debug, Clone, Args)]
pub struct HandlerArgs {
    /// The channel handler: `simulated` (a timed load) or `stream` (consume `--log`).
    #[arg(long, env = "CHANWATCH_HANDLER", value_enum, default_value_t = HandlerKind::Simulated)]
    pub handler: HandlerKind,
    #[command(flatten)]
    pub log: LogArgs,
    /// The stream consumer commits after this many messages…
    #[arg(long, env = "CHANWATCH_COMMIT_EVERY", default_value_t = 100)]
    pub commit_every: u64,
    /// …or this long after its last commit, whichever comes first.
    #[arg(long, env = "CHANWATCH_COMMIT_INTERVAL", value_parser = humantime_secs, default_value = "1s")]
    pub commit_interval: Duration,
    /// Run a worker process per channel instead of a built-in handler: CMD is shell text (quote
    /// it as one argument; no `exec` needed: the node keeps the whole process tree, and it dies
    /// with the node). It gets
    /// CHANWATCH_CHANNEL, CHANWATCH_EPOCH, CHANWATCH_NODE, CHANWATCH_VCHANNEL (JSON),
    /// CHANWATCH_RESUME_POSITION, CHANWATCH_RESUME_STATE (JSON), CHANWATCH_AGENT_URL,
    /// CHANWATCH_AGENT_TOKEN and CHANWATCH_AGENT_SOCKET (the same API on a Unix socket), and
    /// calls the agent API with the token as bearer: POST /ready, /progress {percent},
    /// /commit {position, state?} (409: fenced, exit; 503: paused or store away, retry),
    /// /fail {reason}; GET /state (running|paused); with --log,
    /// GET /read?after=POS&max=N&wait_ms=MS (the channel's next messages). Its exit fails
    /// the channel; release sends SIGTERM to its process group, SIGKILL after --stop-grace.
    #[arg(long, env = "CHANWATCH_EXEC", value_name = "CMD")]
    pub exec: Option<String>,
    /// How long a released --exec worker gets between SIGTERM and SIGKILL (keep it well under
    /// the coordinator's --release-timeout: a release not acked in time fences the node).
    #[arg(long, env = "CHANWATCH_STOP_GRACE", value_parser = humantime_secs, default_value = "10s")]
    pub stop_grace: Duration,
    /// Where the agent API of --exec workers listens (port 0: a free port).
    #[arg(long, env = "CHANWATCH_AGENT", default_value = "127.0.0.1:0")]
    pub agent: String,
    /// An --exec worker's load is done once it is spawned (do not wait for its POST /ready).
    #[arg(long, env = "CHANWATCH_READY_ON_START")]
    pub ready_on_start: bool,
}

impl HandlerArgs {
    /// The exec handler when `--exec` is given, its agent API bound, serving `--log` (if
    /// given) at `GET /read`; `None` otherwise.
    ///
    /// # Errors
    /// `--exec` with `--handler stream`, an empty command, an agent address that cannot be
    /// bound, a `--log` that cannot be opened.
    pub async fn exec(&self, keys: &Keys) -> Result<Option<chanwatch_node::ExecHandler>> {
        let Some(command) = &self.exec else {
            return Ok(None);
        };
        anyhow::ensure!(
            self.handler == HandlerKind::Simulated,
            "--exec runs a worker process per channel; it cannot be combined with --handler stream"
        );
        let options = chanwatch_node::ExecOptions {
            command: command.clone(),
            stop_grace: self.stop_grace,
            ready_on_start: self.ready_on_start,
        };
        let mut handler = chanwatch_node::ExecHandler::bind(options, &self.agent).await?;
        if self.log.log.is_some() {
            handler = handler.with_log(self.log.open(keys, None).await?);
        }
        tracing::info!(agent = handler.agent_url(), command = %command, "exec: workers will be spawned per channel");
        Ok(Some(handler))
    }

    /// The stream consumer on its log (`default_log` when no `--log`), or `None` for the
    /// simulated load.
    ///
    /// # Errors
    /// As [`LogArgs::open`].
    pub async fn consumer(
        &self,
        keys: &Keys,
        default_log: Option<String>,
    ) -> Result<Option<chanwatch_node::handler::StreamConsumer>> {
        if self.handler != HandlerKind::Stream {
            return Ok(None);
        }
        let log = self.log.open(keys, default_log).await?;
        Ok(Some(chanwatch_node::handler::StreamConsumer::new(
            log,
            chanwatch_node::handler::ConsumerOptions {
                commit_every: self.commit_every.max(1),
                commit_interval: self.commit_interval,
                ..chanwatch_node::handler::ConsumerOptions::default()
            },
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units_and_refuse_garbage() {
        assert_eq!(humantime_secs("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(humantime_secs("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_secs("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_secs("ten").is_err());
        assert!(humantime_secs("5 parsecs").is_err());
        assert!(humantime_secs("").is_err());
    }

    #[test]
    fn a_fence_margin_runs_from_the_default_to_a_third_of_the_ttl_less_a_second() {
        let s = Duration::from_secs;
        assert!(check_fence_margin(s(30), s(6)).is_ok()); // the default, ttl / 5
        assert!(check_fence_margin(s(30), s(9)).is_ok()); // 30 / 3 - 1
        assert!(check_fence_margin(s(2), s(1)).is_ok()); // short TTLs: the default only
        let low = check_fence_margin(s(30), s(5)).expect_err("5s is below the default of 6s");
        assert!(
            low.contains("outside 6s to 9s (inclusive) for --session-ttl 30s"),
            "{low}"
        );
        assert!(check_fence_margin(s(30), Duration::from_millis(9_001)).is_err());
        assert!(check_fence_margin(s(2), Duration::from_millis(1_001)).is_err());
    }

    #[test]
    fn coord_node_and_standalone_refuse_the_same_short_session_ttl() {
        use crate::cli::Cli;
        use clap::Parser;
        for sub in ["coord", "node", "standalone"] {
            let err = Cli::try_parse_from(["chanwatch", sub, "--session-ttl", "1s"])
                .expect_err("1s is too short")
                .to_string();
            assert!(err.contains("minimum session TTL of 2s"), "{sub}: {err}");
            Cli::try_parse_from(["chanwatch", sub, "--session-ttl", "2s"])
                .unwrap_or_else(|e| panic!("{sub}: 2s is enough: {e}"));
        }
    }
}
