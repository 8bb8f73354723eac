//! One module per subcommand, each owning its clap `Args` and its `run`.
//!
//! Owns: nothing itself; `lifecycle` holds what the long-running subcommands share while they
//! run (shutdown signal, admin listener).
//! Must not: hold flags shared across subcommands (those are in `crate::flags`) or dispatch
//! (that is `crate::cli`).

pub mod audit;
pub mod bench;
pub mod coord;
pub mod ctl;
pub mod demo;
mod lifecycle;
pub mod node;
pub mod produce;
pub mod standalone;
