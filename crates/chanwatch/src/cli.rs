//! Command-line definition and dispatch.
//!
//! Owns: flag names, defaults, `--help` texts, and turning flags into library configs.
//! Must not: implement behaviour beyond wiring.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use chanwatch_store::{EmbeddedStore, EtcdConfig, EtcdStore, MetaStore, TlsFiles};
use clap::{Args, Parser, Subcommand, ValueEnum};

/// chanwatch: the channel-assignment control plane of a sharded streaming database.
///
/// A coordinator assigns channels to nodes through etcd transactions; nodes watch their own
/// keys and start or stop channels. See the README for a walk-through.
#[derive(Debug, Parser)]
#[command(name = "chanwatch", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Flags shared by every subcommand.
#[derive(Debug, Args)]
pub struct Global {
    /// Log format: human-readable text or one JSON object per line.
    #[arg(long, global = true, env = "CHANWATCH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

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
    fn config(&self) -> EtcdConfig {
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
            .with_context(|| format!("etcd unreachable at {}", self.endpoints.join(",")))?;
        Ok(Arc::new(store))
    }
}

/// Parses `10s`, `500ms`, `2m`, `1h 30m` (humantime syntax).
pub fn humantime_secs(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration ({e}); use e.g. 10s, 500ms, 2m"))
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Benchmarks; one JSON line per result on stdout, a table on stderr.
    Bench(BenchArgs),
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub what: BenchWhat,
}

#[derive(Debug, Subcommand)]
pub enum BenchWhat {
    /// Store floor: single-key CAS txns (serial and concurrent) and 128-op txns.
    Store(BenchStoreArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum StoreKind {
    Embedded,
    Etcd,
}

#[derive(Debug, Args)]
pub struct BenchStoreArgs {
    /// Which backend to measure.
    #[arg(long, value_enum, default_value_t = StoreKind::Embedded)]
    pub store: StoreKind,
    /// Single-key CAS txns per run [default: 200000 embedded, 2000 etcd].
    #[arg(long)]
    pub txns: Option<usize>,
    /// Concurrent tasks for the concurrent CAS figure.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Operations per batched txn.
    #[arg(long, default_value_t = 128)]
    pub batch_ops: usize,
    /// Repetitions; medians are reported.
    #[arg(long, default_value_t = 5)]
    pub runs: usize,
    #[command(flatten)]
    pub etcd: EtcdArgs,
}

/// Sets up `tracing` with `RUST_LOG` (default `info`) in the chosen format.
pub fn init_logging(global: &Global) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match global.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs the chosen subcommand.
///
/// # Errors
/// Whatever the subcommand reports, as one line for the user.
pub async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Bench(b) => match b.what {
            BenchWhat::Store(args) => {
                let store: Arc<dyn MetaStore> = match args.store {
                    StoreKind::Embedded => Arc::new(EmbeddedStore::new()),
                    StoreKind::Etcd => args.etcd.connect().await?,
                };
                crate::bench::store(store, &args).await
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse_with_units_and_refuse_garbage() {
        assert_eq!(humantime_secs("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(humantime_secs("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(humantime_secs("2m"), Ok(Duration::from_secs(120)));
        assert!(humantime_secs("ten").is_err());
        assert!(humantime_secs("5 parsecs").is_err());
        assert!(humantime_secs("").is_err());
    }
}
