//! The etcd backend: [`MetaStore`] over the `etcd-client` crate.
//!
//! Owns: the connection (endpoints, timeouts, credentials, TLS), translation between the
//! store vocabulary and etcd's protobuf types, and the mapping of etcd's errors onto
//! [`StoreError`] so callers can tell retryable from fatal.
//!
//! Must not: retry on its own (callers decide, with their own back-off) or hold a lock across
//! anything but the one keepalive stream per lease.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, CompactionOptions, ConnectOptions, DeleteOptions, GetOptions, Identity,
    LeaseKeepAliveStream, LeaseKeeper, PutOptions, TlsOptions, TxnOpResponse, WatchOptions,
};
use futures_util::StreamExt;
use tokio::sync::Mutex;

use crate::error::{StoreError, StoreResult};
use crate::types::{
    Compare, CompareOp, CompareTarget, EventKind, KeyValue, Lease, LeaseId, Limits, OpResponse,
    RangeResponse, Revision, Txn, TxnOp, TxnResponse, WatchBatch, WatchEvent,
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
        }
    }
}

type Keeper = (LeaseKeeper, LeaseKeepAliveStream);

/// A connected etcd client. Cheap to share behind an `Arc`.
pub struct EtcdStore {
    client: Client,
    endpoints: String,
    limits: Limits,
    /// One open keepalive stream per lease, so a renewal is one round trip. The map's lock is
    /// held only to find an entry; each entry has its own lock for the round trip, so leases
    /// of many sessions in one process never wait for each other.
    keepers: std::sync::Mutex<HashMap<LeaseId, Arc<Mutex<Option<Keeper>>>>>,
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
    /// `Config` for unreadable TLS files or no endpoints; `Unavailable` when etcd does not
    /// answer within the connect timeout; `Unauthenticated` for refused credentials.
    pub async fn connect(config: EtcdConfig) -> StoreResult<Self> {
        if config.endpoints.is_empty() {
            return Err(StoreError::Config(
                "no etcd endpoints given; pass --endpoints http://HOST:2379".into(),
            ));
        }
        let endpoints = config.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(config.connect_timeout)
            .with_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
        if let Some((user, password)) = &config.user {
            options = options.with_user(user.clone(), password.clone());
        }
        if let Some(tls) = &config.tls {
            options = options.with_tls(tls_options(tls)?);
        }
        let probe = async {
            let mut client = Client::connect(&config.endpoints, Some(options)).await?;
            client.get("\0chanwatch-connect-probe", None).await?;
            Ok::<_, etcd_client::Error>(client)
        };
        let client = match tokio::time::timeout(config.connect_timeout, probe).await {
            Ok(Ok(client)) => client,
            Ok(Err(e)) => return Err(map_err(&endpoints, e)),
            Err(_) => {
                return Err(StoreError::Unavailable {
                    endpoints,
                    message: format!("no answer within {:?}", config.connect_timeout),
                })
            }
        };
        Ok(EtcdStore {
            client,
            endpoints,
            limits: config.limits,
            keepers: std::sync::Mutex::new(HashMap::new()),
        })
    }

    fn kv(&self) -> etcd_client::KvClient {
        self.client
            .kv_client()
            .max_decoding_message_size(MAX_DECODING_BYTES)
    }

