//! The leader's summary counts a node that is cut off from etcd as paused — such a node cannot
//! tell the store, so the leader asks its admin API — and as running again once it is back
//! with its session alive. The real `coord` and `node` binaries, the node behind a TCP proxy
//! that cuts its etcd connections; judged only from the leader's `GET /api/v1/summary`.

use super::*;

/// `(paused.nodes, paused.channels)` of the leader's summary, once the nodes have been asked.
fn paused(w: &World) -> Option<(u64, u64)> {
    let out = Command::new("curl")
        .args(["-s", "-m", "2"])
        .arg(format!("http://{}/api/v1/summary", w.admin))
        .output()
        .ok()?;
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    let p = &summary["paused"];
    p["asked_ms_ago"].as_u64()?;
    Some((p["nodes"].as_u64()?, p["channels"].as_u64()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_leaders_summary_counts_a_node_cut_off_from_etcd_as_paused_then_running_again() {
    let w = World::start().await;
    let proxy = Cut::start(w.etcd.endpoint()).await;
    let idle = "curl -s -X POST -H \"Authorization: Bearer $CHANWATCH_AGENT_TOKEN\" \"$CHANWATCH_AGENT_URL/ready\"; while :; do sleep 0.2; done";
    // A node pauses when it has been cut off for its TTL less the fence margin, here the
    // most `--fence-margin` allows (a third of the TTL less 1s; the default, a fifth, made
    // this test wait 36 s for a 9 s window): 19 s after its last renewal, 10–19 s after the
    // cut; it then has 8 s, until its lease could run out, for the leader to ask it (every
    // 3 s) and for the test to heal the cut.
    let node = w.node_via("node", &proxy.addr, "27s", idle, &["--fence-margin=8s"]);
    w.add_channel("p-0", &[]);
    let row = w.watched("p-0", 30);
    wait_for(
        20,
        || format!("summary: nobody paused: {:?}", paused(&w)),
        || (paused(&w)? == (0, 0)).then_some(()),
    );
    proxy.set(true);
    wait_for(
        26,
        || {
            format!(
                "summary: the cut-off node paused: {:?}\n{}",
                paused(&w),
                node.output()
            )
        },
        || (paused(&w)? == (1, 1)).then_some(()),
    );
    proxy.set(false);
    wait_for(
        25,
        || {
            format!(
                "summary: running again: {:?}\n{}",
                paused(&w),
                node.output()
            )
        },
        || (paused(&w)? == (0, 0)).then_some(()),
    );
    // Its session survived: the channel never moved.
    let now = w.row("p-0").expect("p-0");
    assert_eq!(
        (&now["node"], &now["epoch"]),
        (&row["node"], &row["epoch"]),
        "the channel moved: {now}"
    );
}
