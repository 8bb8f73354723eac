//! The admin HTTP API over a real socket on 127.0.0.1: status codes and JSON errors for bad
//! input, and that a refused request writes nothing.
//!
//! Over 600 lines: one flat list of independent request/answer cases over one harness.
//!
//! Over 600 lines: one test per endpoint family on one small harness; split by endpoint, the
//! files would share that harness and nothing else.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Result};
use chanwatch_coord::{CoordHandle, Coordinator};
use chanwatch_store::{EmbeddedStore, MetaStore};
use serde_json::{json, Value};

pub(crate) struct Api {
    base: String,
    client: reqwest::Client,
}

impl Api {
    pub(crate) async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&str>,
    ) -> Result<(u16, Value)> {
        let mut req = self
            .client
            .request(method.clone(), format!("{}{}", self.base, path));
        if method != reqwest::Method::GET {
            req = req.header("content-type", "application/json");
        }
        if let Some(b) = body {
            req = req.body(b.to_owned());
        }
        let resp = req.send().await?;
        let status = resp.status().as_u16();
        let text = resp.text().await?;
        Ok((
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        ))
    }
}

pub(crate) async fn start(store: Arc<dyn MetaStore>, id: &str) -> Result<(Api, CoordHandle)> {
    start_with(store, id, None).await
}

