//! The file log after a crash, and with a reader in another process.

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{ensure, Result};
use bytes::Bytes;
use chanwatch_stream::{FileLog, FileLogOptions, Log, LogError, Message, Position};

fn open(dir: &std::path::Path) -> Result<FileLog> {
    Ok(FileLog::open(dir, FileLogOptions::default())?)
}

async fn append_n(log: &FileLog, channel: &str, n: usize) -> Result<()> {
    for i in 0..n {
        log.append(channel, Bytes::from(format!("m{i}"))).await?;
    }
    Ok(())
}

/// A crash in the middle of an append leaves part of a record at the end of the file.
fn tear(path: &std::path::Path, bytes: &[u8]) -> Result<()> {
    let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
    f.write_all(bytes)?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_torn_last_record_is_skipped_then_cut_off_by_the_next_append() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let log = open(dir.path())?;
    append_n(&log, "c", 3).await?;
    let path = log.channel_path("c");
    let good_len = std::fs::metadata(&path)?.len();
    drop(log);

    // A header promising 100 bytes, and only 10 of them.
    tear(
        &path,
        &[&100u32.to_le_bytes()[..], &[0xab; 4], &[7; 10]].concat(),
    )?;
    let log = open(dir.path())?;
    ensure!(
        log.end("c").await? == Position::from_raw(3),
        "the torn record is no message"
    );
    let got = log.read("c", Position::START, 10, Duration::ZERO).await?;
    ensure!(got.len() == 3, "{got:?}");

    let p = log.append("c", Bytes::from_static(b"after")).await?;
    ensure!(p == Position::from_raw(4), "{p:?}");
    let got = log
        .read("c", Position::from_raw(3), 10, Duration::ZERO)
        .await?;
    ensure!(
        got == vec![Message {
            position: p,
            payload: Bytes::from_static(b"after")
        }],
        "{got:?}"
    );
    // The torn bytes are gone: the file is the good records plus the new one.
    ensure!(std::fs::metadata(&path)?.len() == good_len + 8 + 5);

    // And a fresh process sees all four.
    drop(log);
    let log = open(dir.path())?;
    ensure!(
        log.read("c", Position::START, 10, Duration::ZERO)
            .await?
            .len()
            == 4
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zero_filled_tail_is_torn_not_corrupt() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let log = open(dir.path())?;
    append_n(&log, "c", 2).await?;
    drop(log);
    tear(&open(dir.path())?.channel_path("c"), &[0; 4096])?;
    let log = open(dir.path())?;
    ensure!(log.end("c").await? == Position::from_raw(2));
    ensure!(log.append("c", Bytes::from_static(b"x")).await? == Position::from_raw(3));
    drop(log);
    // The zeros were cut off, not left between the old records and the new one.
    let got = open(dir.path())?
        .read("c", Position::START, 10, Duration::ZERO)
        .await?;
    ensure!(got.len() == 3 && got[2].payload == "x", "{got:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_before_the_last_record_is_corrupt_never_skipped() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let log = open(dir.path())?;
    append_n(&log, "c", 3).await?;
    let path = log.channel_path("c");
    drop(log);
    let mut bytes = std::fs::read(&path)?;
    bytes[8 + 2 + 8] ^= 0xff; // the payload of the second record ("m1")
    std::fs::write(&path, bytes)?;

    let log = open(dir.path())?;
    let read = log.read("c", Position::START, 10, Duration::ZERO).await;
    ensure!(
        matches!(&read, Err(LogError::Corrupt { offset: 10, .. })),
        "{read:?}"
    );
    let append = log.append("c", Bytes::from_static(b"x")).await;
    ensure!(
        matches!(append, Err(LogError::Corrupt { .. })),
        "no append after damage: {append:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_in_another_process_sees_appends_within_the_poll_interval() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // Two logs on one dir share nothing but the files, as two processes do.
    let writer = open(dir.path())?;
    let reader = open(dir.path())?;
    ensure!(reader.end("c").await? == Position::START);
    let waiting = tokio::spawn(async move {
        let started = Instant::now();
        let got = reader
            .read("c", Position::START, 10, Duration::from_secs(10))
            .await;
        (got, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let p = writer.append("c", Bytes::from_static(b"hello")).await?;
    let (got, waited) = waiting.await?;
    let got = got?;
    ensure!(got.len() == 1 && got[0].position == p, "{got:?}");
    ensure!(waited < Duration::from_secs(2), "seen after {waited:?}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fsync_on_every_append_stores_the_same_records() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let options = FileLogOptions {
        fsync: chanwatch_stream::FsyncPolicy::EveryAppend,
        ..FileLogOptions::default()
    };
    let log = FileLog::open(dir.path(), options.clone())?;
    append_n(&log, "c", 3).await?;
    drop(log);
    let got = FileLog::open(dir.path(), options)?
        .read("c", Position::START, 10, Duration::ZERO)
        .await?;
    let texts: Vec<&[u8]> = got.iter().map(|m| &m.payload[..]).collect();
    ensure!(texts == [&b"m0"[..], b"m1", b"m2"], "{got:?}");
    Ok(())
}
