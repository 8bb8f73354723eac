//! The least-privilege etcd roles of docs/OPERATING.md ("etcd users and roles"), tested on an etcd
//! with auth on: a coordinator, a node and `ctl` run as real processes, each as its own
//! user with its own role, and do their work; the node's user cannot write the leader key or
//! drain marks, and `ctl`'s user cannot write at all; the coordinator compacts as its own user.
//! NodeRestriction: two nodes, each with a user bound to the ID block of its name, register
//! in their blocks; etcd itself refuses node A's user every write to node B's session,
//! assignments and ID counter; a session A's user plants under another name in its own
//! block is refused by the coordinator and never gets a channel.

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore, StoreError, Txn, TxnOp};
use chanwatch_testkit::{EtcdFixture, EtcdOptions};

const ROOT: &str = "cw";

/// docs/OPERATING.md's roles, for `--root cw`: (user, grants). Keep in step with that section.
const ROLES: &[(&str, &[(&str, &str)])] = &[
    (
        "chanwatch-coord",
        &[
            ("read", "cw/"),
            ("readwrite", "cw/coord/"),
            ("readwrite", "cw/channel/"),
            ("readwrite", "cw/worker/checkpoint/"),
        ],
    ),
    (
        "chanwatch-node",
        &[
            ("readwrite", "cw/id/node"),
            ("read", "cw/id/name/"),
            ("readwrite", "cw/session/node/"),
            ("readwrite", "cw/channel/"),
            ("readwrite", "cw/worker/checkpoint/"),
        ],
    ),
    ("chanwatch-ctl", &[("read", "cw/")]),
];

mod procs;
use procs::{bin, spawn};

fn common(fixture: &EtcdFixture, user: &str) -> Vec<String> {
    vec![
        format!("--endpoints={}", fixture.endpoint()),
        format!("--root={ROOT}"),
        format!("--etcd-user={user}"),
        format!("--etcd-password={user}-pw"),
    ]
}

fn ctl(fixture: &EtcdFixture, args: &[&str]) -> Output {
    let mut all = vec!["ctl".to_owned()];
    all.extend(common(fixture, "chanwatch-ctl"));
    all.extend(args.iter().map(|a| (*a).to_owned()));
    Command::new(bin())
        .args(&all)
        .stdin(Stdio::null())
        .output()
        .expect("run ctl")
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

async fn store_as(fixture: &EtcdFixture, user: &str) -> EtcdStore {
    EtcdStore::connect(EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        user: Some((user.to_owned(), format!("{user}-pw"))),
        probe_key: Some(format!("{ROOT}/id/node")),
        ..EtcdConfig::default()
    })
    .await
    .unwrap_or_else(|e| panic!("{user} cannot connect: {e}"))
}

async fn refused(store: &EtcdStore, key: &str) -> bool {
    let r = store.txn(Txn::new().and_then([TxnOp::put(key, "x")])).await;
    matches!(r, Err(StoreError::PermissionDenied { .. }))
}

async fn delete_refused(store: &EtcdStore, key: &str) -> bool {
    let r = store.txn(Txn::new().and_then([TxnOp::delete(key)])).await;
    matches!(r, Err(StoreError::PermissionDenied { .. }))
}

/// deploy/config/setup-auth.sh's role for node name `name` bound to ID block `block`, for
/// `--root cw`. Keep in step with that script.
fn node_role(name: &str, block: u16) -> Vec<(&'static str, String)> {
    vec![
        ("read", "cw/id/node".into()),
        ("read", format!("cw/id/name/{name}")),
        ("readwrite", format!("cw/id/block/{block:03}")),
        ("readwrite", format!("cw/session/node/1{block:03}*")),
        ("readwrite", format!("cw/channel/1{block:03}*")),
        ("readwrite", "cw/worker/checkpoint/".into()),
    ]
}

