//! Prometheus metrics of a node (shared by every node of one process).
//!
//! Owns: metric definitions, and two shapes the data plane's metrics need: a gauge that is a
//! sum of per-run shares (`GaugeShare`: the consumer's lag) and the age of the oldest
//! checkpoint among running channels ([`CheckpointAges`], computed when scraped).
//! Must not: be read by the control logic.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};

use chanwatch_store::{AlarmKind, Clock};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry,
};

/// The results a checkpoint commit is counted under.
pub const COMMIT_RESULTS: [&str; 4] = ["ok", "fenced", "unavailable", "too_large"];

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
    /// The age of the oldest checkpoint among running channels (computed when scraped).
    pub checkpoint_ages: CheckpointAges,
    /// Messages the stream consumer folded into its channels' states.
    pub consumer_messages: IntCounter,
    /// Positions the stream consumer's runs are behind their channels' ends, summed.
    pub consumer_lag: IntGauge,
    /// `chanwatch_node_planted_bug{bug} 1` while a planted bug is on (feature
    /// `planted-bugs` only: a build that can switch a safety mechanism off says when it does).
    #[cfg(feature = "planted-bugs")]
    pub planted_bug: IntGaugeVec,
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
                    "Checkpoint commits by result: ok, fenced (this run no longer owns the channel), unavailable (not known to have landed), too_large (state over 64 KiB).",
                ),
                &["result"],
            ))
            .tap(|c| {
                for r in COMMIT_RESULTS {
                    c.with_label_values(&[r]);
                }
            }),
            commit_latency: must(Histogram::with_opts(
                HistogramOpts::new(
                    "chanwatch_node_checkpoint_commit_seconds",
                    "From a handler's commit to its answer (landed, fenced or failed).",
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
            checkpoint_ages: CheckpointAges::new(),
            consumer_messages: must(IntCounter::new(
                "chanwatch_node_consumer_messages_total",
                "Messages the stream consumer read and folded into its channels' states (re-reads after a failover included).",
            )),
            consumer_lag: must(IntGauge::new(
                "chanwatch_node_consumer_lag_positions",
                "Positions the stream consumer's running channels are behind their ends, summed over them: messages on the file log; on NATS stream sequence numbers, so an upper bound on messages. 0 for a run whose last read was not a full batch.",
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
            #[cfg(feature = "planted-bugs")]
            planted_bug: must(IntGaugeVec::new(
                Opts::new(
                    "chanwatch_node_planted_bug",
                    "1 per planted bug switched on in this process's nodes: a safety mechanism is off (a test build).",
                ),
                &["bug"],
            )),
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
        #[cfg(feature = "planted-bugs")]
        registry.register(Box::new(self.planted_bug.clone()))?;
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
        registry.register(Box::new(self.checkpoint_ages.clone()))?;
        registry.register(Box::new(self.consumer_messages.clone()))?;
        registry.register(Box::new(self.consumer_lag.clone()))?;
        Ok(())
    }

    /// Counts acks by result (`committed`, `refused`, `error`).
    pub fn acks(&self, result: &str, n: u64) {
        self.acks.with_label_values(&[result]).inc_by(n);
    }

    /// Counts a checkpoint commit by result (one of [`COMMIT_RESULTS`]).
    pub fn commits(&self, result: &str) {
        self.commits.with_label_values(&[result]).inc();
    }

    /// The count of commits with `result` so far.
    pub fn commit_count(&self, result: &str) -> u64 {
        self.commits.with_label_values(&[result]).get()
    }
}

/// `value.tap(f)`: runs `f` on the value and returns it.
trait Tap: Sized {
    fn tap(self, f: impl FnOnce(&Self)) -> Self {
        f(&self);
        self
    }
}

impl<T> Tap for T {}

/// One run's share of a gauge that sums every run's value: setting it moves the gauge by the
/// difference, dropping it takes its value back out.
#[derive(Debug)]
pub(crate) struct GaugeShare {
    gauge: IntGauge,
    value: i64,
}

impl GaugeShare {
    /// A share of `gauge`, 0 for now.
    pub(crate) fn new(gauge: IntGauge) -> Self {
        GaugeShare { gauge, value: 0 }
    }

    /// Sets this run's value.
    pub(crate) fn set(&mut self, value: i64) {
        self.gauge.add(value - self.value);
        self.value = value;
    }
}

impl Drop for GaugeShare {
    fn drop(&mut self) {
        self.gauge.sub(self.value);
    }
}

/// `chanwatch_node_checkpoint_oldest_age_seconds`: now minus the `updated_at_ms` of the
/// oldest checkpoint among the runs that read or wrote one and still run; 0 when none has.
/// Each run holds a `CheckpointAge`; the age is computed when scraped, with the clock of
/// the last run that registered.
#[derive(Debug, Clone)]
pub struct CheckpointAges {
    inner: Arc<Mutex<Ages>>,
    gauge: Gauge,
}

#[derive(Debug, Default)]
struct Ages {
    clock: Option<Clock>,
    next: u64,
    runs: HashMap<u64, u64>,
}

impl CheckpointAges {
    fn new() -> Self {
        CheckpointAges {
            inner: Arc::default(),
            gauge: must(Gauge::new(
                "chanwatch_node_checkpoint_oldest_age_seconds",
                "Now minus the write time of the oldest checkpoint among this process's running channels (those that read or committed one); 0 when none has.",
            )),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ages> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A run's entry, with no checkpoint yet (not counted until [`CheckpointAge::set`]).
    pub(crate) fn track(&self, clock: Clock) -> CheckpointAge {
        let mut a = self.lock();
        a.clock = Some(clock);
        a.next += 1;
        CheckpointAge {
            ages: self.inner.clone(),
            id: a.next,
        }
    }

    /// The age in seconds now.
    pub fn oldest_age_secs(&self) -> f64 {
        let a = self.lock();
        let (Some(clock), Some(oldest)) = (a.clock, a.runs.values().min()) else {
            return 0.0;
        };
        clock.unix_ms().saturating_sub(*oldest) as f64 / 1000.0
    }
}

impl Collector for CheckpointAges {
    fn desc(&self) -> Vec<&Desc> {
        self.gauge.desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        self.gauge.set(self.oldest_age_secs());
        self.gauge.collect()
    }
}

/// One run's checkpoint time in [`CheckpointAges`]; removed when dropped (the run ended).
#[derive(Debug)]
pub(crate) struct CheckpointAge {
    ages: Arc<Mutex<Ages>>,
    id: u64,
}

impl CheckpointAge {
    /// The run's checkpoint was written at `updated_at_ms`.
    pub(crate) fn set(&self, updated_at_ms: u64) {
        let mut a = self.ages.lock().unwrap_or_else(PoisonError::into_inner);
        a.runs.insert(self.id, updated_at_ms);
    }
}

impl Drop for CheckpointAge {
    fn drop(&mut self) {
        let mut a = self.ages.lock().unwrap_or_else(PoisonError::into_inner);
        a.runs.remove(&self.id);
    }
}
