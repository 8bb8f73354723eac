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
