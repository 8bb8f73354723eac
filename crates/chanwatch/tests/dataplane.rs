//! The data plane through the real binary: `standalone --handler stream` consumes
//! what `produce` appends to a file log while the node owning a channel is drained (its
//! channels move mid-stream), and `audit` finds every channel exact; and the same on real etcd
//! with `coord` and two `node --handler stream` processes, one killed mid-stream, with
//! `produce --all` and `audit --endpoints`.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod procs;
use procs::{bin, free_port, spawn};

/// `curl` the standalone's admin API; the body, or `None` on failure.
fn curl(args: &[&str]) -> Option<String> {
    let out = Command::new("curl")
        .args(["-sf", "--max-time", "5"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Drains the node that owns `channel`, once it has one; its channels move to the other node.
fn drain_owner_of(admin: &str, channel: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let rows: serde_json::Value = curl(&[&format!("http://{admin}/api/v1/channels")])
            .and_then(|b| serde_json::from_str(&b).ok())
            .unwrap_or_default();
        let owner = rows.as_array().into_iter().flatten().find_map(|r| {
            (r["channel"] == channel && r["state"] == "Watched")
                .then(|| r["node"].as_u64())
                .flatten()
        });
        if let Some(node) = owner {
            if curl(&[
                "-X",
                "POST",
                "-H",
                "Content-Type: application/json",
                &format!("http://{admin}/api/v1/nodes/{node}/drain"),
            ])
            .is_some()
            {
                return node;
            }
        }
        assert!(Instant::now() < deadline, "{channel} never watched: {rows}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn standalone_consumes_what_produce_appends_through_a_drain_and_audit_finds_it_exact() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = format!("file:{}", dir.path().join("log").display());
    let port = free_port();
    let admin = format!("127.0.0.1:{port}");
    let mut standalone = spawn(
        dir.path(),
        "standalone",
        &[
            "standalone".into(),
            "--nodes=2".into(),
            "--channels=3".into(),
            format!("--admin={admin}"),
            "--session-ttl=2s".into(),
            "--handler=stream".into(),
            format!("--log={log}"),
            "--commit-interval=200ms".into(),
        ],
    );
    let produced = dir.path().join("produced.json");
    let started = Instant::now();
    let producer = Command::new(bin())
        .args([
            "produce",
            &format!("--log={log}"),
            "--channel=ch-000,ch-001,ch-002",
            "--rate=1500",
            "--duration=3s",
            &format!("--out={}", produced.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("produce runs");
    std::thread::sleep(Duration::from_millis(1000));
    let drained = drain_owner_of(&admin, "ch-000");
    let out = producer.wait_with_output().expect("produce ends");
    assert!(
        out.status.success(),
        "produce failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(standalone.running(), "{}", standalone.output());
    let audit = Command::new(bin())
        .args([
            "audit",
            &format!("--log={log}"),
            // The bare HOST:PORT, as `ctl --admin` takes it (audit waited its whole --wait,
            // then said "relative URL without a base").
            &format!("--admin={admin}"),
            &format!("--produced={}", produced.display()),
            "--wait=30s",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("audit runs");
    let stdout = String::from_utf8_lossy(&audit.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    let verdict: serde_json::Value = serde_json::from_str(last).unwrap_or_else(|e| {
        panic!(
            "audit's last line is JSON ({e}):\n{stdout}\n{}\n{}",
            String::from_utf8_lossy(&audit.stderr),
            standalone.output()
        )
    });
    assert_eq!(verdict["channels"], 3, "{stdout}");
    assert_eq!(verdict["exact"], 3, "{stdout}\n{}", standalone.output());
    assert_eq!(verdict["lost"], 0, "{stdout}");
    assert_eq!(verdict["duplicated"], 0, "{stdout}");
    assert!(audit.status.success(), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(60));
    eprintln!("drained node {drained} mid-stream\n{stdout}");

    // Mistakes say what they are: a log dir with nothing in it, and an admin address where
    // nothing listens (said at once, not after the whole --wait in silence).
    let audit_with = |log: &str, admin: &str, wait: &str| {
        run(&[
            "audit".into(),
            format!("--log={log}"),
            format!("--admin={admin}"),
            format!("--produced={}", produced.display()),
            format!("--wait={wait}"),
        ])
    };
    let empty = format!("file:{}", dir.path().join("no-such-log").display());
    let (ok, _, err) = audit_with(&empty, &admin, "5s");
    assert!(!ok && err.contains("is --log right?"), "{err}");
    let (ok, _, err) = audit_with(&log, &format!("127.0.0.1:{}", free_port()), "1s");
    assert!(!ok && err.contains("waiting up to 1 s (--wait):"), "{err}");
}

/// Runs `chanwatch ARGS` to its end; (success, stdout, stderr).
fn run(args: &[String]) -> (bool, String, String) {
    let out = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("chanwatch runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_on_etcd_consume_exactly_once_through_a_killed_node_and_audit_reads_etcd() {
    let etcd = chanwatch_testkit::EtcdFixture::start().await.expect("etcd");
    let endpoint = format!("--endpoints={}", etcd.endpoint());
    let dir = tempfile::tempdir().expect("tempdir");
    let log = format!("--log=file:{}", dir.path().join("log").display());
    let _coord = spawn(
        dir.path(),
        "coord",
        &[
            "coord".into(),
            endpoint.clone(),
            format!("--admin=127.0.0.1:{}", free_port()),
            "--session-ttl=2s".into(),
            "--release-timeout=5s".into(),
        ],
    );
    let node = |name: &str| {
        spawn(
            dir.path(),
            name,
            &[
                "node".into(),
                // Port 0: several nodes share this machine (the default is 9871).
                "--admin=127.0.0.1:0".into(),
                endpoint.clone(),
                "--session-ttl=2s".into(),
                "--handler=stream".into(),
                log.clone(),
                "--commit-interval=200ms".into(),
            ],
        )
    };
    let mut a = node("node-a");
    let b = node("node-b");
    let deadline = Instant::now() + Duration::from_secs(20);
    for c in ["d-0", "d-1", "d-2", "d-3"] {
        loop {
            let (ok, _, err) = run(&[
                "ctl".into(),
                endpoint.clone(),
                "add-channel".into(),
                c.into(),
            ]);
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "add-channel {c}: {err}");
            std::thread::sleep(Duration::from_millis(250));
        }
    }
    let produced = dir.path().join("produced.json");
    let producer = Command::new(bin())
        .args([
            "produce",
            &log,
            "--all",
            &endpoint,
            "--rate=1000",
            "--duration=4s",
            &format!("--out={}", produced.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("produce runs");
    std::thread::sleep(Duration::from_millis(1500));
    assert!(a.running(), "{}", a.output());
    // kill -9 (Proc's drop): its channels move after the TTL and resume from its commits.
    drop(std::mem::replace(&mut a, node("node-c")));
    let out = producer.wait_with_output().expect("produce ends");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, stdout, stderr) = run(&[
        "audit".into(),
        log.clone(),
        endpoint.clone(),
        format!("--produced={}", produced.display()),
        "--wait=30s".into(),
    ]);
    let last = stdout.lines().last().unwrap_or_default();
    let verdict: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("audit's last line is JSON ({e}):\n{stdout}\n{stderr}"));
    assert_eq!(verdict["channels"], 4, "{stdout}");
    assert_eq!(verdict["exact"], 4, "{stdout}\n{stderr}\n{}", b.output());
    assert!(ok, "{stdout}");
    eprintln!("{stdout}");
}
