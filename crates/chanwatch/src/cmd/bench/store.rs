//! `chanwatch bench store`: the store floor (single-key CAS txns serial and concurrent,
//! batched txns) on either backend.
//!
//! Owns: those workload loops and their percentiles.
//! Must not: assert on timings (benchmarks report; they never fail for being slow).

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use serde_json::json;

use super::{median, BenchStoreArgs, StoreKind};

/// Latency summary of one run.
struct Run {
    per_sec: f64,
    p50: Duration,
    p99: Duration,
}

fn summarize(mut lat: Vec<Duration>, elapsed: Duration, units: usize) -> Run {
    lat.sort_unstable();
    let pick = |q: f64| {
        let idx = ((lat.len() as f64 - 1.0) * q).round() as usize;
        lat.get(idx).copied().unwrap_or_default()
    };
    Run {
        per_sec: units as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: pick(0.50),
        p99: pick(0.99),
    }
}

/// Serial single-key compare-and-swap txns: the latency floor of one coordinator decision.
async fn cas_serial(store: &dyn MetaStore, key: &str, n: usize) -> Result<Run> {
    let mut rev = store
        .txn(Txn::new().and_then([TxnOp::put(key, "0")]))
        .await?
        .revision;
    let mut lat = Vec::with_capacity(n);
    let start = Instant::now();
    for i in 0..n {
        let t = Instant::now();
        let resp = store
            .txn(
                Txn::new()
                    .when([Compare::mod_revision(key, rev)])
                    .and_then([TxnOp::put(key, i.to_string())]),
            )
            .await?;
        ensure!(
            resp.succeeded,
            "uncontended CAS failed: the store lost a write"
        );
        rev = resp.revision;
        lat.push(t.elapsed());
    }
    Ok(summarize(lat, start.elapsed(), n))
}

/// CAS txns from `tasks` concurrent tasks, each on its own key (no contention).
async fn cas_concurrent(store: Arc<dyn MetaStore>, n: usize, tasks: usize) -> Result<Run> {
    let per_task = n.div_ceil(tasks.max(1));
    let start = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks.max(1) {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let key = format!("bench/cas/{t}");
            let r = cas_serial(&*store, &key, per_task).await?;
            anyhow::Ok(r)
        }));
    }
    let mut p50s = Vec::new();
    let mut p99s = Vec::new();
    for h in handles {
        let r = h.await??;
        p50s.push(r.p50.as_secs_f64());
        p99s.push(r.p99.as_secs_f64());
    }
    let elapsed = start.elapsed();
    Ok(Run {
        per_sec: (per_task * tasks.max(1)) as f64 / elapsed.as_secs_f64().max(1e-9),
        p50: Duration::from_secs_f64(median(p50s)),
        p99: Duration::from_secs_f64(p99s.into_iter().fold(0.0, f64::max)),
    })
}

/// Txns of `ops` puts each, like a batch of channel moves.
async fn batched(store: &dyn MetaStore, txns: usize, ops: usize) -> Result<Run> {
    let value = vec![b'v'; 200];
    let mut lat = Vec::with_capacity(txns);
    let start = Instant::now();
    for i in 0..txns {
        let batch: Vec<TxnOp> = (0..ops)
            .map(|j| {
                TxnOp::put(
                    format!("bench/batch/{}", (i * ops + j) % 10_000),
                    value.clone(),
                )
            })
            .collect();
        let t = Instant::now();
        store.txn(Txn::new().and_then(batch)).await?;
        lat.push(t.elapsed());
    }
    Ok(summarize(lat, start.elapsed(), txns))
}

/// `chanwatch bench store`.
///
/// # Errors
/// Store errors during the run.
pub async fn run(store: Arc<dyn MetaStore>, args: &BenchStoreArgs) -> Result<()> {
    let default_txns = match args.store {
        StoreKind::Embedded => 200_000,
        StoreKind::Etcd => 2_000,
    };
    let txns = args.txns.unwrap_or(default_txns).max(1);
    // A batch txn costs about as much as 40-100 single ones; keep the run times comparable.
    let batch_txns = (txns / 40).max(10);
    let runs = args.runs.max(1);
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    eprintln!(
        "bench store: backend {}, {cores} cores, {runs} runs, {txns} CAS txns, {batch_txns} txns of {} ops",
        store.describe(),
        args.batch_ops
    );
    let cases: [(&str, usize); 3] = [
        ("cas_serial", txns),
        ("cas_concurrent", txns),
        ("batch", batch_txns),
    ];
    for (case, n) in cases {
        let mut rates = Vec::new();
        let mut p50 = Vec::new();
        let mut p99 = Vec::new();
        for _ in 0..runs {
            let r = match case {
                "cas_serial" => cas_serial(&*store, "bench/serial", n).await?,
                "cas_concurrent" => cas_concurrent(store.clone(), n, args.concurrency).await?,
                _ => batched(&*store, n, args.batch_ops).await?,
            };
            rates.push(r.per_sec);
            p50.push(r.p50.as_secs_f64() * 1e6);
            p99.push(r.p99.as_secs_f64() * 1e6);
        }
        let line = json!({
            "bench": "store",
            "case": case,
            "store": store.describe(),
            "cores": cores,
            "runs": runs,
            "txns_per_run": n,
            "ops_per_txn": if case == "batch" { args.batch_ops } else { 1 },
            "concurrency": if case == "cas_concurrent" { args.concurrency } else { 1 },
            "txns_per_sec_median": median(rates.clone()).round(),
            "p50_us_median": (median(p50) * 10.0).round() / 10.0,
            "p99_us_median": (median(p99) * 10.0).round() / 10.0,
        });
        println!("{line}");
        eprintln!(
            "  {case:<15} {:>12.0} txn/s   p50 {:>9.1} us   p99 {:>9.1} us",
            line["txns_per_sec_median"].as_f64().unwrap_or(0.0),
            line["p50_us_median"].as_f64().unwrap_or(0.0),
            line["p99_us_median"].as_f64().unwrap_or(0.0),
        );
    }
    Ok(())
}
