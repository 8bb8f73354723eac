//! The NATS JetStream log, through `async-nats`.
//!
//! Owns: one JetStream stream (file storage, limits retention, no limits: messages are kept
//! until an operator removes them) whose subjects are `{prefix}.>`, and one subject per
//! channel, `{prefix}.{channel}` with each `.` of the channel name written `~` (a channel
//! name may hold dots, a subject token may not; `~` is not allowed in channel names, so the
//! mapping is one-to-one). Must not: know etcd, keys or checkpoints.
//!
//! * **Position** = the message's JetStream *stream* sequence. The stream has one counter
//!   for all its channels, so a channel's positions grow with gaps; they survive a restart of
//!   nats-server on the same store dir (`-sd`).
//! * **append** publishes and waits for JetStream's ack (the message is stored), returning
//!   the ack's sequence. nats-server writes its store files at once but fsyncs them only
//!   every `sync_interval` (2 min by default): an acked message survives a `kill -9` of the
//!   server (measured: 5,000 of 5,000), not necessarily a machine crash. A message over the
//!   server's `max_payload` (1 MiB by default) is [`LogError::TooLarge`].
//! * **read** after `p` first asks for the channel's end (one direct get). When there is
//!   something after `p`, it fetches (`no_wait`, up to `max`) through a **cursor**: an
//!   ephemeral pull consumer filtered on the channel's subject, delivering from stream
//!   sequence `p + 1`, without acks, its state in memory. The cursor is kept per channel
//!   (one per channel per `NatsLog`), so a consumer reading on from where its last read
//!   ended pays two round trips per batch (end + fetch); a read from anywhere else, or a
//!   cursor the server dropped (idle for 60 s, or a restart), makes a new one. When there
//!   is nothing and the read may wait, it waits on a plain (core NATS) subscription to the
//!   subject, taken before the end was read, so an append in between is not missed.
//! * **end** is the sequence of the channel subject's last message (a direct "last by
//!   subject" get), or [`Position::START`] when it has none.
//! * While the server is away, calls fail with [`LogError::Unavailable`] after the request
//!   timeout; the client reconnects on its own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::StreamExt;

use crate::{check_channel, Log, LogError, LogResult, Message, Position, MAX_MESSAGE_BYTES};

/// How to reach the server and which stream to use.
#[derive(Debug, Clone)]
pub struct NatsConfig {
    /// Server URL(s), comma-separated: `nats://127.0.0.1:4222`.
    pub url: String,
    /// The JetStream stream holding every channel (e.g. `CHANWATCH`): one per root.
    pub stream: String,
    /// The subjects' first token(s): channel `c` is subject `{subject_prefix}.c`.
    pub subject_prefix: String,
    /// How long one request (publish ack, consumer create, get) may take before the call
    /// fails with [`LogError::Unavailable`]. Default 5 s.
    pub request_timeout: Duration,
}

impl NatsConfig {
    /// Stream `stream` at `url`, subjects prefixed with the stream's name.
    pub fn new(url: impl Into<String>, stream: impl Into<String>) -> Self {
        let stream = stream.into();
        NatsConfig {
            url: url.into(),
            subject_prefix: stream.clone(),
            stream,
            request_timeout: Duration::from_secs(5),
        }
    }
}

/// The JetStream log. See the module docs for positions and costs.
#[derive(Debug, Clone)]
pub struct NatsLog {
    config: NatsConfig,
    js: jetstream::Context,
    stream: stream::Stream,
    /// Per channel, the consumer the last read left behind and where it stands.
    cursors: Arc<Mutex<HashMap<String, Cursor>>>,
}

/// An ephemeral pull consumer of one channel's subject whose next delivery is the first
/// message after `after` (it does not ack; delivered is consumed).
#[derive(Debug)]
struct Cursor {
    consumer: consumer::Consumer<consumer::pull::Config>,
    after: Position,
}

/// How long the server keeps a cursor's consumer that nobody reads.
const CURSOR_IDLE: Duration = Duration::from_secs(60);

