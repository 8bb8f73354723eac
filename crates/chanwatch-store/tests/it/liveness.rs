//! The etcd backend under the faults an operator's etcd has: a full quota (NOSPACE), auth
//! tokens that die with an etcd restart, and roles limited to the root prefix.

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chanwatch_store::{
    AlarmKind, EmbeddedStore, EtcdConfig, EtcdStore, MetaStore, StoreError, Txn, TxnOp,
};
use chanwatch_testkit::{EtcdFixture, EtcdOptions};
use futures_util::StreamExt;

fn config(fixture: &EtcdFixture, user: Option<(&str, &str)>, probe: Option<&str>) -> EtcdConfig {
    EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
        probe_key: probe.map(str::to_owned),
        connect_timeout: Duration::from_secs(3),
        request_timeout: Duration::from_secs(3),
        ..EtcdConfig::default()
    }
}

/// Overwrites one key with 20 KB values until etcd refuses one; returns that refusal. The
/// space is history, which compaction and defragmentation free.
async fn fill(store: &dyn MetaStore) -> Result<StoreError> {
    for i in 0..200u8 {
        let value = vec![b'a' + i % 26; 20_000];
        let put = Txn::new().and_then([TxnOp::put("cw/fill", value)]);
        if let Err(e) = store.txn(put).await {
            return Ok(e);
        }
    }
    bail!("etcd took 4 MB under a 300 KB quota")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nospace_is_named_truly_retryable_and_listed_as_an_alarm() -> Result<()> {
    let fixture = EtcdFixture::start_with(EtcdOptions {
        quota_backend_bytes: Some(300_000),
        ..EtcdOptions::default()
    })
    .await?;
    let store = EtcdStore::connect(config(&fixture, None, Some("cw/id/node"))).await?;
    ensure!(store.alarms().await?.is_empty(), "no alarm at start");

    let refusal = fill(&store).await?;
    ensure!(
        matches!(refusal, StoreError::NoSpace),
        "a full quota is NoSpace: {refusal:?}"
    );
    let text = refusal.to_string();
    ensure!(
        text.contains("etcd is out of space (alarm NOSPACE)") && text.contains("alarm disarm"),
        "the message says what to do: {text}"
    );
    ensure!(refusal.is_retryable(), "NOSPACE passes once disarmed");
    let alarms = store.alarms().await?;
    ensure!(
        alarms.iter().any(|a| a.kind == AlarmKind::NoSpace),
        "alarm list: {alarms:?}"
    );
    let grant = store.grant(Duration::from_secs(5)).await;
    ensure!(
        matches!(grant, Err(StoreError::NoSpace)),
        "a lease grant during the alarm: {grant:?}"
    );
    ensure!(store.get("cw/fill").await?.is_some(), "reads still work");
    store
        .txn(Txn::new().and_then([TxnOp::delete("cw/absent")]))
        .await
        .context("a txn that only deletes passes during the alarm")?;

    fixture.free_space_and_disarm()?;
    ensure!(store.alarms().await?.is_empty(), "disarmed");
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/after", "ok")]))
        .await?;
    store.grant(Duration::from_secs(5)).await?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn the_embedded_store_can_simulate_nospace_as_etcd_behaves() -> Result<()> {
    let store = EmbeddedStore::new();
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/a", "1")]))
        .await?;
    let lease = store.grant(Duration::from_secs(5)).await?;
    store.set_nospace(true);
    ensure!(store.alarms().await?.len() == 1);
    let put = store
        .txn(Txn::new().and_then([TxnOp::put("cw/b", "1")]))
        .await;
    ensure!(matches!(put, Err(StoreError::NoSpace)), "put: {put:?}");
    let mixed = store
        .txn(
            Txn::new()
                .and_then([TxnOp::delete("cw/a")])
                .or_else([TxnOp::put("cw/c", "1")]),
        )
        .await;
    ensure!(
        matches!(mixed, Err(StoreError::NoSpace)),
        "a txn with a put in either branch is refused: {mixed:?}"
    );
    store
        .txn(Txn::new().and_then([TxnOp::delete("cw/a")]))
        .await
        .context("a txn that only deletes passes, as on etcd")?;
    let grant = store.grant(Duration::from_secs(5)).await;
    ensure!(
        matches!(grant, Err(StoreError::NoSpace)),
        "grant: {grant:?}"
    );
    store.keepalive(lease.id).await?;
    store
        .txn(Txn::new().and_then([TxnOp::get("cw/a")]))
        .await
        .context("a read-only txn passes")?;
    store.set_nospace(false);
    ensure!(store.alarms().await?.is_empty());
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/b", "1")]))
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_limited_to_the_root_prefix_can_connect_and_is_refused_by_name_outside() -> Result<()>
{
    let fixture = EtcdFixture::start_with(EtcdOptions {
        root_password: Some("rootpw".into()),
        ..EtcdOptions::default()
    })
    .await?;
    fixture.add_user_with_role("cwuser", "pw", &[("readwrite", "cw/")])?;
    let store = EtcdStore::connect(config(&fixture, Some(("cwuser", "pw")), Some("cw/id/node")))
        .await
        .context("a user whose role allows only cw/ connects")?;
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/k", "v")]))
        .await?;
    ensure!(store.get("cw/k").await?.is_some());
    let mut watch = store.watch("cw/", 0).await?;
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/k", "w")]))
        .await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await?
        .context("watch ended")??;
    ensure!(batch.events.len() == 1);

    let outside = store.get("other/k").await;
    ensure!(
        matches!(&outside, Err(StoreError::PermissionDenied { user, key }) if user == "cwuser" && key == "other/k"),
        "a read outside the role: {outside:?}"
    );
    let text = outside.err().map(|e| e.to_string()).unwrap_or_default();
    ensure!(
        text.contains("cwuser") && text.contains("other/k"),
        "{text}"
    );
    let watch_outside = store.watch("other/", 0).await;
    ensure!(
        matches!(&watch_outside, Err(StoreError::PermissionDenied { key, .. }) if key == "other/"),
        "a watch outside the role: {:?}",
        watch_outside.err()
    );
    let write_outside = store
        .txn(Txn::new().and_then([TxnOp::put("other/k", "v")]))
        .await;
    ensure!(
        matches!(&write_outside, Err(StoreError::PermissionDenied { key, .. }) if key == "other/k"),
        "a write outside the role: {write_outside:?}"
    );

    let wrong = EtcdStore::connect(config(
        &fixture,
        Some(("cwuser", "nope")),
        Some("cw/id/node"),
    ))
    .await;
    ensure!(
        matches!(&wrong, Err(StoreError::Unauthenticated(m)) if m.contains("cwuser")),
        "a wrong password names the user: {wrong:?}"
    );
    ensure!(wrong.err().is_some_and(|e| e.is_config()));
    Ok(())
}

/// Retries `call` for up to 10 s while it fails with a retryable error, as callers do.
async fn eventually<T, F, Fut>(what: &str, mut call: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match call().await {
            Ok(v) => return Ok(v),
            Err(e) if e.is_retryable() && tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("{what}: {e:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_auth_etcd_restart_and_an_expired_token_only_delay_calls() -> Result<()> {
    let mut fixture = EtcdFixture::start_with(EtcdOptions {
        root_password: Some("rootpw".into()),
        extra_args: vec!["--auth-token-ttl=2".into()],
        ..EtcdOptions::default()
    })
    .await?;
    fixture.add_user_with_role("cwuser", "pw", &[("readwrite", "cw/")])?;
    let store =
        EtcdStore::connect(config(&fixture, Some(("cwuser", "pw")), Some("cw/id/node"))).await?;
    let lease = store.grant(Duration::from_secs(30)).await?;
    store.keepalive(lease.id).await?;
    store
        .txn(Txn::new().and_then([TxnOp::put_with_lease("cw/s", "1", lease.id)]))
        .await?;

    // etcd's simple tokens live in its memory. A restart alone may not kill ours: etcd
    // replays the raft entries since its last snapshot, authentication included, and so
    // re-creates the tokens they made. An idle token expires after --auth-token-ttl (here
    // 2 s, 300 s by default) and is then as unknown as after a restart from a snapshot.
    fixture.restart().await?;
    tokio::time::sleep(Duration::from_secs(3)).await;

    eventually("keepalive", || store.keepalive(lease.id)).await?;
    // The watch first: etcd refuses a stale token there by cancelling the new watch with
    // "permission denied", which the client's own token refresh does not catch.
    let mut watch = eventually("watch", || store.watch("cw/", 0)).await?;
    eventually("get", || store.get("cw/s")).await?;
    eventually("txn", || {
        store.txn(Txn::new().and_then([TxnOp::put("cw/t", "1")]))
    })
    .await?;
    let batch = tokio::time::timeout(Duration::from_secs(5), watch.next())
        .await
        .context("the watch made after the restart sees writes")?
        .context("watch ended")??;
    ensure!(batch.events[0].kv.key == "cw/t");
    ensure!(store.get("cw/s").await?.is_some(), "the lease kept its key");
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn an_expired_token_can_be_injected_and_spares_keepalives() -> Result<()> {
    let (store, faults) = chanwatch_store::FaultyStore::new(EmbeddedStore::new());
    let lease = store.grant(Duration::from_secs(5)).await?;
    faults.expire_auth(true);
    let get = store.get("cw/a").await;
    ensure!(
        matches!(&get, Err(e @ StoreError::AuthTokenExpired(_)) if e.is_retryable()),
        "get: {get:?}"
    );
    let txn = store
        .txn(Txn::new().and_then([TxnOp::put("cw/a", "1")]))
        .await;
    ensure!(
        matches!(txn, Err(StoreError::AuthTokenExpired(_))),
        "txn: {txn:?}"
    );
    ensure!(store.watch("cw/", 0).await.is_err());
    store
        .keepalive(lease.id)
        .await
        .context("leases renew without a token")?;
    faults.expire_auth(false);
    store
        .txn(Txn::new().and_then([TxnOp::put("cw/a", "1")]))
        .await?;
    Ok(())
}

/// A renewal whose caller gave up (a timeout around `keepalive`, as the node's keepalive task
/// has) must not leave its answer behind for the next renewal to read: that answer is about an
/// older renewal, so the node would believe its lease renewed later than etcd did — the cause
/// of a double ownership seen in the chaos run while a quota fill slowed etcd down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_given_up_on_does_not_answer_the_next_one() -> Result<()> {
    let fixture = EtcdFixture::start().await?;
    let store = EtcdStore::connect(config(&fixture, None, None)).await?;
    let other = EtcdStore::connect(config(&fixture, None, None)).await?;
    let lease = store.grant(Duration::from_secs(30)).await?.id;
    store.keepalive(lease).await?;
    // Sends a renewal and gives up before its answer is read; the answer arrives later.
    let gave_up = futures_util::FutureExt::now_or_never(store.keepalive(lease));
    ensure!(
        gave_up.is_none(),
        "the renewal was answered at once: {gave_up:?}"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    other.revoke(lease).await?;
    match store.keepalive(lease).await {
        Err(StoreError::LeaseNotFound(id)) if id == lease => Ok(()),
        other => bail!("a renewal after the lease was revoked must say LeaseNotFound: {other:?}"),
    }
}
