//! Prometheus metrics of the coordinator.
//!
//! Owns: the metric definitions and how they are derived from the planner's view, and
//! which of them a process may export: the cluster gauges (channels, nodes, balance) only
//! while it leads (DESIGN §8: metrics are honest on every process).
//! Must not: be read by the control logic: metrics only observe.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use chanwatch_core::planner::Planner;
use chanwatch_core::ChannelState;

/// Failover durations are seconds to tens of seconds (TTL-bound detection is not included:
/// the clock starts when the session is seen gone).
const FAILOVER_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const TXN_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0,
];

/// The gauges that describe the cluster as the leader sees it. Exported only while this
/// process leads and has observed its view: a standby's or a deposed leader's copy would be
/// stale and would double every sum on a dashboard.
#[derive(Debug, Clone)]
struct ClusterGauges {
    channels: IntGaugeVec,
    nodes_alive: IntGauge,
    remaining: IntGauge,
    unbalanced: IntGauge,
    moves_in_flight: IntGauge,
    corrupt: IntGauge,
    /// The store's database size (etcd's `db_size`); not exported while 0 (unknown, or a
    /// store without a database file).
    db_bytes: IntGauge,
    /// Its quota (etcd's, or the configured one); shown with `db_bytes`.
    quota_bytes: IntGauge,
    /// Set by the first observation of a term, cleared when the term ends.
    shown: Arc<AtomicBool>,
}

impl ClusterGauges {
    fn collectors(&self) -> [&dyn Collector; 8] {
        [
            &self.channels,
            &self.nodes_alive,
            &self.remaining,
            &self.unbalanced,
            &self.moves_in_flight,
            &self.corrupt,
            &self.db_bytes,
            &self.quota_bytes,
        ]
    }

    /// Hides the gauges and forgets their values.
    fn clear(&self) {
        self.shown.store(false, Ordering::SeqCst);
        self.channels.reset();
        for g in [
            &self.nodes_alive,
            &self.remaining,
            &self.unbalanced,
            &self.moves_in_flight,
            &self.corrupt,
            &self.db_bytes,
            &self.quota_bytes,
        ] {
            g.set(0);
        }
    }
}

impl Collector for ClusterGauges {
    fn desc(&self) -> Vec<&Desc> {
        self.collectors()
            .into_iter()
            .flat_map(|c| c.desc())
            .collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        if !self.shown.load(Ordering::SeqCst) {
            return Vec::new();
        }
        let unknown_size = self.db_bytes.get() == 0;
        self.collectors()
            .into_iter()
            .flat_map(|c| c.collect())
            .filter(|f| {
                !(unknown_size
                    && matches!(
                        f.name(),
                        "chanwatch_etcd_db_bytes" | "chanwatch_etcd_quota_bytes"
                    ))
            })
            .collect()
    }
}

/// Every coordinator metric. Cheap to share behind an `Arc`.
#[derive(Debug, Clone)]
pub struct CoordMetrics {
    cluster: ClusterGauges,
    reassignments: IntCounterVec,
    /// Seconds from a session's loss to every channel it held `Watched` elsewhere.
    pub failover_seconds: Histogram,
    /// Times the list-watch loop had to start over after an error.
    pub watch_restarts: IntCounter,
    /// Full lists (start, resync, recovery after an error or a stalled watch).
    pub relists: IntCounter,
    /// Times the leader found its watch stalled (behind a keepalive's revision) and relisted.
    pub watch_stalls: IntCounter,
    txns: IntCounterVec,
    /// Latency of coordinator txns.
    pub txn_seconds: Histogram,
    /// 1 while this process is the leader. Set it with [`CoordMetrics::set_leader`], which
    /// also hides the cluster gauges of a process that does not lead.
    pub leader: IntGauge,
    /// Nodes fenced by revoking their session lease (a release past the release timeout).
    pub fences: IntCounter,
    /// Compactions of the store this process ran as leader (DESIGN §8).
    pub compactions: IntCounter,
    /// `chanwatch_coord_planted_bug{bug} 1` while a planted bug is on (feature
    /// `planted-bugs` only: a build that can switch a safety rule off says when it does).
    #[cfg(feature = "planted-bugs")]
    pub planted_bug: IntGaugeVec,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Metric definitions are static; an error here is a programming error caught by the tests.
    r.unwrap_or_else(|e| panic!("bad metric definition: {e}"))
}

