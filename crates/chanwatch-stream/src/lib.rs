//! # chanwatch-stream
//!
//! The data plane's log: one narrow trait, [`Log`] — append a message to a channel, read the
//! channel from a position, wait for more, ask where the channel ends — with two backends:
//!
//! * [`FileLog`] — the **embedded log**: one append-only file per channel under a data dir, no
//!   server (the default for `standalone` and `demo`);
//! * [`NatsLog`] — **NATS JetStream** through `async-nats`: one stream per root, one subject
//!   per channel.
//!
//! This crate owns: the [`Log`] vocabulary ([`Position`], [`Message`], channel names), the
//! error type ([`LogError`]) and the two backends. It must not know etcd, chanwatch's keys,
//! assignments or checkpoints: a consumer handler (elsewhere) stores the [`Position`] it
//! reached, as a string, in its fenced checkpoint.
//!
//! ## Positions
//!
//! A [`Position`] names one message of one channel. Positions of a channel only grow in the
//! order messages were appended; [`Position::START`] (0) is "before the first message" and no
//! message has it. They are opaque otherwise: do not do arithmetic on them (a NATS channel's
//! positions have gaps), and do not carry one from one backend, stream or data dir to another.
//! `Display` / `FromStr` round-trip a position through its decimal string, the form a
//! checkpoint stores.
//!
//! | backend | a message's position |
//! |---|---|
//! | [`FileLog`] | its 1-based index in the channel's file: 1, 2, 3, … with no gaps |
//! | [`NatsLog`] | its JetStream **stream** sequence: one counter for every channel of the stream, so a channel's positions grow with gaps (the other channels' messages) |
//!
//! Both survive a restart (of the process, or of nats-server with the same store dir).
//!
//! ## Reading, and resuming from a checkpoint
//!
//! [`Log::read`] is **exclusive**: `read(channel, after, max, wait)` returns the messages
//! whose position is *greater than* `after`, oldest first, at most `max`. So a consumer
//! resumes from its committed position as it is — the position of the last message it
//! applied — and never sees that message again:
//!
//! ```no_run
//! # async fn consume(log: &dyn chanwatch_stream::Log, committed: Option<&str>) -> Result<(), chanwatch_stream::LogError> {
//! use std::time::Duration;
//! use chanwatch_stream::Position;
//! // No checkpoint yet: start before the first message.
//! let mut at: Position = committed.map(str::parse).transpose()?.unwrap_or(Position::START);
//! loop {
//!     let batch = log.read("orders-0", at, 256, Duration::from_secs(1)).await?;
//!     for message in &batch {
//!         // apply message.payload to the state …
//!         at = message.position;
//!     }
//!     // … and now and then commit (at.to_string(), state) in one fenced txn.
//! #   break;
//! }
//! # Ok(()) }
//! ```
//!
//! ## What "wait for more" guarantees
//!
//! `read` returns as soon as at least one message after `after` exists (with every message
//! already there, up to `max`); if none exists it waits up to `wait` and returns an empty
//! batch when it runs out. `wait` = 0 never waits. An append in the same process wakes a
//! waiting reader at once; on the file log an append by another process (a producer) is seen
//! within [`FileLogOptions::poll_interval`]; on NATS a waiting reader holds a subscription to
//! the channel's subject and is woken by the publish itself. An empty
//! batch means only "nothing yet", never "the end": channels have no end, [`Log::end`] is the
//! last position appended so far.
//!
//! One reader per channel per log handle reads on fastest: the NATS backend keeps a cursor
//! (a server-side consumer) per channel where the last read ended; reads of one channel from
//! two places at once through one handle work but make new cursors.
//!
//! ## What every implementation guarantees
//!
//! The conformance suite (`tests/it/suite.rs`, each case run as `file::<case>` and
//! `nats::<case>` against a real nats-server) proves each line on both backends:
//!
//! | guarantee | proven by |
//! |---|---|
//! | `append` returns positions that grow; `read` returns a channel's messages in append order with those positions, payloads intact, at most `max`. | `appended_messages_read_back_in_order` |
//! | Reading after a middle position returns exactly the messages after it. | `reading_after_a_middle_position_skips_what_came_before` |
//! | `end` is the last appended position (`START` for an empty channel). | `end_is_the_last_appended_position` |
//! | A waiting read wakes on an append, and a read with nothing new returns empty after its wait. | `a_waiting_read_wakes_on_append`, `a_read_with_nothing_new_returns_empty_after_its_wait` |
//! | Channels are independent: messages, positions order and ends do not mix. | `channels_are_independent` |
//! | Messages and positions survive a restart (reopened dir; nats-server restarted on its store dir). | `positions_survive_a_restart` |
//! | Bad channel names are refused with `BadChannel`; oversized messages with `TooLarge`. | `bad_names_and_oversized_messages_are_refused` |
//! | A reader following a channel while another task appends gets every message once, in order. | `a_reader_following_concurrent_appends_misses_nothing` |
//!
//! And per backend:
//!
//! | guarantee | proven by |
//! |---|---|
//! | File log: a torn or zero-filled last record is no message, and the next append cuts it off; damage before the last record is `Corrupt` for reads and appends. | `recovery::a_torn_last_record_is_skipped_then_cut_off_by_the_next_append`, `recovery::a_zero_filled_tail_is_torn_not_corrupt`, `recovery::damage_before_the_last_record_is_corrupt_never_skipped` |
//! | File log: a waiting reader in another process sees an append within the poll interval. | `recovery::a_reader_in_another_process_sees_appends_within_the_poll_interval` |
//! | NATS: while the server is down every call is `Unavailable` (retryable); the same client works again once it is back, with every acked message. | `outage::a_nats_log_fails_retryably_while_the_server_is_down_and_recovers_by_itself` |
//! | [`open`]: `file:DIR` and `nats://…` open their backend; other URLs are `BadUrl` (fatal), an unreachable server `Unavailable`. | `open::a_log_url_opens_its_backend_and_a_bad_one_says_what_is_expected` |
//!
//! ## What a retried append can do
//!
//! An append that failed as `Unavailable` may still have been stored (the ack was lost, or
//! the client sent it after reconnecting), so retrying it can store the message twice, at
//! two positions. A producer that must not duplicate puts a sequence number in its payloads
//! and a consumer skips what it has seen; neither backend de-duplicates.

