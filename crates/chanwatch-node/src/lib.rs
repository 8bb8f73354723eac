//! # chanwatch-node
//!
//! The node runtime: it registers a session under a fresh node ID with a lease, watches
//! `{root}/channel/{id}/`, and drives [`chanwatch_core::node::NodeMachine`]: a runner per
//! channel runs your [`ChannelHandler`], acknowledgements are compare-and-swap txns, and a
//! node that cannot renew its lease, or whose watch falls behind, *pauses* its channels before
//! anyone else could own them — and resumes them warm when the same session answers again
//! (docs/DESIGN.md §3). Only when etcd says the lease is gone does it stop everything and
//! register again under a new ID.
//!
//! ## Embedding a node
//!
//! Implement [`ChannelHandler`] (`load` starts consuming a channel from its checkpoint,
//! `release` stops it, `pause`/`resume` bracket a stretch without the store), then:
//!
//! ```no_run
//! # async fn demo(handler: std::sync::Arc<dyn chanwatch_node::ChannelHandler>)
//! #     -> Result<(), Box<dyn std::error::Error>> {
//! use std::sync::Arc;
//! use chanwatch_store::{EtcdConfig, EtcdStore};
//!
//! let store = Arc::new(EtcdStore::connect(EtcdConfig {
//!     endpoints: vec!["http://127.0.0.1:2379".into()],
//!     ..EtcdConfig::default()
//! }).await?);
//! let node = chanwatch_node::Node::builder(store)
//!     .handler(handler)
//!     .admin_addr("10.0.0.7:9100") // shown by `chanwatch ctl nodes`
//!     .spawn()?;
//! // Serve `chanwatch_node::admin::router(node.watch_status(), node.registry().clone())`
//! // with axum for /healthz, /metrics and /status (ctl reads /status to show pauses).
//! // ... until your program shuts down:
//! node.stop().await?; // releases every channel and revokes the session
//! # Ok(()) }
//! ```
//!
//! `examples/embed_node.rs` runs a custom handler with a coordinator on the embedded store
//! (`cargo run -p chanwatch-node --example embed_node`). Building against etcd needs `protoc`
//! (etcd-client compiles etcd's protobufs): `apt-get install protobuf-compiler`, or set
//! `PROTOC` to a protoc binary.
//!
//! ## Modules
//!
//! `embed` (builder and handle), `runtime` (sessions one after another), `register`,
//! `session` (the event loop), `leave` (a planned restart's `leaving` session write), `runner` (one task per channel), `acks` (group commit),
//! `watchdog` (when to pause; the lease keeper is `chanwatch_store::keep_lease`), `handler` (the trait and built-in handlers),
//! `admin` (HTTP), `agent` (the local API of `--exec` workers), `metrics`, `config`. The `testing` feature adds `RecordingHandler`, a
//! fixture for tests.
//!
//! Owns: the session, the keepalive loop, the runners and the handler lifecycle.
//! Must not: decide assignments (that is the coordinator's job) or write any key but its own
//! session, the ID counter, and acknowledgements of its own channels.

/// Whether planted bug `$bug` (a [`PlantedBug`] variant) is on in `$planted` (a
/// `config::Planted`): always `false` without the `planted-bugs` feature, where the bug's
/// branch is not compiled at all.
macro_rules! planted {
    ($planted:expr, $bug:ident) => {{
        #[cfg(feature = "planted-bugs")]
        let on = $planted.0 == Some(crate::PlantedBug::$bug);
        #[cfg(not(feature = "planted-bugs"))]
        let on = {
            let _ = &$planted;
            false
        };
        on
    }};
}

mod acks;
pub mod admin;
pub mod agent;
pub mod checkpoint;
mod config;
mod embed;
pub mod handler;
mod leave;
pub mod metrics;
mod register;
mod runner;
mod runtime;
mod session;
mod watchdog;

pub use checkpoint::CommitError;
#[cfg(feature = "planted-bugs")]
pub use config::PlantedBug;
pub use config::{NodeConfig, NodeError, NodeStatus, Stop};
pub use embed::{Node, NodeBuilder, NodeHandle, NodeStopper};
pub use handler::{
    AuditLog, ChannelContext, ChannelHandler, ExecHandler, ExecOptions, Interval, NamePatterns,
    OwnershipLog, SimulatedLoad,
};
/// Test fixtures (feature `testing`): a handler that records who ran what, when.
#[cfg(any(test, feature = "testing"))]
pub use handler::{Behaviour, RecordingHandler};
pub use metrics::NodeMetrics;
pub use runtime::{run, run_until};