impl Default for CoordMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl CoordMetrics {
    /// Fresh metrics, not registered anywhere yet.
    pub fn new() -> Self {
        let cluster = ClusterGauges {
            channels: must(IntGaugeVec::new(
                Opts::new("chanwatch_channels", "Channels by assignment state."),
                &["state"],
            )),
            nodes_alive: must(IntGauge::new(
                "chanwatch_nodes_alive",
                "Nodes with a live session.",
            )),
            remaining: must(IntGauge::new(
                "chanwatch_channels_remaining",
                "Channels parked under remaining (no node alive).",
            )),
            unbalanced: must(IntGauge::new(
                "chanwatch_channels_unbalanced",
                "Channels the balanced plan would move (assignments that differ from it).",
            )),
            moves_in_flight: must(IntGauge::new(
                "chanwatch_moves_in_flight",
                "Break-before-make moves waiting for Released.",
            )),
            corrupt: must(IntGauge::new(
                "chanwatch_corrupt_values",
                "Keys whose value does not decode (left alone).",
            )),
            db_bytes: must(IntGauge::new(
                "chanwatch_etcd_db_bytes",
                "Size of etcd's database file in bytes (what --quota-backend-bytes limits), read by the leader every 5 s.",
            )),
            quota_bytes: must(IntGauge::new(
                "chanwatch_etcd_quota_bytes",
                "etcd's --quota-backend-bytes: what it says (3.6+), else coord --quota-backend-bytes; shown with chanwatch_etcd_db_bytes.",
            )),
            shown: Arc::default(),
        };
        CoordMetrics {
            cluster,
            reassignments: must(IntCounterVec::new(
                Opts::new(
                    "chanwatch_reassignments_total",
                    "Assignment changes by cause.",
                ),
                &["cause"],
            )),
            failover_seconds: must(Histogram::with_opts(
                HistogramOpts::new(
                    "chanwatch_failover_duration_seconds",
                    "From a node's session loss to all its channels Watched elsewhere.",
                )
                .buckets(FAILOVER_BUCKETS.to_vec()),
            )),
            watch_restarts: must(IntCounter::new(
                "chanwatch_watch_restarts_total",
                "Times the coordinator's watch broke and was restarted.",
            )),
            relists: must(IntCounter::new(
                "chanwatch_relists_total",
                "Full lists of the store by the coordinator.",
            )),
            watch_stalls: must(IntCounter::new(
                "chanwatch_watch_stalls_total",
                "Times the leader's watch had not reached a keepalive answer's revision in time and it relisted.",
            )),
            txns: must(IntCounterVec::new(
                Opts::new("chanwatch_store_txns_total", "Coordinator txns by result."),
                &["result"],
            )),
            txn_seconds: must(Histogram::with_opts(
                HistogramOpts::new(
                    "chanwatch_store_txn_seconds",
                    "Latency of coordinator txns.",
                )
                .buckets(TXN_BUCKETS.to_vec()),
            )),
            leader: must(IntGauge::new(
                "chanwatch_leader",
                "1 while this coordinator leads.",
            )),
            fences: must(IntCounter::new(
                "chanwatch_nodes_fenced_total",
                "Nodes whose session lease the leader revoked because they did not release a channel in time.",
            )),
            compactions: must(IntCounter::new(
                "chanwatch_compactions_total",
                "Compactions of etcd run by this coordinator as leader (every --compact-interval).",
            )),
            #[cfg(feature = "planted-bugs")]
            planted_bug: must(IntGaugeVec::new(
                Opts::new(
                    "chanwatch_coord_planted_bug",
                    "1 per planted bug switched on in this coordinator: a safety rule is off (a test build).",
                ),
                &["bug"],
            )),
        }
    }