pub mod error;
pub mod file;
pub mod nats;
mod record;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;

pub use error::{LogError, LogResult};
pub use file::{FileLog, FileLogOptions, FsyncPolicy};
pub use nats::{NatsConfig, NatsLog};

/// The largest payload one message may carry: 1 MiB, NATS's default `max_payload`, on both
/// backends so a producer behaves the same on each.
pub const MAX_MESSAGE_BYTES: usize = 1024 * 1024;

/// Where a message sits in its channel. See the crate docs ("Positions") for what it is on
/// each backend; callers only compare, store and parse it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Position(u64);

impl Position {
    /// Before the first message of every channel: reading after it reads from the start.
    pub const START: Position = Position(0);

    /// The position with this raw value (the decimal form of `Display`). For backends and
    /// tests; consumers parse the string they stored.
    pub const fn from_raw(raw: u64) -> Self {
        Position(raw)
    }

    /// The raw value.
    pub const fn raw(self) -> u64 {
        self.0
    }
}

impl fmt::Display for Position {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for Position {
    type Err = LogError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse::<u64>()
            .map(Position)
            .map_err(|_| LogError::BadPosition(s.to_owned()))
    }
}

/// One message read from a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Where it sits; the next read after it starts here.
    pub position: Position,
    /// The bytes appended.
    pub payload: Bytes,
}

