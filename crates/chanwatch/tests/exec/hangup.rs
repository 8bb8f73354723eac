//! A worker that hangs up in the middle of a commit — its request sent, the txn landed in etcd,
//! the answer not yet back — must not be fenced by its own write: its next commit is
//! answered 200 and lands. The real `chanwatch node` binary reaches etcd through a
//! [`GrpcProxy`] that holds txn answers (the txn itself lands), the worker's side is a raw
//! socket closed before the answer, and everything is judged from outside: the HTTP status of
//! the next commit and the checkpoint key read with `etcdctl`. Before the commit was made
//! cancel-safe, hyper dropped the handler with the hung-up connection, the run never booked
//! the revision its write landed at, and its next commit was refused as fenced (409).

use std::io::Write;

use chanwatch_testkit::GrpcProxy;

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_hangs_up_mid_commit_is_not_fenced_by_its_own_write() {
    let w = World::start().await;
    let proxy = GrpcProxy::start(w.etcd.endpoint()).await.expect("proxy");
    // A worker that dumps its environment, says ready and then only sleeps: the test commits
    // with its token, as it would.
    let idle = format!(
        "env > '{0}'/\"$CHANWATCH_CHANNEL\".env; curl -s -X POST -H \"Authorization: Bearer $CHANWATCH_AGENT_TOKEN\" \"$CHANWATCH_AGENT_URL/ready\"; while :; do sleep 0.2; done # {0}",
        w.dir.path().display()
    );
    let node = w.node_via("node", &proxy.endpoint(), "2s", &idle, &[]);
    w.add_channel("c-0", &[]);
    w.watched("c-0", 30);
    let env = env_file(&w.path("c-0.env"));
    let (url, token) = (&env["CHANWATCH_AGENT_URL"], &env["CHANWATCH_AGENT_TOKEN"]);
    let key = "chanwatch/worker/checkpoint/c-0";
    let (code, body) = agent(url, token, "/commit", r#"{"position":"5"}"#);
    assert_eq!(code, 200, "{body}\n{}", node.output());

    // The commit of position 6 reaches etcd, its answer is held, and the worker hangs up.
    proxy.hold_txn_answers();
    let addr = url.trim_start_matches("http://").trim_end_matches('/');
    let mut socket = std::net::TcpStream::connect(addr).expect("the agent accepts");
    let commit = r#"{"position":"6"}"#;
    write!(
        socket,
        "POST /commit HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {token}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{commit}",
        commit.len()
    )
    .expect("the request is sent");
    wait_for(
        10,
        || format!("position 6 in etcd: {:?}", w.etcd_get(key)),
        || w.etcd_get(key).filter(|v| v.contains("\"6\"")).map(|_| ()),
    );
    drop(socket);
    // The node sees the hang-up while the answer is still held.
    tokio::time::sleep(Duration::from_millis(500)).await;
    proxy.release_txn_answers();
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (code, body) = agent(url, token, "/commit", r#"{"position":"7"}"#);
    assert_eq!(
        code,
        200,
        "the run was fenced by its own write: {body}\n{}",
        node.output()
    );
    let stored = w.etcd_get(key).expect("a checkpoint");
    assert!(stored.contains("\"7\""), "the checkpoint is {stored}");
}
