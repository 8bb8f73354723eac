//! Which etcd members get requests: a client of its own per member, for lease renewals, and
//! the set of members the shared (balanced) connection may use.
//!
//! Owns: the per-member clients (made on first use, made again when etcd no longer knows a
//! client's auth token) and the suspect list. A member that left a renewal unanswered or
//! failed it is *suspect*: it is taken out of the shared connection's rotation, so that
//! watches, lists and txns stop landing on a member that hangs (the balancer draws members at
//! random, and a request to a frozen or cut-off member waits out its whole timeout), and a
//! probe asks it every second until it answers — then it is put back. The last member in
//! rotation is not taken out while it is the last: with every member failing (an etcd-wide
//! outage) the shared connection keeps it. It is probed all the same, and taken out at its
//! first unanswered probe once another member is back in rotation (else a member that hung last would keep getting
//! requests after the others recovered, until a renewal happened to find it again).
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

/// Per member (by index): whether the shared connection uses it, and whether a probe watches
/// it (every member out of rotation, and one kept in as the last). The shared connection has
/// one entry per URI: an endpoint named twice (`x:2379` and `http://x:2379/`, or in another
/// case) is one member here too — every index of it is marked together.
#[derive(Debug)]
struct Rotation {
    /// Per index: the member's URL as the connection compares it (lower case, no trailing
    /// `/`; etcd endpoints have no path).
    keys: Vec<String>,
    on: Vec<bool>,
    probed: Vec<bool>,
}

impl Rotation {
    fn new(urls: &[String]) -> Self {
        Rotation {
            keys: urls
                .iter()
                .map(|u| u.trim_end_matches('/').to_ascii_lowercase())
                .collect(),
            on: vec![true; urls.len()],
            probed: vec![false; urls.len()],
        }
    }

    /// Whether members `i` and `j` are one (the same URL).
    fn same(&self, i: usize, j: usize) -> bool {
        self.keys
            .get(i)
            .is_some_and(|k| self.keys.get(j) == Some(k))
    }

    /// Members in rotation other than member `i`.
    fn others(&self, i: usize) -> usize {
        (0..self.keys.len())
            .filter(|j| self.on[*j] && !self.same(i, *j))
            .count()
    }

    /// Whether there is a member other than `i` at all (with one, there is nothing to move
    /// to).
    fn has_others(&self, i: usize) -> bool {
        (0..self.keys.len()).any(|j| !self.same(i, j))
    }

    /// Marks member `i` (every index of it) in rotation or not.
    fn set_on(&mut self, i: usize, on: bool) {
        for j in 0..self.keys.len() {
            if self.same(i, j) {
                self.on[j] = on;
            }
        }
    }

    /// Marks member `i` (every index of it) probed or not.
    fn set_probed(&mut self, i: usize, probed: bool) {
        for j in 0..self.keys.len() {
            if self.same(i, j) {
                self.probed[j] = probed;
            }
        }
    }
}

