//! The etcd backend: [`MetaStore`] over the `etcd-client` crate.
//!
//! Over 600 lines on purpose: one `impl MetaStore` whose calls share the connection, the
//! token refresh and the error mapping (the mapping itself is in `etcd_error.rs`).
//!
//! Owns: the connection (endpoints, timeouts, credentials, TLS; lease renewals go to one
//! member at a time over a connection of their own, and move to the next member when one
//! fails — which members get requests is `etcd_members.rs`), translation between the
//! store vocabulary and etcd's protobuf types, and the mapping of etcd's errors onto
//! [`StoreError`] so callers can tell retryable from fatal.
//!
//! Must not: retry on its own (callers decide, with their own back-off; the one exception is
//! an auth token etcd no longer knows, which is renewed and the call sent once more) or hold a
//! lock across anything but the one keepalive stream per lease (held while that lease's
//! renewal opens a stream, renews, or waits for its member's client to connect); read any
//! key but those the
//! caller names (the connection probe reads [`EtcdConfig::probe_key`], so a user whose role
//! only allows `{root}/` can connect).
//!
//! Over 600 lines because every `MetaStore` call, with its translation, is here; the error
//! mapping is in `etcd_error.rs`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    AlarmAction, AlarmType, Certificate, Client, CompactionOptions, ConnectOptions, DeleteOptions,
    GetOptions, Identity, LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, TxnOpResponse,
    WatchOptions,
};
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::error::{StoreError, StoreResult};
use crate::etcd_error::{cancel_error, map_err};
use crate::etcd_members::Members;
use crate::types::{
    Alarm, AlarmKind, Compare, CompareOp, CompareTarget, EventKind, KeyRange, KeyValue, Lease,
    LeaseId, Limits, OpResponse, RangeResponse, Revision, StoreStatus, Txn, TxnOp, TxnResponse,
    WatchBatch, WatchEvent,
};
use crate::{MetaStore, WatchStream};

/// Largest response accepted from etcd. The client's default (4 MiB) would refuse a full list
/// of 100,000 channels; a relist must never fail for being big.
const MAX_DECODING_BYTES: usize = 512 * 1024 * 1024;

/// Paths to PEM files for TLS to etcd.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// CA that signed etcd's server certificate.
    pub ca: Option<PathBuf>,
    /// Client certificate (with `key`) for mutual TLS.
    pub cert: Option<PathBuf>,
    /// Client private key.
    pub key: Option<PathBuf>,
}

/// How to reach etcd.
#[derive(Debug, Clone)]
pub struct EtcdConfig {
    /// Endpoint URLs, e.g. `http://127.0.0.1:2379`.
    pub endpoints: Vec<String>,
    /// How long to wait for a connection (and for the first probe request).
    pub connect_timeout: Duration,
    /// Deadline of each unary request.
    pub request_timeout: Duration,
    /// Username and password when etcd has auth enabled.
    pub user: Option<(String, String)>,
    /// TLS files when etcd serves https.
    pub tls: Option<TlsFiles>,
    /// Limits to enforce client-side; keep them equal to the server's flags.
    pub limits: Limits,
    /// The key the connection check reads; it proves the credentials and the role's read
    /// permission. Give a key under the root every part may read (the CLI uses
    /// `{root}/id/node`). `None` checks with etcd's status call instead, which reads no key
    /// (and, with auth on, does not prove that credentials were given).
    pub probe_key: Option<String>,
    /// How often each watch asks etcd how far it has got (a progress request). A node
    /// compares the answer with its keepalive's revision to notice a watch that stalled
    /// silently; keep it well under the session TTL.
    pub watch_progress_interval: Duration,
}

impl Default for EtcdConfig {
    fn default() -> Self {
        EtcdConfig {
            endpoints: vec!["http://127.0.0.1:2379".to_owned()],
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
            user: None,
            tls: None,
            limits: Limits::default(),
            probe_key: None,
            watch_progress_interval: Duration::from_secs(1),
        }
    }
}

type Keeper = (LeaseKeeper, LeaseKeepAliveStream);

