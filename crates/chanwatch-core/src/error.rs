//! Errors of the core crate: bad names, bad keys, values that do not decode.
//!
//! All of them are fatal for the input that caused them (retrying the same bytes gives the
//! same error) and never for the process: a caller reports and skips the offending input.

use thiserror::Error;

/// A channel name that breaks the rules of DESIGN.md §2.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum NameError {
    /// The name is empty.
    #[error("channel name is empty; use 1-255 characters from [A-Za-z0-9._-]")]
    Empty,
    /// The name is longer than 255 bytes.
    #[error("channel name is {len} bytes long; the limit is 255")]
    TooLong {
        /// Length of the refused name in bytes.
        len: usize,
    },
    /// The name holds a character outside `[A-Za-z0-9._-]`.
    #[error("channel name {name:?} holds {ch:?} at byte {at}; only [A-Za-z0-9._-] are allowed")]
    BadChar {
        /// The refused name (lossy for display).
        name: String,
        /// The first offending character.
        ch: char,
        /// Its byte offset.
        at: usize,
    },
    /// The name is reserved by the key layout.
    #[error("channel name {0:?} is reserved; pick another name")]
    Reserved(String),
}

/// A store key that does not fit the layout of DESIGN.md §2.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KeyError {
    /// The key is not under the expected prefix.
    #[error("key {key:?} is not under {prefix:?}")]
    WrongPrefix {
        /// The key that was parsed.
        key: String,
        /// The prefix it should have had.
        prefix: String,
    },
    /// The key has the prefix but not the expected shape.
    #[error("key {key:?} is malformed: {why}")]
    Malformed {
        /// The key that was parsed.
        key: String,
        /// What is wrong with it.
        why: String,
    },
}

/// A stored value that does not decode.
#[derive(Debug, Error)]
pub enum DecodeError {
    /// Not valid JSON for the expected type.
    #[error("value does not decode as {what}: {source}")]
    Json {
        /// What the value was supposed to be.
        what: &'static str,
        /// The JSON error.
        #[source]
        source: serde_json::Error,
    },
    /// Valid JSON with a version this build does not understand.
    #[error(
        "{what} has version v={found}; this build understands v={supported}; upgrade chanwatch"
    )]
    Version {
        /// What the value was supposed to be.
        what: &'static str,
        /// The version found.
        found: u64,
        /// The version this build writes.
        supported: u64,
    },
    /// A field breaks a rule (bad channel name, oversized vchannel info, ...).
    #[error("{what} is invalid: {why}")]
    Invalid {
        /// What the value was supposed to be.
        what: &'static str,
        /// The rule it breaks.
        why: String,
    },
    /// A number that should be decimal is not (the node ID counter).
    #[error("value {value:?} is not a decimal node id")]
    NotDecimal {
        /// The offending value, lossy.
        value: String,
    },
}
