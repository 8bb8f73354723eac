//! The admin API's placement additions (DESIGN §5): a channel's weight and group at
//! registration, and pin / unpin, which rewrite the channel's key without moving it.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{ensure, Context, Result};
use chanwatch_core::{ChannelInfo, ChannelName, ChannelOwner, Keys};
use chanwatch_store::{EmbeddedStore, MetaStore};
use reqwest::Method as M;
use serde_json::json;

use crate::api::start;

/// The one key of `name` (under `remaining`: no node runs in this test).
async fn stored(store: &Arc<dyn MetaStore>, name: &str) -> Result<ChannelInfo> {
    let key = Keys::default().channel(ChannelOwner::Remaining, &ChannelName::new(name)?);
    let kv = store.get(&key).await?.context("the key is there")?;
    Ok(ChannelInfo::decode(&kv.value)?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn channels_are_registered_with_weight_and_group_and_pinned_without_moving() -> Result<()> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let (api, handle) = start(store.clone(), "place-1").await?;
    let mut status = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(|s| s.ready)).await??;

    let (code, body) = api
        .call(
            M::POST,
            "/api/v1/channels",
            Some(r#"{"name":"heavy","weight":3,"group":"coll-7"}"#),
        )
        .await?;
    ensure!(code == 201, "{code} {body}");
    let info = stored(&store, "heavy").await?;
    ensure!(
        info.weight == 3 && info.group.as_deref() == Some("coll-7") && !info.pinned,
        "{info:?}"
    );
    for (bad, why) in [
        (r#"{"name":"w0","weight":0}"#, "weight 0"),
        (r#"{"name":"g1","group":"a/b"}"#, "group"),
    ] {
        let (code, body) = api.call(M::POST, "/api/v1/channels", Some(bad)).await?;
        ensure!(
            code == 400 && body["error"].as_str().is_some_and(|e| e.contains(why)),
            "{bad}: {code} {body}"
        );
    }

    let (code, body) = api
        .call(M::POST, "/api/v1/channels/heavy/pin", None)
        .await?;
    ensure!(
        code == 200 && body["pinned"] == json!(true) && body["transitions"][0]["cause"] == "pin",
        "{code} {body}"
    );
    let pinned = stored(&store, "heavy").await?;
    ensure!(
        pinned.pinned && pinned.epoch == info.epoch && pinned.state == info.state,
        "pinning changed more than the flag: {pinned:?}"
    );
    let (code, body) = api
        .call(M::POST, "/api/v1/channels/heavy/pin", None)
        .await?;
    ensure!(
        code == 200 && body["transitions"] == json!([]),
        "{code} {body}"
    );
    let (_, rows) = api.call(M::GET, "/api/v1/channels", None).await?;
    ensure!(
        rows[0]["weight"] == json!(3)
            && rows[0]["group"] == json!("coll-7")
            && rows[0]["pinned"] == json!(true),
        "{rows}"
    );
    let (code, body) = api
        .call(M::POST, "/api/v1/channels/heavy/unpin", None)
        .await?;
    ensure!(
        code == 200 && body["pinned"] == json!(false),
        "{code} {body}"
    );
    ensure!(!stored(&store, "heavy").await?.pinned);
    let (code, body) = api
        .call(M::POST, "/api/v1/channels/nosuch/pin", None)
        .await?;
    ensure!(code == 404, "{code} {body}");
    handle.stop().await?;
    Ok(())
}
