//! Which etcd members get requests: a client of its own per member, for lease renewals, and
//! the set of members the shared (balanced) connection may use.
//!
//! Owns: the per-member clients (made on first use, made again when etcd no longer knows a
//! client's auth token) and the suspect list. A member that left a renewal unanswered or
//! failed it is *suspect*: it is taken out of the shared connection's rotation, so that
//! watches, lists and txns stop landing on a member that hangs (the balancer draws members at
//! random, and a request to a frozen or cut-off member waits out its whole timeout), and a
//! probe asks it every second until it answers — then it is put back. The last member in
//! rotation is never taken out: with every member failing (an etcd-wide outage) the shared
//! connection keeps them all.
//!
//! Must not: decide anything about leases or sessions; retry a caller's call.

use std::sync::{Arc, Mutex as StdMutex, PoisonError, Weak};
use std::time::Duration;

use etcd_client::{Client, ConnectOptions};
use tokio::sync::Mutex;
use tracing::{debug, info, warn};

use crate::error::{StoreError, StoreResult};
use crate::etcd_error::map_err;

/// How often a suspect member is probed.
const PROBE_EVERY: Duration = Duration::from_secs(1);

/// One etcd member.
struct Member {
    /// As given in the endpoints.
    endpoint: String,
    /// With the scheme, as the shared connection keys it.
    url: String,
    /// Its own client, for renewals (shared with the task that connects it).
    client: Arc<Mutex<Option<Client>>>,
}

/// The members, their clients and which of them the shared connection uses.
pub(crate) struct Members {
    list: Vec<Member>,
    /// Per member: in the shared connection's rotation. Probes hold a weak reference: they
    /// end when the store is dropped.
    in_rotation: Arc<StdMutex<Vec<bool>>>,
    options: ConnectOptions,
    user: String,
    /// What a probe reads: a key the role may read (`EtcdConfig::probe_key`, a linearizable
    /// read: a member without a leader fails it), else the member's status.
    probe_key: Option<String>,
}

impl Members {
    pub(crate) fn new(
        endpoints: &[String],
        tls: bool,
        options: ConnectOptions,
        user: String,
        probe_key: Option<String>,
    ) -> Self {
        let scheme = if tls { "https://" } else { "http://" };
        Members {
            list: endpoints
                .iter()
                .map(|e| Member {
                    endpoint: e.clone(),
                    url: if e.contains("://") {
                        e.clone()
                    } else {
                        format!("{scheme}{e}")
                    },
                    client: Arc::new(Mutex::new(None)),
                })
                .collect(),
            in_rotation: Arc::new(StdMutex::new(vec![true; endpoints.len()])),
            options,
            user,
            probe_key,
        }
    }

    /// How many members there are (at least 1 for arithmetic).
    pub(crate) fn len(&self) -> usize {
        self.list.len().max(1)
    }

    /// The endpoints the shared connection sends requests to, in the order given.
    pub(crate) fn in_rotation(&self) -> Vec<String> {
        let on = self
            .in_rotation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        self.list
            .iter()
            .zip(on)
            .filter(|(_, on)| *on)
            .map(|(m, _)| m.endpoint.clone())
            .collect()
    }

    /// The endpoint of member `i`, for errors.
    pub(crate) fn endpoint(&self, i: usize) -> &str {
        self.list.get(i).map_or("", |m| m.endpoint.as_str())
    }

    /// The client of member `i` alone, connected on first use. The connection (with auth,
    /// an authentication round trip) is made by a task of its own, so a caller that gives
    /// up on the renewal does not throw it away: the next renewal finds it made.
    pub(crate) async fn client(&self, i: usize) -> StoreResult<Client> {
        let m = &self.list[i];
        if let Some(c) = m.client.lock().await.as_ref() {
            return Ok(c.clone());
        }
        let (slot, endpoint, options, user) = (
            m.client.clone(),
            m.endpoint.clone(),
            self.options.clone(),
            self.user.clone(),
        );
        let connect = tokio::spawn(async move {
            let c = Client::connect([&endpoint], Some(options))
                .await
                .map_err(|e| map_err(&endpoint, &user, "", e))?;
            *slot.lock().await = Some(c.clone());
            Ok(c)
        });
        connect.await.unwrap_or_else(|e| {
            Err(StoreError::Unavailable {
                endpoints: m.endpoint.clone(),
                message: format!("connecting failed: {e}"),
            })
        })
    }

