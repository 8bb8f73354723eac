//! The `chanwatch` binary: the allocator, then [`chanwatch::main`].
//!
//! Must not: hold anything else; the code is in the package's library (`lib.rs`).

/// mimalloc rather than glibc's malloc: with 1,000,000 channels in one process, each
/// allocation of a few KB made glibc consolidate its fast free lists first, which took most
/// of a 1,000-channel failover round (a plan round 140–230 ms under glibc, ~30 ms with its
/// fast lists off; `docs/BENCHMARKS.md`). The libraries leave the choice to the program
/// that embeds them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> std::process::ExitCode {
    chanwatch::main()
}
