//! The `chanwatch` binary's code, as a library of one function ([`main`]) so that its tests can
//! build it with the `planted-bugs` feature (a package's dev-dependency on itself needs a
//! library): applies `--config`, parses the command line and hands it to `cli::main`.
//!
//! Every flag can also come from a `CHANWATCH_*` environment variable or a `--config` file.
//! The modules: `cli` (the subcommand list, logging, dispatch), `cmd::*` (one per subcommand,
//! each with its `Args` and `run`), `flags` (flag groups several subcommands share), `config`
//! (`--config FILE`), `inproc` (an in-process cluster for demo, standalone and bench).
//!
//! Must not: hold control-plane logic; that lives in the library crates.

mod cli;
mod cmd;
mod config;
mod flags;
mod inproc;

use clap::Parser;

/// Runs the command line of this process; the exit code says whether it succeeded.
pub fn main() -> std::process::ExitCode {
    // The config file becomes environment variables before the flags are parsed, so flags win.
    if let Err(e) = config::apply(std::env::args_os()) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    cli::main(cli::Cli::parse())
}
