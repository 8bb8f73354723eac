//! The status page's API, without a browser: `GET /api/v1/summary`, the paged and filtered
//! `GET /api/v1/channels`, and the bearer token on the writes its buttons send.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use chanwatch_coord::{CoordHandle, Coordinator};
use chanwatch_store::{EmbeddedStore, MetaStore};
use serde_json::{json, Value};

/// A leader on an embedded store with no nodes, its API on 127.0.0.1, and `n` channels
/// `c-0`…`c-{n-1}` registered (all parked under `remaining`).
async fn leader_with(
    n: usize,
    token: Option<&str>,
) -> Result<(String, CoordHandle, Arc<dyn MetaStore>)> {
    leader_on(EmbeddedStore::new(), n, token).await
}

/// [`leader_with`] on `store` (a test keeps a clone to put a faulty node on it).
async fn leader_on(
    store: EmbeddedStore,
    n: usize,
    token: Option<&str>,
) -> Result<(String, CoordHandle, Arc<dyn MetaStore>)> {
    let store: Arc<dyn MetaStore> = Arc::new(store);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let handle = Coordinator::builder(store.clone())
        .id("sum-1")
        .admin_addr(addr.clone())
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let router = chanwatch_coord::api::router(
        handle.clone(),
        chanwatch_coord::api::ApiOptions {
            registry: handle.registry().clone(),
            token: token.map(str::to_owned),
            allowed_hosts: Vec::new(),
        },
    );
    tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    if n > 0 {
        let list: Vec<Value> = (0..n)
            .map(|i| json!({ "name": format!("c-{i}") }))
            .collect();
        let mut req = reqwest::Client::new()
            .post(format!("http://{addr}/api/v1/channels"))
            .header("content-type", "application/json")
            .body(serde_json::to_string(&list)?);
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await?;
        ensure!(resp.status() == 201, "bulk add: {}", resp.text().await?);
    }
    Ok((format!("http://{addr}"), handle, store))
}

async fn get(url: &str) -> Result<(u16, Value)> {
    let resp = reqwest::get(url).await?;
    let code = resp.status().as_u16();
    let text = resp.text().await?;
    Ok((
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    ))
}

