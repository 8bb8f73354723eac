//! Helpers shared by the integration tests that run the real binary: a child process whose
//! stdout and stderr go to a file, killed when dropped; `ctl` against an etcd; a free port.
#![allow(dead_code)] // each test binary uses some of these helpers

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

/// A process of the binary, killed on drop.
pub struct Proc {
    child: Child,
    out: PathBuf,
}

impl Proc {
    /// Its process ID (a coordinator's default `--id` is `coord-{pid}`).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Whether it still runs.
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// Sends it `signal` (e.g. `TERM`) with `kill`.
    pub fn signal(&self, signal: &str) {
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.child.id().to_string())
            .status()
            .is_ok_and(|s| s.success());
        assert!(ok, "kill -{signal} {} failed", self.child.id());
    }

    /// Its exit code once it has exited (`Some(-1)`: killed by a signal).
    pub fn exit_code(&mut self) -> Option<i32> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(status.code().unwrap_or(-1)),
            _ => None,
        }
    }

    /// What it printed so far (stdout and stderr).
    pub fn output(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        // A stopped process (a test's SIGSTOP) dies of SIGKILL too, but resume it first so
        // that nothing of it lingers stopped.
        let _ = Command::new("kill")
            .arg("-CONT")
            .arg(self.child.id().to_string())
            .status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The binary under test.
pub fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_chanwatch"))
}

/// Starts `chanwatch ARGS` with `RUST_LOG=info` (or the test's `CHANWATCH_TEST_RUST_LOG`, to
/// debug a test), its output in `DIR/NAME.out`.
pub fn spawn(dir: &Path, name: &str, args: &[String]) -> Proc {
    let out = dir.join(format!("{name}.out"));
    let file = std::fs::File::create(&out).expect("output file");
    let child = Command::new(bin())
        .args(args)
        .env(
            "RUST_LOG",
            std::env::var("CHANWATCH_TEST_RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("dup"))
        .stderr(file)
        .spawn()
        .expect("spawn chanwatch");
    Proc { child, out }
}

/// Runs `chanwatch ctl --endpoints=ENDPOINT ARGS` and returns what it did.
pub fn ctl(endpoint: &str, args: &[&str]) -> Output {
    Command::new(bin())
        .arg("ctl")
        .arg(format!("--endpoints={endpoint}"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run ctl")
}

#[allow(unused_imports)]
// not every test binary that includes this module starts processes on a port
pub use chanwatch_testkit::free_port;
