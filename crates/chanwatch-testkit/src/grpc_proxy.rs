//! An HTTP/2-aware proxy in front of one etcd endpoint, for faults a TCP proxy cannot make:
//! a *stalled watch*. The connection and every other call (lease keepalives, txns, ranges)
//! keep flowing while the responses of `/etcdserverpb.Watch/Watch` calls are held, exactly
//! what a client sees when etcd's watch stream is stuck — the fault in which a drained node never saw its release requests and
//! kept running its channels beside their new owner. Likewise the
//! answers of txns can be held while the txns themselves reach etcd and land: a write whose
//! caller gives up before it hears the outcome.
//!
//! Owns: a listener on 127.0.0.1 (a free port), one upstream HTTP/2 connection per accepted
//! client connection, and the switches that hold or release watch and txn responses. Held frames are
//! not dropped: they stay in the upstream stream's buffer (and etcd's, past HTTP/2 flow
//! control: 2 MiB per stream, 5 MiB per connection in hyper's client) and arrive, in order,
//! after [`GrpcProxy::release_watches`].
//!
//! Must not: speak TLS (plaintext h2c only, as etcd fixtures without `tls` serve), bind
//! anything but 127.0.0.1, or be used outside tests. Everything stops when the proxy drops.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Empty};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// The gRPC method whose responses [`GrpcProxy::stall_watches`] holds.
pub const WATCH_PATH: &str = "/etcdserverpb.Watch/Watch";

/// The gRPC method whose responses [`GrpcProxy::hold_txn_answers`] holds.
pub const TXN_PATH: &str = "/etcdserverpb.KV/Txn";

/// Why a proxy could not start.
#[derive(Debug, Error)]
pub enum ProxyError {
    /// The upstream is not a plaintext `http://HOST:PORT` endpoint.
    #[error(
        "upstream {0:?} is not `http://HOST:PORT`: the proxy speaks plaintext HTTP/2 only \
         (start the etcd fixture without TLS)"
    )]
    BadUpstream(String),
    /// Binding the loopback listener failed.
    #[error("cannot listen on 127.0.0.1: {0}")]
    Bind(#[from] std::io::Error),
}

/// Whether watch responses are held, and who waits for them.
#[derive(Debug, Default)]
struct Switch {
    state: Mutex<(bool, Vec<Waker>)>,
    watch_calls: AtomicUsize,
}

impl Switch {
    /// True (and `waker` remembered) while watch responses are held.
    fn hold(&self, waker: &Waker) -> bool {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if s.0 && !s.1.iter().any(|w| w.will_wake(waker)) {
            s.1.push(waker.clone());
        }
        s.0
    }

    fn set(&self, stalled: bool) {
        let wakers = {
            let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
            s.0 = stalled;
            std::mem::take(&mut s.1)
        };
        wakers.into_iter().for_each(Waker::wake);
    }

    fn stalled(&self) -> bool {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).0
    }
}

/// A response body that passes frames through unless its switch holds them.
struct Gate {
    inner: Incoming,
    switch: Arc<Switch>,
}

impl Body for Gate {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        if this.switch.hold(cx.waker()) {
            return Poll::Pending;
        }
        Pin::new(&mut this.inner).poll_frame(cx)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

type ProxyBody = BoxBody<Bytes, hyper::Error>;

/// An HTTP/2 proxy to one etcd endpoint that can stall watch responses; stops on drop.
#[derive(Debug)]
pub struct GrpcProxy {
    addr: SocketAddr,
    switch: Arc<Switch>,
    txns: Arc<Switch>,
    task: JoinHandle<()>,
}

impl GrpcProxy {
    /// Listens on a free port of 127.0.0.1 and forwards every connection to `upstream`
    /// (`http://HOST:PORT`, e.g. [`crate::EtcdFixture::endpoint`]). Must be called inside a
    /// tokio runtime.
    ///
    /// # Errors
    /// [`ProxyError`] when the upstream is not plaintext or the port cannot be bound.
    pub async fn start(upstream: &str) -> Result<Self, ProxyError> {
        let target = upstream
            .strip_prefix("http://")
            .map(|t| t.trim_end_matches('/').to_owned())
            .filter(|t| !t.is_empty() && !t.contains('/'))
            .ok_or_else(|| ProxyError::BadUpstream(upstream.to_owned()))?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let switch = Arc::new(Switch::default());
        let txns = Arc::new(Switch::default());
        let task = tokio::spawn(accept(
            listener,
            target,
            Arc::clone(&switch),
            Arc::clone(&txns),
        ));
        Ok(GrpcProxy {
            addr,
            switch,
            txns,
            task,
        })
    }

