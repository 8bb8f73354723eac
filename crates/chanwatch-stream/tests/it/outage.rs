//! The NATS log while nats-server is away: calls fail as retryable, the same client works
//! again once the server is back (its cursors replaced), and nothing acked is lost.

use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Result};
use bytes::Bytes;
use chanwatch_stream::{Log, LogError, NatsConfig, NatsLog, Position};
use chanwatch_testkit::NatsFixture;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nats_log_fails_retryably_while_the_server_is_down_and_recovers_by_itself() -> Result<()>
{
    let mut nats = NatsFixture::start().await?;
    let log = NatsLog::connect(NatsConfig {
        request_timeout: Duration::from_secs(1),
        ..NatsConfig::new(nats.url(), "CHANWATCH")
    })
    .await?;
    let first = log.append("c", Bytes::from_static(b"before")).await?;
    // Leaves a cursor (a consumer on the server) after `first`, which the restart loses.
    let got = log.read("c", Position::START, 10, Duration::ZERO).await?;
    ensure!(got.len() == 1 && got[0].position == first, "{got:?}");

    nats.kill();
    for call in ["append", "read", "end"] {
        let result = match call {
            "append" => log
                .append("c", Bytes::from_static(b"lost?"))
                .await
                .map(|_| ()),
            "read" => log
                .read("c", Position::START, 10, Duration::ZERO)
                .await
                .map(|_| ()),
            _ => log.end("c").await.map(|_| ()),
        };
        match result {
            Err(e @ LogError::Unavailable { .. }) => ensure!(e.is_retryable()),
            other => bail!("{call} with the server down: {other:?}"),
        }
    }

    nats.start_again().await?;
    let started = Instant::now();
    let after = loop {
        match log.append("c", Bytes::from_static(b"after")).await {
            Ok(p) => break p,
            Err(e) if e.is_retryable() && started.elapsed() < Duration::from_secs(20) => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => bail!("no recovery after {:?}: {e}", started.elapsed()),
        }
    };
    ensure!(after > first);
    // Reading on from the cursor's place: the lost consumer is replaced, nothing is skipped.
    let got = log.read("c", first, 10, Duration::ZERO).await?;
    ensure!(got.last().map(|m| m.position) == Some(after), "{got:?}");
    let got = log.read("c", Position::START, 10, Duration::ZERO).await?;
    ensure!(got.first().map(|m| m.position) == Some(first), "{got:?}");
    ensure!(got.last().map(|m| m.position) == Some(after), "{got:?}");
    ensure!(log.end("c").await? == after);
    Ok(())
}
