//! The one error type of the log layer.
//!
//! Owns: [`LogError`], what each failure means and whether retrying helps
//! ([`LogError::is_retryable`]). Must not: name etcd or chanwatch keys. Callers branch on the
//! variant, never on message text.

use std::path::PathBuf;

use thiserror::Error;

/// What went wrong with a [`crate::Log`] call.
#[derive(Debug, Error)]
pub enum LogError {
    /// The log server could not be reached or did not answer in time. Retryable with
    /// back-off.
    #[error("log unavailable at {at}: {message}; check that nats-server -js is running and reachable, retrying")]
    Unavailable {
        /// The server URL.
        at: String,
        /// What the client said.
        message: String,
    },
    /// Reading or writing a log file failed (disk full, permissions, a vanished dir).
    /// Retryable once the disk is fixed: a failed append left nothing behind.
    #[error("log file {path}: {source}; check the disk and the data dir's permissions")]
    Io {
        /// The file or dir.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A channel name breaks the rules (1–255 bytes of `[A-Za-z0-9._-]`). Fatal for that
    /// call: fix the name.
    #[error("channel name {name:?} {reason}")]
    BadChannel {
        /// The name given.
        name: String,
        /// The rule it broke.
        reason: String,
    },
    /// A log URL or backend setting that cannot work. Fatal: fix the configuration.
    #[error("bad log URL {url:?}: {reason}")]
    BadUrl {
        /// The URL (or setting) given.
        url: String,
        /// Why it cannot work and what is expected.
        reason: String,
    },
    /// A position string that is not a position (not a decimal u64). Fatal: the stored
    /// value was not written by this crate.
    #[error(
        "{0:?} is not a log position (expected a decimal number, as Position's Display writes)"
    )]
    BadPosition(String),
    /// A message larger than [`crate::MAX_MESSAGE_BYTES`]. Fatal for that message: split it.
    #[error("message is {bytes} bytes; the limit is {max}; split it")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The limit.
        max: usize,
    },
    /// A channel file holds a damaged record *before* its end (a torn last record is not
    /// this: it is cut off on the next append). Fatal: restore the file from a copy, or cut
    /// it at `offset` (losing every later message) with `truncate -s OFFSET FILE`.
    #[error("log file {path} is damaged at byte {offset}: {reason}; restore it, or truncate it there (later messages are lost)")]
    Corrupt {
        /// The channel file.
        path: PathBuf,
        /// Where the damaged record starts.
        offset: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// The server refused the request for a reason retrying will not fix (e.g. the stream
    /// exists with other subjects). Fatal: fix the server or the configuration.
    #[error("the log server refused: {0}")]
    Refused(String),
}

impl LogError {
    /// Whether the same call may succeed later without a change of configuration.
    pub fn is_retryable(&self) -> bool {
        matches!(self, LogError::Unavailable { .. } | LogError::Io { .. })
    }
}

/// Result of a [`crate::Log`] call.
pub type LogResult<T> = Result<T, LogError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transport_and_disk_failures_are_retryable() {
        let unavailable = LogError::Unavailable {
            at: "nats://x".into(),
            message: "timed out".into(),
        };
        assert!(unavailable.is_retryable());
        assert!(!LogError::TooLarge { bytes: 2, max: 1 }.is_retryable());
        assert!(!LogError::BadChannel {
            name: "a/b".into(),
            reason: "r".into()
        }
        .is_retryable());
        assert!(!LogError::Refused("no".into()).is_retryable());
    }
}
