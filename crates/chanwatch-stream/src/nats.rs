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
//!   something after `p`, it creates an ephemeral pull consumer filtered on the channel's
//!   subject, delivering from stream sequence `p + 1` with no acks and its state in memory,
//!   pulls up to `max` (returning once the consumer has nothing pending), then deletes it.
//!   When there is nothing and the read may wait, it waits on a plain (core NATS)
//!   subscription to the subject, taken before the end was read, so an append in between
//!   is not missed; the server keeps no consumer for an idle reader. A read needs no state
//!   between calls, and a read that returns messages costs about three round trips more
//!   than a long-lived consumer would (no consumer is cached per channel yet).
//! * **end** is the sequence of the channel subject's last message (a direct "last by
//!   subject" get), or [`Position::START`] when it has none.
//! * While the server is away, calls fail with [`LogError::Unavailable`] after the request
//!   timeout; the client reconnects on its own.

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
}

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
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(config.request_timeout)
            .request_timeout(Some(config.request_timeout))
            .connect(config.url.as_str())
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
        Ok(NatsLog { config, js, stream })
    }

    /// The subject of `channel` (a valid name): `{prefix}.{channel}`, `.` written `~`.
    pub fn subject(&self, channel: &str) -> String {
        format!(
            "{}.{}",
            self.config.subject_prefix,
            channel.replace('.', "~")
        )
    }

    fn unavailable(&self, e: impl std::fmt::Display) -> LogError {
        unavailable(&self.config.url, e)
    }

    /// Reads up to `max` messages of `subject` after `after` through a short-lived consumer;
    /// `expires` bounds the wait for the first one.
    async fn read_stored(
        &self,
        subject: String,
        after: Position,
        max: usize,
        expires: Duration,
    ) -> LogResult<Vec<Message>> {
        let consumer = self
            .stream
            .create_consumer(consumer::pull::Config {
                filter_subject: subject,
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: after.raw() + 1,
                },
                ack_policy: consumer::AckPolicy::None,
                memory_storage: true,
                // Removed by the server if this call dies before deleting it.
                inactive_threshold: expires + Duration::from_secs(30),
                ..Default::default()
            })
            .await
            .map_err(|e| self.unavailable(e))?;
        let name = consumer.cached_info().name.clone();
        let result = pull(&consumer, max, expires)
            .await
            .map_err(|e| self.unavailable(e));
        // The consumer holds server memory until it is deleted or inactive; do not wait.
        let stream = self.stream.clone();
        tokio::spawn(async move {
            let _ = stream.delete_consumer(&name).await;
        });
        result
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
        let deadline = tokio::time::Instant::now() + wait;
        let subject = self.subject(channel);
        // Subscribed before looking at the end, so an append in between still wakes us.
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
        let mut expires = self.config.request_timeout;
        if self.end(channel).await? <= after {
            let Some(subscriber) = appended.as_mut() else {
                return Ok(Vec::new());
            };
            // Nothing yet: wait for the channel's next publish (no server state but the
            // subscription), then pull it through a consumer.
            match tokio::time::timeout_at(deadline, subscriber.next()).await {
                Ok(Some(_)) => {}
                Ok(None) => return Err(self.unavailable("the connection closed")),
                Err(_) => return Ok(Vec::new()),
            }
            // A core subscriber can see the message a moment before JetStream stored it.
            expires = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .max(Duration::from_millis(200));
        }
        drop(appended);
        self.read_stored(subject, after, max.max(1), expires).await
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

/// Pulls up to `max` messages, returning after the first one once the consumer reports
/// nothing more pending (or the request expires).
async fn pull(
    consumer: &consumer::Consumer<consumer::pull::Config>,
    max: usize,
    expires: Duration,
) -> Result<Vec<Message>, async_nats::Error> {
    let mut messages = consumer
        .batch()
        .max_messages(max)
        .expires(expires)
        .messages()
        .await?;
    let mut out = Vec::new();
    while let Some(message) = messages.next().await {
        let message = message?;
        let info = message.info()?;
        let (sequence, pending) = (info.stream_sequence, info.pending);
        out.push(Message {
            position: Position::from_raw(sequence),
            payload: message.message.payload.clone(),
        });
        if pending == 0 || out.len() >= max {
            break;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_in_channel_names_stay_one_subject_token() {
        let config = NatsConfig::new("nats://127.0.0.1:4222", "CW");
        assert!(check_names(&config).is_ok());
        let subject = |c: &str| format!("{}.{}", config.subject_prefix, c.replace('.', "~"));
        assert_eq!(subject("orders-0"), "CW.orders-0");
        assert_eq!(subject("a.b"), "CW.a~b");
        assert_ne!(subject(".."), subject("."));
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
