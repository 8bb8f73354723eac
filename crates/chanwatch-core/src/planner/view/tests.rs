//! Unit tests of the planner's view: decoding, ingest, tombstones and the indexes.

use crate::planner::tests::{info, n, name, World};
use crate::planner::*;
use crate::types::{ChannelState, NodeId};

#[test]
fn late_echoes_do_not_bring_back_keys_known_deleted() {
    let mut w = World::new(PlannerConfig::default());
    w.node(2);
    let old = w.keys.channel(n(1), &name("c"));
    let stale = info("c", ChannelState::ToWatch, 1, 0);
    w.put(n(1), stale.clone()); // node 1 has no session: the channel fails over
    let before = w.rev;
    w.rev += 5; // other keys' writes
    let txns = w.settle(0);
    assert_eq!(txns.len(), 1);
    let moved = w.rev;
    assert_eq!(w.owner_of("c").0, n(2));
    // The watch lags: it now delivers an older write of the old key (the ack of a node
    // that died), then the delete of our own txn.
    assert_eq!(w.state.apply_put(&old, &stale.encode(), before + 2), None);
    assert_eq!(w.state.channel_count(), 1);
    assert!(
        w.state.entries().all(|e| e.owner == n(2)),
        "the old key came back"
    );
    assert!(
        w.state.plan(0).is_empty(),
        "a resurrected key was re-planned"
    );
    // A delete older than a value we hold is stale too.
    let new = w.keys.channel(n(2), &name("c"));
    w.state.apply_delete(&new, moved - 1);
    assert_eq!(w.owner_of("c").0, n(2));
    // Once the watch has passed the delete, the tombstone goes; a real re-creation of the
    // old key (a later revision) is applied.
    w.state.apply_delete(&old, moved);
    w.state.caught_up(moved);
    assert!(w.state.tombstones.is_empty());
    assert_eq!(w.state.apply_put(&old, &stale.encode(), moved + 5), None);
    assert_eq!(w.state.entries().count(), 2);
}

#[test]
fn corrupt_values_are_reported_and_left_alone() {
    let mut w = World::new(PlannerConfig::default());
    w.node(1);
    let key = "chanwatch/channel/1/bad";
    assert!(w.state.apply_put(key, b"{not json", 5).is_some());
    assert!(w.state.corrupt().contains_key(key));
    assert!(w.state.plan(0).is_empty());
    w.state.apply_delete(key, 6);
    assert!(w.state.corrupt().is_empty());
}

#[test]
fn a_value_naming_another_channel_than_its_key_is_corrupt_and_left_alone() {
    let mut w = World::new(PlannerConfig::default());
    w.node(1);
    w.node(2);
    let key = "chanwatch/channel/1/bad2";
    let other = info("other", ChannelState::WatchFailed, 1, 0);
    let why = w.state.apply_put(key, &other.encode(), 5).expect("corrupt");
    assert!(why.contains("other") && why.contains("bad2"), "{why}");
    assert!(w.state.corrupt().contains_key(key));
    assert_eq!(w.state.channel_count(), 0, "neither bad2 nor other exists");
    assert!(w.state.plan(10_000).is_empty(), "nothing planned for it");
}

#[test]
fn an_unparsable_drain_key_is_reported_as_corrupt_and_drains_nothing() {
    let mut w = World::new(PlannerConfig::default());
    w.node(1);
    let key = "chanwatch/coord/drain/abc";
    let why = w.state.apply_put(key, b"{}", 5).expect("reported");
    assert!(why.contains("abc") || why.contains("decimal"), "{why}");
    assert!(w.state.corrupt().contains_key(key));
    assert!(w.state.draining().is_empty());
    // Listed again (a relist) it is still reported; a good mark next to it still counts.
    w.state.reset([
        (key, b"{}".as_slice(), 5),
        ("chanwatch/coord/drain/1", b"{}".as_slice(), 6),
    ]);
    assert!(w.state.corrupt().contains_key(key));
    assert!(w.state.draining().contains(&NodeId(1)));
    w.state.apply_delete(key, 7);
    assert!(w.state.corrupt().is_empty());
}

/// NodeRestriction: with ID block 7 reserved for name `a`, a session in the block's key
/// prefix is a node only if it is a block-7 ID under name `a`; anything else there (another
/// name, a short ID such as 1007) is reported and never given a channel. A second name
/// claiming the same block is reported too.
#[test]
fn sessions_in_a_reserved_id_block_must_be_the_blocks_name() {
    use crate::types::NodeSession;
    use crate::IdBlock;
    let mut w = World::new(PlannerConfig::default());
    let b7 = IdBlock::new(7).expect("block");
    assert_eq!(w.state.apply_put(&w.keys.id_name("a"), b"7", 1), None);
    let why = w.state.apply_put(&w.keys.id_name("b"), b"7", 2);
    assert!(
        why.as_deref()
            .is_some_and(|w| w.contains("reserved for node name \"a\"")),
        "{why:?}"
    );
    let session = |id: NodeId, name: &str| NodeSession {
        id,
        admin_addr: String::new(),
        version: "t".into(),
        started_at_ms: 0,
        capacity: 0,
        name: name.into(),
        extra: Default::default(),
    };
    let own = b7.id(1).expect("id");
    let impostor = b7.id(2).expect("id");
    for (rev, (id, name)) in [
        (own, "a"),
        (impostor, "b"),
        (NodeId(1007), "a"),
        (NodeId(3), "b"),
    ]
    .into_iter()
    .enumerate()
    {
        w.state.apply_put(
            &w.keys.session(id),
            &session(id, name).encode(),
            10 + rev as i64,
        );
    }
    let nodes: Vec<NodeId> = w.state.nodes().keys().copied().collect();
    assert_eq!(
        nodes,
        vec![NodeId(3), own],
        "only the block's own and unreserved IDs"
    );
    for refused in [impostor, NodeId(1007)] {
        let why = w.state.corrupt().get(&w.keys.session(refused));
        assert!(
            why.is_some_and(|w| w.starts_with("refused, not a node")),
            "{refused}: {why:?}"
        );
    }
    // Channels go only to the nodes.
    for ch in ["c1", "c2", "c3", "c4"] {
        let txn = w
            .state
            .add_channel(name(ch), Default::default(), 0)
            .expect("add");
        w.rev += 1;
        w.state.applied(&txn, w.rev);
        assert!(
            matches!(w.owner_of(ch).0, crate::keys::ChannelOwner::Node(id) if id == own || id == NodeId(3)),
            "{ch} went to {:?}",
            w.owner_of(ch)
        );
    }
}