/// Where one lease's renewals go: one member at a time, and the next member after a renewal
/// that failed or was given up. The balanced channel picks a member at random for each new
/// stream, so after a renewal failed on a dead or hung member the next could land on it
/// again by chance — and against a hung member each waits out its timeout: two in a row
/// paused a node of a 4 s TTL (`tests/it/members.rs` saw it happen to 2 of 12 leases).
struct KeeperSlot {
    /// The open keepalive stream to `member`, taken out for each round trip.
    stream: Option<Keeper>,
    /// Index of the member renewals go to (in the order of the endpoints).
    member: usize,
    /// The last renewal was answered (else the next opens a stream to the next member).
    answered: bool,
}

/// A connected etcd client. Cheap to share behind an `Arc`.
pub struct EtcdStore {
    client: Client,
    endpoints: String,
    /// The etcd user, for errors that name it (empty: none).
    user: String,
    request_timeout: Duration,
    watch_progress_interval: Duration,
    limits: Limits,
    /// One open keepalive stream per lease, so a renewal is one round trip. The map's lock is
    /// held only to find an entry; each entry has its own lock for the round trip, so leases
    /// of many sessions in one process never wait for each other.
    keepers: std::sync::Mutex<HashMap<LeaseId, Arc<Mutex<KeeperSlot>>>>,
    /// The members: a client each for renewals ([`KeeperSlot`]), and which of them `client`
    /// sends requests to (a member that leaves a renewal unanswered is left out until it
    /// answers again).
    members: Members,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connects and checks that etcd answers.
    ///
    /// # Errors
    /// `Config` for unreadable TLS files, no endpoints, or endpoints that can never connect
    /// (a scheme other than http/https; http with TLS files); `Unavailable` when etcd does not
    /// answer within the connect timeout; `Unauthenticated` for refused credentials;
    /// `PermissionDenied` when the user may not read the probe key.
    pub async fn connect(config: EtcdConfig) -> StoreResult<Self> {
        if config.endpoints.is_empty() {
            return Err(StoreError::Config(
                "no etcd endpoints given; pass --endpoints http://HOST:2379".into(),
            ));
        }
        crate::etcd_error::check_endpoints(&config.endpoints, config.tls.is_some())?;
        let endpoints = config.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some((user, password)) = &config.user {
            // etcd's simple tokens die with a restart and expire after `--auth-token-ttl`
            // idle: the client authenticates again on "invalid auth token" and resends.
            options = options
                .with_user(user.clone(), password.clone())
                .with_auto_token_refresh(true);
        }
        if let Some(tls) = &config.tls {
            options = options.with_tls(tls_options(tls)?);
        }
        let user = config
            .user
            .as_ref()
            .map(|(u, _)| u.clone())
            .unwrap_or_default();
        let probe_key = config.probe_key.clone();
        let member_options = options.clone();
        let probe = async {
            let mut client = Client::connect(&config.endpoints, Some(options)).await?;
            match &probe_key {
                Some(key) => {
                    client.get(key.as_str(), None).await?;
                }
                None => {
                    client.status().await?;
                }
            }
            Ok::<_, etcd_client::Error>(client)
        };
        let probed = probe_key.as_deref().unwrap_or("");
        let client = match tokio::time::timeout(config.connect_timeout, probe).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(map_err(&endpoints, &user, probed, e)),
            Err(_) => {
                return Err(StoreError::Unavailable {
                    endpoints,
                    message: format!("no answer within {:?}", config.connect_timeout),
                })
            }
        };
        let members = Members::new(
            &config.endpoints,
            config.tls.is_some(),
            member_options,
            user.clone(),
            config.probe_key,
        );
        Ok(EtcdStore {
            client,
            endpoints,
            user,
            request_timeout: config.request_timeout,
            watch_progress_interval: config
                .watch_progress_interval
                .max(Duration::from_millis(10)),
            limits: config.limits,
            keepers: std::sync::Mutex::new(HashMap::new()),
            members,
        })
    }

    fn kv(&self) -> etcd_client::KvClient {
        self.client
            .kv_client()
            .max_decoding_message_size(MAX_DECODING_BYTES)
    }

    /// The endpoints requests go to now, in the order given: a member that left a lease
    /// renewal unanswered or failed it is left out until it answers a probe (every second).
    #[must_use]
    pub fn members_in_rotation(&self) -> Vec<String> {
        self.members.in_rotation()
    }

    /// Maps an error of a call about `key`; when etcd no longer knows our auth token (the
    /// client's own refresh-and-resend failed too, or it came on a stream), authenticates
    /// again so that the caller's retry goes out with a fresh token.
    async fn err(&self, e: etcd_client::Error, key: &str) -> StoreError {
        let err = map_err(&self.endpoints, &self.user, key, e);
        if matches!(err, StoreError::AuthTokenExpired(_)) {
            self.reauthenticate().await;
        }
        err
    }

    async fn reauthenticate(&self) {
        if self.user.is_empty() {
            return;
        }
        match tokio::time::timeout(self.request_timeout, self.client.refresh_token()).await {
            Ok(Ok(())) => {
                tracing::info!(user = %self.user, "etcd: authenticated again (token expired or etcd restarted)");
            }
            Ok(Err(e)) => {
                let e = map_err(&self.endpoints, &self.user, "", e);
                tracing::warn!(user = %self.user, error = %e, "etcd: authenticating again failed");
            }
            Err(_) => {
                tracing::warn!(user = %self.user, "etcd: authenticating again timed out");
            }
        }
    }
}

