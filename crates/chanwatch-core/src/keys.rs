//! The key layout of DESIGN.md §2: building keys and parsing them back.
//!
//! Owns: every string that names a key or a prefix in the store. Nothing else in chanwatch
//! formats a key by hand, so the layout can change in one place.
//!
//! Must not: touch values or the store.

use std::fmt;

use crate::error::KeyError;
use crate::types::{ChannelName, NodeId};

/// The segment under `channel/` that parks channels while no node is alive.
pub const REMAINING: &str = "remaining";

/// Who a channel key belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ChannelOwner {
    /// A live (or dead, not yet cleaned up) node.
    Node(NodeId),
    /// Parked under `channel/remaining/` because no node was alive.
    Remaining,
}

impl fmt::Display for ChannelOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChannelOwner::Node(id) => write!(f, "{id}"),
            ChannelOwner::Remaining => f.write_str(REMAINING),
        }
    }
}

/// What a key under the root is, by prefix ([`Keys::kind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyKind {
    /// `{root}/channel/…`: an assignment.
    Channel,
    /// `{root}/session/node/…`: a node's session.
    Session,
    /// `{root}/coord/drain/…`: a drain mark.
    Drain,
    /// `{root}/coord/fence/…`: a fence mark.
    Fence,
    /// `{root}/id/name/…`: an ID block reserved for a node name.
    IdName,
    /// Anything else.
    Other,
}

/// A parsed `{root}/channel/{owner}/{channel}` key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ChannelKey {
    /// Node ID or `remaining`.
    pub owner: ChannelOwner,
    /// The channel.
    pub channel: ChannelName,
}

/// Builds and parses keys under one root prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Keys {
    root: String,
    /// The prefixes the parsers test, made once: made per call (and an error built per
    /// failed test), classifying one watch event cost ~12 allocations.
    sessions: String,
    drains: String,
    fences: String,
    channels: String,
    id_names: String,
}

impl Keys {
    /// A layout under `root` (default `chanwatch`).
    ///
    /// # Errors
    /// [`KeyError::Malformed`] when the root is empty, starts or ends with `/`, holds `//`, or
    /// characters outside `[A-Za-z0-9._/-]`.
    pub fn new(root: impl Into<String>) -> Result<Self, KeyError> {
        let root = root.into();
        let bad = |why: &str| KeyError::Malformed {
            key: root.clone(),
            why: format!(
                "root prefix {why}; use something like \"chanwatch\" or \"prod/chanwatch\""
            ),
        };
        if root.is_empty() {
            return Err(bad("is empty"));
        }
        if root.starts_with('/') || root.ends_with('/') || root.contains("//") {
            return Err(bad("must not start or end with '/' or hold '//'"));
        }
        if !root
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/'))
        {
            return Err(bad("holds characters outside [A-Za-z0-9._/-]"));
        }
        Ok(Keys::with_root(root))
    }

    fn with_root(root: String) -> Self {
        Keys {
            sessions: format!("{root}/session/node/"),
            drains: format!("{root}/coord/drain/"),
            fences: format!("{root}/coord/fence/"),
            channels: format!("{root}/channel/"),
            id_names: format!("{root}/id/name/"),
            root,
        }
    }

    /// What kind of key under the root `key` is, by its prefix alone (no allocation); the
    /// matching `parse_*` then reads it.
    pub fn kind(&self, key: &str) -> KeyKind {
        if key.starts_with(&self.channels) {
            KeyKind::Channel
        } else if key.starts_with(&self.sessions) {
            KeyKind::Session
        } else if key.starts_with(&self.drains) {
            KeyKind::Drain
        } else if key.starts_with(&self.fences) {
            KeyKind::Fence
        } else if key.starts_with(&self.id_names) {
            KeyKind::IdName
        } else {
            KeyKind::Other
        }
    }

    /// The root prefix without a trailing slash.
    pub fn root(&self) -> &str {
        &self.root
    }

    /// `{root}/` — everything chanwatch owns.
    pub fn all_prefix(&self) -> String {
        format!("{}/", self.root)
    }

