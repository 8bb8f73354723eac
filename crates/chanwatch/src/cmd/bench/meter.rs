//! What the benchmarks measure with: a store wrapper that counts the txns sent through it,
//! etcd's own count of the Txn RPCs it handled and its WAL fsyncs (its `/metrics`), this
//! process's CPU and memory and a child's CPU (`/proc`), latency percentiles, and the
//! machine line every result carries.
//!
//! Owns: those instruments. Must not: change what passes through the store (the wrapper only
//! counts), or assert on timings.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_store::{Layer, Layered, MetaStore, StoreResult, Txn, TxnResponse};
use serde_json::{json, Value};

/// A store that counts the txns sent through it (whatever their outcome) and passes every
/// call on unchanged: the embedded store has no txn counter of its own, and on etcd it
/// tells the nodes' txns apart from the coordinator's.
pub(crate) struct CountingStore {
    txns: Arc<AtomicU64>,
}

impl CountingStore {
    /// Counts `inner`'s txns into `txns` (shared by every wrapper of one measurement).
    pub(crate) fn wrap(inner: Arc<dyn MetaStore>, txns: Arc<AtomicU64>) -> Arc<dyn MetaStore> {
        Arc::new(Layered::new(inner, CountingStore { txns }))
    }
}

#[async_trait]
impl Layer for CountingStore {
    async fn txn(&self, inner: &dyn MetaStore, txn: Txn) -> StoreResult<TxnResponse> {
        self.txns.fetch_add(1, Ordering::Relaxed);
        inner.txn(txn).await
    }
}

/// The Txn RPCs an etcd member has handled (every gRPC code), summed from the text of its
/// `/metrics`: etcd 3.4 exports `grpc_server_handled_total{…,grpc_method="Txn",…}` per code.
/// `None` when the text has no such line.
pub(crate) fn txns_in_metrics(text: &str) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines() {
        if !line.starts_with("grpc_server_handled_total{") || !line.contains("grpc_method=\"Txn\"")
        {
            continue;
        }
        if let Some(v) = line
            .rsplit_once(' ')
            .and_then(|(_, v)| v.trim().parse::<f64>().ok())
        {
            sum += v;
            found = true;
        }
    }
    found.then_some(sum)
}

/// Txn RPCs handled so far, summed over every endpoint's `/metrics` (each member counts the
/// RPCs its clients sent it).
///
/// # Errors
/// An endpoint that does not answer, or answers without the Txn counter.
pub(crate) async fn etcd_txns(endpoints: &[String]) -> anyhow::Result<f64> {
    let each = each_metrics(
        endpoints,
        "grpc_server_handled_total for Txn",
        txns_in_metrics,
    )
    .await?;
    Ok(each.iter().sum())
}

/// The WAL fsyncs an etcd member has done: (seconds they took, how many), from its
/// `etcd_disk_wal_fsync_duration_seconds` histogram. `None` when the text has neither.
pub(crate) fn wal_fsyncs_in_metrics(text: &str) -> Option<(f64, f64)> {
    let value = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    Some((
        value("etcd_disk_wal_fsync_duration_seconds_sum")?,
        value("etcd_disk_wal_fsync_duration_seconds_count")?,
    ))
}

/// WAL fsyncs so far, (seconds, count), summed over every endpoint's `/metrics`: over a
/// window, Δseconds ÷ Δcount is etcd's mean fsync — about a microsecond with its data on
/// tmpfs, where it syncs nothing, a fraction of a millisecond and up on a disk.
///
/// # Errors
/// An endpoint that does not answer, or answers without the histogram.
pub(crate) async fn etcd_wal_fsyncs(endpoints: &[String]) -> anyhow::Result<(f64, f64)> {
    let each = each_metrics(
        endpoints,
        "etcd_disk_wal_fsync_duration_seconds",
        wal_fsyncs_in_metrics,
    )
    .await?;
    Ok(each
        .iter()
        .fold((0.0, 0.0), |(s, n), (s1, n1)| (s + s1, n + n1)))
}

/// The mean WAL fsync between two readings of [`etcd_wal_fsyncs`], ms; `None` without both,
/// or without an fsync between them.
pub(crate) fn mean_fsync_ms(before: Option<(f64, f64)>, after: Option<(f64, f64)>) -> Option<f64> {
    match (before, after) {
        (Some((t0, n0)), Some((t1, n1))) if n1 > n0 => Some((t1 - t0) * 1e3 / (n1 - n0)),
        _ => None,
    }
}

/// `parse` of each endpoint's `/metrics` text; `what` names what it looks for.
async fn each_metrics<T>(
    endpoints: &[String],
    what: &str,
    parse: impl Fn(&str) -> Option<T>,
) -> anyhow::Result<Vec<T>> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let mut each = Vec::with_capacity(endpoints.len());
    for e in endpoints {
        let url = format!("{}/metrics", e.trim_end_matches('/'));
        let text = client.get(&url).send().await?.text().await?;
        each.push(
            parse(&text).ok_or_else(|| anyhow::anyhow!("{url} has no {what}; is it etcd 3.4+?"))?,
        );
    }
    Ok(each)
}

