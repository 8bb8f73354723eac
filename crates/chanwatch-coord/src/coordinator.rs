//! Settings of a coordinator, and how to start one.
//!
//! Owns: [`CoordinatorConfig`].
//! Must not: run anything itself.

use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::coord::CoordConfig;
use chanwatch_core::Keys;

/// Settings of a coordinator.
#[derive(Debug, Clone)]
pub struct CoordinatorConfig {
    /// Key layout.
    pub keys: Keys,
    /// Planner settings (timeouts, limits, moves in flight).
    pub planner: CoordConfig,
    /// Lease TTL of the leader key; a standby takes over within about this long.
    pub session_ttl: Duration,
    /// Full relist period: a missed event can never stay unnoticed longer than this.
    pub reconcile_interval: Duration,
    /// Period of the planner tick (timeouts).
    pub tick: Duration,
    /// Txns in flight at once when a plan has several.
    pub pipeline: usize,
    /// Identifies this process in the leader key and logs.
    pub id: String,
    /// Admin API address written into the leader key (what `ctl` connects to).
    pub admin_addr: String,
    /// Where the coordinator's metrics go.
    pub metrics: Arc<crate::metrics::CoordMetrics>,
}

impl Default for CoordinatorConfig {
    fn default() -> Self {
        CoordinatorConfig {
            keys: Keys::default(),
            planner: CoordConfig::default(),
            session_ttl: Duration::from_secs(10),
            reconcile_interval: Duration::from_secs(10),
            tick: Duration::from_secs(1),
            pipeline: 8,
            id: format!("coord-{}", std::process::id()),
            admin_addr: String::new(),
            metrics: Arc::new(crate::metrics::CoordMetrics::new()),
        }
    }
}