    /// `{root}/id/node`: the last node ID handed out.
    pub fn node_id_counter(&self) -> String {
        format!("{}/id/node", self.root)
    }

    /// `{root}/id/name/`: the ID blocks reserved per node name ([`crate::idblock`]).
    pub fn id_names_prefix(&self) -> String {
        self.id_names.clone()
    }

    /// `{root}/id/name/{name}`: the number of the ID block reserved for node name `name`
    /// (decimal), written by an administrator with the etcd role of that name.
    pub fn id_name(&self, name: &str) -> String {
        format!("{}{name}", self.id_names)
    }

    /// Parses `{root}/id/name/{name}` into the name.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere or the name is not a valid node name.
    pub fn parse_id_name<'k>(&self, key: &'k str) -> Result<&'k str, KeyError> {
        let name = strip(key, &self.id_names)?;
        if crate::idblock::valid_name(name) {
            Ok(name)
        } else {
            Err(malformed(
                key,
                "node name is not 1-253 bytes of [A-Za-z0-9._-]",
            ))
        }
    }

    /// `{root}/id/block/{b:03}`: the last sequence number handed out in ID block `b`; only
    /// the nodes of the block's name write it.
    pub fn id_block_counter(&self, block: crate::IdBlock) -> String {
        format!("{}/id/block/{:03}", self.root, block.number())
    }

    /// `{root}/session/node/`.
    pub fn sessions_prefix(&self) -> String {
        self.sessions.clone()
    }

    /// `{root}/session/node/{id}`.
    pub fn session(&self, id: NodeId) -> String {
        format!("{}/session/node/{id}", self.root)
    }

    /// Parses `{root}/session/node/{id}`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere or the ID is not canonical decimal.
    pub fn parse_session(&self, key: &str) -> Result<NodeId, KeyError> {
        let rest = strip(key, &self.sessions)?;
        rest.parse()
            .map_err(|_| malformed(key, "node id is not a decimal number"))
    }

    /// `{root}/coord/leader`.
    pub fn leader(&self) -> String {
        format!("{}/coord/leader", self.root)
    }

    /// `{root}/coord/compact`: the revision the leader last compacted the store to
    /// (decimal), written by compare-and-swap before it compacts, so that one coordinator
    /// compacts per `--compact-interval` even across a failover (DESIGN.md §8).
    pub fn compact(&self) -> String {
        format!("{}/coord/compact", self.root)
    }

    /// `{root}/coord/member/`: one key per live coordinator, leader and standbys alike, under
    /// its campaign lease (so `ctl status` can list the standbys; the key goes with the
    /// process).
    pub fn coord_members_prefix(&self) -> String {
        format!("{}/coord/member/", self.root)
    }

    /// `{root}/coord/member/{id}`: the `CoordSession` of coordinator `id`.
    pub fn coord_member(&self, id: &str) -> String {
        format!("{}/coord/member/{id}", self.root)
    }

    /// `{root}/coord/drain/`: one key per node being drained (DESIGN.md §2, v2): the drain
    /// must survive a coordinator failover and be visible to `ctl nodes`, so it lives in the
    /// store, written by the leader like every assignment.
    pub fn drains_prefix(&self) -> String {
        self.drains.clone()
    }

    /// `{root}/coord/drain/{id}`.
    pub fn drain(&self, id: NodeId) -> String {
        format!("{}/coord/drain/{id}", self.root)
    }

    /// Parses `{root}/coord/drain/{id}`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere or the ID is not canonical decimal.
    pub fn parse_drain(&self, key: &str) -> Result<NodeId, KeyError> {
        let rest = strip(key, &self.drains)?;
        rest.parse()
            .map_err(|_| malformed(key, "node id is not a decimal number"))
    }

    /// `{root}/coord/fence/`: one key per node the leader is fencing by revoking its session
    /// lease (it did not release a channel in time). In the store, like drain marks, so that
    /// a new leader also holds the node's channels until it has surely stopped them.
    pub fn fences_prefix(&self) -> String {
        self.fences.clone()
    }

    /// `{root}/coord/fence/{id}`.
    pub fn fence(&self, id: NodeId) -> String {
        format!("{}/coord/fence/{id}", self.root)
    }

    /// Parses `{root}/coord/fence/{id}`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere or the ID is not canonical decimal.
    pub fn parse_fence(&self, key: &str) -> Result<NodeId, KeyError> {
        let rest = strip(key, &self.fences)?;
        rest.parse()
            .map_err(|_| malformed(key, "node id is not a decimal number"))
    }

    /// `{root}/channel/` — every assignment.
    pub fn channels_prefix(&self) -> String {
        self.channels.clone()
    }

    /// `{root}/channel/{owner}/` — one owner's assignments.
    pub fn owner_prefix(&self, owner: ChannelOwner) -> String {
        format!("{}/channel/{owner}/", self.root)
    }

    /// `{root}/channel/{owner}/{channel}`.
    pub fn channel(&self, owner: ChannelOwner, channel: &ChannelName) -> String {
        format!("{}/channel/{owner}/{channel}", self.root)
    }

    /// Parses `{root}/channel/{owner}/{channel}`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere, the owner is neither a node ID nor `remaining`,
    /// or the channel name is invalid.
    pub fn parse_channel(&self, key: &str) -> Result<ChannelKey, KeyError> {
        let rest = strip(key, &self.channels)?;
        let (owner, name) = rest
            .split_once('/')
            .ok_or_else(|| malformed(key, "expected channel/{node id|remaining}/{channel}"))?;
        let owner = if owner == REMAINING {
            ChannelOwner::Remaining
        } else {
            ChannelOwner::Node(
                owner
                    .parse()
                    .map_err(|_| malformed(key, "owner is neither a node id nor 'remaining'"))?,
            )
        };
        let channel = ChannelName::new(name).map_err(|e| malformed(key, &e.to_string()))?;
        Ok(ChannelKey { owner, channel })
    }

    /// `{root}/worker/`: what the data plane writes (checkpoints). It sorts after every key
    /// the coordinator follows, so the coordinator watches `[{root}/, {root}/worker/)` and
    /// the steady stream of checkpoint commits never reaches it.
    pub fn worker_prefix(&self) -> String {
        format!("{}/worker/", self.root)
    }

    /// `{root}/worker/checkpoint/`.
    pub fn checkpoints_prefix(&self) -> String {
        format!("{}/worker/checkpoint/", self.root)
    }

    /// `{root}/worker/checkpoint/{channel}`.
    pub fn checkpoint(&self, channel: &ChannelName) -> String {
        format!("{}/worker/checkpoint/{channel}", self.root)
    }

    /// Parses `{root}/worker/checkpoint/{channel}`.
    ///
    /// # Errors
    /// [`KeyError`] when the key is elsewhere or the channel name is invalid.
    pub fn parse_checkpoint(&self, key: &str) -> Result<ChannelName, KeyError> {
        let rest = strip(key, &self.checkpoints_prefix())?;
        ChannelName::new(rest).map_err(|e| malformed(key, &e.to_string()))
    }
}