fn tls_options(files: &TlsFiles) -> StoreResult<TlsOptions> {
    let read = |p: &PathBuf, what: &str| {
        std::fs::read(p)
            .map_err(|e| StoreError::Config(format!("cannot read TLS {what} {}: {e}", p.display())))
    };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &files.ca {
        tls = tls.ca_certificate(Certificate::from_pem(read(ca, "CA file")?));
    }
    match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            tls = tls.identity(Identity::from_pem(
                read(cert, "certificate")?,
                read(key, "key")?,
            ));
        }
        (None, None) => {}
        _ => {
            return Err(StoreError::Config(
                "a TLS client certificate needs both --etcd-cert and --etcd-key".into(),
            ))
        }
    }
    Ok(tls)
}

fn from_pb(kv: &etcd_client::KeyValue) -> KeyValue {
    KeyValue {
        key: String::from_utf8_lossy(kv.key()).into_owned(),
        value: kv.value().to_vec(),
        create_revision: kv.create_revision(),
        mod_revision: kv.mod_revision(),
        version: kv.version(),
        lease: (kv.lease() != 0).then_some(kv.lease()),
    }
}

fn compare_to_pb(c: Compare) -> etcd_client::Compare {
    let op = match c.op {
        CompareOp::Equal => etcd_client::CompareOp::Equal,
        CompareOp::NotEqual => etcd_client::CompareOp::NotEqual,
        CompareOp::Less => etcd_client::CompareOp::Less,
        CompareOp::Greater => etcd_client::CompareOp::Greater,
    };
    match c.target {
        CompareTarget::Value(v) => etcd_client::Compare::value(c.key, op, v),
        CompareTarget::ModRevision(r) => etcd_client::Compare::mod_revision(c.key, op, r),
        CompareTarget::CreateRevision(r) => etcd_client::Compare::create_revision(c.key, op, r),
        CompareTarget::Version(v) => etcd_client::Compare::version(c.key, op, v),
    }
}

fn op_to_pb(op: TxnOp) -> etcd_client::TxnOp {
    match op {
        TxnOp::Put { key, value, lease } => {
            etcd_client::TxnOp::put(key, value, lease.map(|l| PutOptions::new().with_lease(l)))
        }
        TxnOp::Delete { key } => etcd_client::TxnOp::delete(key, None),
        TxnOp::DeletePrefix { prefix } => {
            etcd_client::TxnOp::delete(prefix, Some(DeleteOptions::new().with_prefix()))
        }
        TxnOp::Get { key } => etcd_client::TxnOp::get(key, None),
    }
}

#[async_trait]
impl MetaStore for EtcdStore {
    async fn get(&self, key: &str) -> StoreResult<Option<KeyValue>> {
        let resp = match self.kv().get(key, None).await {
            Ok(r) => r,
            Err(e) => return Err(self.err(e, key).await),
        };
        Ok(resp.kvs().first().map(from_pb))
    }

