//! The conformance suite: one body per guarantee of the `Log` docs, run on every backend.
//! Bodies use only the trait (and `Harness::restart`), in real time.

use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use bytes::Bytes;
use chanwatch_stream::{LogError, Message, Position, MAX_MESSAGE_BYTES};

use crate::Harness;

/// Long enough for a loaded 2-core machine; a passing case never waits it out.
const WAIT: Duration = Duration::from_secs(10);

fn payload(i: usize) -> Bytes {
    Bytes::from(format!("message-{i}"))
}

/// Reads every message of `channel` after `after`, in batches of `batch`.
async fn read_all(
    h: &Harness,
    channel: &str,
    after: Position,
    batch: usize,
) -> Result<Vec<Message>> {
    let mut out = Vec::new();
    let mut at = after;
    loop {
        let got = h.log.read(channel, at, batch, Duration::ZERO).await?;
        ensure!(
            got.len() <= batch.max(1),
            "read returned {} > max {batch}",
            got.len()
        );
        let Some(last) = got.last() else {
            return Ok(out);
        };
        at = last.position;
        out.extend(got);
    }
}

pub async fn appended_messages_read_back_in_order(h: Harness) -> Result<()> {
    let mut positions = Vec::new();
    for i in 0..25 {
        positions.push(h.log.append("orders-0", payload(i)).await?);
    }
    ensure!(
        positions.windows(2).all(|w| w[0] < w[1]),
        "positions grow: {positions:?}"
    );
    ensure!(positions[0] > Position::START);
    for batch in [1, 7, 100] {
        let got = read_all(&h, "orders-0", Position::START, batch).await?;
        let got_positions: Vec<Position> = got.iter().map(|m| m.position).collect();
        ensure!(
            got_positions == positions,
            "batch {batch}: {got_positions:?} != {positions:?}"
        );
        for (i, m) in got.iter().enumerate() {
            ensure!(m.payload == payload(i), "message {i} is {:?}", m.payload);
        }
    }
    // An empty payload is a message too.
    let p = h.log.append("orders-0", Bytes::new()).await?;
    let got = h
        .log
        .read("orders-0", positions[24], 10, Duration::ZERO)
        .await?;
    ensure!(
        got == vec![Message {
            position: p,
            payload: Bytes::new()
        }],
        "{got:?}"
    );
    Ok(())
}

pub async fn reading_after_a_middle_position_skips_what_came_before(h: Harness) -> Result<()> {
    let mut positions = Vec::new();
    for i in 0..10 {
        positions.push(h.log.append("c", payload(i)).await?);
    }
    for k in [0, 4, 8] {
        let got = read_all(&h, "c", positions[k], 3).await?;
        let want: Vec<Message> = (k + 1..10)
            .map(|i| Message {
                position: positions[i],
                payload: payload(i),
            })
            .collect();
        ensure!(got == want, "after message {k}: {got:?}");
    }
    let after_last = h.log.read("c", positions[9], 10, Duration::ZERO).await?;
    ensure!(
        after_last.is_empty(),
        "nothing after the last: {after_last:?}"
    );
    Ok(())
}

pub async fn end_is_the_last_appended_position(h: Harness) -> Result<()> {
    ensure!(
        h.log.end("empty").await? == Position::START,
        "an empty channel ends at START"
    );
    let mut last = Position::START;
    for i in 0..5 {
        last = h.log.append("c", payload(i)).await?;
        ensure!(h.log.end("c").await? == last);
    }
    h.log.append("other", payload(0)).await?;
    ensure!(
        h.log.end("c").await? == last,
        "another channel's append moves no end"
    );
    Ok(())
}

