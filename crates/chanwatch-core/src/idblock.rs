//! Node ID blocks (DESIGN §2 "NodeRestriction"): node IDs reserved per node name, so that an
//! etcd role bound to a name before the node starts can reach that node's keys and no
//! other node's.
//!
//! etcd grants a role keys by exact key or by prefix. A node's keys are named by its ID,
//! handed out at start, so a role written beforehand can only name them by a prefix of the
//! ID's decimal form. Block `b` (0–999) is every 16-digit ID whose decimal form starts with
//! `1` and `b` in three digits: `1{b:03}` followed by a 12-digit sequence number, that is
//! `10^15 + b·10^12 + seq`. The role of the name that owns block `b` grants the prefixes
//! `{root}/session/node/1{b:03}` and `{root}/channel/1{b:03}`. Those prefixes also hold
//! shorter or longer IDs that start with the same digits (`1007`, `10071`, …): an ID from the
//! cluster-wide counter can fall in a block's prefix, so a node without a block skips such IDs
//! while it can read the reserved blocks, and the coordinator refuses any session in a
//! reserved block's prefix that is not a block ID of that block under the block's name.
//! IDs stay below 2^53, so JSON readers in any language read them exactly.
//!
//! Owns: the arithmetic of blocks and the rule that decides whether a session may live at
//! its ID ([`foreign`]). Must not: do I/O or know key strings (that is [`crate::keys`]).

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;

use crate::types::NodeId;

/// The first ID of block 0: `1` followed by fifteen zeros.
const BASE: u64 = 1_000_000_000_000_000;
/// IDs per block (the sequence number's room).
const PER_BLOCK: u64 = 1_000_000_000_000;
/// The highest block number.
pub const MAX_BLOCK: u16 = 999;

/// A block of node IDs (0–999), reserved for one node name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct IdBlock(u16);

impl IdBlock {
    /// Block `b`, if `b` is at most [`MAX_BLOCK`].
    pub fn new(b: u16) -> Option<Self> {
        (b <= MAX_BLOCK).then_some(IdBlock(b))
    }

    /// The block's number.
    pub fn number(self) -> u16 {
        self.0
    }

    /// The `seq`-th ID of the block (`seq` from 1), or `None` once the block is used up
    /// (10^12 − 1 registrations).
    pub fn id(self, seq: u64) -> Option<NodeId> {
        (1..PER_BLOCK)
            .contains(&seq)
            .then(|| NodeId(BASE + u64::from(self.0) * PER_BLOCK + seq))
    }

    /// The sequence number of `id` in this block, if it is one of this block's IDs.
    pub fn seq(self, id: NodeId) -> Option<u64> {
        (IdBlock::of(id) == Some(self)).then(|| (id.0 - BASE) % PER_BLOCK)
    }

    /// The block `id` is a block ID of (16 digits, starting with `1`), if any.
    pub fn of(id: NodeId) -> Option<IdBlock> {
        (BASE..2 * BASE)
            .contains(&id.0)
            .then(|| IdBlock(((id.0 - BASE) / PER_BLOCK) as u16))
    }

    /// The block whose key prefixes `id`'s decimal form falls in (`1007…` of any length from
    /// four digits: block 7), whether or not `id` is a block ID.
    pub fn prefix_of(id: NodeId) -> Option<IdBlock> {
        let s = id.0.to_string();
        if s.len() < 4 || !s.starts_with('1') {
            return None;
        }
        s[1..4].parse().ok().and_then(IdBlock::new)
    }

    /// The decimal prefix of the block's IDs (`1007` for block 7): the etcd roles grant
    /// `{root}/session/node/{prefix}` and `{root}/channel/{prefix}`.
    pub fn id_prefix(self) -> String {
        format!("1{:03}", self.0)
    }
}

impl fmt::Display for IdBlock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl FromStr for IdBlock {
    type Err = String;

    /// A decimal block number, 0–999 (surrounding blanks allowed: the value of
    /// `{root}/id/name/{name}` is written by hand or by a script).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.trim()
            .parse::<u16>()
            .ok()
            .and_then(IdBlock::new)
            .ok_or_else(|| {
                format!(
                    "{:?} is not an ID block number (0–{MAX_BLOCK})",
                    s.chars().take(32).collect::<String>()
                )
            })
    }
}

