//! The top of the command line: `Cli` (global flags and the subcommand), logging set-up, the
//! runtime, and dispatch to the subcommand's `run`.
//!
//! Owns: the list of subcommands, the global flags (`--config`, `--log-format`), the default
//! log level per subcommand, and mapping an error to one line and a non-zero exit.
//! Must not: define a subcommand's flags (each `crate::cmd::*` module owns its `Args`; shared
//! groups are in `crate::flags`) or implement behaviour beyond dispatch.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::cmd;

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
    /// A TOML file of flag values (keys are long flag names, e.g. `session-ttl = "5s"`).
    /// Precedence: flags, then environment, then this file.
    #[arg(long, global = true, env = "CHANWATCH_CONFIG")]
    pub config: Option<PathBuf>,
    /// Log format: human-readable text or one JSON object per line.
    #[arg(long, global = true, env = "CHANWATCH_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// A scripted tour on the embedded store: nodes join, channels are assigned, a node dies,
    /// a node joins, a node drains, all die, one returns. Checks invariants at every step.
    Demo,
    /// Coordinator and nodes in one process on the embedded store, with the admin API.
    Standalone(cmd::standalone::Args),
    /// Run a coordinator: campaigns for leadership; the leader assigns channels to nodes.
    Coord(cmd::coord::Args),
    /// Run a node: registers a session, runs the channels assigned to it.
    Node(cmd::node::Args),
    /// Inspect and change the cluster (reads etcd, sends changes to the leader).
    Ctl(cmd::ctl::Args),
    /// Append sequence-numbered messages to channels of a log at a steady rate; write what
    /// was produced per channel to a JSON file (for `audit`).
    Produce(cmd::produce::Args),
    /// Check that the consumer's committed state of every produced channel is exactly what
    /// was produced up to its committed position; a table, then one JSON line.
    Audit(cmd::audit::Args),
    /// Benchmarks; one JSON line per result on stdout, a table on stderr.
    Bench(cmd::bench::Args),
}

/// Sets up `tracing` with `RUST_LOG` (default `default_level`) in the chosen format. Colours
/// only when stderr is a terminal and `NO_COLOR` is unset: a log file, the journal or a pipe
/// gets plain text.
pub fn init_logging(global: &Global, default_level: &str) {
    use std::io::IsTerminal;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none())
        .with_writer(std::io::stderr);
    match global.log_format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

/// Runs the chosen subcommand on a fresh runtime, with logging set up; the exit code says
/// whether it succeeded (the error, if any, printed as one line).
pub fn main(cli: Cli) -> ExitCode {
    // The demo and ctl print tables for a person; their logs would only clutter them.
    let default_level = match cli.command {
        // The tour kills in-process nodes, whose consumer tasks outlive them until their next
        // commit is fenced (a killed process's would not): their "fenced; stopping" warnings
        // are the kill step's own, and came between the tour's steps.
        Command::Demo => "warn,chanwatch_node::handler::consumer=error",
        Command::Ctl(_) | Command::Bench(_) | Command::Produce(_) | Command::Audit(_) => "warn",
        _ => "info",
    };
    init_logging(&cli.global, default_level);
    // The benchmark's compiled worker is a blocking loop, run by the thousand on one machine:
    // no runtime of its own (threads, an epoll set, a timer in every one of them).
    if let Command::Bench(cmd::bench::Args {
        what: cmd::bench::What::ExecWorker(args),
    }) = &cli.command
    {
        return match cmd::bench::exec_worker(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the chosen subcommand.
///
/// # Errors
/// Whatever the subcommand reports, as one line for the user.
pub async fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Demo => cmd::demo::run().await,
        Command::Standalone(args) => cmd::standalone::run(args).await,
        Command::Coord(args) => cmd::coord::run(args).await,
        Command::Node(args) => cmd::node::run(args).await,
        Command::Ctl(args) => cmd::ctl::run(args).await,
        Command::Bench(args) => cmd::bench::run(args).await,
        Command::Produce(args) => cmd::produce::run(args).await,
        Command::Audit(args) => cmd::audit::run(args).await,
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
}