    async fn range_keys(&self, keys: &KeyRange) -> StoreResult<RangeResponse> {
        let prefix = keys.start();
        let options = match keys.end() {
            None => GetOptions::new().with_prefix(),
            Some(end) => GetOptions::new().with_range(end),
        };
        let resp = match self.kv().get(prefix, Some(options)).await {
            Ok(r) => r,
            Err(e) => return Err(self.err(e, prefix).await),
        };
        Ok(RangeResponse {
            kvs: resp.kvs().iter().map(from_pb).collect(),
            revision: resp.header().map_or(0, |h| h.revision()),
        })
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        // Check client-side first so the error carries the numbers, as the embedded store's does.
        txn.check(&self.limits)?;
        let first_key = txn_first_key(&txn);
        let pb = etcd_client::Txn::new()
            .when(
                txn.compares
                    .into_iter()
                    .map(compare_to_pb)
                    .collect::<Vec<_>>(),
            )
            .and_then(txn.then.into_iter().map(op_to_pb).collect::<Vec<_>>())
            .or_else(txn.otherwise.into_iter().map(op_to_pb).collect::<Vec<_>>());
        let resp = match self.kv().txn(pb).await {
            Ok(r) => r,
            Err(e) => return Err(self.err(e, &first_key).await),
        };
        let responses = resp
            .op_responses()
            .into_iter()
            .map(|r| match r {
                TxnOpResponse::Put(_) => OpResponse::Put,
                TxnOpResponse::Delete(d) => OpResponse::Delete {
                    deleted: u64::try_from(d.deleted()).unwrap_or(0),
                },
                TxnOpResponse::Get(g) => OpResponse::Get {
                    kv: g.kvs().first().map(from_pb),
                },
                TxnOpResponse::Txn(_) => OpResponse::Put,
            })
            .collect();
        Ok(TxnResponse {
            succeeded: resp.succeeded(),
            revision: resp.header().map_or(0, |h| h.revision()),
            responses,
        })
    }