    fn err(&self, e: etcd_client::Error) -> StoreError {
        map_err(&self.endpoints, e)
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

/// Maps etcd's errors by gRPC code and the server's fixed error strings (etcd's `rpctypes`).
fn map_err(endpoints: &str, e: etcd_client::Error) -> StoreError {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::GRpcStatus(status) => {
            let msg = status.message().to_owned();
            if msg.contains("too many operations in txn request") {
                return StoreError::TooManyOps { ops: 0, max: 0 };
            }
            if msg.contains("request is too large") {
                return StoreError::RequestTooLarge { bytes: 0, max: 0 };
            }
            if msg.contains("requested lease not found") {
                return StoreError::LeaseNotFound(0);
            }
            if msg.contains("required revision has been compacted") {
                return StoreError::Compacted {
                    compact_revision: 0,
                };
            }
            if msg.contains("authentication failed")
                || msg.contains("user name is empty")
                || msg.contains("permission denied")
                || msg.contains("invalid auth token")
            {
                return StoreError::Unauthenticated(msg);
            }
            if msg.contains("required revision is a future revision") {
                return StoreError::FutureRevision {
                    requested: 0,
                    current: 0,
                };
            }
            match status.code() {
                Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Aborted => {
                    StoreError::Unavailable {
                        endpoints: endpoints.to_owned(),
                        message: msg,
                    }
                }
                Code::Unauthenticated | Code::PermissionDenied => StoreError::Unauthenticated(msg),
                Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => {
                    StoreError::InvalidArgument(msg)
                }
                Code::ResourceExhausted => StoreError::RequestTooLarge { bytes: 0, max: 0 },
                _ => StoreError::Backend(format!("{:?}: {msg}", status.code())),
            }
        }
        E::TransportError(t) => StoreError::Unavailable {
            endpoints: endpoints.to_owned(),
            message: format!("{t}: {}", source_chain(&t)),
        },
        E::IoError(io) => StoreError::Unavailable {
            endpoints: endpoints.to_owned(),
            message: io.to_string(),
        },
        E::InvalidUri(u) => StoreError::Config(format!("bad etcd endpoint URL: {u}")),
        E::InvalidArgs(a) => StoreError::InvalidArgument(a),
        E::WatchError(w) => StoreError::WatchClosed(w),
        E::LeaseKeepAliveError(m) if m.contains("not found") => StoreError::LeaseNotFound(0),
        other => StoreError::Backend(other.to_string()),
    }
}

fn source_chain(e: &dyn std::error::Error) -> String {
    let mut out = String::new();
    let mut cur = e.source();
    while let Some(s) = cur {
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
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
        let resp = self.kv().get(key, None).await.map_err(|e| self.err(e))?;
        Ok(resp.kvs().first().map(from_pb))
    }

    async fn range(&self, prefix: &str) -> StoreResult<RangeResponse> {
        let resp = self
            .kv()
            .get(prefix, Some(GetOptions::new().with_prefix()))
            .await
            .map_err(|e| self.err(e))?;
        Ok(RangeResponse {
            kvs: resp.kvs().iter().map(from_pb).collect(),
            revision: resp.header().map_or(0, |h| h.revision()),
        })
    }

    async fn txn(&self, txn: Txn) -> StoreResult<TxnResponse> {
        // Check client-side first so the error carries the numbers, as the embedded store's does.
        txn.check(&self.limits)?;
        let pb = etcd_client::Txn::new()
            .when(
                txn.compares
                    .into_iter()
                    .map(compare_to_pb)
                    .collect::<Vec<_>>(),
            )
            .and_then(txn.then.into_iter().map(op_to_pb).collect::<Vec<_>>())
            .or_else(txn.otherwise.into_iter().map(op_to_pb).collect::<Vec<_>>());
        let resp = self.kv().txn(pb).await.map_err(|e| self.err(e))?;
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

    async fn watch(&self, prefix: &str, from_revision: Revision) -> StoreResult<WatchStream> {
        let mut options = WatchOptions::new().with_prefix().with_prev_key();
        if from_revision > 0 {
            options = options.with_start_revision(from_revision);
        }
        let stream = self
            .client
            .watch_client()
            .watch(prefix, Some(options))
            .await
            .map_err(|e| self.err(e))?;
        let endpoints = self.endpoints.clone();
        // State: the etcd stream (its request half must stay alive, or etcd ends the watch),
        // and whether we already yielded a terminal error.
        let out = futures_util::stream::unfold(Some(stream), move |state| {
            let endpoints = endpoints.clone();
            async move {
                let mut stream = state?;
                loop {
                    match stream.next().await {
                        None => {
                            return Some((
                                Err(StoreError::WatchClosed(
                                    "etcd ended the watch stream".into(),
                                )),
                                None,
                            ))
                        }
                        Some(Err(e)) => return Some((Err(map_err(&endpoints, e)), None)),
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
                                let why = resp.cancel_reason().to_owned();
                                return Some((Err(StoreError::WatchClosed(why)), None));
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
                                    Some(WatchEvent {
                                        kind,
                                        kv,
                                        prev_kv: ev.prev_kv().map(from_pb),
                                    })
                                })
                                .collect();
                            // The "created" ack and progress notifications carry no events.
                            if !events.is_empty() {
                                return Some((Ok(WatchBatch { events }), Some(stream)));
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
        let resp = self
            .client
            .lease_client()
            .grant(i64::try_from(secs.max(1)).unwrap_or(i64::MAX), None)
            .await
            .map_err(|e| self.err(e))?;
        Ok(Lease {
            id: resp.id(),
            ttl: Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(0)),
        })
    }

    async fn keepalive(&self, lease: LeaseId) -> StoreResult<()> {
        let slot = {
            let mut map = self
                .keepers
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            map.entry(lease).or_default().clone()
        };
        let mut slot = slot.lock().await;
        if let Some((keeper, stream)) = slot.as_mut() {
            let renewed = async {
                keeper.keep_alive().await?;
                stream.message().await
            }
            .await;
            return match renewed {
                Ok(Some(resp)) if resp.ttl() > 0 => Ok(()),
                Ok(_) => {
                    *slot = None;
                    Err(StoreError::LeaseNotFound(lease))
                }
                Err(e) => {
                    *slot = None;
                    Err(fix_lease(self.err(e), lease))
                }
            };
        }
        // Opening the stream sends the first renewal and checks the lease exists.
        match self.client.lease_client().keep_alive(lease).await {
            Ok(pair) => {
                *slot = Some(pair);
                Ok(())
            }
            Err(e) => Err(fix_lease(self.err(e), lease)),
        }
    }

    async fn revoke(&self, lease: LeaseId) -> StoreResult<()> {
        self.keepers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&lease);
        self.client
            .lease_client()
            .revoke(lease)
            .await
            .map_err(|e| fix_lease(self.err(e), lease))?;
        Ok(())
    }

    async fn compact(&self, revision: Revision) -> StoreResult<()> {
        match self
            .kv()
            .compact(revision, Some(CompactionOptions::new().with_physical()))
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                let err = self.err(e);
                match err {
                    StoreError::FutureRevision { .. } => {
                        let current = self.range("\0").await.map_or(0, |r| r.revision);
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

    fn limits(&self) -> &Limits {
        &self.limits
    }

    fn describe(&self) -> String {
        format!("etcd {}", self.endpoints)
    }
}

/// Fills in the lease ID that etcd's error text does not carry.
fn fix_lease(err: StoreError, lease: LeaseId) -> StoreError {
    match err {
        StoreError::LeaseNotFound(_) => StoreError::LeaseNotFound(lease),
        other => other,
    }
}
