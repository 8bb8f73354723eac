//! Domain types of DESIGN.md §2 and their JSON encoding.
//!
//! Owns: identifiers (`NodeId`, `Epoch`, `ChannelName`), channel values (`ChannelInfo`,
//! `VChannelInfo`, `Progress`), session values (`NodeSession`, `CoordSession`) and
//! `Checkpoint`. Every value type keeps unknown JSON fields in `extra` so that a newer writer's
//! fields survive a read-modify-write by an older reader.
//!
//! Must not: know where values are stored (that is [`crate::keys`]) or decide transitions.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::error::{DecodeError, NameError};

/// Version written in the `v` field of [`ChannelInfo`]. A reader refuses a larger one rather
/// than guess at its meaning.
pub const CHANNEL_INFO_VERSION: u64 = 1;

/// Cap on the encoded size of [`VChannelInfo`]: 128 moves of this size stay under etcd's
/// request limit only if each is small, and Milvus once built a 3.4 MB txn from channel info.
pub const MAX_VCHANNEL_BYTES: usize = 64 * 1024;

/// Longest allowed channel name in bytes.
pub const MAX_CHANNEL_NAME_BYTES: usize = 255;

/// Fields of a [`ChannelInfo`] the coordinator sets; a registration (one channel or a bulk
/// list) may not give them.
pub const COORDINATOR_FIELDS: [&str; 8] = [
    "v",
    "channel",
    "state",
    "epoch",
    "start_time_ms",
    "reason",
    "progress",
    "round",
];

/// Most bytes, encoded, of a registered channel's fields besides `name` and `vchannel`
/// (`weight`, `group`, and fields this build does not know, kept verbatim).
pub const MAX_CHANNEL_EXTRA_BYTES: usize = 4 * 1024;

/// A node's identity. Handed out once from the `{root}/id/node` counter (or from the counter of
/// the ID block reserved for the node's name, [`crate::idblock`]) and never reused, so a
/// restarted node always starts with an empty prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for NodeId {
    type Err = DecodeError;

    /// Parses the decimal form used in keys and in the ID counter. Leading zeros and signs are
    /// refused so that each ID has exactly one key.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let canonical = !s.is_empty()
            && s.bytes().all(|b| b.is_ascii_digit())
            && (s == "0" || !s.starts_with('0'));
        match (canonical, s.parse::<u64>()) {
            (true, Ok(n)) => Ok(NodeId(n)),
            _ => Err(DecodeError::NotDecimal {
                value: s.chars().take(64).collect(),
            }),
        }
    }
}

/// The assignment generation of one channel. Grows by one on every (re)assignment; checkpoints
/// and acknowledgements carrying a smaller epoch are stale and refused.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl Epoch {
    /// The epoch that follows this one.
    #[must_use]
    pub fn next(self) -> Epoch {
        Epoch(self.0.saturating_add(1))
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A validated channel name: 1-255 bytes of `[A-Za-z0-9._-]`, not a reserved word.
///
/// The character set keeps names safe as a single key segment (no `/`) and in URLs.
///
/// Shared, not copied: a name is held by the coordinator's map, its value, its attention
/// and cool-down entries and every change a round plans for it, and a clone is a reference
/// count (a `String` clone per copy was ~5 allocations of a 1,000-channel failover round's
/// ~10 per channel).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChannelName(Arc<str>);

impl ChannelName {
    /// Validates and wraps a name.
    ///
    /// # Errors
    /// [`NameError`] saying which rule the name breaks.
    pub fn new(name: impl AsRef<str>) -> Result<Self, NameError> {
        let name = name.as_ref();
        if name.is_empty() {
            return Err(NameError::Empty);
        }
        if name.len() > MAX_CHANNEL_NAME_BYTES {
            return Err(NameError::TooLong { len: name.len() });
        }
        if let Some((at, ch)) = name
            .char_indices()
            .find(|&(_, c)| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
        {
            return Err(NameError::BadChar {
                name: name.to_owned(),
                ch,
                at,
            });
        }
        // "." and ".." would be path-like segments in URLs of the admin API.
        if name == "." || name == ".." {
            return Err(NameError::Reserved(name.to_owned()));
        }
        Ok(ChannelName(Arc::from(name)))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ChannelName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for ChannelName {
    type Err = NameError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        ChannelName::new(s)
    }
}

impl Serialize for ChannelName {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ChannelName {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        // Validated from the input's own bytes: the only copy is the shared one.
        struct Name;
        impl serde::de::Visitor<'_> for Name {
            type Value = ChannelName;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a channel name")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ChannelName, E> {
                ChannelName::new(v).map_err(E::custom)
            }
        }
        d.deserialize_str(Name)
    }
}

/// Where a channel is in its assignment lifecycle (DESIGN.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ChannelState {
    /// Assigned to a node, which has not yet acknowledged it.
    ToWatch,
    /// The node runs the channel.
    Watched,
    /// The node tried and failed to load the channel; the coordinator will reassign it.
    WatchFailed,
    /// The coordinator asked the node to stop the channel before a move.
    ToRelease,
    /// The node stopped the channel; the coordinator may now move it.
    Released,
}