    /// Whether member `i` is in the shared connection's rotation.
    pub(crate) fn is_in_rotation(&self, i: usize) -> bool {
        self.in_rotation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(i)
            .copied()
            .unwrap_or(false)
    }

    /// Maps an error of member `i`'s client, naming that member; forgets the client when
    /// etcd no longer knows its auth token, so the next use authenticates again.
    pub(crate) async fn err(&self, i: usize, e: etcd_client::Error) -> StoreError {
        let m = &self.list[i];
        let err = map_err(&m.endpoint, &self.user, "", e);
        if matches!(err, StoreError::AuthTokenExpired(_)) {
            *m.client.lock().await = None;
        }
        err
    }

    /// Member `i` left a renewal unanswered or failed it: takes it out of `shared`'s
    /// rotation (unless no other member would be left in it) and probes it until it
    /// answers. Returns at once: the work is a task of its own, which a caller's timeout
    /// cannot cut short (a member marked out and never probed would stay out for good).
    pub(crate) fn suspect(&self, i: usize, shared: &Client) {
        let m = &self.list[i];
        {
            let mut in_rotation = self
                .in_rotation
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            // Others by URL: an endpoint named twice is one entry of the shared connection.
            let others = self
                .list
                .iter()
                .zip(in_rotation.iter())
                .filter(|(o, on)| **on && o.url != m.url)
                .count();
            if !in_rotation.get(i).copied().unwrap_or(false) || others == 0 {
                return;
            }
            in_rotation[i] = false;
        }
        warn!(member = %m.endpoint, "etcd: a member left a lease renewal unanswered or failed it; sending requests to the other members until it answers again");
        let probe = Probe {
            url: m.url.clone(),
            endpoint: m.endpoint.clone(),
            index: i,
            options: self.options.clone(),
            probe_key: self.probe_key.clone(),
            shared: shared.clone(),
            in_rotation: Arc::downgrade(&self.in_rotation),
        };
        tokio::spawn(probe.run());
    }
}

/// Asks a suspect member every second until it answers, then puts it back.
struct Probe {
    url: String,
    endpoint: String,
    index: usize,
    options: ConnectOptions,
    probe_key: Option<String>,
    shared: Client,
    in_rotation: Weak<StdMutex<Vec<bool>>>,
}

/// How long a change to the shared connection's endpoints may wait to be queued (its queue
/// is drained as requests go through).
const CHANGE_WAIT: Duration = Duration::from_secs(5);

impl Probe {
    async fn run(self) {
        match tokio::time::timeout(CHANGE_WAIT, self.shared.remove_endpoint(&self.url)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                warn!(member = %self.endpoint, error = %e, "etcd: cannot take a member out of rotation");
            }
            Err(_) => {
                warn!(member = %self.endpoint, "etcd: cannot take a member out of rotation: the connection took no change for 5s");
            }
        }
        let mut client: Option<Client> = None;
        let since = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            if self.in_rotation.strong_count() == 0 {
                return;
            }
            let answered = tokio::time::timeout(PROBE_EVERY, async {
                let c = match client.clone() {
                    Some(c) => c,
                    None => {
                        let c = Client::connect([&self.endpoint], Some(self.options.clone()))
                            .await
                            .ok()?;
                        client = Some(c.clone());
                        c
                    }
                };
                let mut kv = c.kv_client();
                let mut maintenance = c.maintenance_client();
                match &self.probe_key {
                    Some(key) => kv.get(key.as_str(), None).await.ok().map(|_| ()),
                    None => maintenance.status().await.ok().map(|_| ()),
                }
            })
            .await;
            if !matches!(answered, Ok(Some(()))) {
                debug!(member = %self.endpoint, "etcd: the member out of rotation does not answer yet");
                continue;
            }
            let Some(in_rotation) = self.in_rotation.upgrade() else {
                return;
            };
            match tokio::time::timeout(CHANGE_WAIT, self.shared.add_endpoint(&self.url)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    warn!(member = %self.endpoint, error = %e, "etcd: cannot put a member back in rotation; probing again");
                    continue;
                }
                Err(_) => {
                    warn!(member = %self.endpoint, "etcd: cannot put a member back in rotation: the connection took no change for 5s; probing again");
                    continue;
                }
            }
            if let Some(on) = in_rotation
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get_mut(self.index)
            {
                *on = true;
            }
            info!(member = %self.endpoint, after = ?since.elapsed(), "etcd: the member answers again; back in rotation");
            return;
        }
    }
}
