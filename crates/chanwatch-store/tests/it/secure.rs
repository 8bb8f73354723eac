//! The etcd backend against an etcd that requires TLS with client certificates and auth.

use anyhow::{ensure, Context, Result};
use chanwatch_store::{EtcdConfig, EtcdStore, MetaStore, StoreError, TlsFiles, Txn, TxnOp};
use chanwatch_testkit::{EtcdFixture, EtcdOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_and_auth_work_and_wrong_credentials_are_refused_clearly() -> Result<()> {
    let fixture = EtcdFixture::start_with(EtcdOptions {
        tls: true,
        root_password: Some("pw".into()),
        ..EtcdOptions::default()
    })
    .await?;
    let tls = fixture.tls().context("tls fixture")?;
    let files = TlsFiles {
        ca: Some(tls.ca.clone()),
        cert: Some(tls.client_cert.clone()),
        key: Some(tls.client_key.clone()),
    };
    let config = |user: Option<(&str, &str)>, tls: Option<TlsFiles>| EtcdConfig {
        endpoints: vec![fixture.endpoint().to_owned()],
        user: user.map(|(u, p)| (u.to_owned(), p.to_owned())),
        tls,
        probe_key: Some("k".to_owned()),
        connect_timeout: std::time::Duration::from_secs(3),
        ..EtcdConfig::default()
    };
    ensure!(fixture.endpoint().starts_with("https://"));

    let store = EtcdStore::connect(config(Some(("root", "pw")), Some(files.clone()))).await?;
    store
        .txn(Txn::new().and_then([TxnOp::put("k", "v")]))
        .await?;
    ensure!(store.get("k").await?.map(|kv| kv.value) == Some(b"v".to_vec()));

    let wrong = EtcdStore::connect(config(Some(("root", "nope")), Some(files.clone()))).await;
    ensure!(
        matches!(wrong, Err(StoreError::Unauthenticated(_))),
        "wrong password: {wrong:?}"
    );

    let anonymous = EtcdStore::connect(config(None, Some(files.clone()))).await;
    ensure!(
        matches!(anonymous, Err(StoreError::Unauthenticated(_))),
        "no user: {anonymous:?}"
    );

    let no_tls = EtcdStore::connect(config(Some(("root", "pw")), None)).await;
    ensure!(
        matches!(no_tls, Err(StoreError::Unavailable { .. })),
        "no TLS: {no_tls:?}"
    );

    let missing = EtcdStore::connect(config(
        Some(("root", "pw")),
        Some(TlsFiles {
            ca: Some("/nonexistent/ca.pem".into()),
            cert: None,
            key: None,
        }),
    ))
    .await;
    ensure!(
        matches!(&missing, Err(StoreError::Config(m)) if m.contains("/nonexistent/ca.pem")),
        "missing CA file: {missing:?}"
    );
    Ok(())
}