impl Default for Keys {
    fn default() -> Self {
        Keys::with_root("chanwatch".to_owned())
    }
}

fn strip<'k>(key: &'k str, prefix: &str) -> Result<&'k str, KeyError> {
    key.strip_prefix(prefix)
        .ok_or_else(|| KeyError::WrongPrefix {
            key: key.to_owned(),
            prefix: prefix.to_owned(),
        })
}

fn malformed(key: &str, why: &str) -> KeyError {
    KeyError::Malformed {
        key: key.to_owned(),
        why: why.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_follow_the_design_layout() {
        let k = Keys::new("cw").expect("root");
        let c = ChannelName::new("ch1").expect("name");
        assert_eq!(k.node_id_counter(), "cw/id/node");
        assert_eq!(k.session(NodeId(7)), "cw/session/node/7");
        assert_eq!(k.leader(), "cw/coord/leader");
        assert_eq!(
            k.channel(ChannelOwner::Node(NodeId(7)), &c),
            "cw/channel/7/ch1"
        );
        assert_eq!(
            k.channel(ChannelOwner::Remaining, &c),
            "cw/channel/remaining/ch1"
        );
        assert_eq!(k.checkpoint(&c), "cw/worker/checkpoint/ch1");
        // The coordinator's range `[all_prefix, worker_prefix)` holds every key it follows
        // and no checkpoint.
        let coordinator =
            |key: &str| key >= k.all_prefix().as_str() && key < k.worker_prefix().as_str();
        for key in [
            k.node_id_counter(),
            k.session(NodeId(7)),
            k.leader(),
            k.drain(NodeId(7)),
            k.fence(NodeId(7)),
            k.channel(ChannelOwner::Node(NodeId(7)), &c),
            k.channel(ChannelOwner::Remaining, &c),
        ] {
            assert!(
                coordinator(&key),
                "{key} is outside the coordinator's range"
            );
        }
        assert!(!coordinator(&k.checkpoint(&c)));
        // A node's prefix must not be a prefix of another node's prefix.
        assert!(!k
            .owner_prefix(ChannelOwner::Node(NodeId(12)))
            .starts_with(&k.owner_prefix(ChannelOwner::Node(NodeId(1)))));
    }

    #[test]
    fn bad_keys_are_typed_errors() {
        let k = Keys::default();
        for bad in [
            "chanwatch/channel/",
            "chanwatch/channel/7",
            "chanwatch/channel/07/c",
            "chanwatch/channel/x/c",
            "chanwatch/channel/7/",
            "chanwatch/channel/7/a/b",
            "chanwatch/channel/remaining/",
            "other/channel/7/c",
        ] {
            assert!(k.parse_channel(bad).is_err(), "{bad:?} parsed");
        }
        assert!(k.parse_session("chanwatch/session/node/").is_err());
        assert!(k.parse_session("chanwatch/session/node/-1").is_err());
        assert!(k
            .parse_checkpoint("chanwatch/worker/checkpoint/a/b")
            .is_err());
    }

    #[test]
    fn bad_roots_are_refused() {
        for bad in ["", "/x", "x/", "a//b", "a b", "ä"] {
            assert!(Keys::new(bad).is_err(), "{bad:?} accepted");
        }
        assert!(Keys::new("prod/chanwatch-1").is_ok());
    }

    fn owner_strategy() -> impl Strategy<Value = ChannelOwner> {
        prop_oneof![
            Just(ChannelOwner::Remaining),
            any::<u64>().prop_map(|n| ChannelOwner::Node(NodeId(n))),
        ]
    }

    proptest! {
        #[test]
        fn channel_keys_round_trip(
            root in "[a-z]{1,8}(/[a-z0-9._-]{1,8}){0,2}",
            owner in owner_strategy(),
            channel in crate::types::tests::name_strategy(),
        ) {
            let k = Keys::new(root).expect("valid root");
            let key = k.channel(owner, &channel);
            prop_assert!(key.starts_with(&k.owner_prefix(owner)));
            prop_assert_eq!(k.parse_channel(&key).expect("parses"), ChannelKey { owner, channel: channel.clone() });
            prop_assert_eq!(k.parse_checkpoint(&k.checkpoint(&channel)).expect("checkpoint"), channel);
        }

        #[test]
        fn session_keys_round_trip(id in any::<u64>()) {
            let k = Keys::default();
            prop_assert_eq!(k.parse_session(&k.session(NodeId(id))).expect("parses"), NodeId(id));
        }

        #[test]
        fn key_parsers_never_panic(s in ".{0,80}", tail in ".{0,40}") {
            let k = Keys::default();
            let _ = k.parse_channel(&s);
            let _ = k.parse_session(&s);
            let _ = k.parse_checkpoint(&s);
            let _ = k.parse_channel(&format!("chanwatch/channel/{tail}"));
            let _ = k.parse_session(&format!("chanwatch/session/node/{tail}"));
        }
    }
}
