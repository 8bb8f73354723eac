//! `chanwatch-lab`: the lab binary — tools that need test code, kept out of the `chanwatch`
//! binary users deploy. Today one subcommand, `sim`: whole clusters on simulated time under
//! seeded faults (`chanwatch-sim`, which runs on the fault-injecting store and tokio's paused
//! clock), with the planted bugs that prove its checker works.
//!
//! Owns: parsing the lab's command line and dispatch. Must not: be depended on by any product
//! crate, or hold simulation logic (that is `chanwatch-sim`).

mod sim;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// chanwatch-lab: lab tools for chanwatch's developers (not the binary to deploy).
#[derive(Debug, Parser)]
#[command(name = "chanwatch-lab", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Deterministic simulation: whole clusters (2 coordinators, nodes, embedded store) on
    /// simulated time under seeded random faults, checking the invariants of DESIGN.md §6
    /// after every step. The same seed always replays the same run.
    Sim(sim::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        // Each seed runs on a runtime of its own, on plain threads; thousands of simulated
        // failures would log thousands of warnings, so nothing is logged — except when one
        // seed is replayed with RUST_LOG set (`RUST_LOG=chanwatch_node=debug ... --seed S
        // --trace`): the processes' own log lines then go to stderr, between the trace's.
        Command::Sim(args) => {
            if args.seed.is_some() && std::env::var_os("RUST_LOG").is_some() {
                tracing_subscriber::fmt()
                    .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
                    .with_writer(std::io::stderr)
                    .without_time()
                    .init();
            }
            sim::run(&args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
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
