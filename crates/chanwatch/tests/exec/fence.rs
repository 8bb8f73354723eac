//! A node that learns its lease is gone (no pause before: the store answered "no such lease")
//! fences itself: its workers are killed at once, not after the stop grace — another node may
//! start their channels any moment (found by the chaos run with Python workers: a worker's
//! last commit on SIGTERM waited for the fenced session's end, the node for the grace, and
//! another node started the channel meanwhile).

use super::*;

/// The lease of node `id`'s session key, in hex as `etcdctl lease revoke` wants it.
fn session_lease(w: &World) -> Option<String> {
    let out = Command::new("etcdctl")
        .args([
            &w.endpoint(),
            "get",
            "--prefix",
            "chanwatch/session/node/",
            "-w",
            "json",
        ])
        .env("ETCDCTL_API", "3")
        .output()
        .expect("etcdctl runs");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let lease = v["kvs"].as_array()?.first()?["lease"].as_i64()?;
    Some(format!("{lease:x}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_finds_its_lease_gone_kills_its_workers_at_once_without_the_grace() {
    let w = World::start().await;
    let marker = w.dir.path().display().to_string();
    // Ignores SIGTERM; the grace (60 s) would outlast the test.
    let stubborn = format!(
        "trap '' TERM; while :; do sleep 0.2; done # {}",
        w.dir.path().display()
    );
    let node = w.node("node", &stubborn, &["--ready-on-start", "--stop-grace=60s"]);
    w.add_channel("f-0", &[]);
    w.watched("f-0", 30);
    wait_for(
        10,
        || "worker up".into(),
        || (!procs_with(&marker).is_empty()).then_some(()),
    );
    let workers = procs_with(&marker);
    let lease = wait_for(10, || "the node's session".into(), || session_lease(&w));
    let out = Command::new("etcdctl")
        .args([&w.endpoint(), "lease", "revoke", &lease])
        .env("ETCDCTL_API", "3")
        .output()
        .expect("etcdctl runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let revoked = Instant::now();
    wait_for(
        15,
        || {
            format!(
                "the worker killed once the lease is known gone: {}",
                node.output()
            )
        },
        // The node registers again and gets the channel back: a new worker, of another pid.
        || {
            let now = procs_with(&marker);
            (!workers.iter().any(|p| now.contains(p))).then_some(())
        },
    );
    assert!(
        node.output().contains("fenced itself"),
        "the node did not fence itself: {}",
        node.output()
    );
    eprintln!("worker gone {:?} after the revoke", revoked.elapsed());
}