    async fn watch_keys(
        &self,
        keys: &KeyRange,
        from_revision: Revision,
    ) -> StoreResult<WatchStream> {
        let prefix = keys.start();
        // No `prev_kv`: see `WatchEvent::kv`.
        let mut options = match keys.end() {
            None => WatchOptions::new().with_prefix(),
            Some(end) => WatchOptions::new().with_range(end),
        };
        if from_revision > 0 {
            options = options.with_start_revision(from_revision);
        }
        // etcd checks a watch's token and permission when it creates the watch, and says no
        // by cancelling it with "permission denied" (not with a gRPC error the client could
        // refresh its token on). After an etcd restart that is what a stale token gets: so
        // read the creation answer, and on a refusal authenticate again and watch once more.
        let mut refreshed = false;
        let (stream, first) = loop {
            let mut stream = match self
                .client
                .watch_client()
                .watch(prefix, Some(options.clone()))
                .await
            {
                Ok(s) => s,
                Err(e) => return Err(self.err(e, prefix).await),
            };
            let first = match tokio::time::timeout(self.request_timeout, stream.message()).await {
                Err(_) => {
                    return Err(StoreError::Unavailable {
                        endpoints: self.endpoints.clone(),
                        message: format!(
                            "watch of {prefix:?} not created within {:?}",
                            self.request_timeout
                        ),
                    })
                }
                Ok(Err(e)) => return Err(self.err(e, prefix).await),
                Ok(Ok(None)) => {
                    return Err(StoreError::WatchClosed(
                        "etcd ended the watch stream before creating the watch".into(),
                    ))
                }
                Ok(Ok(Some(first))) => first,
            };
            if !first.canceled() || first.compact_revision() > 0 {
                break (stream, first);
            }
            let refused = cancel_error(&self.endpoints, &self.user, prefix, first.cancel_reason());
            let auth = matches!(
                refused,
                StoreError::AuthTokenExpired(_) | StoreError::PermissionDenied { .. }
            );
            if !auth || refreshed || self.user.is_empty() {
                return Err(refused);
            }
            refreshed = true;
            self.reauthenticate().await;
        };
        let endpoints = self.endpoints.clone();
        let user = self.user.clone();
        let key = prefix.to_owned();
        let client = self.client.clone();
        let request_timeout = self.request_timeout;
        // A progress request now and then: its answer says how far the watch has got, so a
        // consumer can tell a quiet prefix from a stalled stream.
        let mut progress = tokio::time::interval(self.watch_progress_interval);
        progress.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        progress.reset();
        // State: the etcd stream (its request half must stay alive, or etcd ends the watch),
        // the creation answer not yet looked at and the progress timer; `None` once a terminal
        // error was yielded.
        let out =
            futures_util::stream::unfold(Some((stream, Some(first), progress)), move |state| {
                let endpoints = endpoints.clone();
                let user = user.clone();
                let key = key.clone();
                let client = client.clone();
                async move {
                    let (mut stream, mut pending, mut progress) = state?;
                    loop {
                        let next = match pending.take() {
                            Some(first) => Some(Ok(first)),
                            None => tokio::select! {
                                next = stream.next() => next,
                                _ = progress.tick() => {
                                    // A failed send means the stream is ending: its next answer
                                    // says so.
                                    let _ = stream.request_progress().await;
                                    continue;
                                }
                            },
                        };
                        match next {
                            None => {
                                return Some((
                                    Err(StoreError::WatchClosed(
                                        "etcd ended the watch stream".into(),
                                    )),
                                    None,
                                ))
                            }
                            Some(Err(e)) => {
                                return Some((Err(map_err(&endpoints, &user, &key, e)), None))
                            }
                            Some(Ok(resp)) => {
                                if resp.compact_revision() > 0 {
                                    return Some((
                                        Err(StoreError::Compacted {
                                            compact_revision: resp.compact_revision(),
                                        }),
                                        None,
                                    ));
                                }
                                if resp.canceled() {
                                    let err =
                                        cancel_error(&endpoints, &user, &key, resp.cancel_reason());
                                    if matches!(err, StoreError::AuthTokenExpired(_)) {
                                        // So that the caller's next watch goes with a fresh token.
                                        let _ = tokio::time::timeout(
                                            request_timeout,
                                            client.refresh_token(),
                                        )
                                        .await;
                                    }
                                    return Some((Err(err), None));
                                }
                                let events: Vec<WatchEvent> = resp
                                    .events()
                                    .iter()
                                    .filter_map(|ev| {
                                        let kv = from_pb(ev.kv()?);
                                        let kind = match ev.event_type() {
                                            etcd_client::EventType::Put => EventKind::Put,
                                            etcd_client::EventType::Delete => EventKind::Delete,
                                        };
                                        Some(WatchEvent { kind, kv })
                                    })
                                    .collect();
                                if !events.is_empty() {
                                    let batch = WatchBatch::of_events(events);
                                    return Some((Ok(batch), Some((stream, None, progress))));
                                }
                                // The "created" answer carries the revision the watch was made
                                // at, not one it has delivered up to (it may replay history).
                                if resp.created() {
                                    continue;
                                }
                                // A progress notification (etcd 3.4 answers a progress request
                                // with the member's revision; see docs/TESTING.md, "Faults the
                                // world has", on its caveat).
                                let revision = resp.header().map_or(0, |h| h.revision());
                                if revision > 0 {
                                    let batch = WatchBatch::progress(revision);
                                    return Some((Ok(batch), Some((stream, None, progress))));
                                }
                            }
                        }
                    }
                }
            });
        Ok(Box::pin(out))
    }