impl ChannelState {
    /// All states, in lifecycle order.
    pub const ALL: [ChannelState; 5] = [
        ChannelState::ToWatch,
        ChannelState::Watched,
        ChannelState::WatchFailed,
        ChannelState::ToRelease,
        ChannelState::Released,
    ];

    /// The name used in JSON and in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ChannelState::ToWatch => "ToWatch",
            ChannelState::Watched => "Watched",
            ChannelState::WatchFailed => "WatchFailed",
            ChannelState::ToRelease => "ToRelease",
            ChannelState::Released => "Released",
        }
    }
}

impl fmt::Display for ChannelState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Load progress a node writes into the value while a load runs; the watch timeout counts from
/// `updated_at_ms`, so a slow but live load is never churned.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// 0-100.
    pub percent: u8,
    /// Unix milliseconds of the node's clock when it wrote this.
    pub updated_at_ms: u64,
}

/// What a node needs to restore a channel: the stream position to seek to and the segments it
/// owns. Opaque to chanwatch apart from its size cap.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct VChannelInfo {
    /// The collection this channel belongs to.
    #[serde(default)]
    pub collection_id: u64,
    /// Where to resume consuming (opaque to chanwatch, e.g. an encoded message ID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seek_position: Option<String>,
    /// Segments that still receive data.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unflushed_segment_ids: Vec<i64>,
    /// Segments already flushed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub flushed_segment_ids: Vec<i64>,
    /// Free-form metadata for the channel handler.
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub metadata: Map<String, Value>,
    /// Fields this build does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl VChannelInfo {
    /// Parses user-supplied vchannel JSON (from `ctl add-channel --vchannel` or the API) and
    /// checks its size cap.
    ///
    /// # Errors
    /// [`DecodeError::Json`] for bad JSON, [`DecodeError::Invalid`] when over 64 KiB.
    pub fn from_json(bytes: &[u8]) -> Result<Self, DecodeError> {
        let info: VChannelInfo =
            serde_json::from_slice(bytes).map_err(|source| DecodeError::Json {
                what: "vchannel info",
                source,
            })?;
        info.check_size()?;
        Ok(info)
    }

    /// Checks the 64 KiB cap on the encoded form.
    ///
    /// # Errors
    /// [`DecodeError::Invalid`] naming the size and the cap.
    pub fn check_size(&self) -> Result<(), DecodeError> {
        let len = encoded_len(self);
        if len > MAX_VCHANNEL_BYTES {
            return Err(DecodeError::Invalid {
                what: "vchannel info",
                why: format!(
                    "it is {len} bytes encoded; the limit is {MAX_VCHANNEL_BYTES} bytes \
                     (keep large state outside chanwatch and store a reference)"
                ),
            });
        }
        Ok(())
    }
}

