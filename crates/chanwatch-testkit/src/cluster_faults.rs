//! Whole-cluster faults of [`EtcdCluster`] for chaos tests: members serving clients on more
//! addresses (a network namespace's veth), every member down at once, a full quota (NOSPACE)
//! and its cleanup the way an operator does it.

use std::time::Duration;

use crate::{spawn, EtcdCluster, FixtureError};

/// Options of [`EtcdCluster::start_with`].
#[derive(Debug, Clone, Default)]
pub struct ClusterOptions {
    /// Extra etcd flags for every member, e.g. `--quota-backend-bytes=33554432`.
    pub extra_args: Vec<String>,
    /// More local addresses every member serves clients on (same port as on 127.0.0.1), e.g.
    /// the host end of a veth pair that leads into a network namespace. Clients reach them by
    /// [`EtcdCluster::endpoints_on`].
    pub extra_client_hosts: Vec<String>,
}

/// Whole-cluster faults for chaos tests: every member down at once, a full quota (NOSPACE).
impl EtcdCluster {
    /// Every member's client URL on `host` (one of [`ClusterOptions::extra_client_hosts`]).
    pub fn endpoints_on(&self, host: &str) -> Vec<String> {
        self.members
            .iter()
            .map(|m| m.client_url.replace("127.0.0.1", host))
            .collect()
    }

    /// Kills every member (`SIGKILL`): the cluster is gone until
    /// [`start_all_members`](Self::start_all_members); data dirs and ports stay.
    pub fn kill_all_members(&mut self) {
        for m in &mut self.members {
            if let Some(mut c) = m.child.take() {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }

    /// Starts every member that is not running on its data and waits until all serve (a
    /// member alone cannot serve without quorum, so all start before any wait).
    ///
    /// # Errors
    /// [`FixtureError`] when a member does not serve again within 30 s.
    pub async fn start_all_members(&mut self) -> Result<(), FixtureError> {
        for m in &mut self.members {
            if m.child.is_none() {
                m.child = Some(spawn(&m.command, &m.dir)?);
            }
        }
        for i in 0..self.members.len() {
            self.wait_member(i, Duration::from_secs(30)).await?;
        }
        Ok(())
    }

    /// Writes 1 MiB values under `prefix` until etcd refuses with NOSPACE (`database space
    /// exceeded`; start the cluster with a small `--quota-backend-bytes`). Returns how many
    /// bytes were written. Stops with an error after 4 GiB or on any other error.
    ///
    /// # Errors
    /// [`FixtureError::Client`] when a put fails for another reason than NOSPACE.
    pub async fn fill_quota(&self, prefix: &str) -> Result<usize, FixtureError> {
        let mut c = etcd_client::Client::connect(self.endpoints(), None).await?;
        let value = vec![b'x'; 1 << 20];
        for i in 0..4096usize {
            match c.put(format!("{prefix}{i:06}"), value.clone(), None).await {
                Ok(_) => {}
                Err(e) if e.to_string().contains("database space exceeded") => {
                    return Ok(i * value.len())
                }
                Err(e) => return Err(e.into()),
            }
        }
        Err(FixtureError::Io(std::io::Error::other(
            "4 GiB written and no NOSPACE: is --quota-backend-bytes set?",
        )))
    }

    /// Undoes [`fill_quota`](Self::fill_quota) the way an operator does: deletes `prefix`,
    /// compacts, defragments every member and disarms every alarm.
    ///
    /// # Errors
    /// [`FixtureError::Client`] when a step fails (the caller may retry: each step is
    /// idempotent).
    pub async fn clear_quota(&self, prefix: &str) -> Result<(), FixtureError> {
        use etcd_client::{AlarmAction, AlarmOptions, AlarmType, CompactionOptions, DeleteOptions};
        let mut c = etcd_client::Client::connect(self.endpoints(), None).await?;
        let deleted = c
            .delete(prefix, Some(DeleteOptions::new().with_prefix()))
            .await?;
        let revision = deleted.header().map_or(0, |h| h.revision());
        match c
            .compact(revision, Some(CompactionOptions::new().with_physical()))
            .await
        {
            Ok(_) => {}
            // Already compacted past it (e.g. by the test's own compaction): nothing to do.
            Err(e) if e.to_string().contains("compacted") => {}
            Err(e) => return Err(e.into()),
        }
        for url in self.endpoints() {
            let mut m = etcd_client::Client::connect([url], None).await?;
            m.defragment().await?;
        }
        let alarms = c
            .alarm(AlarmAction::Get, AlarmType::None, None)
            .await?
            .alarms()
            .to_vec();
        for a in alarms {
            let mut options = AlarmOptions::new();
            options.with_member(a.member_id());
            c.alarm(AlarmAction::Deactivate, a.alarm(), Some(options))
                .await?;
        }
        Ok(())
    }
}
