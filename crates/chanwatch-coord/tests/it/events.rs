//! The admin API's event feed and one-object reads (`GET /api/v1/events`, `GET
//! /api/v1/channels/{name}`, `GET /api/v1/nodes/{id}`, `POST /api/v1/nodes/{id}/undrain`) over
//! a real socket, with a coordinator and two nodes as tasks on the embedded store.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_core::{ChannelName, ChannelState, VChannelInfo};
use serde_json::{json, Value};

use crate::cluster::{retry_not_ready, Cluster};

async fn serve(handle: chanwatch_coord::CoordHandle) -> Result<String> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let router = chanwatch_coord::api::router(handle, chanwatch_coord::api::ApiOptions::default());
    tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    Ok(format!("http://{addr}"))
}

async fn get(client: &reqwest::Client, url: &str) -> Result<(u16, Value)> {
    let resp = client.get(url).send().await?;
    let code = resp.status().as_u16();
    let text = resp.text().await?;
    Ok((
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

fn causes(events: &Value) -> Vec<String> {
    events
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|e| e["cause"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_feed_and_one_object_reads_show_a_move_a_drain_and_an_undrain() -> Result<()> {
    let cluster = Cluster::embedded().await?;
    let coord = cluster.spawn_coord("c1");
    let base = serve(coord.handle.clone()).await?;
    let (a, b) = (cluster.spawn_node(), cluster.spawn_node());
    cluster.wait_leader_ready(&coord).await?;
    cluster.wait_coord_nodes(&coord, 2).await?;
    let (a, b) = (
        cluster.wait_node_id(&a).await?,
        cluster.wait_node_id(&b).await?,
    );
    let name = ChannelName::new("orders-0")?;
    let vchannel = VChannelInfo::from_json(br#"{"collection_id":7}"#)?;
    retry_not_ready(|| coord.handle.add_channel(name.clone(), vchannel.clone())).await?;
    let watched = cluster
        .wait_until(Duration::from_secs(20), "orders-0 Watched", |v| {
            v.channels.iter().any(|c| c.state == ChannelState::Watched)
        })
        .await?;
    let on = watched.channels[0].node.context("assigned")?;
    let other = if on == a.0 { b } else { a };
    let client = reqwest::Client::new();

    // A follower connected before the move sees it as it happens.
    let mut feed = client.get(format!("{base}/api/v1/events")).send().await?;
    ensure!(
        feed.headers()["content-type"] == "text/event-stream",
        "{:?}",
        feed.headers()
    );
    coord.handle.move_channel(name.clone(), other).await?;
    let mut seen = String::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    while !seen.contains(r#""cause":"manual""#) {
        let chunk = tokio::time::timeout_at(until, feed.chunk())
            .await
            .with_context(|| format!("no manual move on the feed; it sent: {seen}"))??
            .context("the feed ended")?;
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    ensure!(seen.starts_with("event: history\n"), "{seen}");
    ensure!(
        seen.contains(r#""cause":"assign""#),
        "replayed history: {seen}"
    );

    // The move's second half (onto the other node) lands after the release is acked.
    cluster
        .wait_until(
            Duration::from_secs(20),
            "orders-0 Watched on the other node",
            |v| {
                v.channels
                    .iter()
                    .any(|c| c.node == Some(other.0) && c.state == ChannelState::Watched)
            },
        )
        .await?;

    // The list as JSON, from a sequence number.
    let (code, list) = get(&client, &format!("{base}/api/v1/events?follow=0")).await?;
    ensure!(code == 200, "{code} {list}");
    ensure!(list["history"]["leader"] == json!("c1"), "{list}");
    let all = causes(&list["events"]);
    ensure!(all.contains(&"joined".to_owned()), "{all:?}");
    let last = list["history"]["last_seq"].as_u64().context("last_seq")?;
    let (_, tail) = get(
        &client,
        &format!("{base}/api/v1/events?follow=0&since={last}"),
    )
    .await?;
    ensure!(tail["events"].as_array().map(Vec::len) == Some(1), "{tail}");

    // One channel: assignment, vchannel, history with the manual move.
    let (code, detail) = get(&client, &format!("{base}/api/v1/channels/orders-0")).await?;
    ensure!(code == 200, "{code} {detail}");
    ensure!(detail["vchannel"]["collection_id"] == json!(7), "{detail}");
    ensure!(
        detail["assignments"].as_array().map(Vec::len) == Some(1),
        "{detail}"
    );
    let history = causes(&detail["history"]);
    ensure!(
        history.first().map(String::as_str) == Some("assign"),
        "{history:?}"
    );
    ensure!(history.contains(&"manual".to_owned()), "{history:?}");
    let (code, _) = get(&client, &format!("{base}/api/v1/channels/nope")).await?;
    ensure!(code == 404);

    // Drain, then undrain: the mark goes, the node's history has both.
    coord.handle.drain(other).await?;
    let (_, node) = get(&client, &format!("{base}/api/v1/nodes/{other}")).await?;
    ensure!(node["draining"] == json!(true), "{node}");
    let resp = client
        .post(format!("{base}/api/v1/nodes/{other}/undrain"))
        .header("content-type", "application/json")
        .send()
        .await?;
    ensure!(resp.status() == 202, "{}", resp.status());
    let body: Value = resp.json().await?;
    ensure!(body["was_draining"] == json!(true), "{body}");
    let (_, node) = get(&client, &format!("{base}/api/v1/nodes/{other}")).await?;
    ensure!(node["draining"] == json!(false), "{node}");
    ensure!(node["session"]["id"] == json!(other.0), "{node}");
    let node_history = causes(&node["history"]);
    for what in ["joined", "manual", "drained", "undrained"] {
        ensure!(
            node_history.contains(&what.to_owned()),
            "{what}: {node_history:?}"
        );
    }
    let drain_mark = cluster.store.get(&cluster.keys.drain(other)).await?;
    ensure!(drain_mark.is_none(), "the drain mark is still there");
    let (code, _) = get(&client, &format!("{base}/api/v1/nodes/x")).await?;
    ensure!(code == 400);
    let (code, _) = get(&client, &format!("{base}/api/v1/nodes/999")).await?;
    ensure!(code == 404);
    // A path the API does not have, and one asked with a method it does not take: JSON
    // errors that say so.
    let (code, body) = get(&client, &format!("{base}/api/v1/nodez")).await?;
    ensure!(code == 404, "{code}");
    ensure!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("no such endpoint: GET /api/v1/nodez")),
        "{body}"
    );
    let (code, body) = get(&client, &format!("{base}/api/v1/balance")).await?;
    ensure!(code == 405, "{code}");
    ensure!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("/api/v1/balance does not take GET")),
        "{body}"
    );
    // Undraining a node that has neither a mark nor a session (a mistyped ID) is refused.
    let resp = client
        .post(format!("{base}/api/v1/nodes/999/undrain"))
        .header("content-type", "application/json")
        .send()
        .await?;
    ensure!(resp.status() == 404, "{}", resp.status());
    let body: Value = resp.json().await?;
    ensure!(
        body["error"]
            .as_str()
            .is_some_and(|e| e.contains("node 999 is not alive")),
        "{body}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_refuses_the_event_feed_with_the_leaders_address() -> Result<()> {
    let cluster = Cluster::embedded().await?;
    let leader = cluster.spawn_coord("c1");
    cluster.wait_leader_ready(&leader).await?;
    let standby = cluster.spawn_coord("c2");
    let base = serve(standby.handle.clone()).await?;
    let client = reqwest::Client::new();
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (code, body) = get(&client, &format!("{base}/api/v1/events")).await?;
        if code == 503 && body["leader"] == json!("c1.invalid:1") {
            return Ok(());
        }
        ensure!(tokio::time::Instant::now() < until, "{code} {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
