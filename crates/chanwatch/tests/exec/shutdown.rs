//! A node shut down (stopped, not fenced) still writes and answers the commit a worker makes
//! on its `SIGTERM`: the session used to stop taking commits while it waited for its
//! channels' releases, and each release waits for its worker, so the worker's last commit
//! hung until `--stop-grace` ran out and `SIGKILL` ended it, and nothing landed. In process
//! (a coordinator and a node on the embedded store), a shell worker with `curl`.

use chanwatch_core::{ChannelName, ChannelState, Checkpoint, Keys, VChannelInfo};
use chanwatch_node::{ExecHandler, ExecOptions, Node};
use chanwatch_store::{EmbeddedStore, MetaStore};

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_last_commit_on_a_node_shutdown_lands_at_once_not_after_the_stop_grace() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path().display();
    // Ready at once; on SIGTERM one last commit, its status and time kept in a file.
    let worker = format!(
        r#"post() {{ curl -s -o /dev/null -w '%{{http_code}}' --max-time 60 -X POST -H "Authorization: Bearer $CHANWATCH_AGENT_TOKEN" -H 'Content-Type: application/json' -d "$2" "$CHANWATCH_AGENT_URL/$1"; }}
trap 'post commit "{{\"position\":\"last\"}}" > "{d}/last.tmp"; mv "{d}/last.tmp" "{d}/last"; exit 0' TERM
post ready '{{}}' > /dev/null
touch "{d}/ready"
while :; do sleep 0.1 & wait $!; done"#
    );
    let store = Arc::new(EmbeddedStore::new());
    let coord = chanwatch_coord::Coordinator::builder(store.clone())
        .spawn()
        .expect("coordinator");
    let mut ready = coord.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready))
        .await
        .expect("coordinator ready in time")
        .expect("coordinator status");
    let grace = Duration::from_secs(30);
    let exec = ExecHandler::bind(
        ExecOptions {
            stop_grace: grace,
            ..ExecOptions::new(worker)
        },
        "127.0.0.1:0",
    )
    .await
    .expect("agent binds");
    let node = Node::builder(store.clone())
        .handler(Arc::new(exec))
        .spawn()
        .expect("node");
    let channel = ChannelName::new("s-0").expect("name");
    coord
        .add_channel(channel.clone(), VChannelInfo::default())
        .await
        .expect("add channel");
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = coord.channels().await.expect("channels");
        if rows.iter().any(|r| r.state == ChannelState::Watched)
            && dir.path().join("ready").exists()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the channel is not Watched with its worker ready"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stopping = Instant::now();
    tokio::time::timeout(grace + Duration::from_secs(10), node.stop())
        .await
        .expect("the node stops")
        .expect("the node stops cleanly");
    let took = stopping.elapsed();
    let answer = std::fs::read_to_string(dir.path().join("last")).unwrap_or_default();
    assert_eq!(
        answer, "200",
        "the worker's last commit was answered {answer:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "the shutdown took {took:?}: the last commit waited for the stop grace ({grace:?})"
    );
    let kv = store
        .get(&Keys::default().checkpoint(&channel))
        .await
        .expect("get")
        .expect("the last commit landed");
    let cp = Checkpoint::decode(&kv.value).expect("decodes");
    assert_eq!(cp.position, "last");
    coord.stop().await.expect("coordinator stops");
}