/// Whether a node name can be a key segment (`{root}/id/name/{name}`): 1–253 bytes of
/// `[A-Za-z0-9._-]`, not `.` or `..` (host names and Kubernetes pod names are).
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 253
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Why a session at `id` that says it is `name` may not be a node, given the reserved
/// blocks (block → name); `None` when it may. A session whose ID lies in a reserved block's
/// prefix must be a block ID of that block (not a shorter or longer one) under that block's
/// name: an etcd user that can write the prefix is that name's, so anything else there was
/// written by someone who should not have, or by a node given the wrong `--name`.
pub fn foreign(id: NodeId, name: &str, reserved: &BTreeMap<IdBlock, String>) -> Option<String> {
    let block = IdBlock::prefix_of(id)?;
    let owner = reserved.get(&block)?;
    if IdBlock::of(id) != Some(block) {
        return Some(format!(
            "node id {id} lies in the key prefix of ID block {block} (reserved for node name {owner:?}) but is not one of its IDs"
        ));
    }
    if name != owner {
        return Some(format!(
            "node id {id} is in ID block {block}, reserved for node name {owner:?}, but its session says name {name:?}"
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_ids_are_sixteen_digits_under_the_blocks_prefix_and_below_2_pow_53() {
        let b7 = IdBlock::new(7).expect("7 is a block");
        let first = b7.id(1).expect("first");
        assert_eq!(first.to_string(), "1007000000000001");
        assert!(first.to_string().starts_with(&b7.id_prefix()));
        assert_eq!(IdBlock::of(first), Some(b7));
        assert_eq!(b7.seq(first), Some(1));
        let last = IdBlock::new(MAX_BLOCK)
            .and_then(|b| b.id(PER_BLOCK - 1))
            .expect("last");
        assert_eq!(last.to_string(), "1999999999999999");
        assert!(last.0 < 1 << 53, "JSON readers would round it");
        assert_eq!(IdBlock::of(last).map(IdBlock::number), Some(999));
        assert_eq!(b7.id(0), None);
        assert_eq!(b7.id(PER_BLOCK), None);
        assert_eq!(IdBlock::new(1000), None);
        // Not block IDs: short, long, or not starting with 1.
        for id in [
            1007,
            10_071,
            10_070_000_000_000_001,
            2_007_000_000_000_001,
            999,
        ] {
            assert_eq!(IdBlock::of(NodeId(id)), None, "{id}");
        }
        assert_eq!(b7.seq(NodeId(1007)), None);
    }

    #[test]
    fn the_prefix_of_an_id_is_the_block_whose_etcd_grant_covers_it() {
        for (id, block) in [
            (1007, Some(7)),
            (10_071, Some(7)),
            (1_007_000_000_000_001, Some(7)),
            (10_070_000_000_000_001, Some(7)),
            (1999, Some(999)),
            (100, None),
            (2007, None),
            (1, None),
        ] {
            assert_eq!(
                IdBlock::prefix_of(NodeId(id)).map(IdBlock::number),
                block,
                "{id}"
            );
        }
    }

    #[test]
    fn a_session_in_a_reserved_prefix_must_be_a_block_id_under_the_blocks_name() {
        let b7 = IdBlock::new(7).expect("block");
        let reserved: BTreeMap<IdBlock, String> = [(b7, "node-a".to_owned())].into();
        let own = b7.id(3).expect("id");
        assert_eq!(foreign(own, "node-a", &reserved), None);
        let wrong_name = foreign(own, "node-b", &reserved).expect("refused");
        assert!(wrong_name.contains("\"node-a\"") && wrong_name.contains("\"node-b\""));
        let short = foreign(NodeId(1007), "node-a", &reserved).expect("refused");
        assert!(short.contains("not one of its IDs"), "{short}");
        // Outside every reserved block: anything goes, as without blocks.
        assert_eq!(foreign(NodeId(3), "x", &reserved), None);
        let b8 = IdBlock::new(8).and_then(|b| b.id(1)).expect("id");
        assert_eq!(foreign(b8, "x", &reserved), None);
    }

    #[test]
    fn block_numbers_and_names_parse_strictly() {
        assert_eq!("7".parse::<IdBlock>().map(IdBlock::number), Ok(7));
        assert_eq!(" 12\n".parse::<IdBlock>().map(IdBlock::number), Ok(12));
        for bad in ["", "1000", "-1", "x", "7.0"] {
            assert!(bad.parse::<IdBlock>().is_err(), "{bad:?}");
        }
        assert!(valid_name("node-0.example_1"));
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(254)] {
            assert!(!valid_name(bad), "{bad:?}");
        }
    }
}