fn names(page: &Value) -> Vec<String> {
    page["rows"]
        .as_array()
        .map(|rows| {
            rows.iter()
                .filter_map(|r| r["channel"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_page_by_filter_in_natural_order_and_the_plain_list_stays_as_it_was() -> Result<()>
{
    let (base, _h, _) = leader_with(25, None).await?;
    let (code, plain) = get(&format!("{base}/api/v1/channels")).await?;
    ensure!(
        code == 200 && plain.as_array().is_some_and(|a| a.len() == 25),
        "the plain list changed: {code} {plain}"
    );

    let (code, page) = get(&format!("{base}/api/v1/channels?limit=10")).await?;
    ensure!(code == 200, "{code} {page}");
    ensure!(
        page["total"] == json!(25) && page["offset"] == json!(0),
        "{page}"
    );
    let want: Vec<String> = (0..10).map(|i| format!("c-{i}")).collect();
    ensure!(
        names(&page) == want,
        "not natural order: {:?}",
        names(&page)
    );

    let (_, page) = get(&format!("{base}/api/v1/channels?offset=20&limit=10")).await?;
    let want: Vec<String> = (20..25).map(|i| format!("c-{i}")).collect();
    ensure!(names(&page) == want, "{page}");

    let (_, page) = get(&format!("{base}/api/v1/channels?name=C-1&limit=500")).await?;
    let mut want = vec!["c-1".to_owned()];
    want.extend((10..20).map(|i| format!("c-{i}")));
    ensure!(
        page["total"] == json!(11) && names(&page) == want,
        "name filter: {page}"
    );

    let (_, page) = get(&format!(
        "{base}/api/v1/channels?node=remaining&state=towatch"
    ))
    .await?;
    ensure!(page["total"] == json!(25), "{page}");
    ensure!(page["rows"][0]["node"].is_null(), "{page}");
    let (_, page) = get(&format!("{base}/api/v1/channels?node=7")).await?;
    ensure!(
        page["total"] == json!(0) && names(&page).is_empty(),
        "{page}"
    );
    let (_, page) = get(&format!("{base}/api/v1/channels?state=Watched")).await?;
    ensure!(page["total"] == json!(0), "{page}");

    let (_, page) = get(&format!("{base}/api/v1/channels?limit=5&checkpoints=1")).await?;
    ensure!(
        names(&page).len() == 5 && page["rows"][0]["checkpoint"].is_null(),
        "a page with checkpoints: {page}"
    );

    for (query, says) in [
        ("state=Sleeping", "expected one of"),
        ("node=x", "node id"),
        ("limit=0", "expected 1 to 500"),
        ("limit=501", "expected 1 to 500"),
        ("offset=-1", "whole number"),
    ] {
        let (code, body) = get(&format!("{base}/api/v1/channels?{query}")).await?;
        ensure!(
            code == 400 && body["error"].as_str().is_some_and(|e| e.contains(says)),
            "{query}: {code} {body}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_counts_every_channel_and_names_the_first_parked_ones() -> Result<()> {
    let (base, h, store) = leader_with(30, None).await?;
    let standby = Coordinator::builder(store)
        .id("sum-2")
        .admin_addr("127.0.0.1:1")
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while h.summary().await?.standbys.is_empty() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the standby never showed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (code, s) = get(&format!("{base}/api/v1/summary")).await?;
    ensure!(code == 200, "{code} {s}");
    ensure!(s["channels"]["total"] == json!(30), "{s}");
    ensure!(s["channels"]["by_state"]["ToWatch"] == json!(30), "{s}");
    ensure!(s["channels"]["by_state"]["Watched"] == json!(0), "{s}");
    ensure!(s["channels"]["remaining"] == json!(30), "{s}");
    ensure!(s["remaining"]["count"] == json!(30), "{s}");
    let first: Vec<&str> = s["remaining"]["first"]
        .as_array()
        .map(|a| a.iter().filter_map(|b| b["channel"].as_str()).collect())
        .unwrap_or_default();
    ensure!(
        first.len() == chanwatch_coord::summary::SUMMARY_LIST
            && first[..3] == ["c-0", "c-1", "c-2"],
        "capped, natural order: {first:?}"
    );
    ensure!(s["nodes"] == json!([]), "{s}");
    ensure!(s["leader"]["id"] == json!("sum-1"), "{s}");
    ensure!(
        s["standbys"]
            == json!([{"id": "sum-2", "admin_addr": "127.0.0.1:1", "since_ms": s["standbys"][0]["since_ms"], "term": 0}]),
        "{s}"
    );
    ensure!(
        matches!(
            standby.summary().await,
            Err(chanwatch_coord::ApiError::NotLeader { .. })
        ),
        "a standby answers a summary"
    );
    ensure!(s["leader"]["term"].as_i64().is_some_and(|t| t > 0), "{s}");
    ensure!(
        s["store"]["reachable"] == json!(true) && s["store"]["alarms"] == json!([]),
        "{s}"
    );
    ensure!(s["history"]["leader"] == json!("sum-1"), "{s}");
    // The same through the handle.
    let direct = h.summary().await?;
    ensure!(direct.channels.total == 30 && direct.remaining.count == 30);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pages_action_buttons_need_the_token_and_its_reads_do_not() -> Result<()> {
    let (base, _h, _) = leader_with(1, Some("s3cret")).await?;
    let client = reqwest::Client::new();
    let actions = [
        ("/api/v1/channels/c-0/pin", "{}"),
        ("/api/v1/channels/c-0/unpin", "{}"),
        ("/api/v1/channels/c-0/move", r#"{"to":1}"#),
        ("/api/v1/nodes/1/drain", "{}"),
        ("/api/v1/nodes/1/undrain", "{}"),
    ];
    for (path, body) in actions {
        for auth in [None, Some("Bearer wrong")] {
            let mut req = client
                .post(format!("{base}{path}"))
                .header("content-type", "application/json")
                .body(body);
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let resp = req.send().await?;
            let code = resp.status().as_u16();
            let text = resp.text().await?;
            ensure!(
                code == 401 && text.contains("bearer token"),
                "{path} with {auth:?}: {code} {text}"
            );
        }
    }
    // With the token the API does them (or says why not: no node 1 here).
    let resp = client
        .post(format!("{base}/api/v1/channels/c-0/pin"))
        .header("content-type", "application/json")
        .bearer_auth("s3cret")
        .body("{}")
        .send()
        .await?;
    ensure!(resp.status() == 200, "pin: {}", resp.text().await?);
    let resp = client
        .post(format!("{base}/api/v1/nodes/1/drain"))
        .header("content-type", "application/json")
        .bearer_auth("s3cret")
        .body("{}")
        .send()
        .await?;
    ensure!(
        resp.status() == 404,
        "drain of no node: {}",
        resp.text().await?
    );
    for path in ["/", "/api/v1/summary", "/api/v1/channels?limit=5"] {
        let (code, body) = get(&format!("{base}{path}")).await?;
        ensure!(code == 200, "{path} needs no token: {code} {body}");
    }
    Ok(())
}

/// Polls the summary until `ok` holds for it (15 s).
async fn summary_until(base: &str, what: &str, ok: impl Fn(&Value) -> bool) -> Result<Value> {
    let until = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        let (code, s) = get(&format!("{base}/api/v1/summary")).await?;
        if code == 200 && ok(&s) {
            return Ok(s);
        }
        ensure!(
            tokio::time::Instant::now() < until,
            "no summary with {what} within 15 s; the last: {code} {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A node whose keepalives fail pauses its channels while its lease still lives, so the
/// store still shows it as a live node: the summary names it paused, with its channels and
/// its own reason, as its admin `GET /status` says (the leader asks, as `ctl status` does),
/// and running again once its keepalives pass.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_summary_names_a_node_that_paused_as_the_node_itself_says() -> Result<()> {
    let inner = EmbeddedStore::new();
    let (base, _h, _) = leader_on(inner.clone(), 4, None).await?;
    let (faulty, faults) = chanwatch_store::FaultyStore::new(inner);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let admin = listener.local_addr()?.to_string();
    let node = chanwatch_node::Node::builder(Arc::new(faulty))
        .admin_addr(admin.clone())
        .name("n-pause")
        // Renewals every 4 s; paused 5 s after the last one that succeeded; the lease
        // lives 12 s: a pause of at least 7 s before the coordinator could see it gone.
        .session_ttl(Duration::from_secs(12))
        .fence_margin(Duration::from_secs(7))
        .spawn()?;
    let router = chanwatch_node::admin::router(node.watch_status(), node.registry().clone());
    tokio::spawn(async move { axum::serve(listener, router).await });

    let node0 = |s: &Value| s["nodes"][0].clone();
    let s = summary_until(&base, "the node running its 4 channels", |s| {
        node0(s)["paused"] == json!(false) && node0(s)["channels"] == json!(4)
    })
    .await?;
    ensure!(
        node0(&s)["admin_addr"] == json!(admin)
            && s["paused"]["nodes"] == json!(0)
            && s["paused"]["unknown"] == json!(0)
            && s["paused"]["no_admin"] == json!(0)
            && s["paused"]["asked_ms_ago"].is_u64(),
        "{s}"
    );

    faults.fail_keepalives(true);
    let s = summary_until(&base, "the node paused", |s| {
        node0(s)["paused"] == json!(true)
    })
    .await?;
    ensure!(
        s["paused"]["nodes"] == json!(1)
            && s["paused"]["channels"] == json!(4)
            && node0(&s)["paused_reason"]
                .as_str()
                .is_some_and(|r| r.contains("keepalive")),
        "{s}"
    );

    faults.fail_keepalives(false);
    summary_until(&base, "the node running again", |s| {
        node0(s)["paused"] == json!(false) && s["paused"]["nodes"] == json!(0)
    })
    .await?;
    node.stop().await?;
    Ok(())
}
