//! Prometheus metrics of a node (shared by every node of one process).
//!
//! Owns: metric definitions. Must not: be read by the control logic.

use std::collections::BTreeSet;

use chanwatch_store::AlarmKind;
use prometheus::{
    Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

const ACK_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0,
];

/// Node metrics. Cheap to share behind an `Arc`.
#[derive(Debug, Clone)]
pub struct NodeMetrics {
    /// Channels with a runner (loading or running).
    pub running: IntGauge,
    acks: IntCounterVec,
    commits: IntCounterVec,
    /// From a handler's `commit` to its answer (landed, fenced or failed).
    pub commit_latency: Histogram,
    /// From an assignment seen (PUT) to its `Watched` ack committed.
    pub ack_latency: Histogram,
    /// Sessions registered.
    pub sessions: IntCounter,
    /// Times a node fenced itself.
    pub fences: IntCounter,
    /// 1 while the node's channels are paused (the store is out of reach).
    pub paused: IntGauge,
    /// Times the node paused its channels.
    pub pauses: IntCounter,
    /// Times a node's watch broke and was restarted.
    pub watch_restarts: IntCounter,
    /// Full lists of a node's prefix.
    pub relists: IntCounter,
    /// 1 while the store has raised an alarm of that type (`NOSPACE`, `CORRUPT`).
    pub etcd_alarm: IntGaugeVec,
    /// Assignment keys seen that do not decode or whose value names another channel: not run.
    pub corrupt: IntCounter,
}

fn must<T>(r: prometheus::Result<T>) -> T {
    // Static definitions: an error is a programming error caught by the tests.
    r.unwrap_or_else(|e| panic!("bad metric definition: {e}"))
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// Fresh metrics, not registered anywhere yet.
    pub fn new() -> Self {
        NodeMetrics {
            running: must(IntGauge::new(
                "chanwatch_node_channels_running",
                "Channels loading or running on this process's nodes.",
            )),
            acks: must(IntCounterVec::new(
                Opts::new(
                    "chanwatch_node_acks_total",
                    "Acknowledgement writes by result.",
                ),
                &["result"],
            )),
            commits: must(IntCounterVec::new(
                Opts::new(
                    "chanwatch_node_checkpoint_commits_total",
                    "Checkpoint commits by result (committed, fenced, error).",
                ),
                &["result"],
            )),
            commit_latency: must(Histogram::with_opts(
                HistogramOpts::new(
                    "chanwatch_node_checkpoint_commit_seconds",
                    "From a handler's commit to its answer.",
                )
                .buckets(ACK_BUCKETS.to_vec()),
            )),
            ack_latency: must(Histogram::with_opts(
                HistogramOpts::new(
                    "chanwatch_node_ack_latency_seconds",
                    "From an assignment seen to its Watched ack committed.",
                )
                .buckets(ACK_BUCKETS.to_vec()),
            )),
            sessions: must(IntCounter::new(
                "chanwatch_node_sessions_total",
                "Sessions registered.",
            )),
            fences: must(IntCounter::new(
                "chanwatch_node_fences_total",
                "Times a node stopped every channel because the store said its lease was gone.",
            )),
            paused: must(IntGauge::new(
                "chanwatch_node_paused",
                "1 while the node's channels are paused: the store is out of reach or the node cannot see its assignments.",
            )),
            pauses: must(IntCounter::new(
                "chanwatch_node_pauses_total",
                "Times the node paused every channel (they resume warm if its session survives).",
            )),
            watch_restarts: must(IntCounter::new(
                "chanwatch_node_watch_restarts_total",
                "Times a node's watch broke and was restarted.",
            )),
            relists: must(IntCounter::new(
                "chanwatch_node_relists_total",
                "Full lists of a node's own prefix.",
            )),
            corrupt: must(IntCounter::new(
                "chanwatch_node_corrupt_values_total",
                "Assignments seen that do not decode or name another channel than their key; not run.",
            )),
            etcd_alarm: {
                let g = must(IntGaugeVec::new(
                    Opts::new(
                        "chanwatch_etcd_alarm",
                        "1 while etcd has raised an alarm of this type (NOSPACE: writes refused).",
                    ),
                    &["type"],
                ));
                for kind in AlarmKind::ALL {
                    g.with_label_values(&[kind.name()]).set(0);
                }
                g
            },
        }
    }

    /// Sets `chanwatch_etcd_alarm` to the alarms raised now.
    pub fn set_alarms(&self, raised: &BTreeSet<AlarmKind>) {
        for kind in AlarmKind::ALL {
            self.etcd_alarm
                .with_label_values(&[kind.name()])
                .set(i64::from(raised.contains(&kind)));
        }
    }

    /// Registers every metric in `registry`.
    ///
    /// # Errors
    /// A metric of the same name is already registered there.
    pub fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.running.clone()))?;
        registry.register(Box::new(self.acks.clone()))?;
        registry.register(Box::new(self.ack_latency.clone()))?;
        registry.register(Box::new(self.commits.clone()))?;
        registry.register(Box::new(self.commit_latency.clone()))?;
        registry.register(Box::new(self.sessions.clone()))?;
        registry.register(Box::new(self.fences.clone()))?;
        registry.register(Box::new(self.paused.clone()))?;
        registry.register(Box::new(self.pauses.clone()))?;
        registry.register(Box::new(self.watch_restarts.clone()))?;
        registry.register(Box::new(self.relists.clone()))?;
        registry.register(Box::new(self.etcd_alarm.clone()))?;
        registry.register(Box::new(self.corrupt.clone()))?;
        Ok(())
    }

    /// Counts acks by result (`committed`, `refused`, `error`).
    pub fn acks(&self, result: &str, n: u64) {
        self.acks.with_label_values(&[result]).inc_by(n);
    }

    /// Counts checkpoint commits by result (`committed`, `fenced`, `error`).
    pub fn commits(&self, result: &str) {
        self.commits.with_label_values(&[result]).inc();
    }
}