/// The value of `{root}/channel/{id}/{channel}` and `{root}/channel/remaining/{channel}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChannelInfo {
    /// Format version, [`CHANNEL_INFO_VERSION`].
    pub v: u64,
    /// The channel this value describes; must match the key.
    pub channel: ChannelName,
    /// Lifecycle state.
    pub state: ChannelState,
    /// Assignment generation.
    pub epoch: Epoch,
    /// Unix milliseconds when this assignment (this epoch) began; timeouts resume from it after
    /// a coordinator failover.
    pub start_time_ms: u64,
    /// What the node needs to restore the channel.
    #[serde(default)]
    pub vchannel: VChannelInfo,
    /// Why the channel is in this state (e.g. the load error of `WatchFailed`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Load progress, written by the node while a load runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<Progress>,
    /// The channel's relative load (DESIGN §5); absent means 1, and 0 counts as 1.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub weight: u32,
    /// A group (e.g. the collection) whose channels placement spreads across nodes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    /// Balance never moves a pinned channel (drains, failovers and manual moves still do).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub pinned: bool,
    /// Set by the coordinator on a `ToWatch` put when one plan round puts several channels on
    /// the same node, so that the node can acknowledge them in one write (DESIGN §2). A node
    /// takes it off what it keeps: no ack carries it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub round: Option<RoundHint>,
    /// Fields this build does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// "This put is one of `puts` that plan round `id` writes to this node" (DESIGN §2): the
/// coordinator's moves of a failover travel in many txns, and a node that acknowledged each
/// batch its watch showed wrote two or three ack txns where one would do, each queueing in
/// etcd behind the moves still in flight.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct RoundHint {
    /// The round, unique among one leader's rounds.
    pub id: u64,
    /// How many `ToWatch` puts the round writes to this node.
    pub puts: u32,
}

fn one() -> u32 {
    1
}

fn is_one(w: &u32) -> bool {
    *w == 1
}

/// Largest channel weight accepted from an operator: loads stay exact in integer arithmetic.
pub const MAX_CHANNEL_WEIGHT: u32 = 1_000_000;

/// Longest channel group name in bytes.
pub const MAX_GROUP_BYTES: usize = 255;

impl ChannelInfo {
    /// The weight placement counts: [`ChannelInfo::weight`], with 0 read as 1.
    pub fn load_weight(&self) -> u64 {
        u64::from(self.weight.max(1))
    }

    /// A fresh assignment in `ToWatch`.
    pub fn new(
        channel: ChannelName,
        epoch: Epoch,
        start_time_ms: u64,
        vchannel: VChannelInfo,
    ) -> Self {
        ChannelInfo {
            v: CHANNEL_INFO_VERSION,
            channel,
            state: ChannelState::ToWatch,
            epoch,
            start_time_ms,
            vchannel,
            reason: None,
            progress: None,
            weight: 1,
            group: None,
            pinned: false,
            round: None,
            extra: Map::new(),
        }
    }

    /// Encodes to the JSON stored in the key.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }

    /// The length of [`ChannelInfo::encode`]'s bytes, without making them.
    pub fn encoded_len(&self) -> usize {
        encoded_len(self)
    }

    /// Decodes and validates a stored value.
    ///
    /// # Errors
    /// [`DecodeError`] for bad JSON, an unknown future version, a bad channel name or an
    /// oversized vchannel. Never panics, whatever the bytes.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        let info: ChannelInfo = decode(bytes, "channel info")?;
        if info.v > CHANNEL_INFO_VERSION || info.v == 0 {
            return Err(DecodeError::Version {
                what: "channel info",
                found: info.v,
                supported: CHANNEL_INFO_VERSION,
            });
        }
        info.vchannel.check_size()?;
        Ok(info)
    }
}

/// The session field a leaving node sets ([`NodeSession::leaving`]).
const LEAVING: &str = "leaving";

