//! One channel, two folds: the Rust stream consumer (`--handler stream`) and the Python
//! worker (`examples/workers/consumer.py agent` through `--exec`) resume each other's
//! checkpoints on NATS, so `audit` judges both as one (the chaos run mixes them under faults;
//! this proves the handover deterministically).

use super::*;

/// A node on `log` with a handler log `DIR/NAME.log`: the Python worker, or the Rust consumer.
fn data_node(w: &World, name: &str, log: &str, python: bool) -> Proc {
    let mut args = vec![
        "node".to_owned(),
        // Port 0: two nodes share this machine (the default is 9871).
        "--admin=127.0.0.1:0".into(),
        w.endpoint(),
        "--session-ttl=2s".into(),
        format!("--log={log}"),
        format!("--handler-log={}", w.path(&format!("{name}.log")).display()),
    ];
    if python {
        args.push(format!(
            "--exec=exec python3 '{}/consumer.py' agent",
            workers().display()
        ));
        args.push("--stop-grace=5s".into());
    } else {
        args.extend(["--handler=stream".into(), "--commit-interval=200ms".into()]);
    }
    spawn(w.dir.path(), name, &args)
}

/// Node IDs of the `start` lines of a handler log.
fn node_ids(w: &World, name: &str) -> std::collections::BTreeSet<String> {
    runs(&w.path(&format!("{name}.log")))
        .into_iter()
        .filter(|r| r.0 == "start")
        .map(|r| r.1)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_moved_between_the_rust_consumer_and_the_python_worker_keep_one_exact_state() {
    let w = World::start().await;
    let nats = chanwatch_testkit::NatsFixture::start().await.expect("nats");
    let log = nats.url().to_owned();
    let py = data_node(&w, "python", &log, true);
    let rs = data_node(&w, "rust", &log, false);
    let channels = ["m-0", "m-1", "m-2", "m-3"];
    for c in channels {
        w.add_channel(c, &[]);
    }
    for c in channels {
        w.watched(c, 30);
    }
    let produced = w.path("produced.json");
    let producer = Command::new(bin())
        .args([
            "produce",
            &format!("--log={log}"),
            "--all",
            &w.endpoint(),
            "--rate=400",
            "--duration=7s",
            &format!("--out={}", produced.display()),
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("produce runs");
    // Twice, mid-stream: every channel to the other node (the other fold), break-before-make;
    // each new run resumes from what the other language committed.
    let (ok, out, err) = w.ctl(&["nodes", "-o", "json"]);
    assert!(ok, "ctl nodes: {out}{err}");
    let nodes: Vec<u64> = serde_json::from_str::<serde_json::Value>(&out)
        .expect("ctl nodes -o json")
        .as_array()
        .expect("an array")
        .iter()
        .filter_map(|n| n["id"].as_u64())
        .collect();
    assert_eq!(nodes.len(), 2, "{out}");
    for _ in 0..2 {
        std::thread::sleep(Duration::from_millis(2000));
        let mut targets = Vec::new();
        for c in channels {
            let at = w.watched(c, 30)["node"].as_u64().expect("a node");
            let to = if at == nodes[0] { nodes[1] } else { nodes[0] };
            let (ok, out, err) = w.ctl(&["move", c, "--to", &to.to_string()]);
            assert!(ok, "move {c} to {to}: {out}{err}");
            targets.push((c, to));
        }
        for (c, to) in targets {
            wait_for(
                30,
                || format!("{c} Watched on node {to}: {:?}", w.row(c)),
                || {
                    w.row(c)
                        .filter(|r| r["state"] == "Watched" && r["node"].as_u64() == Some(to))
                },
            );
        }
    }
    let out = producer.wait_with_output().expect("produce ends");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (ok, stdout, stderr) = run(&[
        "audit".into(),
        format!("--log={log}"),
        w.endpoint(),
        format!("--produced={}", produced.display()),
        "--wait=40s".into(),
    ]);
    let last = stdout.lines().last().unwrap_or_default();
    let verdict: serde_json::Value = serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("audit's last line is JSON ({e}):\n{stdout}\n{stderr}"));
    assert_eq!(
        verdict["exact"],
        4,
        "{stdout}\n{stderr}\npython node:\n{}\nrust node:\n{}",
        py.output(),
        rs.output()
    );
    assert!(ok, "{stdout}");
    // Every channel ran on both folds (the handler logs say which node started which epoch).
    let (py_ids, rs_ids) = (node_ids(&w, "python"), node_ids(&w, "rust"));
    for c in channels {
        let started: Vec<(String, String)> = ["python", "rust"]
            .iter()
            .flat_map(|n| {
                runs(&w.path(&format!("{n}.log")))
                    .into_iter()
                    .filter(|r| r.0 == "start" && r.2 == c)
                    .map(|r| ((*n).to_owned(), r.1))
            })
            .collect();
        assert!(
            started.iter().any(|(_, id)| py_ids.contains(id))
                && started.iter().any(|(_, id)| rs_ids.contains(id)),
            "{c} did not run on both folds: {started:?}"
        );
    }
    eprintln!("{stdout}");
}
