//! The data plane through the real binary (issue 12): `standalone --handler stream` consumes
//! what `produce` appends to a file log, and `audit` finds every channel exact.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod procs;
use procs::{bin, spawn};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("free port")
        .port()
}

#[test]
fn standalone_consumes_what_produce_appends_and_audit_finds_it_exact() {
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
    let out = Command::new(bin())
        .args([
            "produce",
            &format!("--log={log}"),
            "--channel=ch-000,ch-001,ch-002",
            "--rate=1500",
            "--duration=3s",
            &format!("--out={}", produced.display()),
        ])
        .stdin(Stdio::null())
        .output()
        .expect("produce runs");
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
            &format!("--admin=http://{admin}"),
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
    eprintln!("{stdout}");
}
