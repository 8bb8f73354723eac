//! The `chanwatch` binary: parses flags, builds the parts, runs the chosen subcommand.
//!
//! Owns: the command line (every flag also from a `CHANWATCH_*` environment variable),
//! logging set-up and the mapping of errors to one clear line and a non-zero exit.
//!
//! Must not: hold control-plane logic; that lives in the library crates.

mod bench;
mod bench_system;
mod cli;
mod cmd;
mod config;
mod ctl;
mod demo;
mod inproc;
mod sim;

use clap::Parser;

fn main() -> std::process::ExitCode {
    // The config file becomes environment variables before the flags are parsed, so flags win.
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    if let Some(path) = config::config_path(&args) {
        match config::load(std::path::Path::new(&path)) {
            // Single-threaded here: no runtime or thread exists yet.
            Ok(vars) => vars.into_iter().for_each(|(k, v)| std::env::set_var(k, v)),
            Err(e) => {
                eprintln!("error: {e:#}");
                return std::process::ExitCode::FAILURE;
            }
        }
    }
    let cli = cli::Cli::parse();
    // The demo and ctl print tables for a person; their logs would only clutter them.
    let default_level = match cli.command {
        cli::Command::Demo | cli::Command::Ctl(_) | cli::Command::Bench(_) => "warn",
        // Thousands of simulated failures would log thousands of warnings.
        cli::Command::Sim(_) => "off",
        _ => "info",
    };
    cli::init_logging(&cli.global, default_level);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(cli::run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
