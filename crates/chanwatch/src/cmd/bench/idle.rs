//! `chanwatch bench idle`: what a settled cluster costs while nothing changes — etcd's own
//! counters (requests and bytes it sent, by gRPC method, from its `/metrics`) and this
//! process's CPU (coordinator and nodes together), over an idle window, at each size given.
//!
//! Owns: the idle workload (channels seeded `Watched`, then nothing) and reading etcd's
//! per-method counters. Must not: assert on the figures.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use chanwatch_core::ChannelState;
use serde_json::json;

use super::meter::round3;
use super::system::{
    cluster_with, cpu_secs, machine, open, seed, teardown, timings, until_watched,
};
use super::{BenchIdleArgs, StoreKind};

/// etcd's counters by gRPC method: requests handled, and bytes it sent to clients in total.
#[derive(Debug, Default, Clone)]
struct Counters {
    requests: BTreeMap<String, f64>,
    sent_bytes: f64,
}

/// Sums one metric's samples by their `grpc_method` label (or all of them, without one).
fn parse(text: &str) -> Counters {
    let mut c = Counters::default();
    for line in text.lines() {
        let value = || {
            line.rsplit_once(' ')
                .and_then(|(_, v)| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0)
        };
        if line.starts_with("grpc_server_handled_total{") {
            if let Some(method) = line
                .split("grpc_method=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            {
                *c.requests.entry(method.to_owned()).or_default() += value();
            }
        } else if line.starts_with("etcd_network_client_grpc_sent_bytes_total") {
            c.sent_bytes += value();
        }
    }
    c
}

async fn scrape(endpoints: &[String]) -> Result<Counters> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()?;
    let mut sum = Counters::default();
    for e in endpoints {
        let url = format!("{}/metrics", e.trim_end_matches('/'));
        let text = client
            .get(&url)
            .send()
            .await
            .with_context(|| format!("scraping {url}"))?
            .text()
            .await?;
        let c = parse(&text);
        for (m, v) in c.requests {
            *sum.requests.entry(m).or_default() += v;
        }
        sum.sent_bytes += c.sent_bytes;
    }
    Ok(sum)
}

/// `chanwatch bench idle`.
///
/// # Errors
/// Store errors, an etcd whose `/metrics` cannot be read, or a cluster that does not settle.
pub async fn run(args: &BenchIdleArgs) -> Result<()> {
    let etcd = args.store == StoreKind::Etcd;
    for (run, &channels) in args.channels.iter().enumerate() {
        let store = open(args.store, &args.etcd).await?;
        let mut t = timings();
        t.resync_interval = args.resync_interval;
        let (c, procs, ids) = cluster_with(store, run, args.nodes, t).await?;
        seed(&c, &ids, channels, ChannelState::Watched).await?;
        until_watched(&c, channels, Duration::from_secs(600)).await?;
        // Let the set-up's own traffic (acks, the first plans) die down.
        tokio::time::sleep(args.settle).await;
        let before = if etcd {
            Some(scrape(&args.etcd.endpoints).await?)
        } else {
            None
        };
        let (cpu0, t0) = (cpu_secs(), Instant::now());
        tokio::time::sleep(args.duration).await;
        let secs = t0.elapsed().as_secs_f64();
        let cpu_ms_per_s = (cpu_secs() - cpu0) * 1000.0 / secs;
        let mut by_method = serde_json::Map::new();
        let mut kb_per_s = None;
        if let (Some(b), true) = (before, etcd) {
            let a = scrape(&args.etcd.endpoints).await?;
            for (m, v) in &a.requests {
                let rate = (v - b.requests.get(m).copied().unwrap_or(0.0)) / secs;
                if rate > 0.0 {
                    by_method.insert(m.clone(), json!(round3(rate)));
                }
            }
            kb_per_s = Some(round3((a.sent_bytes - b.sent_bytes) / secs / 1024.0));
        }
        eprintln!(
            "  {channels} channels, {} nodes, idle {secs:.0} s: etcd sent {} KB/s, requests/s {:?}; process CPU {cpu_ms_per_s:.2} ms/s",
            args.nodes,
            kb_per_s.map_or("n/a".into(), |k| k.to_string()),
            by_method
        );
        println!(
            "{}",
            json!({
                "bench": "idle", "store": format!("{:?}", args.store).to_lowercase(),
                "machine": machine(args.store), "channels": channels, "nodes": args.nodes,
                "idle_seconds": round3(secs),
                "resync_interval_s": args.resync_interval.as_secs_f64(),
                "etcd_sent_kb_per_sec": kb_per_s,
                "etcd_requests_per_sec_by_method": by_method,
                "process_cpu_ms_per_sec": round3(cpu_ms_per_s),
                "note": "CPU is the whole process: coordinator and nodes (and the embedded store)",
            })
        );
        teardown(c, procs).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_sum_by_method_and_bytes_over_services() {
        let text = "\
# HELP grpc_server_handled_total x
grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 7
grpc_server_handled_total{grpc_code=\"Canceled\",grpc_method=\"Range\",grpc_service=\"etcdserverpb.KV\",grpc_type=\"unary\"} 1
grpc_server_handled_total{grpc_code=\"OK\",grpc_method=\"LeaseKeepAlive\",grpc_service=\"etcdserverpb.Lease\",grpc_type=\"bidi_stream\"} 2
etcd_network_client_grpc_sent_bytes_total 1024
";
        let c = parse(text);
        assert_eq!(c.requests.get("Range"), Some(&8.0));
        assert_eq!(c.requests.get("LeaseKeepAlive"), Some(&2.0));
        assert_eq!(c.sent_bytes, 1024.0);
    }
}
