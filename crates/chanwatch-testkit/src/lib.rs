//! Test fixtures shared by the integration tests of every crate.
//!
//! The single-member fixture is here; the 3-member cluster in `cluster.rs`, whole-cluster
//! faults in `cluster_faults.rs`, the proxy in `grpc_proxy.rs`, the nats-server fixture in
//! `nats.rs`.
//!
//! Owns: starting a real `etcd` process on free loopback ports with a temporary data dir,
//! waiting until it serves, and killing it (and removing the dir) when the fixture drops;
//! faults that keep the data: kill and start again, freeze and thaw (one fixture), kill and
//! start again (members of a cluster); an HTTP/2 proxy in front of a fixture that can stall
//! its watch streams while every other call flows ([`GrpcProxy`]); a `nats-server -js` with
//! a temporary store dir ([`NatsFixture`]). The in-process cluster is a product crate of its
//! own, `chanwatch-cluster`.
//!
//! Must not: be used outside tests and lab tools (no product crate depends on it), or bind
//! anything but 127.0.0.1.
//!
//! The binary is `$CHANWATCH_ETCD_BIN` if set, else `etcd` on `PATH`, else `/usr/bin/etcd`.
//! A missing binary is an error that says how to install it: integration tests fail rather
//! than silently skip.

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use thiserror::Error;

mod cluster;
mod cluster_faults;
pub use cluster::EtcdCluster;
mod grpc_proxy;
mod nats;
pub use cluster_faults::ClusterOptions;
pub use grpc_proxy::{GrpcProxy, ProxyError, WATCH_PATH};
pub use nats::{nats_binary, NatsFixture};

