//! `chanwatch ctl` as an operator runs it: the real binary against a real etcd holding a
//! session, three assignments (one parked) and a checkpoint written by this test — output
//! formats (`-o table|wide|json|yaml`, the hidden `--json`), natural order, the `--node` /
//! `--state` filters, and a reader that closes the pipe early.

use std::process::{Command, Output, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use chanwatch_core::{
    ChannelInfo, ChannelName, ChannelOwner, ChannelState, Checkpoint, Epoch, Keys, NodeId,
    NodeSession, VChannelInfo,
};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore, Txn, TxnOp};
use chanwatch_testkit::EtcdFixture;
use serde_json::Value;

mod procs;
use procs::bin;

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_millis() as u64
}

/// etcd with node 1's session; `orders-10` (vchannel: collection 7, seek p-42; checkpoint at
/// position 1234, epoch 3, written 5 s ago) and `orders-2` on node 1, Watched; `orders-1`
/// parked under `remaining`.
async fn seeded() -> EtcdFixture {
    let fixture = EtcdFixture::start().await.expect("etcd");
    let store = EtcdStore::connect(EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        ..EtcdConfig::default()
    })
    .await
    .expect("connect");
    let keys = Keys::default();
    let now = now_ms();
    let session = NodeSession {
        id: NodeId(1),
        admin_addr: String::new(),
        version: "test".into(),
        started_at_ms: now - 60_000,
        capacity: 0,
        name: String::new(),
        extra: Default::default(),
    };
    let name = |n: &str| ChannelName::new(n).expect("name");
    let info = |n: &str, state, epoch, vchannel| {
        let mut i = ChannelInfo::new(name(n), Epoch(epoch), now - 30_000, vchannel);
        i.state = state;
        i.encode()
    };
    let vchannel = VChannelInfo::from_json(br#"{"collection_id":7,"seek_position":"p-42"}"#)
        .expect("vchannel");
    let checkpoint = Checkpoint {
        epoch: Epoch(3),
        position: "1234".into(),
        state: Some(serde_json::json!({"count": 1234})),
        updated_at_ms: now - 5_000,
        extra: Default::default(),
    };
    let node1 = ChannelOwner::Node(NodeId(1));
    let ops = vec![
        TxnOp::put(keys.session(NodeId(1)), session.encode()),
        TxnOp::put(
            keys.channel(node1, &name("orders-10")),
            info("orders-10", ChannelState::Watched, 3, vchannel),
        ),
        TxnOp::put(
            keys.channel(node1, &name("orders-2")),
            info(
                "orders-2",
                ChannelState::Watched,
                1,
                VChannelInfo::default(),
            ),
        ),
        TxnOp::put(
            keys.channel(ChannelOwner::Remaining, &name("orders-1")),
            info(
                "orders-1",
                ChannelState::ToWatch,
                1,
                VChannelInfo::default(),
            ),
        ),
        TxnOp::put(keys.checkpoint(&name("orders-10")), checkpoint.encode()),
    ];
    store.txn(Txn::new().and_then(ops)).await.expect("seed");
    fixture
}

