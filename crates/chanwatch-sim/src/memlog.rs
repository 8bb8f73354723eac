//! The simulation's data-plane log: [`MemLog`], an in-memory [`Log`] whose waiting reads
//! wait on tokio's (paused) clock, so the simulation's time drives them like everything else.
//!
//! Owns: the messages of every channel of one run (positions 1, 2, 3, … per channel, as the
//! file log's) and waking readers on append. Must not: fail, read the wall clock, or use
//! anything whose wake-up order is random (readers wait on a [`tokio::sync::Notify`], which
//! wakes its waiters in a fixed order, or on a timer).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use chanwatch_stream::{check_channel, Log, LogResult, Message, Position};
use tokio::sync::Notify;

/// An in-memory log (see the module docs). Clones share the messages.
#[derive(Debug, Clone, Default)]
pub struct MemLog {
    channels: Arc<Mutex<BTreeMap<String, Vec<Bytes>>>>,
    appended: Arc<Notify>,
}

impl MemLog {
    /// An empty log.
    pub fn new() -> Self {
        MemLog::default()
    }

    /// Every message of `channel` up to and including `upto`, oldest first.
    pub fn messages(&self, channel: &str, upto: Position) -> Vec<Bytes> {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        let upto = usize::try_from(upto.raw()).unwrap_or(usize::MAX);
        channels
            .get(channel)
            .map(|m| m.iter().take(upto).cloned().collect())
            .unwrap_or_default()
    }

    fn after(&self, channel: &str, after: Position, max: usize) -> Vec<Message> {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(msgs) = channels.get(channel) else {
            return Vec::new();
        };
        let from = usize::try_from(after.raw()).unwrap_or(usize::MAX);
        msgs.iter()
            .enumerate()
            .skip(from)
            .take(max.max(1))
            .map(|(i, payload)| Message {
                position: Position::from_raw(i as u64 + 1),
                payload: payload.clone(),
            })
            .collect()
    }

    fn end_now(&self, channel: &str) -> Position {
        let channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
        Position::from_raw(channels.get(channel).map_or(0, |m| m.len() as u64))
    }
}

#[async_trait]
impl Log for MemLog {
    async fn append(&self, channel: &str, payload: Bytes) -> LogResult<Position> {
        check_channel(channel)?;
        let at = {
            let mut channels = self.channels.lock().unwrap_or_else(PoisonError::into_inner);
            let msgs = channels.entry(channel.to_owned()).or_default();
            msgs.push(payload);
            msgs.len() as u64
        };
        self.appended.notify_waiters();
        Ok(Position::from_raw(at))
    }

    async fn read(
        &self,
        channel: &str,
        after: Position,
        max: usize,
        wait: Duration,
    ) -> LogResult<Vec<Message>> {
        check_channel(channel)?;
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let notified = self.appended.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let batch = self.after(channel, after, max);
            if !batch.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(batch);
            }
            tokio::select! {
                biased;
                () = &mut notified => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
        }
    }

    async fn end(&self, channel: &str) -> LogResult<Position> {
        check_channel(channel)?;
        Ok(self.end_now(channel))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_waiting_read_wakes_on_append_and_times_out_on_the_paused_clock() {
        let log = MemLog::new();
        let start = tokio::time::Instant::now();
        let empty = log
            .read("c", Position::START, 10, Duration::from_secs(3))
            .await
            .ok();
        assert_eq!(empty.map(|b| b.len()), Some(0));
        assert_eq!(start.elapsed(), Duration::from_secs(3));
        let reader = {
            let log = log.clone();
            tokio::spawn(async move {
                log.read("c", Position::START, 10, Duration::from_secs(60))
                    .await
            })
        };
        tokio::time::sleep(Duration::from_secs(1)).await;
        let _ = log.append("c", Bytes::from_static(b"a")).await;
        let _ = log.append("c", Bytes::from_static(b"b")).await;
        let batch = reader.await.ok().and_then(Result::ok).unwrap_or_default();
        assert_eq!(batch.len(), 2);
        assert_eq!(batch[1].position, Position::from_raw(2));
        assert_eq!(start.elapsed(), Duration::from_secs(4));
        let rest = log
            .read("c", Position::from_raw(1), 10, Duration::ZERO)
            .await
            .unwrap_or_default();
        assert_eq!(rest.len(), 1);
        assert_eq!(log.messages("c", Position::from_raw(1)).len(), 1);
        assert_eq!(log.end("c").await.ok(), Some(Position::from_raw(2)));
    }
}