/// Why an etcd fixture could not start.
#[derive(Debug, Error)]
pub enum FixtureError {
    /// No etcd binary was found.
    #[error(
        "no etcd binary found (looked at $CHANWATCH_ETCD_BIN, PATH and /usr/bin/etcd); \
         install it with `apt-get install -y etcd-server` or set CHANWATCH_ETCD_BIN"
    )]
    NoBinary,
    /// No nats-server binary was found.
    #[error(
        "no nats-server binary found (looked at $CHANWATCH_NATS_BIN, PATH and \
         /usr/sbin/nats-server); install it with `apt-get install -y nats-server` or set \
         CHANWATCH_NATS_BIN"
    )]
    NoNatsBinary,
    /// nats-server started but JetStream did not serve in time (or the process exited).
    #[error("nats-server did not become ready within {timeout:?}; its log:\n{log}")]
    NatsNotReady {
        /// How long we waited.
        timeout: Duration,
        /// The tail of its log.
        log: String,
    },
    /// Starting the process or making its data dir failed.
    #[error("could not start etcd or nats-server: {0}")]
    Io(#[from] std::io::Error),
    /// An `etcdctl` command failed.
    #[error("etcdctl {args:?} failed: {stderr}")]
    Etcdctl {
        /// Its arguments.
        args: Vec<String>,
        /// What it printed on stderr.
        stderr: String,
    },
    /// A client call to the fixture failed while setting it up.
    #[error("etcd set-up call failed: {0}")]
    Client(#[from] etcd_client::Error),
    /// etcd started but did not serve in time.
    #[error("etcd did not become healthy within {timeout:?}; its log:\n{log}")]
    NotHealthy {
        /// How long we waited.
        timeout: Duration,
        /// The tail of etcd's log.
        log: String,
    },
}

/// Extra server flags for a fixture.
#[derive(Debug, Clone, Default)]
pub struct EtcdOptions {
    /// Extra command-line flags passed to etcd as they are.
    pub extra_args: Vec<String>,
    /// Serve clients over TLS with client-certificate auth, with certificates made for the
    /// fixture (see [`EtcdFixture::tls`]).
    pub tls: bool,
    /// Enable etcd auth with user `root` and this password.
    pub root_password: Option<String>,
    /// `--quota-backend-bytes`: a small quota (e.g. 300 KB) fills quickly, so a test can see
    /// the NOSPACE alarm.
    pub quota_backend_bytes: Option<u64>,
}

/// PEM files made for a TLS fixture: a CA, the server's certificate, a client certificate.
#[derive(Debug, Clone)]
pub struct TlsMaterial {
    /// The CA that signed both certificates.
    pub ca: PathBuf,
    /// Client certificate.
    pub client_cert: PathBuf,
    /// Client key.
    pub client_key: PathBuf,
    server_cert: PathBuf,
    server_key: PathBuf,
}

/// Makes a CA and server/client certificates for 127.0.0.1 with the `openssl` command.
fn make_certs(dir: &Path) -> Result<TlsMaterial, FixtureError> {
    let run = |args: &[&str]| -> Result<(), FixtureError> {
        let out =
            Command::new("openssl")
                .args(args)
                .current_dir(dir)
                .output()
                .map_err(|e| {
                    FixtureError::Io(std::io::Error::new(
                e.kind(),
                format!("cannot run openssl ({e}); install it with `apt-get install -y openssl`"),
            ))
                })?;
        if out.status.success() {
            Ok(())
        } else {
            Err(FixtureError::Io(std::io::Error::other(format!(
                "openssl {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ))))
        }
    };
    let ext = dir.join("san.ext");
    std::fs::write(
        &ext,
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
    )?;
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=chanwatch-test-ca",
    ])?;
    for who in ["server", "client"] {
        run(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            &format!("{who}.key"),
            "-out",
            &format!("{who}.csr"),
            "-subj",
            &format!("/CN={who}"),
        ])?;
        run(&[
            "x509",
            "-req",
            "-in",
            &format!("{who}.csr"),
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            &format!("{who}.pem"),
            "-days",
            "2",
            "-extfile",
            "san.ext",
        ])?;
    }
    Ok(TlsMaterial {
        ca: dir.join("ca.pem"),
        client_cert: dir.join("client.pem"),
        client_key: dir.join("client.key"),
        server_cert: dir.join("server.pem"),
        server_key: dir.join("server.key"),
    })
}

/// A running etcd process, killed on drop.
#[derive(Debug)]
pub struct EtcdFixture {
    child: Child,
    client_url: String,
    data_dir: tempfile::TempDir,
    command: Vec<String>,
    tls: Option<TlsMaterial>,
    root_password: Option<String>,
}

/// Finds the etcd binary.
///
/// # Errors
/// [`FixtureError::NoBinary`] with install instructions.
pub fn etcd_binary() -> Result<PathBuf, FixtureError> {
    if let Some(p) = std::env::var_os("CHANWATCH_ETCD_BIN") {
        return Ok(PathBuf::from(p));
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join("etcd");
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    let fallback = Path::new("/usr/bin/etcd");
    if fallback.is_file() {
        return Ok(fallback.to_path_buf());
    }
    Err(FixtureError::NoBinary)
}

/// A temporary directory for etcd data, on tmpfs when available: etcd fsyncs every commit,
/// which dominates test time on disk.
fn data_tempdir(prefix: &str) -> std::io::Result<tempfile::TempDir> {
    let base = Path::new("/dev/shm");
    let builder = {
        let mut b = tempfile::Builder::new();
        b.prefix(prefix);
        b
    };
    if base.is_dir() {
        builder.tempdir_in(base)
    } else {
        builder.tempdir()
    }
}

/// A loopback TCP port nothing listens on right now, for a process to be started on it.
///
/// Taken from below the machine's ephemeral range (`ip_local_port_range`, 32768–60999 by
/// default), not by binding port 0: a port from that range, released, can be the local port
/// of the next outgoing connection of any process before the server binds it (CI saw a node's
/// `--admin` fail with "address already in use" that way, under load). Successive calls in
/// one process walk the 12,000 ports below that range from a point set by the process ID, so
/// one test binary's ports never repeat (two port-0 binds in a row could: CI saw nats-server
/// start with its client and monitor ports equal); two test binaries at once (cargo runs one
/// at a time) most likely start far apart, and a port either took first is skipped by the
/// other's bind check — only a port probed by both before either server binds can clash.
///
/// # Panics
/// When no port in the range can be bound (the loopback is full).
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    // The ephemeral range's low end; a range that starts too low for a span below it (some
    // containers use 1024–65535) leaves no safe ports: take the default's.
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| r.split_whitespace().next()?.parse::<u32>().ok())
        .filter(|low| *low >= 1024 + SPAN && *low <= 65_536)
        .unwrap_or(32_768);
    let low = ephemeral_low - SPAN;
    let start = std::process::id().wrapping_mul(7919) % SPAN;
    for _ in 0..SPAN {
        let i = NEXT.fetch_add(1, Ordering::Relaxed);
        let Ok(port) = u16::try_from(low + (start + i) % SPAN) else {
            continue;
        };
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {low}-{}", low + SPAN - 1);
}

/// `N` distinct free ports ([`free_port`]).
fn free_ports<const N: usize>() -> std::io::Result<[u16; N]> {
    Ok(std::array::from_fn(|_| free_port()))
}

impl EtcdFixture {
    /// Starts etcd with default flags and waits until it serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the binary is missing or etcd does not come up within 20 s.
    pub async fn start() -> Result<Self, FixtureError> {
        Self::start_with(EtcdOptions::default()).await
    }

    /// Starts etcd with extra flags and waits until it serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the binary is missing or etcd does not come up within 20 s.
    pub async fn start_with(options: EtcdOptions) -> Result<Self, FixtureError> {
        let bin = etcd_binary()?;
        let data_dir = data_tempdir("chanwatch-etcd-")?;
        let [client_port, peer_port] = free_ports()?;
        let tls = if options.tls {
            Some(make_certs(data_dir.path())?)
        } else {
            None
        };
        let scheme = if tls.is_some() { "https" } else { "http" };
        let client_url = format!("{scheme}://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut command = vec![
            bin.display().to_string(),
            "--name=fixture".to_owned(),
            format!("--data-dir={}", data_dir.path().join("data").display()),
            format!("--listen-client-urls={client_url}"),
            format!("--advertise-client-urls={client_url}"),
            format!("--listen-peer-urls={peer_url}"),
            format!("--initial-advertise-peer-urls={peer_url}"),
            format!("--initial-cluster=fixture={peer_url}"),
            "--initial-cluster-state=new".to_owned(),
            "--log-level=warn".to_owned(),
        ];
        if let Some(t) = &tls {
            command.push(format!("--cert-file={}", t.server_cert.display()));
            command.push(format!("--key-file={}", t.server_key.display()));
            command.push(format!("--trusted-ca-file={}", t.ca.display()));
            command.push("--client-cert-auth".to_owned());
        }
        if let Some(q) = options.quota_backend_bytes {
            command.push(format!("--quota-backend-bytes={q}"));
        }
        command.extend(options.extra_args);
        let child = spawn(&command, data_dir.path())?;
        let fixture = EtcdFixture {
            child,
            client_url,
            data_dir,
            command,
            tls,
            root_password: None,
        };
        fixture.wait_healthy(Duration::from_secs(20)).await?;
        let mut fixture = fixture;
        if let Some(pw) = options.root_password {
            fixture.enable_auth(&pw).await?;
            fixture.root_password = Some(pw);
        }
        Ok(fixture)
    }

    /// Client options that reach this fixture (TLS files, root credentials).
    fn client_options(&self) -> Result<Option<etcd_client::ConnectOptions>, FixtureError> {
        let mut options = etcd_client::ConnectOptions::new();
        if let Some(t) = &self.tls {
            let tls = etcd_client::TlsOptions::new()
                .ca_certificate(etcd_client::Certificate::from_pem(std::fs::read(&t.ca)?))
                .identity(etcd_client::Identity::from_pem(
                    std::fs::read(&t.client_cert)?,
                    std::fs::read(&t.client_key)?,
                ));
            options = options.with_tls(tls);
        }
        if let Some(pw) = &self.root_password {
            options = options.with_user("root", pw.clone());
        }
        Ok(Some(options))
    }

    async fn enable_auth(&self, password: &str) -> Result<(), FixtureError> {
        let step = async {
            let mut c =
                etcd_client::Client::connect([&self.client_url], self.client_options()?).await?;
            c.user_add("root", password, None).await?;
            c.user_grant_role("root", "root").await?;
            c.auth_enable().await?;
            Ok::<_, FixtureError>(())
        };
        step.await
    }

    /// Runs `etcdctl` against this fixture (as `root` when auth is on, with the fixture's TLS
    /// files) and returns its stdout. `etcdctl` is looked up beside the etcd binary, then on
    /// `PATH`.
    ///
    /// # Errors
    /// [`FixtureError::Etcdctl`] with etcdctl's stderr when it fails.
    pub fn etcdctl(&self, args: &[&str]) -> Result<String, FixtureError> {
        let user = self.root_password.as_ref().map(|pw| format!("root:{pw}"));
        self.etcdctl_as(user.as_deref(), args)
    }

    /// Runs `etcdctl` as `user` (`NAME:PASSWORD`; `None`: no user); see [`Self::etcdctl`].
    ///
    /// # Errors
    /// [`FixtureError::Etcdctl`] with etcdctl's stderr when it fails.
    pub fn etcdctl_as(&self, user: Option<&str>, args: &[&str]) -> Result<String, FixtureError> {
        let beside = etcd_binary()?.with_file_name("etcdctl");
        let bin = if beside.is_file() {
            beside
        } else {
            PathBuf::from("etcdctl")
        };
        let mut full = vec![format!("--endpoints={}", self.client_url)];
        if let Some(u) = user {
            full.push(format!("--user={u}"));
        }
        if let Some(t) = &self.tls {
            full.push(format!("--cacert={}", t.ca.display()));
            full.push(format!("--cert={}", t.client_cert.display()));
            full.push(format!("--key={}", t.client_key.display()));
        }
        full.extend(args.iter().map(|a| (*a).to_owned()));
        let out = Command::new(bin)
            .args(&full)
            .env("ETCDCTL_API", "3")
            .stdin(Stdio::null())
            .output()?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(FixtureError::Etcdctl {
                args: full,
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            })
        }
    }

    /// Creates user `name` with `password` and a role of the same name holding `grants`:
    /// each is (`read` | `write` | `readwrite`, key or prefix ending in `/`; a trailing `/`
    /// grants the prefix, and so does a trailing `*`, which is dropped: `cw/channel/1007*` is
    /// every key starting `cw/channel/1007`), as docs/OPERATING.md's "etcd users and roles"
    /// and deploy/config/setup-auth.sh do.
    ///
    /// # Errors
    /// [`FixtureError::Etcdctl`] when a command fails (e.g. auth is off).
    pub fn add_user_with_role(
        &self,
        name: &str,
        password: &str,
        grants: &[(&str, &str)],
    ) -> Result<(), FixtureError> {
        self.etcdctl(&["role", "add", name])?;
        for (perm, key) in grants {
            let (prefix, key) = if let Some(stem) = key.strip_suffix('*') {
                ("--prefix=true", stem)
            } else if key.ends_with('/') {
                ("--prefix=true", *key)
            } else {
                ("--prefix=false", *key)
            };
            self.etcdctl(&["role", "grant-permission", name, prefix, perm, key])?;
        }
        self.etcdctl(&["user", "add", &format!("{name}:{password}")])?;
        self.etcdctl(&["user", "grant-role", name, name])?;
        Ok(())
    }

    /// What an operator does to end a NOSPACE alarm: compact to the current revision,
    /// defragment, disarm.
    ///
    /// # Errors
    /// [`FixtureError::Etcdctl`] when a step fails.
    pub fn free_space_and_disarm(&self) -> Result<(), FixtureError> {
        let status = self.etcdctl(&["endpoint", "status", "-w", "json"])?;
        let revision = status
            .split("\"revision\":")
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
            .map(str::to_owned)
            .ok_or_else(|| FixtureError::Etcdctl {
                args: vec!["endpoint".into(), "status".into()],
                stderr: format!("no revision in {status}"),
            })?;
        // Compacting the revision already compacted fails; that is fine here.
        let _ = self.etcdctl(&["compaction", "--physical", &revision]);
        self.etcdctl(&["defrag"])?;
        self.etcdctl(&["alarm", "disarm"])?;
        Ok(())
    }

    /// TLS files of a fixture started with `tls: true`.
    pub fn tls(&self) -> Option<&TlsMaterial> {
        self.tls.as_ref()
    }

    async fn wait_healthy(&self, timeout: Duration) -> Result<(), FixtureError> {
        let started = Instant::now();
        let options = self.client_options()?;
        while started.elapsed() < timeout {
            let probe = async {
                let mut c =
                    etcd_client::Client::connect([&self.client_url], options.clone()).await?;
                c.get("health", None).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), probe).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(FixtureError::NotHealthy {
            timeout,
            log: self.log_tail(),
        })
    }

    /// Kills etcd and starts it again on the same ports and data: every client connection
    /// and watch breaks, no data is lost.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not come back within 20 s.
    pub async fn restart(&mut self) -> Result<(), FixtureError> {
        self.kill();
        self.start_again().await
    }

    /// Kills etcd (`SIGKILL`); [`Self::start_again`] brings it back on the same ports and
    /// data. Meanwhile its endpoint refuses connections, as a crashed etcd's does.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts etcd again after [`Self::kill`] (on the same ports and data) and waits until it
    /// serves.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not come back within 20 s.
    pub async fn start_again(&mut self) -> Result<(), FixtureError> {
        self.child = spawn(&self.command, self.data_dir.path())?;
        self.wait_healthy(Duration::from_secs(20)).await
    }

    /// Freezes etcd (`SIGSTOP`): its connections stay open and nothing answers, and its
    /// clock-driven work (lease expiry) waits until [`EtcdFixture::thaw`].
    ///
    /// # Errors
    /// [`FixtureError::Io`] when the signal cannot be sent.
    pub fn freeze(&self) -> Result<(), FixtureError> {
        signal(self.child.id(), "-STOP")
    }

    /// Wakes a frozen etcd (`SIGCONT`) and waits until it serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the signal cannot be sent or etcd does not serve within 20 s.
    pub async fn thaw(&self) -> Result<(), FixtureError> {
        signal(self.child.id(), "-CONT")?;
        self.wait_healthy(Duration::from_secs(20)).await
    }

    /// The client URL, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> &str {
        &self.client_url
    }

    /// The last lines of etcd's log, for failure messages.
    pub fn log_tail(&self) -> String {
        let text =
            std::fs::read_to_string(self.data_dir.path().join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

fn spawn(command: &[String], dir: &Path) -> Result<Child, FixtureError> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join("etcd.log"))?;
    let (bin, args) = command.split_first().ok_or(FixtureError::NoBinary)?;
    Ok(Command::new(bin)
        .args(args)
        .env("ETCD_UNSUPPORTED_ARCH", std::env::consts::ARCH)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()?)
}

/// Sends a signal with the `kill` command (no libc binding needed for tests).
fn signal(pid: u32, sig: &str) -> Result<(), FixtureError> {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()?;
    if status.success() {
        Ok(())
    } else {
        Err(FixtureError::Io(std::io::Error::other(format!(
            "`kill {sig} {pid}` failed: {status}"
        ))))
    }
}

impl Drop for EtcdFixture {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
