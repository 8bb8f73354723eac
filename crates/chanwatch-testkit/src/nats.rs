//! A real `nats-server -js` for tests.
//!
//! Owns: starting `nats-server` with JetStream on free loopback ports (clients and
//! monitoring) and a temporary store dir, waiting until JetStream serves, restarting it on
//! the same store dir, and killing it (and removing the dir) on drop. Must not: be used
//! outside tests, or bind anything but 127.0.0.1.
//!
//! The binary is `$CHANWATCH_NATS_BIN` if set, else `nats-server` on `PATH`, else
//! `/usr/sbin/nats-server` (Debian's package). A missing binary is an error that says how to
//! install it: tests fail rather than skip.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::{data_tempdir, free_ports, signal, FixtureError};

/// Finds the nats-server binary.
///
/// # Errors
/// [`FixtureError::NoNatsBinary`] with install instructions.
pub fn nats_binary() -> Result<PathBuf, FixtureError> {
    if let Some(p) = std::env::var_os("CHANWATCH_NATS_BIN") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(FixtureError::NoNatsBinary)
        };
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("nats-server");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let fallback = Path::new("/usr/sbin/nats-server");
    if fallback.is_file() {
        return Ok(fallback.to_path_buf());
    }
    Err(FixtureError::NoNatsBinary)
}

/// A running `nats-server -js`, killed on drop.
#[derive(Debug)]
pub struct NatsFixture {
    child: Option<Child>,
    url: String,
    monitor_port: u16,
    command: Vec<String>,
    dir: tempfile::TempDir,
}

impl NatsFixture {
    /// Starts `nats-server -js -sd DIR -a 127.0.0.1 -p PORT` and waits until JetStream
    /// serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the binary is missing or the server is not ready within 20 s.
    pub async fn start() -> Result<Self, FixtureError> {
        let bin = nats_binary()?;
        let dir = data_tempdir("chanwatch-nats-")?;
        let [port, monitor_port] = free_ports()?;
        let command = vec![
            bin.display().to_string(),
            "-js".to_owned(),
            "-sd".to_owned(),
            dir.path().join("store").display().to_string(),
            "-a".to_owned(),
            "127.0.0.1".to_owned(),
            "-p".to_owned(),
            port.to_string(),
            "-m".to_owned(),
            monitor_port.to_string(),
            "-l".to_owned(),
            dir.path().join("nats.log").display().to_string(),
        ];
        let mut fixture = NatsFixture {
            child: None,
            url: format!("nats://127.0.0.1:{port}"),
            monitor_port,
            command,
            dir,
        };
        fixture.start_again().await?;
        Ok(fixture)
    }

    /// The client URL, e.g. `nats://127.0.0.1:41234`.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The JetStream store dir (`-sd`), kept across restarts.
    pub fn store_dir(&self) -> PathBuf {
        self.dir.path().join("store")
    }

    /// Stops the server gracefully (`SIGTERM`, it flushes its store) and starts it again on
    /// the same port and store dir; clients reconnect on their own.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not serve again within 20 s.
    pub async fn restart(&mut self) -> Result<(), FixtureError> {
        if let Some(mut child) = self.child.take() {
            signal(child.id(), "-TERM")?;
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait()?.is_none() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        self.start_again().await
    }

    /// Kills the server (`SIGKILL`), keeping its store; [`Self::start_again`] brings it back.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server (again, after [`Self::kill`]) on the same port and store dir and
    /// waits until JetStream serves.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not serve within 20 s.
    pub async fn start_again(&mut self) -> Result<(), FixtureError> {
        if self.child.is_none() {
            let (bin, args) = self
                .command
                .split_first()
                .ok_or(FixtureError::NoNatsBinary)?;
            let out = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.path().join("nats.out"))?;
            self.child = Some(
                Command::new(bin)
                    .args(args)
                    .stdin(Stdio::null())
                    .stdout(out.try_clone()?)
                    .stderr(out)
                    .spawn()?,
            );
        }
        self.wait_ready(Duration::from_secs(20)).await
    }

    /// Polls the monitoring endpoint until `/healthz` (JetStream included) answers 200.
    async fn wait_ready(&mut self, timeout: Duration) -> Result<(), FixtureError> {
        let started = Instant::now();
        while started.elapsed() < timeout {
            if let Some(child) = self.child.as_mut() {
                if let Some(status) = child.try_wait()? {
                    return Err(FixtureError::NatsNotReady {
                        timeout,
                        log: format!("nats-server exited ({status})\n{}", self.log_tail()),
                    });
                }
            }
            let probe = healthz(self.monitor_port);
            if let Ok(Ok(true)) = tokio::time::timeout(Duration::from_secs(1), probe).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(FixtureError::NatsNotReady {
            timeout,
            log: self.log_tail(),
        })
    }

    /// The last lines of the server's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let mut text = String::new();
        for name in ["nats.out", "nats.log"] {
            text.push_str(&std::fs::read_to_string(self.dir.path().join(name)).unwrap_or_default());
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

/// `GET /healthz` on the monitoring port: 200 once JetStream is up.
async fn healthz(port: u16) -> std::io::Result<bool> {
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    conn.write_all(b"GET /healthz HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n")
        .await?;
    let mut reply = Vec::new();
    conn.read_to_end(&mut reply).await?;
    Ok(reply.starts_with(b"HTTP/1.0 200") || reply.starts_with(b"HTTP/1.1 200"))
}

impl Drop for NatsFixture {
    fn drop(&mut self) {
        self.kill();
    }
}
