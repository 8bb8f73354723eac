//! `chanwatch ctl status` as an operator runs it: two real coordinators (a leader and a
//! standby) on a real etcd with a 32 MiB quota, compacting every second; a channel parked for
//! want of nodes. The status names both coordinators, the member's health, version, raft term
//! and db size against the quota read from etcd itself, the channel counts, and the
//! compaction — in every `-o` format.

mod procs;

use std::process::Output;
use std::time::{Duration, Instant};

use chanwatch_testkit::{EtcdFixture, EtcdOptions};
use procs::{free_port, spawn};
use serde_json::Value;

const QUOTA: u64 = 32 * 1024 * 1024;

fn ctl(fixture: &EtcdFixture, args: &[&str]) -> Output {
    procs::ctl(fixture.endpoint(), args)
}

/// Retries `f` every 200 ms until it returns `Some`, for up to `limit`.
fn eventually<T>(what: &str, limit: Duration, mut f: impl FnMut() -> Option<T>) -> T {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(start.elapsed() < limit, "no {what} within {limit:?}");
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn status_shows_the_leader_the_standby_etcd_against_its_quota_channels_and_compaction() {
    let fixture = EtcdFixture::start_with(EtcdOptions {
        quota_backend_bytes: Some(QUOTA),
        ..EtcdOptions::default()
    })
    .await
    .expect("etcd");
    let dir = tempfile::tempdir().expect("tempdir");
    let coord = |name: &str| {
        spawn(
            dir.path(),
            name,
            &[
                "coord".to_owned(),
                format!("--endpoints={}", fixture.endpoint()),
                format!("--admin=127.0.0.1:{}", free_port()),
                "--compact-interval=1s".to_owned(),
            ],
        )
    };
    let mut first = coord("coord-1");
    let mut second = coord("coord-2");
    eventually(
        "a leader accepting add-channel",
        Duration::from_secs(30),
        || {
            assert!(first.running(), "coordinator exited:\n{}", first.output());
            assert!(second.running(), "coordinator exited:\n{}", second.output());
            ctl(&fixture, &["add-channel", "orders-1"])
                .status
                .success()
                .then_some(())
        },
    );

    let status = eventually(
        "a status with a standby and a compaction",
        Duration::from_secs(30),
        || {
            let out = ctl(&fixture, &["status", "-o", "json"]);
            assert!(
                out.status.success(),
                "ctl status failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let v: Value = serde_json::from_slice(&out.stdout).expect("json");
            (v["standbys"].as_array().is_some_and(|s| s.len() == 1) && v["compaction"].is_object())
                .then_some(v)
        },
    );
    let leader = status["leader"]["id"].as_str().expect("a leader");
    let standby = status["standbys"][0]["id"].as_str().expect("a standby");
    assert_ne!(leader, standby);
    let etcd = &status["etcd"][0];
    assert_eq!(etcd["healthy"], true, "{status:#}");
    assert!(etcd["version"].as_str().expect("version").starts_with("3."));
    assert_eq!(etcd["is_leader"], true);
    assert!(etcd["raft_term"].as_u64().expect("term") >= 1);
    assert!(etcd["db_size"].as_u64().expect("db size") > 0);
    assert_eq!(etcd["quota"], QUOTA, "{status:#}");
    assert_ne!(etcd["quota_source"], "assumed", "{status:#}");
    assert_eq!(status["alarms"], serde_json::json!([]));
    assert_eq!(status["nodes"], 0);
    assert_eq!(status["channels_total"], 1);
    assert_eq!(status["channels"]["remaining"], 1);
    assert!(
        status["compaction"]["revision"]
            .as_i64()
            .expect("compacted to")
            > 0
    );

    // The same facts for a person, and in YAML.
    let out = ctl(&fixture, &["status"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains(&format!("Leader:      {leader}")), "{text}");
    assert!(text.contains(&format!("Standbys:    {standby}")), "{text}");
    assert!(text.contains("32.0 MiB"), "{text}");
    assert!(text.contains("Channels:    1 ("), "{text}");
    assert!(text.contains("Compacted:   to revision"), "{text}");
    let yaml = ctl(&fixture, &["status", "-o", "yaml"]);
    let y: Value = serde_yaml_ng::from_slice(&yaml.stdout).expect("yaml");
    assert_eq!(y["leader"]["id"], leader);

    // The leader goes: the standby leads, and no standby is left. Either process may have
    // won the election (the test once assumed the first did, and killed the standby when
    // the second won).
    let (gone, mut second) = if leader == format!("coord-{}", first.pid()) {
        (first, second)
    } else {
        assert_eq!(leader, format!("coord-{}", second.pid()), "{status:#}");
        (second, first)
    };
    drop(gone);
    eventually("the standby leading alone", Duration::from_secs(30), || {
        let out = ctl(&fixture, &["status", "-o", "json"]);
        let v: Value = serde_json::from_slice(&out.stdout).ok()?;
        (v["leader"]["id"] == standby && v["standbys"].as_array().is_some_and(Vec::is_empty))
            .then_some(())
    });
    assert!(second.running(), "{}", second.output());
}
