//! `open(url, stream)`: the URL picks the backend; a URL that cannot work is fatal, an
//! unreachable server retryable.

use std::time::Duration;

use anyhow::{ensure, Result};
use bytes::Bytes;
use chanwatch_stream::{open, LogError, Position};
use chanwatch_testkit::NatsFixture;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_log_url_opens_its_backend_and_a_bad_one_says_what_is_expected() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let data = dir.path().join("log");
    let log = open(&format!("file:{}", data.display()), "CHANWATCH").await?;
    let p = log.append("c", Bytes::from_static(b"x")).await?;
    ensure!(data.join("c.log").is_file() && p == Position::from_raw(1));

    let nats = NatsFixture::start().await?;
    // Several servers, comma-separated: the client picks one that answers.
    let log = open(&format!("{},{}", nats.url(), nats.url()), "CHANWATCH").await?;
    let p = log.append("c", Bytes::from_static(b"x")).await?;
    let got = log.read("c", Position::START, 10, Duration::ZERO).await?;
    ensure!(got.len() == 1 && got[0].position == p, "{got:?}");

    for bad in [
        "file:",
        "http://127.0.0.1:4222",
        "/tmp/x",
        "nats://127.0.0.1:notaport",
    ] {
        match open(bad, "CHANWATCH").await {
            Err(e @ LogError::BadUrl { .. }) => ensure!(!e.is_retryable(), "{e}"),
            other => anyhow::bail!("{bad}: {:?}", other.map(|_| ())),
        }
    }
    let bad_stream = open(nats.url(), "a.b").await;
    ensure!(
        matches!(bad_stream, Err(LogError::BadUrl { .. })),
        "{:?}",
        bad_stream.map(|_| ())
    );

    // Nothing listens on port 1: retryable.
    match open("nats://127.0.0.1:1", "CHANWATCH").await {
        Err(e @ LogError::Unavailable { .. }) => ensure!(e.is_retryable()),
        other => anyhow::bail!("unreachable server: {:?}", other.map(|_| ())),
    }
    Ok(())
}