    /// Registers every metric in `registry`.
    ///
    /// # Errors
    /// A metric of the same name is already registered there.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.cluster.clone()))?;
        #[cfg(feature = "planted-bugs")]
        registry.register(Box::new(self.planted_bug.clone()))?;
        registry.register(Box::new(self.reassignments.clone()))?;
        registry.register(Box::new(self.failover_seconds.clone()))?;
        registry.register(Box::new(self.watch_restarts.clone()))?;
        registry.register(Box::new(self.relists.clone()))?;
        registry.register(Box::new(self.watch_stalls.clone()))?;
        registry.register(Box::new(self.txns.clone()))?;
        registry.register(Box::new(self.txn_seconds.clone()))?;
        registry.register(Box::new(self.fences.clone()))?;
        registry.register(Box::new(self.leader.clone()))?;
        registry.register(Box::new(self.compactions.clone()))?;
        Ok(())
    }

    /// Reassignments counted so far for `cause` (benchmarks read it).
    pub fn reassignments_of(&self, cause: &str) -> u64 {
        self.reassignments.with_label_values(&[cause]).get()
    }

    /// Txns counted so far with `result`.
    pub fn txns_of(&self, result: &str) -> u64 {
        self.txns.with_label_values(&[result]).get()
    }

    /// Channels in `state` at the last planner round.
    pub fn channels_in(&self, state: ChannelState) -> i64 {
        self.cluster
            .channels
            .with_label_values(&[state.as_str()])
            .get()
    }

    /// Moves in flight at the last planner round.
    pub fn moves_in_flight(&self) -> i64 {
        self.cluster.moves_in_flight.get()
    }

    /// Says whether this process leads (`chanwatch_leader`). Not leading also hides the
    /// cluster gauges and clears them, so a deposed leader shows nothing stale; the next
    /// term shows them again from its first observation.
    pub fn set_leader(&self, leads: bool) {
        self.leader.set(i64::from(leads));
        if !leads {
            self.cluster.clear();
        }
    }

    /// Sets `chanwatch_etcd_db_bytes` (exported only while leading, like the cluster gauges).
    pub fn set_db_bytes(&self, bytes: i64) {
        self.cluster.db_bytes.set(bytes);
    }

    /// Sets `chanwatch_etcd_quota_bytes` (exported with `chanwatch_etcd_db_bytes`).
    pub fn set_quota_bytes(&self, bytes: i64) {
        self.cluster.quota_bytes.set(bytes);
    }

    /// The last `chanwatch_etcd_db_bytes` read (0: unknown, or not leading).
    pub fn db_bytes(&self) -> i64 {
        self.cluster.db_bytes.get()
    }

    /// What `chanwatch_etcd_quota_bytes` holds (0: not read yet).
    pub fn quota_bytes(&self) -> i64 {
        self.cluster.quota_bytes.get()
    }

    /// Counts one reassignment.
    pub fn reassigned(&self, cause: &str) {
        self.reassignments.with_label_values(&[cause]).inc();
    }

    /// Counts one txn by result (`committed`, `refused`, `error`).
    pub fn txn(&self, result: &str) {
        self.txns.with_label_values(&[result]).inc();
    }

    /// Refreshes the gauges derived from the view. `with_balance` also computes the balance
    /// plan (a full pass over the loads), so callers do it at most once per tick.
    pub fn observe(&self, state: &Planner, with_balance: bool) {
        let c = &self.cluster;
        let census = state.census();
        for (i, s) in ChannelState::ALL.iter().enumerate() {
            c.channels
                .with_label_values(&[s.as_str()])
                .set(i64::try_from(census.by_state[i]).unwrap_or(i64::MAX));
        }
        c.remaining
            .set(i64::try_from(census.remaining).unwrap_or(i64::MAX));
        c.nodes_alive
            .set(i64::try_from(state.nodes().len()).unwrap_or(i64::MAX));
        c.moves_in_flight
            .set(i64::try_from(state.moves_in_flight()).unwrap_or(i64::MAX));
        c.corrupt
            .set(i64::try_from(state.corrupt().len()).unwrap_or(i64::MAX));
        if with_balance {
            c.unbalanced
                .set(i64::try_from(state.balance_plan().len()).unwrap_or(i64::MAX));
        }
        if self.leader.get() == 1 {
            c.shown.store(true, Ordering::SeqCst);
        }
    }
}