    async fn grant(&self, ttl: Duration) -> StoreResult<Lease> {
        let secs = ttl.as_secs() + u64::from(ttl.subsec_nanos() > 0);
        let resp = match self
            .client
            .lease_client()
            .grant(i64::try_from(secs.max(1)).unwrap_or(i64::MAX), None)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err(self.err(e, "").await),
        };
        Ok(Lease {
            id: resp.id(),
            ttl: Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0)),
        })
    }

    async fn keepalive(&self, lease: LeaseId) -> StoreResult<Revision> {
        let slot = {
            let mut map = self
                .keepers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let members = self.members.len();
            map.entry(lease)
                .or_insert_with(|| {
                    // Leases of different processes start on different members.
                    let member = usize::try_from(lease.unsigned_abs() % members as u64);
                    Arc::new(Mutex::new(KeeperSlot {
                        stream: None,
                        member: member.unwrap_or(0),
                        answered: true,
                    }))
                })
                .clone()
        };
        let mut slot = slot.lock().await;
        // Until this renewal is answered: a caller that gives up on it (a timeout around this
        // call) leaves it unanswered, and the next renewal goes to the next member.
        let answered = std::mem::replace(&mut slot.answered, false);
        // The stream is taken out for the round trip and put back only once its answer has
        // been read: a caller that gives up drops the stream with the future, so an answer
        // that comes late is never read as the answer to the next renewal — which would date
        // that renewal later than etcd did it.
        if let Some((mut keeper, mut stream)) = slot.stream.take() {
            let renewed = async {
                keeper.keep_alive().await?;
                stream.message().await
            }
            .await;
            return match renewed {
                Ok(Some(resp)) if resp.ttl() > 0 => {
                    let revision = resp.header().map_or(0, |h| h.revision());
                    slot.stream = Some((keeper, stream));
                    slot.answered = true;
                    Ok(revision)
                }
                Ok(Some(_)) => Err(StoreError::LeaseNotFound(lease)),
                // The stream ended (the member died or restarted, the connection broke): that
                // says nothing about the lease. The next renewal opens a stream to the next
                // member, which checks it.
                Ok(None) => Err(StoreError::Unavailable {
                    endpoints: self.members.endpoint(slot.member).to_owned(),
                    message: "the keepalive stream ended".into(),
                }),
                Err(e) => Err(fix_lease(self.members.err(slot.member, e).await, lease)),
            };
        }
        if !answered {
            // It hung or failed: the shared connection leaves it out until it answers, and
            // renewals go to the next member in rotation (the next at all if none is).
            self.members.suspect(slot.member, &self.client);
            let n = self.members.len();
            let from = slot.member;
            slot.member = (1..=n)
                .map(|k| (from + k) % n)
                .find(|m| !self.members.same(*m, from) && self.members.is_in_rotation(*m))
                .unwrap_or((from + 1) % n);
        }
        let member = slot.member;
        let client = self.members.client(member).await?;
        // Opening the stream sends the first renewal and checks the lease exists.
        match client.lease_client().keep_alive(lease).await {
            // etcd-client reads the first answer itself, so its revision is not known here:
            // renew once more on the new stream for an answer that names one. Without it,
            // the first renewal of every lease (and of every stream opened after a member
            // change) named no revision, and a leader whose watch stalled in that period could
            // not tell (found from outside: a failed channel retried on its node while a node
            // that had registered was not yet seen).
            Ok((mut keeper, mut stream)) => {
                let again = async {
                    keeper.keep_alive().await?;
                    stream.message().await
                }
                .await;
                slot.answered = true;
                match again {
                    Ok(Some(resp)) if resp.ttl() > 0 => {
                        slot.stream = Some((keeper, stream));
                        Ok(resp.header().map_or(0, |h| h.revision()))
                    }
                    Ok(Some(_)) => Err(StoreError::LeaseNotFound(lease)),
                    // The opening renewal landed; this one did not: the revision stays
                    // unknown, and the next renewal opens a new stream.
                    Ok(None) | Err(_) => Ok(0),
                }
            }
            Err(e) => Err(fix_lease(self.members.err(member, e).await, lease)),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.keepers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&lease);
        match self.client.lease_client().revoke(lease).await {
            Ok(_) => Ok(()),
            Err(e) => Err(fix_lease(self.err(e, "").await, lease)),
        }
    }

    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        match self
            .kv()
            .compact(revision, Some(CompactionOptions::new().with_physical()))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                let err = self.err(e, "").await;
                match err {
                    StoreError::FutureRevision { .. } => {
                        // The status call reads no key, so this works for a role limited
                        // to the root prefix.
                        let current = self
                            .client
                            .maintenance_client()
                            .status()
                            .await
                            .ok()
                            .and_then(|s| s.header().map(|h| h.revision()))
                            .unwrap_or(0);
                        Err(StoreError::FutureRevision {
                            requested: revision,
                            current,
                        })
                    }
                    other => Err(other),
                }
            }
        }
    }

    async fn status(&self) -> StoreResult<Option<StoreStatus>> {
        match self.client.maintenance_client().status().await {
            Ok(s) => Ok(Some(StoreStatus {
                db_size: s.db_size(),
                db_size_in_use: s.raft_used_db_size(),
                revision: s.header().map_or(0, |h| h.revision()),
                db_size_quota: s.db_size_quota(),
            })),
            Err(e) => Err(self.err(e, "").await),
        }
    }

    async fn alarms(&self) -> StoreResult<Vec<Alarm>> {
        let resp = match self
            .client
            .maintenance_client()
            .alarm(AlarmAction::Get, AlarmType::None, None)
            .await
        {
            Ok(r) => r,
            Err(e) => return Err(self.err(e, "").await),
        };
        Ok(resp
            .alarms()
            .iter()
            .filter_map(|a| {
                let kind = match a.alarm() {
                    AlarmType::Nospace => AlarmKind::NoSpace,
                    AlarmType::Corrupt => AlarmKind::Corrupt,
                    AlarmType::None => return None,
                };
                Some(Alarm {
                    member: a.member_id(),
                    kind,
                })
            })
            .collect())
    }

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn describe(&self) -> String {
        format!("etcd {}", self.endpoints)
    }
}

