//! `NatsFixture`: a nats-server with JetStream that restarts on its store and dies on drop.

use std::time::Duration;

use chanwatch_testkit::NatsFixture;
use tokio::io::AsyncReadExt;

/// The first line a NATS server sends a new client: `INFO {...}`.
async fn server_info(url: &str) -> std::io::Result<String> {
    let addr = url.trim_start_matches("nats://");
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    let mut buf = vec![0; 4096];
    let n = tokio::time::timeout(Duration::from_secs(5), conn.read(&mut buf)).await??;
    Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_fixture_serves_jetstream_restarts_on_its_store_and_stops_on_drop(
) -> Result<(), Box<dyn std::error::Error>> {
    let mut nats = NatsFixture::start().await?;
    let url = nats.url().to_owned();
    assert!(url.starts_with("nats://127.0.0.1:"), "{url}");
    let info = server_info(&url).await?;
    assert!(
        info.starts_with("INFO ") && info.contains("\"jetstream\":true"),
        "{info}"
    );

    let store = nats.store_dir();
    assert!(
        store.join("jetstream").is_dir(),
        "JetStream keeps its data under -sd"
    );
    nats.restart().await?;
    assert_eq!(nats.store_dir(), store);
    assert!(server_info(&url).await?.contains("\"jetstream\":true"));

    nats.kill();
    assert!(server_info(&url).await.is_err(), "a killed server refuses");
    nats.start_again().await?;
    assert!(server_info(&url).await.is_ok());

    drop(nats);
    assert!(
        server_info(&url).await.is_err(),
        "dropping the fixture stops the server"
    );
    assert!(!store.exists(), "and removes its store");
    Ok(())
}