/// An etcd with auth on and the users of [`ROLES`], each with the password `{user}-pw`.
async fn etcd_with_roles() -> EtcdFixture {
    let fixture = EtcdFixture::start_with(EtcdOptions {
        root_password: Some("rootpw".into()),
        ..EtcdOptions::default()
    })
    .await
    .expect("etcd with auth");
    for (user, grants) in ROLES {
        fixture
            .add_user_with_role(user, &format!("{user}-pw"), grants)
            .expect("user and role");
    }
    fixture
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_part_works_with_its_least_privilege_role_and_no_more() {
    let fixture = etcd_with_roles().await;
    let dir = tempfile::tempdir().expect("tempdir");
    let port = chanwatch_testkit::free_port();
    let mut coord_args = vec![
        "coord".to_owned(),
        format!("--admin=127.0.0.1:{port}"),
        "--compact-interval=1s".to_owned(),
    ];
    coord_args.extend(common(&fixture, "chanwatch-coord"));
    let mut coord = spawn(dir.path(), "coord", &coord_args);
    let mut node_args = vec!["node".to_owned(), "--admin=127.0.0.1:0".to_owned()];
    node_args.extend(common(&fixture, "chanwatch-node"));
    let mut node = spawn(dir.path(), "node", &node_args);

    // ctl (read-only role) adds a channel through the leader's admin API, once there is one.
    eventually(
        "a leader accepting add-channel",
        Duration::from_secs(30),
        || {
            assert!(coord.running(), "coordinator exited:\n{}", coord.output());
            assert!(node.running(), "node exited:\n{}", node.output());
            ctl(&fixture, &["add-channel", "c1"])
                .status
                .success()
                .then_some(())
        },
    );
    let rows = eventually("c1 Watched on node 1", Duration::from_secs(30), || {
        let out = ctl(&fixture, &["channels", "--json"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        (out.status.success() && text.contains("\"c1\"") && text.contains("Watched"))
            .then_some(text)
    });
    assert!(rows.contains("Watched"), "{rows}");
    let nodes = ctl(&fixture, &["nodes", "--json"]);
    assert!(nodes.status.success(), "ctl nodes: {nodes:?}");

    // What each role must not do.
    let node_user = store_as(&fixture, "chanwatch-node").await;
    assert!(
        refused(&node_user, &format!("{ROOT}/coord/leader")).await,
        "a node's user can write the leader key"
    );
    assert!(
        refused(&node_user, &format!("{ROOT}/coord/drain/1")).await,
        "a node's user can write drain marks"
    );
    let ctl_user = store_as(&fixture, "chanwatch-ctl").await;
    assert!(
        refused(&ctl_user, &format!("{ROOT}/channel/remaining/c2")).await,
        "ctl's user can write"
    );
    let coord_user = store_as(&fixture, "chanwatch-coord").await;
    assert!(
        refused(&coord_user, &format!("{ROOT}/session/node/99")).await,
        "the coordinator's user can write sessions"
    );
    // The leader compacts etcd as its own user (etcd lets any authenticated user compact).
    let compacted_to = async {
        for _ in 0..100 {
            if let Ok(Some(kv)) = coord_user.get(&format!("{ROOT}/coord/compact")).await {
                return String::from_utf8_lossy(&kv.value).parse::<i64>().ok();
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }
    .await
    .unwrap_or_else(|| panic!("no compaction within 10 s:\n{}", coord.output()));
    let mut from_before = coord_user
        .watch(&format!("{ROOT}/"), compacted_to - 1)
        .await
        .expect("watch");
    assert!(
        matches!(
            futures_util::StreamExt::next(&mut from_before).await,
            Some(Err(StoreError::Compacted { .. }))
        ),
        "history before {compacted_to} was not compacted:\n{}",
        coord.output()
    );
    assert!(coord.running(), "coordinator exited:\n{}", coord.output());
    assert!(node.running(), "node exited:\n{}", node.output());

    // The leader's write permission on the channels taken away while it leads: ctl's add is
    // answered with etcd's own words, and the coordinator logs it as well (a newcomer's
    // leader whose writes etcd refused logged nothing, and ctl said it waited for a leader).
    fixture
        .etcdctl(&[
            "role",
            "revoke-permission",
            "chanwatch-coord",
            &format!("{ROOT}/channel/"),
            "--prefix=true",
        ])
        .expect("revoke the coordinator's write permission");
    let out = ctl(&fixture, &["--timeout=5s", "add-channel", "c2"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "add-channel c2 succeeded: {stderr}");
    assert!(stderr.contains("permission denied"), "{stderr}");
    assert!(
        stderr.contains(
            "retrying for up to 5 s (--timeout): the leader could not make the change (503)"
        ) && stderr.contains("gave up after 5 s (--timeout)"),
        "{stderr}"
    );
    eventually("the leader's own log line", Duration::from_secs(5), || {
        let log = coord.output();
        log.lines()
            .any(|l| {
                l.contains("WARN")
                    && l.contains("the txn of an admin request failed")
                    && l.contains("permission denied")
            })
            .then_some(())
    });
}

/// NodeRestriction (DESIGN §2, docs/OPERATING.md "One etcd user per node"): users
/// `chanwatch-node-a` and `chanwatch-node-b`, bound to ID blocks 7 and 8 as
/// deploy/config/setup-auth.sh binds them, run nodes `--name a` and `--name b`. Judged from
/// outside: etcdctl shows each session in its block; etcd answers "permission denied" to
/// every write of a's user to b's session, assignment keys, ID counter and block
/// reservation (and to a's own reservation); a session a's user writes under name b in its
/// own block is refused by the coordinator (its log) and gets none of 8 channels.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nodes_etcd_user_reaches_only_its_own_id_blocks_keys() {
    let fixture = etcd_with_roles().await;
    for (name, block) in [("a", 7u16), ("b", 8)] {
        let user = format!("chanwatch-node-{name}");
        let grants = node_role(name, block);
        let grants: Vec<(&str, &str)> = grants.iter().map(|(p, k)| (*p, k.as_str())).collect();
        fixture
            .add_user_with_role(&user, &format!("{user}-pw"), &grants)
            .expect("user and role");
        fixture
            .etcdctl(&["put", &format!("{ROOT}/id/name/{name}"), &block.to_string()])
            .expect("reserve the block");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let port = chanwatch_testkit::free_port();
    let mut coord_args = vec!["coord".to_owned(), format!("--admin=127.0.0.1:{port}")];
    coord_args.extend(common(&fixture, "chanwatch-coord"));
    let mut coord = spawn(dir.path(), "coord", &coord_args);
    let mut nodes: Vec<_> = ["a", "b"]
        .iter()
        .map(|name| {
            let mut args = vec![
                "node".to_owned(),
                "--admin=127.0.0.1:0".to_owned(),
                format!("--name={name}"),
            ];
            args.extend(common(&fixture, &format!("chanwatch-node-{name}")));
            spawn(dir.path(), &format!("node-{name}"), &args)
        })
        .collect();
    let (id_a, id_b) = ("1007000000000001", "1008000000000001");
    let sessions = eventually(
        "both sessions in their blocks",
        Duration::from_secs(30),
        || {
            for n in &mut nodes {
                assert!(n.running(), "node exited:\n{}", n.output());
            }
            let keys = fixture
                .etcdctl(&[
                    "get",
                    "--prefix",
                    "--keys-only",
                    &format!("{ROOT}/session/node/"),
                ])
                .ok()?;
            (keys.contains(id_a) && keys.contains(id_b)).then_some(keys)
        },
    );
    assert_eq!(
        sessions.split_whitespace().count(),
        2,
        "no other session: {sessions}"
    );

    let a = store_as(&fixture, "chanwatch-node-a").await;
    // A session a's user may write (its own block's prefix) under b's name: an impostor.
    let impostor = format!("{ROOT}/session/node/1007000000000099");
    let value = r#"{"id":1007000000000099,"admin_addr":"127.0.0.1:1","version":"x","started_at_ms":1,"capacity":1,"name":"b"}"#;
    a.txn(Txn::new().and_then([TxnOp::put(&impostor, value)]))
        .await
        .expect("a's user writes in its own block");
    eventually(
        "a leader accepting add-channel",
        Duration::from_secs(30),
        || {
            assert!(coord.running(), "coordinator exited:\n{}", coord.output());
            ctl(&fixture, &["add-channel", "c0"])
                .status
                .success()
                .then_some(())
        },
    );
    for i in 1..8 {
        let out = ctl(&fixture, &["add-channel", &format!("c{i}")]);
        assert!(out.status.success(), "add-channel c{i}: {out:?}");
    }
    let owners = eventually("8 channels Watched", Duration::from_secs(30), || {
        let out = fixture
            .etcdctl(&[
                "get",
                "--prefix",
                "--keys-only",
                &format!("{ROOT}/channel/"),
            ])
            .ok()?;
        let keys: Vec<String> = out.split_whitespace().map(str::to_owned).collect();
        let watched = fixture
            .etcdctl(&[
                "get",
                "--prefix",
                "--print-value-only",
                &format!("{ROOT}/channel/"),
            ])
            .ok()?
            .matches("\"Watched\"")
            .count();
        (keys.len() == 8 && watched == 8).then_some(keys)
    });
    for key in &owners {
        assert!(
            key.contains(&format!("/channel/{id_a}/"))
                || key.contains(&format!("/channel/{id_b}/")),
            "{key}: a channel not on node a or b (the impostor 1007000000000099?)"
        );
    }
    eventually(
        "the coordinator's refusal in its log",
        Duration::from_secs(10),
        || {
            coord
                .output()
                .lines()
                .any(|l| l.contains("1007000000000099") && l.contains("refused, not a node"))
                .then_some(())
        },
    );
    let b_channel = owners
        .iter()
        .find(|k| k.contains(id_b))
        .unwrap_or_else(|| panic!("node b got no channel: {owners:?}"));

    // What etcd refuses a's user.
    for key in [
        format!("{ROOT}/session/node/{id_b}"),
        format!("{ROOT}/session/node/1008000000000002"),
        format!("{ROOT}/channel/{id_b}/c-new"),
        b_channel.clone(),
        format!("{ROOT}/id/block/008"),
        format!("{ROOT}/id/name/b"),
        format!("{ROOT}/id/name/a"),
        format!("{ROOT}/id/node"),
        format!("{ROOT}/coord/leader"),
    ] {
        assert!(refused(&a, &key).await, "a's user may write {key}");
    }
    for key in [format!("{ROOT}/session/node/{id_b}"), b_channel.clone()] {
        assert!(delete_refused(&a, &key).await, "a's user may delete {key}");
    }
    // And what it may: its own block's keys (here its counter, rewritten as it was).
    let counter = format!("{ROOT}/id/block/007");
    let own = a
        .get(&counter)
        .await
        .expect("a reads its counter")
        .expect("exists");
    a.txn(Txn::new().and_then([TxnOp::put(&counter, own.value)]))
        .await
        .expect("a's user writes its own counter");
    for n in &mut nodes {
        assert!(n.running(), "node exited:\n{}", n.output());
    }
    assert!(coord.running(), "coordinator exited:\n{}", coord.output());
}