/// How often a woken reader looks again for a message it was told of but JetStream has not
/// stored yet.
const STORE_LAG_POLL: Duration = Duration::from_millis(10);

impl NatsLog {
    /// Connects to the server and creates the stream if it does not exist.
    ///
    /// # Errors
    /// [`LogError::BadUrl`] for an unparsable URL or a stream name / prefix NATS refuses;
    /// [`LogError::Unavailable`] when the server cannot be reached or has no JetStream
    /// (retryable); [`LogError::Refused`] when the stream exists without the subjects
    /// `{prefix}.>`.
    pub async fn connect(config: NatsConfig) -> LogResult<Self> {
        check_names(&config)?;
        let servers = config
            .url
            .split(',')
            .map(|one| one.trim().parse::<async_nats::ServerAddr>())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| LogError::BadUrl {
                url: config.url.clone(),
                reason: format!("{e}; expected nats://HOST:PORT[,nats://HOST:PORT…]"),
            })?;
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(config.request_timeout)
            .request_timeout(Some(config.request_timeout))
            .connect(servers)
            .await
            .map_err(|e| match e.kind() {
                async_nats::ConnectErrorKind::ServerParse => LogError::BadUrl {
                    url: config.url.clone(),
                    reason: format!("{e}; expected nats://HOST:PORT"),
                },
                _ => unavailable(&config.url, e),
            })?;
        let mut js = jetstream::new(client);
        js.set_timeout(config.request_timeout);
        let subjects = format!("{}.>", config.subject_prefix);
        let mut stream = js
            .get_or_create_stream(stream::Config {
                name: config.stream.clone(),
                subjects: vec![subjects.clone()],
                storage: stream::StorageType::File,
                retention: stream::RetentionPolicy::Limits,
                allow_direct: true,
                ..Default::default()
            })
            .await
            .map_err(|e| unavailable(&config.url, format!("stream {}: {e}", config.stream)))?;
        let info = stream
            .info()
            .await
            .map_err(|e| unavailable(&config.url, e))?;
        if !info.config.subjects.contains(&subjects) {
            return Err(LogError::Refused(format!(
                "stream {} exists with subjects {:?}, not {subjects:?}; use another stream \
                 name or add the subject to it",
                config.stream, info.config.subjects
            )));
        }
        Ok(NatsLog {
            config,
            js,
            stream,
            cursors: Arc::default(),
        })
    }

    /// The subject of `channel` (a valid name): `{prefix}.{channel}`, `.` written `~`.
    pub fn subject(&self, channel: &str) -> String {
        subject(&self.config.subject_prefix, channel)
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> LogError {
        unavailable(&self.config.url, e)
    }

    /// What is stored after `after`, up to `max`, without waiting: nothing when the
    /// channel's end is not past `after` (one direct get); else a fetch through the cursor
    /// the last read left at `after`, or through a new one.
    async fn read_stored(
        &self,
        channel: &str,
        subject: &str,
        after: Position,
        max: usize,
    ) -> LogResult<Vec<Message>> {
        if self.end(channel).await? <= after {
            return Ok(Vec::new());
        }
        if let Some(mut cursor) = self.take_cursor(channel, after) {
            // An empty or failed fetch although the end is past `after`: the consumer is gone
            // (idle too long, or the server restarted); fall through to a new one.
            if let Ok(batch) = self.fetch(&mut cursor, max).await {
                if !batch.is_empty() {
                    self.put_cursor(channel, cursor);
                    return Ok(batch);
                }
            }
            self.delete_later(cursor);
        }
        let consumer = self
            .stream
            .create_consumer(consumer::pull::Config {
                filter_subject: subject.to_owned(),
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: after.raw() + 1,
                },
                ack_policy: consumer::AckPolicy::None,
                memory_storage: true,
                inactive_threshold: CURSOR_IDLE,
                ..Default::default()
            })
            .await
            .map_err(|e| self.unavailable(e))?;
        let mut cursor = Cursor { consumer, after };
        match self.fetch(&mut cursor, max).await {
            Ok(batch) => {
                self.put_cursor(channel, cursor);
                Ok(batch)
            }
            Err(e) => {
                self.delete_later(cursor);
                Err(self.unavailable(e))
            }
        }
    }

    /// Fetches what the cursor's consumer has now (a `no_wait` pull: the server answers at
    /// once and keeps no request open, so nothing is delivered after we stop listening), up
    /// to `max`, and moves the cursor past it.
    async fn fetch(&self, cursor: &mut Cursor, max: usize) -> Result<Vec<Message>, String> {
        let work = async {
            let mut messages = cursor
                .consumer
                .fetch()
                .max_messages(max)
                .messages()
                .await
                .map_err(|e| e.to_string())?;
            let mut out = Vec::new();
            while let Some(message) = messages.next().await {
                let message = message.map_err(|e| e.to_string())?;
                let info = message.info().map_err(|e| e.to_string())?;
                let sequence = info.stream_sequence;
                out.push(Message {
                    position: Position::from_raw(sequence),
                    payload: message.message.payload.clone(),
                });
                // Not `pending == 0`: a message appended meanwhile may still be delivered
                // after it, and the server's cursor would then be past `cursor.after` — the
                // next fetch would skip that message. The batch ends by itself (the server's
                // no-wait status) or at `max`.
                if out.len() >= max {
                    break;
                }
            }
            Ok::<_, String>(out)
        };
        let out = tokio::time::timeout(self.config.request_timeout, work)
            .await
            .map_err(|_| "no answer to a fetch in time".to_owned())??;
        if let Some(last) = out.last() {
            cursor.after = last.position;
        }
        Ok(out)
    }

    fn take_cursor(&self, channel: &str, after: Position) -> Option<Cursor> {
        let taken = self
            .cursors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(channel);
        match taken {
            Some(cursor) if cursor.after == after => Some(cursor),
            Some(elsewhere) => {
                self.delete_later(elsewhere);
                None
            }
            None => None,
        }
    }

    fn put_cursor(&self, channel: &str, cursor: Cursor) {
        let replaced = self
            .cursors
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(channel.to_owned(), cursor);
        if let Some(old) = replaced {
            self.delete_later(old);
        }
    }

    /// Deletes a cursor's consumer in the background (the server would after
    /// [`CURSOR_IDLE`] anyway).
    fn delete_later(&self, cursor: Cursor) {
        let stream = self.stream.clone();
        let name = cursor.consumer.cached_info().name.clone();
        tokio::spawn(async move {
            let _ = stream.delete_consumer(&name).await;
        });
    }
}