/// A channel's messages as an append-only log. Object-safe: runtimes hold an
/// `Arc<dyn Log>`. Every method validates the channel name first (see [`check_channel`]).
#[async_trait]
pub trait Log: Send + Sync + 'static {
    /// Appends `payload` to `channel` and returns its position once it is stored (see each
    /// backend for what "stored" means: the file log's [`FsyncPolicy`], JetStream's ack).
    ///
    /// # Errors
    /// [`LogError::BadChannel`], [`LogError::TooLarge`] (fatal for that call);
    /// [`LogError::Unavailable`] / [`LogError::Io`] (retryable; a retried append may store the
    /// message twice if the first one landed unseen).
    async fn append(&self, channel: &str, payload: Bytes) -> LogResult<Position>;

    /// The messages of `channel` after `after` (exclusive), oldest first, at most `max`
    /// (`max` = 0 reads one). Returns at once when there is at least one; otherwise waits up
    /// to `wait` for one and returns an empty batch when none came.
    ///
    /// # Errors
    /// [`LogError::BadChannel`] (fatal); [`LogError::Corrupt`] (fatal, the file needs an
    /// operator); [`LogError::Unavailable`] / [`LogError::Io`] (retryable).
    async fn read(
        &self,
        channel: &str,
        after: Position,
        max: usize,
        wait: Duration,
    ) -> LogResult<Vec<Message>>;

    /// The position of the last message appended to `channel` so far, or
    /// [`Position::START`] when it has none.
    ///
    /// # Errors
    /// As [`Log::read`].
    async fn end(&self, channel: &str) -> LogResult<Position>;
}

/// Opens the log a URL names: `file:DIR` (a [`FileLog`] with default options; the dir is
/// created) or `nats://HOST:PORT[,nats://…]` (a [`NatsLog`] on the JetStream stream
/// `stream`, subjects `{stream}.{channel}`).
///
/// # Errors
/// [`LogError::BadUrl`] for any other URL or an invalid stream name;
/// [`LogError::Unavailable`] when the server cannot be reached (retryable); [`LogError::Io`]
/// when the dir cannot be made.
pub async fn open(url: &str, stream: &str) -> LogResult<Arc<dyn Log>> {
    if let Some(dir) = url.strip_prefix("file:") {
        if dir.is_empty() {
            return Err(LogError::BadUrl {
                url: url.to_owned(),
                reason: "file: needs a directory, e.g. file:/var/lib/chanwatch/log".to_owned(),
            });
        }
        return Ok(Arc::new(FileLog::open(dir, FileLogOptions::default())?));
    }
    if url.starts_with("nats://") {
        let log = NatsLog::connect(NatsConfig::new(url, stream)).await?;
        return Ok(Arc::new(log));
    }
    Err(LogError::BadUrl {
        url: url.to_owned(),
        reason: "expected file:DIR or nats://HOST:PORT".to_owned(),
    })
}

/// Checks a channel name against chanwatch's rules: 1–255 bytes of `[A-Za-z0-9._-]`.
///
/// # Errors
/// [`LogError::BadChannel`] naming the rule broken.
pub fn check_channel(name: &str) -> LogResult<()> {
    let bad = |reason: String| {
        Err(LogError::BadChannel {
            name: name.to_owned(),
            reason,
        })
    };
    if name.is_empty() || name.len() > 255 {
        return bad(format!("is {} bytes; 1 to 255 are allowed", name.len()));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return bad(format!("holds {c:?}; only [A-Za-z0-9._-] are allowed"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_round_trip_through_their_string() {
        for raw in [0, 1, 42, u64::MAX] {
            let p = Position::from_raw(raw);
            assert_eq!(p.to_string().parse::<Position>().ok(), Some(p));
        }
        assert!(matches!(
            "x1".parse::<Position>(),
            Err(LogError::BadPosition(_))
        ));
        assert!(Position::START < Position::from_raw(1));
    }

    #[test]
    fn channel_names_follow_the_control_planes_rules() {
        for ok in ["a", "orders-0", "a.b_c-D9", ".", "..", &"x".repeat(255)] {
            assert!(check_channel(ok).is_ok(), "{ok}");
        }
        for bad in ["", "a/b", "a b", "a*", "a>", "ü", &"x".repeat(256)] {
            assert!(
                matches!(check_channel(bad), Err(LogError::BadChannel { .. })),
                "{bad}"
            );
        }
    }
}