fn ctl(fixture: &EtcdFixture, args: &[&str]) -> Output {
    procs::ctl(fixture.endpoint(), args)
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "ctl failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The channel names of a JSON (or YAML-read) array of lines, in order.
fn names(v: &Value) -> Vec<&str> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|c| c["channel"].as_str().expect("channel"))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_channels_wide_shows_vchannel_and_checkpoint_in_natural_order() {
    let fixture = seeded().await;
    let table = ok(&ctl(&fixture, &["channels"]));
    let wide = ok(&ctl(&fixture, &["channels", "-o", "wide"]));
    let first_words = |text: &str| -> Vec<String> {
        text.lines()
            .skip(1)
            .take(3)
            .map(|l| l.split_whitespace().next().unwrap_or("").to_owned())
            .collect()
    };
    assert_eq!(
        first_words(&wide),
        ["orders-1", "orders-2", "orders-10"],
        "{wide}"
    );
    assert!(
        !table.contains("POSITION") && wide.lines().next().is_some_and(|h| h.contains("POSITION")),
        "table:\n{table}\nwide:\n{wide}"
    );
    let line = wide
        .lines()
        .find(|l| l.starts_with("orders-10 "))
        .expect("orders-10 line");
    assert!(line.contains("coll=7 seek=p-42"), "{line}");
    let cells: Vec<&str> = line.split_whitespace().collect();
    // ... VCHANNEL (3 words), POSITION, CP EPOCH, CP AGE.
    let n = cells.len();
    assert_eq!(&cells[n - 3..n - 1], ["1234", "3"], "{line}");
    let age: u64 = cells[n - 1]
        .strip_suffix('s')
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("checkpoint age is not in seconds: {line}"));
    assert!((5..60).contains(&age), "{line}");
    // A channel without a checkpoint says so.
    let two = wide
        .lines()
        .find(|l| l.starts_with("orders-2 "))
        .expect("orders-2");
    let cells: Vec<&str> = two.split_whitespace().collect();
    assert_eq!(&cells[cells.len() - 4..], ["-", "-", "-", "-"], "{two:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_channels_json_and_yaml_carry_the_checkpoint_and_json_is_an_alias() {
    let fixture = seeded().await;
    let json: Value =
        serde_json::from_str(&ok(&ctl(&fixture, &["channels", "-o", "json"]))).expect("json");
    assert_eq!(
        names(&json),
        ["orders-1", "orders-2", "orders-10"],
        "{json}"
    );
    let ten = &json[2];
    assert_eq!(ten["node"], 1);
    assert_eq!(ten["vchannel"]["collection_id"], 7);
    assert_eq!(ten["checkpoint"]["position"], "1234");
    assert_eq!(ten["checkpoint"]["epoch"], 3);
    assert!(ten["checkpoint"]["age_ms"].as_u64().expect("age_ms") >= 5_000);
    assert_eq!(json[0]["node"], Value::Null);
    assert_eq!(json[0]["checkpoint"], Value::Null);

    // `--json`, hidden, still means `-o json`, after the subcommand or before it.
    for args in [&["channels", "--json"][..], &["--json", "channels"]] {
        let alias: Value = serde_json::from_str(&ok(&ctl(&fixture, args))).expect("json");
        assert_eq!(names(&alias), names(&json), "{args:?}");
        assert_eq!(alias[2]["checkpoint"]["position"], "1234");
    }
    let yaml: Value =
        serde_yaml_ng::from_str(&ok(&ctl(&fixture, &["-o", "yaml", "channels"]))).expect("yaml");
    assert_eq!(names(&yaml), names(&json));
    assert_eq!(yaml[2]["checkpoint"]["position"], "1234");

    let nodes: Value =
        serde_yaml_ng::from_str(&ok(&ctl(&fixture, &["nodes", "-o", "yaml"]))).expect("yaml");
    assert_eq!(nodes[0]["id"], 1, "{nodes}");
    assert_eq!(nodes[0]["channels"], 2, "{nodes}");
    let help = ok(&ctl(&fixture, &["channels", "--help"]));
    assert!(
        help.contains("--output") && !help.contains("--json"),
        "{help}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_channels_filters_by_node_and_by_state() {
    let fixture = seeded().await;
    let pick = |args: &[&str]| -> Vec<String> {
        let mut all = vec!["channels", "-o", "json"];
        all.extend(args);
        let v: Value = serde_json::from_str(&ok(&ctl(&fixture, &all))).expect("json");
        names(&v).into_iter().map(str::to_owned).collect()
    };
    assert_eq!(pick(&["--node", "1"]), ["orders-2", "orders-10"]);
    assert_eq!(pick(&["--node", "remaining"]), ["orders-1"]);
    assert_eq!(pick(&["--node", "2"]), Vec::<String>::new());
    assert_eq!(pick(&["--state", "towatch"]), ["orders-1"]);
    assert_eq!(
        pick(&["--state", "Watched", "--node", "1"]),
        ["orders-2", "orders-10"]
    );
    let table = ok(&ctl(&fixture, &["channels", "--state", "ToWatch"]));
    assert!(table.contains("1 channel(s)"), "{table}");
    let bad = ctl(&fixture, &["channels", "--state", "bogus"]);
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("ToWatch, Watched"),
        "{err}"
    );
    let bad = ctl(&fixture, &["channels", "--node", "x"]);
    assert!(!bad.status.success(), "{bad:?}");
    // A root nothing runs under says so (a mistyped --root looked like an empty cluster);
    // the seeded root does not.
    let empty = ctl(&fixture, &["--root", "chanwatch2", "channels"]);
    assert!(ok(&empty).contains("0 channel(s)"));
    let note = String::from_utf8_lossy(&empty.stderr);
    assert!(
        note.contains("etcd holds nothing under chanwatch2/"),
        "{note}"
    );
    let seeded = ctl(&fixture, &["channels"]);
    assert!(!String::from_utf8_lossy(&seeded.stderr).contains("holds nothing"));
}

/// `ctl channels | head -1`: the reader goes away before ctl writes; ctl ends quietly (it
/// panicked with "Broken pipe", rc 101).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_ends_quietly_when_its_reader_closes_the_pipe() {
    let fixture = seeded().await;
    for what in ["channels", "nodes"] {
        let mut child = Command::new(bin())
            .arg("ctl")
            .arg(format!("--endpoints={}", fixture.endpoint()))
            .arg(what)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn ctl");
        drop(child.stdout.take()); // the reader is gone before ctl has written a byte
        let out = child.wait_with_output().expect("wait");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success() && !err.contains("panicked"),
            "ctl {what}: {:?}\n{err}",
            out.status
        );
    }
}
