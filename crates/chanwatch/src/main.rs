//! The `chanwatch` binary: applies `--config`, parses the command line and hands it to
//! `cli::main`.
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

/// mimalloc rather than glibc's malloc: with 1,000,000 channels in one process, each
/// allocation of a few KB made glibc consolidate its fast free lists first, which took most
/// of a 1,000-channel failover round (a plan round 140–230 ms under glibc, ~30 ms with its
/// fast lists off; `docs/BENCHMARKS.md`). The libraries leave the choice to the program
/// that embeds them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    // The config file becomes environment variables before the flags are parsed, so flags win.
    if let Err(e) = config::apply(std::env::args_os()) {
        eprintln!("error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    cli::main(cli::Cli::parse())
}