fn unavailable(url: &str, e: impl std::fmt::Display) -> LogError {
    LogError::Unavailable {
        at: url.to_owned(),
        message: e.to_string(),
    }
}

/// Stream names may not hold `.`, `*`, `>`, whitespace or path separators; the prefix is
/// one or more subject tokens without wildcards.
fn check_names(config: &NatsConfig) -> LogResult<()> {
    let bad = |reason: String| {
        Err(LogError::BadUrl {
            url: config.url.clone(),
            reason,
        })
    };
    let name_ok = !config.stream.is_empty()
        && config
            .stream
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-'));
    if !name_ok {
        return bad(format!(
            "stream name {:?}: use 1 or more of [A-Za-z0-9_-]",
            config.stream
        ));
    }
    let prefix_ok = config.subject_prefix.split('.').all(|token| {
        !token.is_empty()
            && token
                .chars()
                .all(|c| c.is_ascii_graphic() && !matches!(c, '*' | '>'))
    });
    if !prefix_ok {
        return bad(format!(
            "subject prefix {:?}: use dot-separated tokens without wildcards or spaces",
            config.subject_prefix
        ));
    }
    Ok(())
}

#[async_trait]
impl Log for NatsLog {
    async fn append(&self, channel: &str, payload: Bytes) -> LogResult<Position> {
        check_channel(channel)?;
        // A server may be configured with a smaller `max_payload` than the crate's limit.
        let server_max = self.js.client().server_info().max_payload;
        let max = match server_max {
            0 => MAX_MESSAGE_BYTES,
            n => n.min(MAX_MESSAGE_BYTES),
        };
        if payload.len() > max {
            return Err(LogError::TooLarge {
                bytes: payload.len(),
                max,
            });
        }
        let ack = self
            .js
            .publish(self.subject(channel), payload)
            .await
            .map_err(|e| self.unavailable(e))?
            .await
            .map_err(|e| self.unavailable(e))?;
        Ok(Position::from_raw(ack.sequence))
    }