/// The value of `{root}/session/node/{id}`, attached to the node's lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeSession {
    /// The node's ID (also in the key).
    pub id: NodeId,
    /// Where the node's admin HTTP listens, if anywhere.
    #[serde(default)]
    pub admin_addr: String,
    /// chanwatch version of the node.
    #[serde(default)]
    pub version: String,
    /// Unix milliseconds when the session began.
    pub started_at_ms: u64,
    /// Relative capacity for weighted assignment (`--capacity`); 0 means the default, 1.
    /// A node's load is its channels' weights over this (DESIGN §5).
    #[serde(default)]
    pub capacity: u32,
    /// The node's stable name (`node --name`, default the host name): what operators and
    /// metrics know it by, unlike the ID, which changes with every session. Empty when unset.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Fields this build does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl NodeSession {
    /// The capacity placement divides by: [`NodeSession::capacity`], with 0 read as 1.
    pub fn load_capacity(&self) -> u64 {
        u64::from(self.capacity.max(1))
    }

    /// Encodes to JSON.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }
    /// Decodes a stored value.
    ///
    /// # Errors
    /// [`DecodeError::Json`] when the bytes are not a node session.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        decode(bytes, "node session")
    }

    /// Whether the node announced it is leaving (a planned restart, DESIGN §5): the
    /// coordinator drains it and assigns nothing new to it. Kept as `"leaving": true` among
    /// the session's fields ([`NodeSession::extra`]), absent while the node is not leaving.
    pub fn leaving(&self) -> bool {
        self.extra.get(LEAVING).and_then(Value::as_bool) == Some(true)
    }

    /// Marks the session as leaving (or not).
    pub fn set_leaving(&mut self, leaving: bool) {
        if leaving {
            self.extra.insert(LEAVING.to_owned(), Value::Bool(true));
        } else {
            self.extra.remove(LEAVING);
        }
    }
}

/// The value of `{root}/coord/leader`, attached to the leader's lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CoordSession {
    /// A unique ID of the coordinator process (for logs and `ctl`).
    pub id: String,
    /// Where the leader's admin API listens; `ctl` sends writes there.
    pub admin_addr: String,
    /// Unix milliseconds when this coordinator started.
    pub started_at_ms: u64,
    /// Fields this build does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl CoordSession {
    /// Encodes to JSON.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }
    /// Decodes a stored value.
    ///
    /// # Errors
    /// [`DecodeError::Json`] when the bytes are not a coordinator session.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        decode(bytes, "coordinator session")
    }
}

/// The value of `{root}/worker/checkpoint/{channel}`: how far the owner has consumed, and the
/// handler's small state as of that position (written together, so a state is exactly the
/// fold of the messages up to the position). Written only by the owning node's fenced txn
/// (DESIGN §4: it compares the assignment key's create revision, the session and the
/// checkpoint's own mod revision), deleted by the coordinator with the channel.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// The epoch of the assignment under which this was written.
    pub epoch: Epoch,
    /// Opaque stream position.
    pub position: String,
    /// The handler's state as of `position` (at most [`Checkpoint::MAX_STATE_BYTES`] encoded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<Value>,
    /// Unix milliseconds of the writer's clock.
    pub updated_at_ms: u64,
    /// Fields this build does not know, kept verbatim.
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

impl Checkpoint {
    /// Largest encoded state a commit may carry (DESIGN §2).
    pub const MAX_STATE_BYTES: usize = 64 * 1024;

    /// Encodes to JSON.
    pub fn encode(&self) -> Vec<u8> {
        encode(self)
    }
    /// Decodes a stored value.
    ///
    /// # Errors
    /// [`DecodeError::Json`] when the bytes are not a checkpoint.
    pub fn decode(bytes: &[u8]) -> Result<Self, DecodeError> {
        decode(bytes, "checkpoint")
    }
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs to a Vec cannot fail: all map keys are strings and there
    // is no I/O. Fall back to an empty object rather than panic if that ever changes.
    serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec())
}

/// The length of `value`'s JSON, counted as it is written: nothing is allocated.
fn encoded_len<T: Serialize>(value: &T) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    match serde_json::to_writer(&mut c, value) {
        Ok(()) => c.0,
        Err(_) => encode(value).len(),
    }
}

fn decode<'a, T: Deserialize<'a>>(bytes: &'a [u8], what: &'static str) -> Result<T, DecodeError> {
    serde_json::from_slice(bytes).map_err(|source| DecodeError::Json { what, source })
}

#[cfg(test)]
pub(crate) mod tests;