/// Renders a registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    let encoder = prometheus::TextEncoder::new();
    if let Err(e) = encoder.encode_utf8(&registry.gather(), &mut out) {
        out = format!("# error encoding metrics: {e}\n");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_registers_once_and_renders() {
        let m = CoordMetrics::new();
        let r = Registry::new();
        m.register(&r).expect("first registration");
        m.reassigned("failover");
        m.txn("committed");
        let text = render(&r);
        for name in [
            "chanwatch_reassignments_total{cause=\"failover\"} 1",
            "chanwatch_store_txns_total{result=\"committed\"} 1",
            "chanwatch_leader 0",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(m.register(&r).is_err(), "registering twice must fail");
    }

    #[test]
    fn the_db_size_is_exported_by_the_leader_once_known() {
        let m = CoordMetrics::new();
        let r = Registry::new();
        m.register(&r).expect("registration");
        let state = Planner::new(
            chanwatch_core::Keys::default(),
            chanwatch_core::planner::PlannerConfig::default(),
        );
        m.set_leader(true);
        m.observe(&state, true);
        assert!(
            !render(&r).contains("chanwatch_etcd_db_bytes"),
            "unknown size shown"
        );
        m.set_db_bytes(4096);
        m.set_quota_bytes(1 << 25);
        assert!(render(&r)
            .lines()
            .any(|l| l == "chanwatch_etcd_db_bytes 4096"));
        assert!(render(&r)
            .lines()
            .any(|l| l == "chanwatch_etcd_quota_bytes 33554432"));
        m.set_leader(false);
        assert!(
            !render(&r).contains("chanwatch_etcd_db_bytes")
                && !render(&r).contains("chanwatch_etcd_quota_bytes"),
            "a standby shows it"
        );
    }

    #[test]
    fn cluster_gauges_are_exported_only_while_leading_and_cleared_on_step_down() {
        let m = CoordMetrics::new();
        let r = Registry::new();
        m.register(&r).expect("registration");
        let state = Planner::new(
            chanwatch_core::Keys::default(),
            chanwatch_core::planner::PlannerConfig::default(),
        );
        m.observe(&state, true);
        let standby = render(&r);
        assert!(
            !standby.contains("chanwatch_nodes_alive"),
            "a standby exports cluster gauges:\n{standby}"
        );
        m.set_leader(true);
        m.observe(&state, true);
        let leader = render(&r);
        for name in [
            "chanwatch_leader 1",
            "chanwatch_nodes_alive 0",
            "chanwatch_channels_unbalanced 0",
        ] {
            assert!(
                leader.lines().any(|l| l == name),
                "missing {name} in\n{leader}"
            );
        }
        m.set_leader(false);
        let deposed = render(&r);
        assert!(
            deposed.lines().any(|l| l == "chanwatch_leader 0"),
            "{deposed}"
        );
        for name in [
            "chanwatch_channels",
            "chanwatch_nodes_alive",
            "chanwatch_moves_in_flight",
        ] {
            assert!(
                !deposed.contains(&format!("{name} ")) && !deposed.contains(&format!("{name}{{")),
                "a deposed leader still exports {name}:\n{deposed}"
            );
        }
    }
}
