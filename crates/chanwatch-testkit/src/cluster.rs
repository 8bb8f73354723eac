//! A cluster of etcd members on loopback ports ([`EtcdCluster`]), each with its own data dir,
//! with faults that keep the data: kill a member and start it again. Whole-cluster faults
//! are in `cluster_faults.rs`.
//!
//! Owns: the members' processes and dirs. Must not: bind anything but 127.0.0.1 (and the
//! extra client hosts a chaos test names).

use super::*;

/// A cluster of etcd members on loopback ports, each with its own data dir; killed on drop.
#[derive(Debug)]
pub struct EtcdCluster {
    pub(crate) members: Vec<Member>,
    _dir: tempfile::TempDir,
}

#[derive(Debug)]
pub(crate) struct Member {
    pub(crate) child: Option<Child>,
    pub(crate) client_url: String,
    pub(crate) command: Vec<String>,
    pub(crate) dir: PathBuf,
}

impl EtcdCluster {
    /// Starts `n` members and waits until every one serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the binary is missing or a member does not come up within 30 s.
    pub async fn start(n: usize) -> Result<Self, FixtureError> {
        Self::start_with(n, ClusterOptions::default()).await
    }

    /// Starts `n` members with `options` and waits until every one serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the binary is missing or a member does not come up within 30 s.
    pub async fn start_with(n: usize, options: ClusterOptions) -> Result<Self, FixtureError> {
        let bin = etcd_binary()?;
        let dir = data_tempdir("chanwatch-etcd-cluster-")?;
        let mut ports = Vec::new();
        for _ in 0..n {
            let [client, peer] = free_ports()?;
            ports.push((client, peer));
        }
        let initial: Vec<String> = ports
            .iter()
            .enumerate()
            .map(|(i, (_, peer))| format!("m{i}=http://127.0.0.1:{peer}"))
            .collect();
        let mut members = Vec::new();
        for (i, (client, peer)) in ports.iter().enumerate() {
            let mdir = dir.path().join(format!("m{i}"));
            std::fs::create_dir_all(&mdir)?;
            let client_url = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let listen: Vec<String> = std::iter::once(client_url.clone())
                .chain(
                    options
                        .extra_client_hosts
                        .iter()
                        .map(|h| format!("http://{h}:{client}")),
                )
                .collect();
            let mut command = vec![
                bin.display().to_string(),
                format!("--name=m{i}"),
                format!("--data-dir={}", mdir.join("data").display()),
                format!("--listen-client-urls={}", listen.join(",")),
                format!("--advertise-client-urls={client_url}"),
                format!("--listen-peer-urls={peer_url}"),
                format!("--initial-advertise-peer-urls={peer_url}"),
                format!("--initial-cluster={}", initial.join(",")),
                "--initial-cluster-state=new".to_owned(),
                "--initial-cluster-token=chanwatch-test".to_owned(),
                "--log-level=warn".to_owned(),
            ];
            command.extend(options.extra_args.iter().cloned());
            let child = spawn(&command, &mdir)?;
            members.push(Member {
                child: Some(child),
                client_url,
                command,
                dir: mdir,
            });
        }
        let cluster = EtcdCluster { members, _dir: dir };
        for i in 0..n {
            cluster.wait_member(i, Duration::from_secs(30)).await?;
        }
        Ok(cluster)
    }

    /// Every member's client URL.
    pub fn endpoints(&self) -> Vec<String> {
        self.members.iter().map(|m| m.client_url.clone()).collect()
    }

    /// Kills member `i` (`SIGKILL`) and starts it again on its data: it rejoins the cluster.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not serve again within 30 s.
    pub async fn restart_member(&mut self, i: usize) -> Result<(), FixtureError> {
        let m = &mut self.members[i];
        if let Some(mut c) = m.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        m.child = Some(spawn(&m.command, &m.dir)?);
        self.wait_member(i, Duration::from_secs(30)).await
    }

    /// Kills member `i` (`SIGKILL`) and leaves it down, keeping its data; stopping a
    /// majority this way loses quorum. [`EtcdCluster::start_member`] brings it back.
    pub fn kill_member(&mut self, i: usize) {
        if let Some(mut c) = self.members[i].child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The index of the member that leads now, as the members themselves say (`None` when
    /// none answers that it leads).
    pub async fn leader(&self) -> Option<usize> {
        for (i, m) in self.members.iter().enumerate() {
            let status = async {
                let mut c = etcd_client::Client::connect([&m.client_url], None).await?;
                c.status().await
            };
            let Ok(Ok(status)) = tokio::time::timeout(Duration::from_secs(1), status).await else {
                continue;
            };
            if status.header().map(|h| h.member_id()) == Some(status.leader()) {
                return Some(i);
            }
        }
        None
    }

    /// Freezes member `i` (`SIGSTOP`): it keeps its connections and takes new ones (the
    /// kernel accepts them) but answers nothing, like a member that hangs or is cut off.
    ///
    /// # Errors
    /// [`FixtureError::Io`] when the member is not running or the signal cannot be sent.
    pub fn freeze_member(&self, i: usize) -> Result<(), FixtureError> {
        match &self.members[i].child {
            Some(c) => signal(c.id(), "-STOP"),
            None => Err(FixtureError::Io(std::io::Error::other(format!(
                "etcd member {i} is not running"
            )))),
        }
    }

    /// Wakes a frozen member (`SIGCONT`) and waits until it serves.
    ///
    /// # Errors
    /// [`FixtureError`] when the signal cannot be sent or it does not serve within 30 s.
    pub async fn thaw_member(&self, i: usize) -> Result<(), FixtureError> {
        if let Some(c) = &self.members[i].child {
            signal(c.id(), "-CONT")?;
        }
        self.wait_member(i, Duration::from_secs(30)).await
    }

    /// Starts a killed member again on its data and waits until it serves, which needs a
    /// quorum: start members back one by one until a majority runs.
    ///
    /// # Errors
    /// [`FixtureError`] when it does not serve within 30 s.
    pub async fn start_member(&mut self, i: usize) -> Result<(), FixtureError> {
        let m = &mut self.members[i];
        if m.child.is_none() {
            m.child = Some(spawn(&m.command, &m.dir)?);
        }
        self.wait_member(i, Duration::from_secs(30)).await
    }

    pub(crate) async fn wait_member(
        &self,
        i: usize,
        timeout: Duration,
    ) -> Result<(), FixtureError> {
        let url = &self.members[i].client_url;
        let started = Instant::now();
        while started.elapsed() < timeout {
            let probe = async {
                let mut c = etcd_client::Client::connect([url], None).await?;
                c.get("health", None).await
            };
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_secs(1), probe).await {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let text =
            std::fs::read_to_string(self.members[i].dir.join("etcd.log")).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        Err(FixtureError::NotHealthy {
            timeout,
            log: lines[lines.len().saturating_sub(30)..].join("\n"),
        })
    }
}

impl Drop for EtcdCluster {
    fn drop(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
}
