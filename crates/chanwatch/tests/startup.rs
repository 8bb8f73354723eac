//! Processes started while etcd is down wait for it (DESIGN §6 invariant 10): a coordinator
//! and a node started before etcd serves keep running, say why, and do their work once it
//! does.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chanwatch_testkit::EtcdFixture;

mod procs;
use procs::{bin, spawn};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_coordinator_and_a_node_started_while_etcd_is_down_wait_for_it() {
    let mut fixture = EtcdFixture::start().await.expect("etcd");
    let endpoint = format!("--endpoints={}", fixture.endpoint());
    fixture.kill();
    let dir = tempfile::tempdir().expect("tempdir");
    let port = chanwatch_testkit::free_port();
    let mut coord = spawn(
        dir.path(),
        "coord",
        &[
            "coord".to_owned(),
            endpoint.clone(),
            format!("--admin=127.0.0.1:{port}"),
            "--connect-timeout=1s".to_owned(),
        ],
    );
    let mut node = spawn(
        dir.path(),
        "node",
        &[
            "node".to_owned(),
            // Port 0: several nodes share this machine (the default is 9871).
            "--admin=127.0.0.1:0".to_owned(),
            endpoint.clone(),
            "--connect-timeout=1s".to_owned(),
        ],
    );
    std::thread::sleep(Duration::from_secs(4));
    assert!(coord.running(), "coordinator exited:\n{}", coord.output());
    assert!(node.running(), "node exited:\n{}", node.output());
    assert!(
        node.output().contains("cannot connect to etcd yet"),
        "the node says why it waits:\n{}",
        node.output()
    );

    fixture.start_again().await.expect("etcd back");
    let start = Instant::now();
    loop {
        let added = Command::new(bin())
            .args(["ctl", &endpoint, "add-channel", "c1"])
            .stdin(Stdio::null())
            .output()
            .expect("ctl");
        if added.status.success() {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no leader 30 s after etcd came back:\n{}",
            coord.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    loop {
        let out = Command::new(bin())
            .args(["ctl", &endpoint, "channels", "--json"])
            .stdin(Stdio::null())
            .output()
            .expect("ctl");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains("Watched") {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "c1 not Watched 40 s after etcd came back: {text}\n{}",
            node.output()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(coord.running() && node.running());
}

#[test]
fn a_node_with_a_fence_margin_out_of_range_exits_at_once_naming_the_range() {
    // Checked before the node looks for etcd (there is none at this endpoint): a bad flag
    // must not wait for a dependency.
    for margin in ["3s", "6s"] {
        let fence = format!("--fence-margin={margin}");
        let (ok, err) = exit_of(&[
            "node",
            "--endpoints=http://127.0.0.1:1",
            "--admin=127.0.0.1:0",
            "--session-ttl=20s",
            &fence,
        ]);
        assert!(!ok, "--fence-margin {margin} accepted: {err}");
        let want = format!(
            "--fence-margin {margin} is outside 4s to 5s 666ms (inclusive) for --session-ttl 20s"
        );
        assert!(err.contains(&want), "{err}");
    }
}

/// Runs `chanwatch ARGS` and waits up to 10 s for it to exit: its success and stderr.
fn exit_of(args: &[&str]) -> (bool, String) {
    let mut p = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run chanwatch");
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = p.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = p.kill();
            panic!("{args:?} did not exit within 10 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut p.stderr.take().expect("stderr"), &mut err)
        .expect("read stderr");
    (status.success(), err)
}

/// An endpoint that can never connect is a configuration error, said at once: a newcomer's
/// `htp://` and an `http://` endpoint with `--etcd-ca` were retried as "unavailable" for ever.
#[test]
fn an_endpoint_that_can_never_connect_ends_the_process_at_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca_file = dir.path().join("ca.pem");
    std::fs::write(&ca_file, "not read: the endpoint is refused first").expect("ca file");
    let ca = ca_file.to_str().expect("utf-8 path");
    for part in ["node", "coord"] {
        for (flags, says) in [
            (
                vec!["--endpoints=htp://127.0.0.1:1"],
                "the scheme htp:// is neither http:// nor https://",
            ),
            (
                vec!["--endpoints=http://127.0.0.1:1", "--etcd-ca", ca],
                "is plain HTTP but TLS files were given",
            ),
        ] {
            let mut args = vec![part, "--admin=127.0.0.1:0"];
            args.extend(flags);
            let (ok, err) = exit_of(&args);
            assert!(!ok && err.contains(says), "{args:?}: {err}");
        }
    }
}
