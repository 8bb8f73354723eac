//! # chanwatch-coord
//!
//! The coordinator runtime. It campaigns for `{root}/coord/leader` with a lease; the winner
//! lists everything, drives the pure planner ([`chanwatch_core::planner::Planner`]) from a
//! list-watch of the whole root and a periodic tick, and runs the planned txns — each one
//! guarded by the leader key's create revision, so a deposed leader cannot write. Standbys
//! watch the leader key and take over when it disappears; a leader watches it too and steps
//! down the moment it is deleted or replaced.
//!
//! ## Embedding a coordinator
//!
//! Build one on a store with [`Coordinator::builder`], start it with
//! [`CoordinatorBuilder::spawn`], and talk to it through the [`CoordHandle`] you get back:
//! its status, the admin requests (what the HTTP API in [`api`] serves), its metrics
//! registry, and [`CoordHandle::stop`]. Dropping the last handle stops it too.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//!
//! use chanwatch_coord::Coordinator;
//! use chanwatch_core::{ChannelName, VChannelInfo};
//! use chanwatch_store::{EmbeddedStore, MetaStore};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // The store the cluster shares (here in memory; `EtcdStore` for real etcd).
//! let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
//! let coordinator = Coordinator::builder(store)
//!     .session_ttl(Duration::from_secs(5))
//!     .spawn()?;
//!
//! // Alone, it wins the election; once it has listed the store it is ready.
//! coordinator.watch_status().wait_for(|s| s.ready).await?;
//!
//! // No node is alive, so the channel waits under `remaining` until one registers.
//! let name = ChannelName::new("orders-0")?;
//! coordinator.add_channel(name, VChannelInfo::default()).await?;
//! let rows = coordinator.channels().await?;
//! assert_eq!((rows.len(), rows[0].node), (1, None));
//!
//! // Its metrics are registered for you; serve them on your own /metrics.
//! let text = chanwatch_coord::metrics::render(coordinator.registry());
//! assert!(text.contains("chanwatch_leader 1"));
//!
//! // The leader resigns (revokes its lease), so a standby would take over at once.
//! coordinator.stop().await?;
//! assert!(!coordinator.status().leader);
//! # Ok(())
//! # }
//! ```
//!
//! `examples/embed_coordinator.rs` is the same as a program. A caller that must own the task
//! (to pause or abort it, as the simulation and tests do) uses
//! [`CoordinatorBuilder::build`] and runs [`Coordinator::run`] itself.
//!
//! ## Modules
//!
//! `election.rs` (campaign, leader lease, standby), `term.rs` (one term as leader: the loop
//! that drives the planner, fed to the core's `Pacer`, which decides when to plan),
//! `execute.rs` (planned txns to store txns, fencing), `availability.rs` (how
//! long the store was away, so timers stand still), `handle.rs`
//! ([`CoordHandle`]), `coordinator.rs` ([`Coordinator`], its builder and
//! [`CoordinatorConfig`]), [`api`] (the admin HTTP API), [`summary`] (the status page's reads) with
//! `probe.rs` (asks the nodes' admin HTTP whether they paused) and [`metrics`].
//!
//! Owns: election, the leader loop, txn execution (pipelined), the [`CoordHandle`] request
//! channel and the admin HTTP API ([`api`]).
//! Must not: run channels. It reads the whole root (sessions, channels, drain and fence
//! marks) and writes only the leader key `{root}/coord/leader`, channel assignments
//! `{root}/channel/`, and drain and fence marks `{root}/coord/drain/`, `{root}/coord/fence/`;
//! besides, it revokes the session lease of a node it fences and deletes a leader key that
//! no lease holds. Its only calls to nodes are the status page's `GET /status` reads (`probe.rs`).

pub mod api;
mod availability;
mod bulk;
pub mod checkpoints;
mod coordinator;
pub mod detail;
mod election;
pub mod events;
mod execute;
mod handle;
pub mod metrics;
pub mod probe;
pub mod summary;
mod term;
mod upkeep;
mod watch_health;

pub use bulk::{BulkError, MAX_BULK_CHANNELS};
pub use coordinator::{Coordinator, CoordinatorBuilder, CoordinatorConfig};
pub use election::CoordError;
pub use handle::{ApiError, CoordHandle, CoordStatus};
pub use metrics::CoordMetrics;
pub use upkeep::DEFAULT_QUOTA as DEFAULT_QUOTA_BACKEND_BYTES;