pub async fn a_waiting_read_wakes_on_append(h: Harness) -> Result<()> {
    let first = h.log.append("c", payload(0)).await?;
    let log = h.log.clone();
    let started = Instant::now();
    let reader = tokio::spawn(async move { log.read("c", first, 10, WAIT).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    ensure!(!reader.is_finished(), "the read waits while nothing is new");
    let second = h.log.append("c", payload(1)).await?;
    let got = tokio::time::timeout(WAIT, reader).await???;
    ensure!(
        got == vec![Message {
            position: second,
            payload: payload(1)
        }],
        "{got:?}"
    );
    ensure!(
        started.elapsed() < WAIT,
        "woken by the append, not by the timeout"
    );
    Ok(())
}

pub async fn a_read_with_nothing_new_returns_empty_after_its_wait(h: Harness) -> Result<()> {
    let p = h.log.append("c", payload(0)).await?;
    let started = Instant::now();
    let got = h.log.read("c", p, 10, Duration::from_millis(400)).await?;
    let waited = started.elapsed();
    ensure!(got.is_empty(), "{got:?}");
    ensure!(
        waited >= Duration::from_millis(350) && waited < Duration::from_secs(5),
        "waited {waited:?} for a 400 ms wait"
    );
    let started = Instant::now();
    ensure!(h
        .log
        .read("empty", Position::START, 10, Duration::ZERO)
        .await?
        .is_empty());
    ensure!(
        started.elapsed() < Duration::from_secs(2),
        "a zero wait does not wait"
    );
    Ok(())
}

pub async fn channels_are_independent(h: Harness) -> Result<()> {
    let names = ["a", "a.b", "a-b", "b"];
    for round in 0..4 {
        for (k, name) in names.iter().enumerate() {
            h.log
                .append(name, Bytes::from(format!("{name}/{round}/{k}")))
                .await?;
        }
    }
    for name in names {
        let got = read_all(&h, name, Position::START, 100).await?;
        let texts: Vec<String> = got
            .iter()
            .map(|m| String::from_utf8_lossy(&m.payload).into_owned())
            .collect();
        ensure!(texts.len() == 4, "{name}: {texts:?}");
        for (round, text) in texts.iter().enumerate() {
            ensure!(
                text.starts_with(&format!("{name}/{round}/")),
                "{name}: {texts:?}"
            );
        }
        ensure!(
            h.log.end(name).await? == got[3].position,
            "{name}: end is its own last"
        );
    }
    Ok(())
}

pub async fn positions_survive_a_restart(mut h: Harness) -> Result<()> {
    let mut before = Vec::new();
    for i in 0..6 {
        before.push(h.log.append(["x", "y"][i % 2], payload(i)).await?);
    }
    let x_before = read_all(&h, "x", Position::START, 100).await?;
    h.restart().await?;
    let x_after = read_all(&h, "x", Position::START, 100).await?;
    ensure!(x_after == x_before, "{x_after:?} != {x_before:?}");
    ensure!(h.log.end("y").await? == before[5]);
    // Resuming from a position taken before the restart, and appending after it.
    let next = h.log.append("x", payload(6)).await?;
    ensure!(next > before[5], "{next:?} after {:?}", before[5]);
    let got = read_all(&h, "x", before[4], 100).await?;
    ensure!(
        got == vec![Message {
            position: next,
            payload: payload(6)
        }],
        "{got:?}"
    );
    Ok(())
}

pub async fn bad_names_and_oversized_messages_are_refused(h: Harness) -> Result<()> {
    for bad in ["", "a/b", "a b", "a*", "a>"] {
        let append = h.log.append(bad, payload(0)).await;
        ensure!(
            matches!(append, Err(LogError::BadChannel { .. })),
            "{bad:?}: {append:?}"
        );
        let read = h.log.read(bad, Position::START, 1, Duration::ZERO).await;
        ensure!(
            matches!(read, Err(LogError::BadChannel { .. })),
            "{bad:?}: {read:?}"
        );
        ensure!(matches!(
            h.log.end(bad).await,
            Err(LogError::BadChannel { .. })
        ));
    }
    let big = Bytes::from(vec![1; MAX_MESSAGE_BYTES + 1]);
    let e = h.log.append("c", big).await;
    ensure!(matches!(e, Err(LogError::TooLarge { .. })), "{e:?}");
    ensure!(
        h.log.end("c").await? == Position::START,
        "nothing was stored"
    );
    Ok(())
}

/// A reader that follows a channel while another task appends to it gets every message once,
/// in order. (On NATS a batch once ended at a message whose `pending` was 0 while the server
/// went on delivering one appended meanwhile; the cursor then skipped it.)
pub async fn a_reader_following_concurrent_appends_misses_nothing(h: Harness) -> Result<()> {
    const N: usize = 3000;
    let writer = h.log.clone();
    let appends = tokio::spawn(async move {
        for i in 0..N {
            writer.append("follow", payload(i)).await?;
        }
        Ok::<_, LogError>(())
    });
    let mut got = Vec::new();
    let mut at = Position::START;
    let deadline = Instant::now() + Duration::from_secs(20);
    while got.len() < N && Instant::now() < deadline {
        for m in h
            .log
            .read("follow", at, 7, Duration::from_millis(200))
            .await?
        {
            ensure!(m.position > at, "positions grow");
            at = m.position;
            got.push(m.payload);
        }
    }
    appends.await??;
    ensure!(got.len() == N, "read {} of {N} messages", got.len());
    ensure!(
        got.iter().enumerate().all(|(i, p)| *p == payload(i)),
        "every message once, in order"
    );
    Ok(())
}