    /// The URL clients use instead of etcd's, e.g. `http://127.0.0.1:41234`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Holds the response frames of every watch call, open or future, until
    /// [`Self::release_watches`]; every other call keeps flowing.
    pub fn stall_watches(&self) {
        self.switch.set(true);
    }

    /// Lets held and future watch responses flow again.
    pub fn release_watches(&self) {
        self.switch.set(false);
    }

    /// Whether watch responses are held now.
    pub fn watches_stalled(&self) -> bool {
        self.switch.stalled()
    }

    /// Holds the answers of every txn, sent or future, until [`Self::release_txn_answers`]:
    /// the txns still reach etcd (and land), their callers just do not hear back.
    pub fn hold_txn_answers(&self) {
        self.txns.set(true);
    }

    /// Lets held and future txn answers flow again.
    pub fn release_txn_answers(&self) {
        self.txns.set(false);
    }

    /// How many watch calls went through the proxy so far (to check a client uses it).
    pub fn watch_calls(&self) -> usize {
        self.switch.watch_calls.load(Ordering::Relaxed)
    }
}

impl Drop for GrpcProxy {
    fn drop(&mut self) {
        // Dropping the accept task's JoinSet aborts every connection task.
        self.task.abort();
    }
}

/// Accepts client connections until aborted; each gets its own upstream connection.
async fn accept(listener: TcpListener, target: String, switch: Arc<Switch>, txns: Arc<Switch>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                if let Ok((client, _)) = accepted {
                    let _ = client.set_nodelay(true);
                    connections.spawn(serve(
                        client,
                        target.clone(),
                        Arc::clone(&switch),
                        Arc::clone(&txns),
                    ));
                }
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Serves one client connection over one upstream HTTP/2 connection; a failed upstream
/// closes the client connection (the client reconnects, as it would to a dying etcd).
async fn serve(client: TcpStream, target: String, switch: Arc<Switch>, txns: Arc<Switch>) {
    let Ok(upstream) = TcpStream::connect(&target).await else {
        return;
    };
    let _ = upstream.set_nodelay(true);
    let Ok((sender, upstream_conn)) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(upstream)).await
    else {
        return;
    };
    let service = hyper::service::service_fn(move |req: Request<Incoming>| {
        forward(req, sender.clone(), Arc::clone(&switch), Arc::clone(&txns))
    });
    let downstream = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
        .serve_connection(TokioIo::new(client), service);
    tokio::select! {
        _ = downstream => {}
        _ = upstream_conn => {}
    }
}

/// Forwards one call; watch and txn responses go through a [`Gate`] each.
async fn forward(
    req: Request<Incoming>,
    mut sender: hyper::client::conn::http2::SendRequest<Incoming>,
    switch: Arc<Switch>,
    txns: Arc<Switch>,
) -> Result<Response<ProxyBody>, std::convert::Infallible> {
    let is_watch = req.uri().path() == WATCH_PATH;
    let gate = if is_watch {
        Some(switch)
    } else if req.uri().path() == TXN_PATH {
        Some(txns)
    } else {
        None
    };
    if let Some(switch) = gate.as_ref().filter(|_| is_watch) {
        switch.watch_calls.fetch_add(1, Ordering::Relaxed);
    }
    let response = match sender.send_request(req).await {
        Ok(r) => r,
        Err(_) => {
            let mut r = Response::new(Empty::new().map_err(|never| match never {}).boxed());
            *r.status_mut() = StatusCode::BAD_GATEWAY;
            return Ok(r);
        }
    };
    Ok(match gate {
        Some(switch) => response.map(|inner| Gate { inner, switch }.boxed()),
        None => response.map(BodyExt::boxed),
    })
}