/// One etcd member's own view, from the maintenance `status` of the endpoint asked
/// ([`EtcdStore::member_status`]; `etcdctl endpoint status`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// The member that answered.
    pub member_id: u64,
    /// Its etcd version.
    pub version: String,
    /// The member it takes for the raft leader (0: none).
    pub leader: u64,
    /// Its raft term.
    pub raft_term: u64,
    /// Its raft index.
    pub raft_index: u64,
    /// The store's revision.
    pub revision: Revision,
    /// Bytes of the backend database file (what the quota limits).
    pub db_size: i64,
    /// Bytes of it in use (0 when the member does not say).
    pub db_size_in_use: i64,
    /// The member's backend quota in bytes, when it says (etcd 3.6 and later; 0 before).
    pub db_size_quota: i64,
    /// Whether it is a learner (not voting).
    pub is_learner: bool,
    /// Errors the member reports about itself.
    pub errors: Vec<String>,
}

impl EtcdStore {
    /// The maintenance `status` of the member this client talks to: connect with a single
    /// endpoint to ask one member.
    ///
    /// # Errors
    /// The member does not answer, or refuses the call.
    pub async fn member_status(&self) -> StoreResult<MemberStatus> {
        match self.client.maintenance_client().status().await {
            Ok(s) => Ok(MemberStatus {
                member_id: s.header().map_or(0, |h| h.member_id()),
                version: s.version().to_owned(),
                leader: s.leader(),
                raft_term: s.raft_term(),
                raft_index: s.raft_index(),
                revision: s.header().map_or(0, |h| h.revision()),
                db_size: s.db_size(),
                db_size_in_use: s.raft_used_db_size(),
                db_size_quota: s.db_size_quota(),
                is_learner: s.is_learner(),
                errors: s.errors().to_vec(),
            }),
            Err(e) => Err(self.err(e, "").await),
        }
    }
}

/// The first key a txn names, for errors that must say which key was refused.
fn txn_first_key(txn: &Txn) -> String {
    txn.compares
        .first()
        .map(|c| c.key.clone())
        .or_else(|| {
            txn.then
                .iter()
                .chain(&txn.otherwise)
                .next()
                .map(|op| match op {
                    TxnOp::Put { key, .. } | TxnOp::Delete { key } | TxnOp::Get { key } => {
                        key.clone()
                    }
                    TxnOp::DeletePrefix { prefix } => prefix.clone(),
                })
        })
        .unwrap_or_default()
}

/// Fills in the lease ID that etcd's error text does not carry.
fn fix_lease(err: StoreError, lease: LeaseId) -> StoreError {
    match err {
        StoreError::LeaseNotFound(_) => StoreError::LeaseNotFound(lease),
        other => other,
    }
}