/// Resident set size of this process (Linux), in bytes.
pub(crate) fn rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// User + system CPU time of this process (Linux, clock ticks of 10 ms), in seconds.
pub(crate) fn cpu_secs() -> f64 {
    stat_cpu_secs("self")
}

/// utime + stime of `/proc/{pid}/stat` (`self` for this process), seconds at the usual 100
/// ticks per second; 0 when it cannot be read (the process is gone).
fn stat_cpu_secs(pid: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            // Fields after the command name, which is in parentheses and may hold spaces.
            let rest = s.rsplit_once(')')?.1;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let utime: f64 = f.get(11)?.parse().ok()?;
            let stime: f64 = f.get(12)?.parse().ok()?;
            Some((utime + stime) / 100.0)
        })
        .unwrap_or(0.0)
}

/// A worker's CPU time, seconds; 0 once it is gone. From `/proc/PID/schedstat` (the time
/// its main thread ran, in ns — a worker's work is its main thread's): `/proc/PID/stat`
/// counts in ticks of 10 ms and rounds each process down, and a thousand workers each
/// running ~1 ms in a window summed to anything from 0 to 21 µs per commit. `stat` when
/// the kernel has no schedstat.
pub(crate) fn cpu_of(pid: u32) -> f64 {
    if let Some(ns) = std::fs::read_to_string(format!("/proc/{pid}/schedstat"))
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<f64>().ok())
    {
        return ns / 1e9;
    }
    stat_cpu_secs(&pid.to_string())
}

/// The `q` quantile (0..=1) of sorted samples, nearest rank; 0 for none.
pub(crate) fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let idx = ((sorted.len() as f64 - 1.0) * q.clamp(0.0, 1.0)).round() as usize;
    sorted[idx]
}

/// Rounds to 3 decimals.
pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// Cores, the load average when the run started (other work on the machine), and the build.
pub(crate) fn machine() -> Value {
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().map(str::to_owned));
    json!({
        "cores": cores,
        "loadavg_1m_at_start": load,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wal_fsyncs_are_the_histograms_sum_and_count() {
        let text = "\
# TYPE etcd_disk_wal_fsync_duration_seconds histogram
etcd_disk_wal_fsync_duration_seconds_bucket{le=\"0.001\"} 180000
etcd_disk_wal_fsync_duration_seconds_sum 127.05
etcd_disk_wal_fsync_duration_seconds_count 200522
etcd_disk_backend_commit_duration_seconds_sum 9
";
        assert_eq!(wal_fsyncs_in_metrics(text), Some((127.05, 200_522.0)));
        assert_eq!(
            wal_fsyncs_in_metrics("etcd_disk_wal_fsync_duration_seconds_sum 1\n"),
            None,
            "a sum without a count"
        );
    }

    /// Over a window, the mean is Δseconds ÷ Δcount — not the mean since etcd started — and
    /// a window without an fsync, or a reading missing, has none.
    #[test]
    fn the_mean_fsync_is_the_windows_own() {
        let ms = mean_fsync_ms(Some((100.0, 200_000.0)), Some((100.6, 201_000.0)))
            .expect("a window with fsyncs");
        assert!((ms - 0.6).abs() < 1e-9, "{ms}");
        assert_eq!(mean_fsync_ms(Some((1.0, 10.0)), Some((1.0, 10.0))), None);
        assert_eq!(mean_fsync_ms(None, Some((1.0, 10.0))), None);
        assert_eq!(mean_fsync_ms(Some((1.0, 10.0)), None), None);
    }

    #[test]
    fn the_txn_count_sums_every_code_of_the_txn_method_only() {
        let text = "\
# HELP grpc_server_handled_total Total number of RPCs completed on the server.
grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 120
grpc_server_handled_total{grpc_code=\"Unavailable\",grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 3
grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 999
grpc_server_started_total{grpc_method=\"Txn\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 500
";
        assert_eq!(txns_in_metrics(text), Some(123.0));
        assert_eq!(txns_in_metrics("etcd_mvcc_txn_total 5\n"), None);
    }

    #[tokio::test]
    async fn a_counting_store_counts_every_txn_and_passes_it_on() {
        use chanwatch_store::{Compare, EmbeddedStore, TxnOp};
        let count = Arc::new(AtomicU64::new(0));
        let store = CountingStore::wrap(Arc::new(EmbeddedStore::new()), count.clone());
        let put = store
            .txn(Txn::new().and_then([TxnOp::put("k", "v")]))
            .await
            .expect("put");
        assert!(put.succeeded);
        // A refused txn is a txn spent too.
        let refused = store
            .txn(
                Txn::new()
                    .when([Compare::absent("k")])
                    .and_then([TxnOp::put("k", "w")]),
            )
            .await
            .expect("txn");
        assert!(!refused.succeeded);
        assert_eq!(
            store.get("k").await.expect("get").map(|kv| kv.value),
            Some(b"v".to_vec())
        );
        assert_eq!(count.load(Ordering::Relaxed), 2);
    }

    #[test]
    fn quantiles_pick_the_nearest_rank() {
        let xs: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(quantile(&xs, 0.5), 51.0);
        assert_eq!(quantile(&xs, 0.99), 99.0);
        assert_eq!(quantile(&xs, 1.0), 100.0);
        assert_eq!(quantile(&[], 0.5), 0.0);
    }
}