async fn start_with(
    store: Arc<dyn MetaStore>,
    id: &str,
    token: Option<&str>,
) -> Result<(Api, CoordHandle)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let handle = Coordinator::builder(store)
        .id(id)
        .admin_addr(addr.clone())
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let router = chanwatch_coord::api::router(
        handle.clone(),
        chanwatch_coord::api::ApiOptions {
            registry: handle.registry().clone(),
            token: token.map(str::to_owned),
            allowed_hosts: vec!["Coord.Example".into()],
        },
    );
    tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    Ok((
        Api {
            base: format!("http://{addr}"),
            client: reqwest::Client::new(),
        },
        handle,
    ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_4xx_and_changes_nothing() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "api-1").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    use reqwest::Method as M;

    let (code, _) = api.call(M::GET, "/healthz", None).await?;
    ensure!(code == 200);
    let (code, body) = api.call(M::GET, "/readyz", None).await?;
    ensure!(
        code == 200 && body["leader"] == json!(true),
        "{code} {body}"
    );

    let (code, body) = api
        .call(
            M::POST,
            "/api/v1/channels",
            Some(r#"{"name":"c1","vchannel":{"collection_id":7}}"#),
        )
        .await?;
    ensure!(code == 201, "{code} {body}");
    ensure!(
        body[0]["cause"] == json!("assign") && body[0]["node"].is_null(),
        "{body}"
    );

    let cases: Vec<(M, String, Option<String>, u16, &str)> = vec![
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(r#"{"name":"c1"}"#.into()),
            409,
            "already exists",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(r#"{"name":"a/b"}"#.into()),
            400,
            "only [A-Za-z0-9._-]",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(r#"{"name":""}"#.into()),
            400,
            "empty",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some("{nope".into()),
            400,
            "bad request body",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(r#"{"name":"x","colour":"red"}"#.into()),
            400,
            "unknown field",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(format!(
                r#"{{"name":"big","vchannel":{{"metadata":{{"b":"{}"}}}}}}"#,
                "x".repeat(70_000)
            )),
            400,
            "limit is 65536",
        ),
        (
            M::POST,
            "/api/v1/channels".into(),
            Some(format!(
                r#"{{"name":"huge","vchannel":{{"metadata":{{"b":"{}"}}}}}}"#,
                "x".repeat(400_000)
            )),
            413,
            "",
        ),
        (
            M::DELETE,
            "/api/v1/channels/nope".into(),
            None,
            404,
            "does not exist",
        ),
        (
            M::POST,
            "/api/v1/channels/c1/move".into(),
            Some(r#"{"to":42}"#.into()),
            404,
            "not alive",
        ),
        (
            M::POST,
            "/api/v1/channels/c1/move".into(),
            Some(r#"{"to":"x"}"#.into()),
            400,
            "bad request body",
        ),
        (
            M::POST,
            "/api/v1/nodes/42/drain".into(),
            None,
            404,
            "not alive",
        ),
        (
            M::POST,
            "/api/v1/nodes/abc/drain".into(),
            None,
            400,
            "not a node id",
        ),
    ];
    for (method, path, body, want, says) in cases {
        let (code, got) = api.call(method.clone(), &path, body.as_deref()).await?;
        ensure!(
            code == want,
            "{method} {path}: got {code}, want {want}: {got}"
        );
        let msg = got["error"].as_str().unwrap_or_default();
        ensure!(
            msg.contains(says),
            "{method} {path}: error {msg:?} does not say {says:?}"
        );
    }
    let list = store.range("chanwatch/channel/").await?;
    ensure!(
        list.kvs.len() == 1,
        "refused requests wrote something: {:?}",
        list.kvs
    );

    let (code, body) = api
        .call(M::POST, "/api/v1/balance?dry_run=true", None)
        .await?;
    ensure!(code == 200 && body["moves"] == json!([]), "{code} {body}");
    let (code, body) = api.call(M::GET, "/api/v1/channels", None).await?;
    ensure!(
        code == 200 && body[0]["channel"] == json!("c1") && body[0]["node"].is_null(),
        "{body}"
    );
    let (code, _) = api.call(M::DELETE, "/api/v1/channels/c1", None).await?;
    ensure!(code == 200);
    ensure!(store.range("chanwatch/channel/").await?.kvs.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_answers_writes_with_503_and_the_leaders_address() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (leader, handle) = start(store.clone(), "leader").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    let (standby, standby_handle) = start(store.clone(), "standby").await?;
    let mut s = standby_handle.watch_status();
    tokio::time::timeout(
        Duration::from_secs(10),
        s.wait_for(|s| s.leader_addr.is_some()),
    )
    .await??;
    let (code, body) = standby
        .call(
            reqwest::Method::POST,
            "/api/v1/channels",
            Some(r#"{"name":"c1"}"#),
        )
        .await?;
    ensure!(code == 503, "{code} {body}");
    ensure!(
        body["leader"] == json!(leader.base.trim_start_matches("http://")),
        "{body}"
    );
    let (code, _) = standby.call(reqwest::Method::GET, "/readyz", None).await?;
    ensure!(code == 503, "a standby must not be ready");
    ensure!(store.range("chanwatch/channel/").await?.kvs.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_need_the_bearer_token_when_one_is_set_and_reads_do_not() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start_with(store.clone(), "tok", Some("s3cret")).await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    let url = format!("{}/api/v1/channels", api.base);
    for auth in [
        None,
        Some("Bearer wrong"),
        Some("s3cret"),
        Some("Bearer s3cre"),
    ] {
        let mut req = api
            .client
            .post(&url)
            .header("content-type", "application/json")
            .body(r#"{"name":"c1"}"#);
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        let resp = req.send().await?;
        ensure!(
            resp.status().as_u16() == 401,
            "{auth:?} got {}",
            resp.status()
        );
        let body: Value = resp.json().await?;
        ensure!(
            body["error"]
                .as_str()
                .unwrap_or_default()
                .contains("bearer token"),
            "{body}"
        );
    }
    ensure!(
        store.range("chanwatch/channel/").await?.kvs.is_empty(),
        "an unauthenticated write landed"
    );
    let resp = api
        .client
        .post(&url)
        .bearer_auth("s3cret")
        .header("content-type", "application/json")
        .body(r#"{"name":"c1"}"#)
        .send()
        .await?;
    ensure!(resp.status().as_u16() == 201, "{}", resp.status());
    let (code, _) = api
        .call(reqwest::Method::GET, "/api/v1/channels", None)
        .await?;
    ensure!(code == 200, "reads need no token");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_and_the_status_page_are_served() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "m").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    api.call(
        reqwest::Method::POST,
        "/api/v1/channels",
        Some(r#"{"name":"c1"}"#),
    )
    .await?;
    // Gauges refresh on the next planner round.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let text = api
        .client
        .get(format!("{}/metrics", api.base))
        .send()
        .await?
        .text()
        .await?;
    for want in [
        "chanwatch_leader 1",
        "chanwatch_channels_remaining 1",
        "chanwatch_channels{state=\"ToWatch\"} 1",
        "chanwatch_nodes_alive 0",
        "chanwatch_reassignments_total{cause=\"assign\"} 1",
        "chanwatch_store_txns_total{result=\"committed\"}",
        "chanwatch_store_txn_seconds_bucket",
        "chanwatch_relists_total",
    ] {
        ensure!(text.contains(want), "/metrics lacks {want}:\n{text}");
    }
    let page = api
        .client
        .get(format!("{}/", api.base))
        .send()
        .await?
        .text()
        .await?;
    ensure!(page.contains("<title>chanwatch</title>") && page.contains("/api/v1/channels"));
    ensure!(
        !page.contains("http://") && !page.contains("https://"),
        "the status page must not load anything from elsewhere"
    );
    Ok(())
}

/// One raw request: method, path, headers (a `Host` among them replaces the real one), body.
async fn raw(
    api: &Api,
    method: reqwest::Method,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> Result<(u16, String)> {
    let mut req = api.client.request(method, format!("{}{}", api.base, path));
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    if let Some(b) = body {
        req = req.body(b.to_owned());
    }
    let resp = req.send().await?;
    let code = resp.status().as_u16();
    let body: Value = resp.json().await.unwrap_or(Value::Null);
    Ok((code, body["error"].as_str().unwrap_or_default().to_owned()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cross_site_and_dns_rebinding_requests_are_refused_and_change_nothing() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "csrf").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    let addr = api.base.trim_start_matches("http://").to_owned();
    let port = addr.rsplit_once(':').map(|(_, p)| p).unwrap_or_default();
    let json = ("content-type", "application/json");
    let same_origin = format!("http://{addr}");
    let localhost = format!("localhost:{port}");
    let wrong_port = "127.0.0.1:1".to_owned();
    // Allowed by ApiOptions::allowed_hosts (`--admin-host`), matched without case.
    let allowed_name = format!("coord.example:{port}");
    use reqwest::Method as M;
    type Case<'a> = (
        M,
        &'a str,
        Vec<(&'a str, &'a str)>,
        Option<&'a str>,
        u16,
        &'a str,
    );
    let cases: Vec<Case> = vec![
        // The finding: a web page's form or fetch drains a node.
        (
            M::POST,
            "/api/v1/nodes/1/drain",
            vec![json, ("origin", "http://evil.example")],
            None,
            403,
            "cross-site",
        ),
        (
            M::POST,
            "/api/v1/channels",
            vec![json, ("origin", "null")],
            Some(r#"{"name":"x"}"#),
            403,
            "Origin \"null\"",
        ),
        // A form post cannot send application/json.
        (
            M::POST,
            "/api/v1/nodes/1/drain",
            vec![("content-type", "application/x-www-form-urlencoded")],
            Some("a=b"),
            415,
            "Content-Type: application/json",
        ),
        (M::POST, "/api/v1/balance", vec![], None, 415, "got none"),
        (
            M::DELETE,
            "/api/v1/channels/c1",
            vec![("content-type", "text/plain")],
            None,
            415,
            "text/plain",
        ),
        (
            M::POST,
            "/api/v1/channels",
            vec![("content-type", "text/plain")],
            Some(r#"{"name":"x"}"#),
            415,
            "Content-Type",
        ),
        // The finding: an array body created a channel.
        (
            M::POST,
            "/api/v1/channels",
            vec![json],
            Some(r#"["x"]"#),
            400,
            "[0] a string, not a JSON object",
        ),
        (
            M::POST,
            "/api/v1/channels/c1/move",
            vec![json],
            Some("[1]"),
            400,
            "JSON object",
        ),
        // DNS rebinding: reads and writes under a foreign name.
        (
            M::GET,
            "/api/v1/channels",
            vec![("host", "evil.example")],
            None,
            421,
            "Host \"evil.example\" refused",
        ),
        (
            M::GET,
            "/readyz",
            vec![("host", &wrong_port)],
            None,
            421,
            "DNS rebinding",
        ),
        (
            M::POST,
            "/api/v1/channels",
            vec![json, ("host", "evil.example:80")],
            Some(r#"{"name":"x"}"#),
            421,
            "refused",
        ),
    ];
    for (method, path, headers, body, want, says) in cases {
        let (code, msg) = raw(&api, method.clone(), path, &headers, body).await?;
        ensure!(
            code == want,
            "{method} {path} {headers:?}: got {code}, want {want}: {msg}"
        );
        ensure!(
            msg.contains(says),
            "{method} {path} {headers:?}: error {msg:?} does not say {says:?}"
        );
    }
    ensure!(
        store.range("chanwatch/channel/").await?.kvs.is_empty(),
        "a refused request wrote something"
    );

    // The normal paths: the bound address, localhost with the port, a same-origin page,
    // bodiless writes with the content type.
    for (i, headers) in [
        vec![json],
        vec![json, ("host", localhost.as_str())],
        vec![json, ("origin", same_origin.as_str())],
        vec![("content-type", "application/json; charset=utf-8")],
        vec![json, ("host", allowed_name.as_str())],
    ]
    .into_iter()
    .enumerate()
    {
        let body = format!(r#"{{"name":"ok{i}"}}"#);
        let (code, msg) = raw(&api, M::POST, "/api/v1/channels", &headers, Some(&body)).await?;
        ensure!(code == 201, "{headers:?}: {code} {msg}");
    }
    let (code, msg) = raw(&api, M::POST, "/api/v1/balance?dry_run=true", &[json], None).await?;
    ensure!(code == 200, "{code} {msg}");
    let (code, msg) = raw(&api, M::DELETE, "/api/v1/channels/ok0", &[json], None).await?;
    ensure!(code == 200, "{code} {msg}");
    let (code, _) = raw(
        &api,
        M::GET,
        "/api/v1/channels",
        &[("host", &localhost)],
        None,
    )
    .await?;
    ensure!(code == 200);
    let (code, _) = raw(&api, M::GET, "/", &[], None).await?;
    ensure!(code == 200, "the status page");
    ensure!(store.range("chanwatch/channel/").await?.kvs.len() == 4);
    Ok(())
}

/// `GET /api/v1/channels?checkpoints=1` adds each channel's checkpoint, read from the store
/// for the request (written here behind the coordinator's back, so no view of the leader's can
/// hold it); without the parameter the rows stay as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_carry_their_checkpoint_read_from_the_store_when_asked() -> Result<()> {
    use chanwatch_core::{ChannelName, Checkpoint, Epoch, Keys};
    use chanwatch_store::{Txn, TxnOp};
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "cp").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    use reqwest::Method as M;
    for name in ["c1", "c2"] {
        let body = format!(r#"{{"name":"{name}"}}"#);
        let (code, body) = api.call(M::POST, "/api/v1/channels", Some(&body)).await?;
        ensure!(code == 201, "{code} {body}");
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_millis() as u64;
    let cp = Checkpoint {
        epoch: Epoch(1),
        position: "4242".into(),
        state: Some(json!({"count": 4242})),
        updated_at_ms: now - 3_000,
        extra: Default::default(),
    };
    let key = Keys::default().checkpoint(&ChannelName::new("c1")?);
    store
        .txn(Txn::new().and_then([TxnOp::put(&key, cp.encode())]))
        .await?;

    let (code, plain) = api.call(M::GET, "/api/v1/channels", None).await?;
    ensure!(code == 200, "{code} {plain}");
    ensure!(
        plain[0].get("checkpoint").is_none(),
        "a plain list reads no checkpoint: {plain}"
    );
    let (code, rows) = api
        .call(M::GET, "/api/v1/channels?checkpoints=1", None)
        .await?;
    ensure!(code == 200, "{code} {rows}");
    let row = |n: &str| {
        rows.as_array()
            .and_then(|a| a.iter().find(|r| r["channel"] == json!(n)))
            .cloned()
            .unwrap_or(Value::Null)
    };
    let c1 = row("c1")["checkpoint"].clone();
    ensure!(
        c1["position"] == json!("4242") && c1["epoch"] == json!(1),
        "{rows}"
    );
    ensure!(
        c1.get("state").is_none(),
        "the handler's state is left out: {c1}"
    );
    let age = c1["age_ms"].as_u64().unwrap_or(0);
    ensure!((3_000..60_000).contains(&age), "age {age}: {rows}");
    ensure!(row("c2")["checkpoint"].is_null(), "{rows}");
    let (code, body) = api
        .call(M::GET, "/api/v1/channels?checkpoints=maybe", None)
        .await?;
    ensure!(code == 400, "{code} {body}");

    // The handle reads the same through the store, on a standby too.
    let all = handle.checkpoints().await?;
    ensure!(all.checkpoints.len() == 1 && all.checkpoints[0].channel == "c1");
    Ok(())
}

/// Channel names under the root, read from the store.
async fn stored_channels(store: &dyn MetaStore) -> Result<Vec<String>> {
    let keys = chanwatch_core::Keys::default();
    let list = store.range(&keys.channels_prefix()).await?;
    Ok(list
        .kvs
        .iter()
        .filter_map(|kv| keys.parse_channel(&kv.key).ok())
        .map(|ck| ck.channel.to_string())
        .collect())
}

/// A list registers every channel in it, and a list with bad entries is refused whole —
/// every bad entry named with its index, nothing written — as is one naming a registered
/// channel (409) or one over the limit (413).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_channels_registers_all_of_them_or_names_every_bad_entry_and_writes_nothing(
) -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "api-bulk").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;
    use reqwest::Method as M;

    let good: Vec<Value> = (0..300)
        .map(|i| json!({ "name": format!("b{i:03}"), "vchannel": { "collection_id": i } }))
        .collect();
    let (code, body) = api
        .call(
            M::POST,
            "/api/v1/channels",
            Some(&Value::from(good).to_string()),
        )
        .await?;
    ensure!(code == 201, "{code} {body}");
    ensure!(body.as_array().map(Vec::len) == Some(300), "{body}");
    ensure!(stored_channels(&*store).await?.len() == 300);

    let bad = r#"[{"name":"n1"}, {"name":"bad/name"}, {"name":"n1"}, 7, {"name":"n4"}]"#;
    let (code, body) = api.call(M::POST, "/api/v1/channels", Some(bad)).await?;
    ensure!(code == 400, "{code} {body}");
    let refused: Vec<u64> = body["refused"]
        .as_array()
        .map(|r| r.iter().filter_map(|e| e["index"].as_u64()).collect())
        .unwrap_or_default();
    ensure!(refused == [1, 2, 3], "{body}");
    let msg = body["error"].as_str().unwrap_or_default();
    ensure!(
        msg.contains("3 of 5")
            && msg.contains("nothing was written")
            && msg.contains("listed twice"),
        "{body}"
    );

    let taken = r#"[{"name":"n1"}, {"name":"b007"}, {"name":"b100"}]"#;
    let (code, body) = api.call(M::POST, "/api/v1/channels", Some(taken)).await?;
    ensure!(code == 409, "{code} {body}");
    ensure!(body["refused"][0]["index"] == json!(1), "{body}");
    ensure!(
        body["refused"][1]["error"] == json!("channel b100 already exists"),
        "{body}"
    );

    let over: Vec<Value> = (0..10_001)
        .map(|i| json!({ "name": format!("o{i}") }))
        .collect();
    let (code, body) = api
        .call(
            M::POST,
            "/api/v1/channels",
            Some(&Value::from(over).to_string()),
        )
        .await?;
    ensure!(code == 413, "{code} {body}");
    ensure!(
        body["error"]
            .as_str()
            .unwrap_or_default()
            .contains("the limit is 10000"),
        "{body}"
    );

    let (code, body) = api.call(M::POST, "/api/v1/channels", Some("[]")).await?;
    ensure!(code == 400, "{code} {body}");
    // Nothing of the refused lists was written.
    ensure!(stored_channels(&*store).await?.len() == 300);
    Ok(())
}