/// The members, their clients and which of them the shared connection uses.
pub(crate) struct Members {
    list: Vec<Member>,
    /// Per member: in the shared connection's rotation, and probed. Probes hold a weak
    /// reference: they end when the store is dropped.
    rotation: Arc<StdMutex<Rotation>>,
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
        let list: Vec<Member> = endpoints
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
            .collect();
        let urls: Vec<String> = list.iter().map(|m| m.url.clone()).collect();
        Members {
            list,
            rotation: Arc::new(StdMutex::new(Rotation::new(&urls))),
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
            .rotation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .on
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

    /// Whether indices `i` and `j` name one member (the same URL, as the connection compares
    /// it).
    pub(crate) fn same(&self, i: usize, j: usize) -> bool {
        self.rotation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .same(i, j)
    }

    /// Whether member `i` is in the shared connection's rotation.
    pub(crate) fn is_in_rotation(&self, i: usize) -> bool {
        self.rotation
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .on
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
    /// rotation (unless no other member would be left in it: then it stays, until another
    /// is back) and probes it until it answers. Returns at once: the work is a task of its
    /// own, which a caller's timeout cannot cut short (a member marked out and never probed
    /// would stay out for good).
    pub(crate) fn suspect(&self, i: usize, shared: &Client) {
        let m = &self.list[i];
        let kept = {
            let mut rotation = self.rotation.lock().unwrap_or_else(PoisonError::into_inner);
            if rotation.probed.get(i).copied().unwrap_or(true) || !rotation.has_others(i) {
                // A probe watches it already (out of rotation, or kept in as the last), or
                // it is the only member: nothing to move its requests to.
                return;
            }
            rotation.set_probed(i, true);
            let kept = rotation.others(i) == 0;
            if !kept {
                rotation.set_on(i, false);
            }
            kept
        };
        if kept {
            // Not a warning: in an etcd-wide outage (a member without a leader still answers
            // the status probe) this comes again with each round of failed renewals.
            debug!(member = %m.endpoint, "etcd: a member left a lease renewal unanswered or failed it, and no other member is in rotation: keeping it, and taking it out once another member answers again");
        } else {
            warn!(member = %m.endpoint, "etcd: a member left a lease renewal unanswered or failed it; sending requests to the other members until it answers again");
        }
        let probe = Probe {
            url: m.url.clone(),
            endpoint: m.endpoint.clone(),
            index: i,
            options: self.options.clone(),
            probe_key: self.probe_key.clone(),
            shared: shared.clone(),
            rotation: Arc::downgrade(&self.rotation),
        };
        tokio::spawn(probe.run(!kept));
    }
}

/// Asks a suspect member every second until it answers, then puts it back (or, kept in
/// rotation as the last, takes it out at an unanswered probe once another member is in).
struct Probe {
    url: String,
    endpoint: String,
    index: usize,
    options: ConnectOptions,
    probe_key: Option<String>,
    shared: Client,
    rotation: Weak<StdMutex<Rotation>>,
}

/// How long a change to the shared connection's endpoints may wait to be queued (its queue
/// is drained as requests go through).
const CHANGE_WAIT: Duration = Duration::from_secs(5);

impl Probe {
    /// Takes the member out of the shared connection's endpoints; false when the connection
    /// did not take the change (the caller tries again at its next probe).
    async fn take_out(&self) -> bool {
        match tokio::time::timeout(CHANGE_WAIT, self.shared.remove_endpoint(&self.url)).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                warn!(member = %self.endpoint, error = %e, "etcd: cannot take a member out of rotation; trying again at the next probe");
                false
            }
            Err(_) => {
                warn!(member = %self.endpoint, "etcd: cannot take a member out of rotation: the connection took no change for 5s; trying again at the next probe");
                false
            }
        }
    }

    /// Probes until the member answers; `out`: it is out of rotation (else kept in as the
    /// last one).
    async fn run(self, mut out: bool) {
        // Whether the shared connection has taken the member out (the table says `out`).
        let mut removed = out && self.take_out().await;
        let mut client: Option<Client> = None;
        let mut since = tokio::time::Instant::now();
        loop {
            tokio::time::sleep(PROBE_EVERY).await;
            if self.rotation.strong_count() == 0 {
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
            let Some(rotation) = self.rotation.upgrade() else {
                return;
            };
            if !matches!(answered, Ok(Some(()))) {
                if !out {
                    // Kept in as the last one: out now if another member is back.
                    let mut r = rotation.lock().unwrap_or_else(PoisonError::into_inner);
                    if r.others(self.index) > 0 {
                        r.set_on(self.index, false);
                        out = true;
                        since = tokio::time::Instant::now();
                        warn!(member = %self.endpoint, "etcd: the member kept in rotation as the last one still does not answer, and another is back: sending requests to the others until it answers again");
                    }
                }
                if out && !removed {
                    removed = self.take_out().await;
                }
                debug!(member = %self.endpoint, out, "etcd: the suspect member does not answer yet");
                continue;
            }
            if out {
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
            }
            {
                let mut r = rotation.lock().unwrap_or_else(PoisonError::into_inner);
                r.set_on(self.index, true);
                r.set_probed(self.index, false);
            }
            if out {
                info!(member = %self.endpoint, after = ?since.elapsed(), "etcd: the member answers again; back in rotation");
            } else {
                debug!(member = %self.endpoint, after = ?since.elapsed(), "etcd: the member kept in rotation as the last one answers again");
            }
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Rotation;

    /// An endpoint named twice (the shared connection's one entry), even spelt differently,
    /// is one member: marked in and out together, never counted as another beside itself.
    #[test]
    fn an_endpoint_named_twice_is_one_member() {
        let mut r = Rotation::new(&[
            "http://x:2379".into(),
            "http://X:2379/".into(),
            "http://y:2379".into(),
        ]);
        assert!(r.same(0, 1) && !r.same(0, 2));
        assert_eq!(r.others(0), 1);
        assert!(r.has_others(0));
        r.set_on(1, false);
        r.set_probed(0, true);
        assert_eq!(r.on, [false, false, true]);
        assert_eq!(r.probed, [true, true, false]);
        assert_eq!(r.others(2), 0, "y is the last member in rotation");
        r.set_on(0, true);
        assert_eq!(r.on, [true, true, true]);
        let one = Rotation::new(&["http://x:2379".into(), "http://x:2379".into()]);
        assert!(
            !one.has_others(1),
            "one member named twice has nowhere to move to"
        );
    }
}
