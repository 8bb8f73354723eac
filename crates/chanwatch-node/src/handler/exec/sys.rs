//! The exec handler's only `unsafe` code (the node crate denies `unsafe_code` everywhere
//! else): the `pre_exec` hook that ties a worker's life to the node's, and `kill(2)` of a
//! worker's process group.
//!
//! Owns: those two system calls. Must not: grow — anything that can be done safely is done in
//! `exec.rs`.
#![allow(unsafe_code)]

use std::os::unix::process::CommandExt;

/// Makes the child spawned by `cmd` receive `signal` (`SIGKILL` for a worker exec'd directly,
/// `SIGUSR2` for a guard shell, whose trap kills the worker's process group on it) when the
/// thread that spawns it exits
/// (`PR_SET_PDEATHSIG`: the kernel ties it to the forking *thread*, so the caller spawns from
/// a thread that lives as long as the process), and refuses to exec when the node already died
/// between the fork and the `prctl` (its parent is then no longer the node).
pub(super) fn die_with_node(cmd: &mut std::process::Command, signal: libc::c_int) {
    let node = libc::pid_t::try_from(std::process::id()).unwrap_or(libc::pid_t::MAX);
    // SAFETY: the closure runs in the forked child before `exec`. It calls only `prctl` and
    // `getppid` (both async-signal-safe), builds errors without allocating, and touches no
    // lock or memory shared with the parent.
    unsafe {
        cmd.pre_exec(move || {
            let sig = libc::c_ulong::try_from(signal).unwrap_or(9);
            if libc::prctl(libc::PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if libc::getppid() != node {
                return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// Sends `signal` (`libc::SIGTERM`, `libc::SIGKILL`, or 0: only whether any is left) to every
/// process of the group `pgid`;
/// false when no process is left in it (or the group ID does not fit a `pid_t`).
pub(super) fn signal_group(pgid: u32, signal: libc::c_int) -> bool {
    let Ok(pgid) = libc::pid_t::try_from(pgid) else {
        return false;
    };
    if pgid <= 1 {
        return false;
    }
    // SAFETY: `kill` takes plain integers and touches no memory of ours; a negative pid names
    // the process group, which is the worker's own (it was spawned as its group's leader).
    unsafe { libc::kill(-pgid, signal) == 0 }
}
