//! Unit tests of `ctl`'s way to the leader.

use chanwatch_core::planner::Cause;
use chanwatch_core::{ChannelInfo, ChannelOwner};
use chanwatch_store::EmbeddedStore;

use super::*;

/// A leader on the embedded store, its admin API served on a free loopback port; the
/// handle keeps it running.
async fn leader_on_embedded_store() -> Result<(Leader, chanwatch_coord::CoordHandle)> {
    let store: Arc<dyn MetaStore> = Arc::new(EmbeddedStore::new());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let handle = chanwatch_coord::Coordinator::builder(store.clone())
        .admin_addr(listener.local_addr()?.to_string())
        .session_ttl(Duration::from_secs(3))
        .spawn()?;
    let router =
        chanwatch_coord::api::router(handle.clone(), chanwatch_coord::api::ApiOptions::default());
    tokio::spawn(chanwatch_coord::api::serve(
        listener,
        router,
        std::future::pending(),
    ));
    let mut ready = handle.watch_status();
    tokio::time::timeout(Duration::from_secs(10), ready.wait_for(|s| s.ready)).await??;
    let leader = Leader {
        source: Source::Etcd(store),
        keys: Keys::default(),
        token: None,
        timeout: Duration::from_secs(10),
        followed: Default::default(),
    };
    Ok((leader, handle))
}

/// ctl's writes pass the admin API's cross-site guard: the leader's advertised address as
/// `Host`, and the JSON content type on every write, bodiless POSTs and DELETEs included
/// (without it they got 415).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_writes_pass_the_admin_apis_cross_site_guard() -> Result<()> {
    let (leader, _handle) = leader_on_embedded_store().await?;
    let c1 = ChannelName::new("c1")?;
    let out = leader.add_channel_with(&c1, None, None, None).await?;
    assert_eq!(out[0].channel, c1, "{out:?}");
    let plan = leader.balance(true).await?;
    assert!(plan.dry_run, "{plan:?}");
    leader.remove_channel(&c1).await?;
    // Refused for what it asks (no node 9), not for how it asks.
    let e = leader
        .drain(NodeId(9))
        .await
        .expect_err("node 9 does not exist");
    assert!(e.to_string().contains("not alive"), "{e}");
    Ok(())
}

/// `--vchannel` is parsed once into a `VChannelInfo` and sent typed: what lands in etcd is
/// that value, fields this build does not know included, and the answer comes back as
/// typed transitions (parked under `remaining`: no node is alive).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_typed_vchannel_reaches_etcd_unchanged_and_the_answer_reads_back_typed() -> Result<()> {
    let (leader, _handle) = leader_on_embedded_store().await?;
    let vchannel = VChannelInfo::from_json(
        br#"{"collection_id":7,"seek_position":"p-42","flushed_segment_ids":[3],
             "metadata":{"k":"v"},"a_future_field":[1,2]}"#,
    )?;
    let c2 = ChannelName::new("c2")?;
    let out = leader
        .add_channel_with(&c2, Some(&vchannel), None, None)
        .await?;
    assert_eq!(out.len(), 1, "{out:?}");
    let t = &out[0];
    assert_eq!(
        (&t.channel, t.cause, t.from, t.to),
        (&c2, Cause::Assign, None, Some(ChannelOwner::Remaining)),
        "{t:?}"
    );
    let keys = &leader.keys;
    let Source::Etcd(store) = &leader.source else {
        unreachable!("built on the store above")
    };
    let list = store.range(&keys.all_prefix()).await?;
    let stored = list
        .kvs
        .iter()
        .filter(|kv| keys.parse_channel(&kv.key).is_ok())
        .map(|kv| ChannelInfo::decode(&kv.value))
        .collect::<Result<Vec<_>, _>>()?;
    assert_eq!(stored.len(), 1, "{stored:?}");
    assert_eq!(stored[0].vchannel, vchannel);
    Ok(())
}