    async fn read(
        &self,
        channel: &str,
        after: Position,
        max: usize,
        wait: Duration,
    ) -> LogResult<Vec<Message>> {
        check_channel(channel)?;
        let max = max.max(1);
        let deadline = tokio::time::Instant::now() + wait;
        let subject = self.subject(channel);
        // Subscribed before looking, so an append in between still wakes us.
        let mut appended = if wait.is_zero() {
            None
        } else {
            Some(
                self.js
                    .client()
                    .subscribe(subject.clone())
                    .await
                    .map_err(|e| self.unavailable(e))?,
            )
        };
        let batch = self.read_stored(channel, &subject, after, max).await?;
        let Some(subscriber) = appended.as_mut().filter(|_| batch.is_empty()) else {
            return Ok(batch);
        };
        // Nothing yet: wait for the channel's next publish (the server keeps nothing for us
        // but the subscription), then read it.
        match tokio::time::timeout_at(deadline, subscriber.next()).await {
            Ok(Some(_)) => {}
            Ok(None) => return Err(self.unavailable("the connection closed")),
            Err(_) => return Ok(Vec::new()),
        }
        drop(appended);
        // A core subscriber can see a message a moment before JetStream has stored it.
        loop {
            let batch = self.read_stored(channel, &subject, after, max).await?;
            if !batch.is_empty() || tokio::time::Instant::now() >= deadline {
                return Ok(batch);
            }
            tokio::time::sleep(STORE_LAG_POLL).await;
        }
    }

    async fn end(&self, channel: &str) -> LogResult<Position> {
        check_channel(channel)?;
        match self
            .stream
            .get_last_raw_message_by_subject(&self.subject(channel))
            .await
        {
            Ok(message) => Ok(Position::from_raw(message.sequence)),
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => {
                Ok(Position::START)
            }
            Err(e) => Err(self.unavailable(e)),
        }
    }
}

/// The subject of `channel` under `prefix`: `{prefix}.{channel}`, each `.` of the channel
/// written `~` (a valid channel name has no `~`), so the channel is one subject token.
fn subject(prefix: &str, channel: &str) -> String {
    format!("{prefix}.{}", channel.replace('.', "~"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_in_channel_names_stay_one_subject_token() {
        let config = NatsConfig::new("nats://127.0.0.1:4222", "CW");
        assert!(check_names(&config).is_ok());
        let of = |c: &str| subject(&config.subject_prefix, c);
        assert_eq!(of("orders-0"), "CW.orders-0");
        assert_eq!(of("a.b"), "CW.a~b");
        assert_ne!(of(".."), of("."));
        // One token after the prefix: no `.` left in the channel's part.
        for c in ["a.b.c", "..", "x.", ".y"] {
            let s = of(c);
            assert_eq!(s.split('.').count(), 2, "{c:?} → {s:?}");
        }
    }

    #[test]
    fn stream_names_nats_refuses_are_bad_configuration() {
        for stream in ["", "a.b", "a b", "a*"] {
            let config = NatsConfig::new("nats://x:1", stream);
            assert!(
                matches!(check_names(&config), Err(LogError::BadUrl { .. })),
                "{stream:?}"
            );
        }
    }
}
