//! Unit tests of the checker: each check catches what it should on a real embedded store.

use super::*;
use chanwatch_core::{Checkpoint, NodeSession, VChannelInfo};
use chanwatch_store::{EmbeddedStore, MetaStore, Txn, TxnOp};

/// Writes `key = value` as `writer` and lets the checker see it.
async fn write(
    store: &EmbeddedStore,
    writers: &Writers,
    checker: &mut Checker,
    writer: Writer,
    key: String,
    value: Vec<u8>,
) {
    let next = store.revision() + 1;
    writers
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .insert(next, writer);
    let r = store
        .txn(Txn::new().and_then([TxnOp::put(&key, value)]))
        .await;
    assert!(r.is_ok(), "{r:?}");
    checker.poll(&mut |_, _| {});
}

fn checkpoint(position: u64) -> Vec<u8> {
    Checkpoint {
        epoch: Epoch(1),
        position: position.to_string(),
        state: None,
        updated_at_ms: 0,
        extra: Default::default(),
    }
    .encode()
}

#[tokio::test(start_paused = true)]
async fn checkpoints_only_from_the_owner_and_positions_only_forward() {
    let store = EmbeddedStore::new();
    let keys = Keys::default();
    let writers = Writers::default();
    let mut c = Checker::new(keys.clone(), store.observe(), writers.clone());
    let ch = ChannelName::new("ch-000").unwrap_or_else(|_| unreachable!());
    for (id, slot) in [(1, 0), (2, 1)] {
        let s = NodeSession {
            id: NodeId(id),
            admin_addr: format!("proc{slot}"),
            version: String::new(),
            started_at_ms: 0,
            capacity: 0,
            name: String::new(),
            extra: Default::default(),
        };
        write(
            &store,
            &writers,
            &mut c,
            Writer::Node(slot),
            keys.session(NodeId(id)),
            s.encode(),
        )
        .await;
    }
    c.requested_adds.insert(ch.clone());
    let info = ChannelInfo::new(ch.clone(), Epoch(1), 0, VChannelInfo::default());
    write(
        &store,
        &writers,
        &mut c,
        Writer::Coord("coord1".into()),
        keys.channel(ChannelOwner::Node(NodeId(1)), &ch),
        info.encode(),
    )
    .await;
    c.violations.retain(|v| !v.contains("leader key"));
    let cp = keys.checkpoint(&ch);
    write(
        &store,
        &writers,
        &mut c,
        Writer::Node(0),
        cp.clone(),
        checkpoint(10),
    )
    .await;
    assert_eq!(c.violations, Vec::<String>::new());
    write(
        &store,
        &writers,
        &mut c,
        Writer::Node(0),
        cp.clone(),
        checkpoint(7),
    )
    .await;
    assert!(
        c.violations
            .iter()
            .any(|v| v.contains("went back from 10 to 7")),
        "{:?}",
        c.violations
    );
    c.violations.clear();
    write(
        &store,
        &writers,
        &mut c,
        Writer::Node(1),
        cp,
        checkpoint(12),
    )
    .await;
    assert!(
        c.violations
            .iter()
            .any(|v| v.contains("stale checkpoint: proc1")),
        "{:?}",
        c.violations
    );
}

/// Invariant 5 is judged by weight over capacity: 4 channels on a node of capacity 2
/// and 2 on one of capacity 1 are balanced; by count they would not be, and a heavy
/// channel alone on one node is balanced against an empty one only within its weight.
#[tokio::test(start_paused = true)]
async fn settled_judges_balance_by_weight_over_capacity() {
    let store = EmbeddedStore::new();
    let keys = Keys::default();
    let writers = Writers::default();
    let mut c = Checker::new(keys.clone(), store.observe(), writers.clone());
    for (id, capacity) in [(1, 2), (2, 1)] {
        let s = NodeSession {
            id: NodeId(id),
            name: String::new(),
            admin_addr: format!("proc{id}"),
            version: String::new(),
            started_at_ms: 0,
            capacity,
            extra: Default::default(),
        };
        let key = keys.session(NodeId(id));
        write(
            &store,
            &writers,
            &mut c,
            Writer::Node(id as usize),
            key,
            s.encode(),
        )
        .await;
    }
    let expected: BTreeSet<ChannelName> = ["c0", "c1", "c2", "c3", "c4", "c5"]
        .into_iter()
        .filter_map(|n| ChannelName::new(n).ok())
        .collect();
    let key = |name: &str, node: u64| {
        let ch = ChannelName::new(name).unwrap_or_else(|_| unreachable!());
        keys.channel(ChannelOwner::Node(NodeId(node)), &ch)
    };
    let value = |name: &str| {
        let ch = ChannelName::new(name).unwrap_or_else(|_| unreachable!());
        let mut info = ChannelInfo::new(ch, Epoch(1), 0, VChannelInfo::default());
        info.state = ChannelState::Watched;
        info.encode()
    };
    let coord = || Writer::Coord("coord1".into());
    for name in ["c0", "c1", "c2", "c3", "c4", "c5"] {
        write(&store, &writers, &mut c, coord(), key(name, 1), value(name)).await;
    }
    let none = BTreeSet::new();
    // 6/2 = 3 vs 0/1: over one channel (1) on the smallest capacity (1).
    let why = c.settled(&expected, &none).expect("unbalanced");
    assert!(why.contains("unbalanced"), "{why}");
    for name in ["c4", "c5"] {
        let r = store
            .txn(Txn::new().and_then([TxnOp::delete(key(name, 1))]))
            .await;
        assert!(r.is_ok(), "{r:?}");
        c.poll(&mut |_, _| {});
        write(&store, &writers, &mut c, coord(), key(name, 2), value(name)).await;
    }
    // 4/2 = 2 vs 2/1 = 2: balanced by load, though 4 vs 2 by count.
    assert_eq!(c.settled(&expected, &none), None);
}
