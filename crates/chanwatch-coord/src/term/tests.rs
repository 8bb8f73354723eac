//! The term's unit tests: deposition by a full list, and the loss hold fed by the term.

use super::*;
use chanwatch_core::planner::pacer::{HOLD_MAX, QUIET_MIN};
use chanwatch_core::Keys;
use chanwatch_store::{EmbeddedStore, KeyValue};

/// What a test's `Term` borrows or takes (it borrows the first two from its caller).
fn parts() -> (
    CoordinatorConfig,
    watch::Sender<CoordStatus>,
    Arc<dyn MetaStore>,
) {
    let (status, _) = watch::channel(CoordStatus::default());
    (
        CoordinatorConfig::default(),
        status,
        Arc::new(EmbeddedStore::new()),
    )
}

fn leader_kv(keys: &Keys, create_revision: i64, lease: Option<LeaseId>) -> KeyValue {
    KeyValue {
        key: keys.leader(),
        value: b"{}".to_vec(),
        create_revision,
        mod_revision: create_revision,
        version: 1,
        lease,
    }
}

#[tokio::test(start_paused = true)]
async fn a_full_list_deposes_the_leader_unless_the_key_is_its_own() {
    let (config, status, store) = parts();
    let mut term = Term::new(store, &config, Clock::system(), 5, 0x77, &status);
    let reset = |kvs: Vec<KeyValue>| Update::Reset { kvs, revision: 9 };
    let keys = &config.keys;
    assert_eq!(
        term.apply(reset(vec![leader_kv(keys, 5, Some(0x77))])),
        Ok(())
    );
    for (case, kvs) in [
        ("gone", vec![]),
        ("re-created", vec![leader_kv(keys, 8, Some(0x78))]),
        ("rewritten without a lease", vec![leader_kv(keys, 5, None)]),
        (
            "rewritten on another lease",
            vec![leader_kv(keys, 5, Some(0x78))],
        ),
    ] {
        let why = term.apply(reset(kvs)).expect_err(case);
        assert!(
            why.contains("deposed") || why.contains("gone"),
            "{case}: {why}"
        );
    }
}

impl Term<'_> {
    /// When a round may run, not before `not_before` (the gap's end), as the pacer sees
    /// the losses this term fed it.
    fn plan_at(&self, not_before: tokio::time::Instant) -> tokio::time::Instant {
        not_before.max(self.origin + self.pacer.round_at())
    }
}

/// A bare session of node `id`.
fn session(id: NodeId) -> chanwatch_core::NodeSession {
    chanwatch_core::NodeSession {
        id,
        admin_addr: String::new(),
        version: String::new(),
        started_at_ms: 1,
        capacity: 0,
        name: String::new(),
        extra: Default::default(),
    }
}

/// A node holding `channel` in `term`'s view, then its session gone.
fn lose(term: &mut Term<'_>, node: u64, channel: &str, rev: i64) {
    use chanwatch_core::{ChannelInfo, ChannelOwner, ChannelState, Epoch};
    let keys = term.config.keys.clone();
    let id = NodeId(node);
    let session = session(id);
    term.state
        .apply_put(&keys.session(id), &session.encode(), rev);
    if !channel.is_empty() {
        let name = ChannelName::new(channel).expect("a valid test channel name");
        let mut info = ChannelInfo::new(name.clone(), Epoch(1), 1, Default::default());
        info.state = ChannelState::Watched;
        let key = keys.channel(ChannelOwner::Node(id), &name);
        term.state.apply_put(&key, &info.encode(), rev + 1);
    }
    term.state.apply_delete(&keys.session(id), rev + 2);
    term.session_gone(id, "a test");
}

#[tokio::test(start_paused = true)]
async fn a_burst_of_session_losses_is_planned_once_it_is_over() {
    let (config, status, store) = parts();
    let mut term = Term::new(store, &config, Clock::system(), 5, 0x77, &status);
    let now = || tokio::time::Instant::now();
    // Nothing lost: a plan may run when the gap allows.
    assert_eq!(term.plan_at(now()), now());
    // A node that held nothing is no failover: no hold.
    lose(&mut term, 9, "", 10);
    assert_eq!(term.plan_at(now()), now());
    // A loss holds the plan until the quiet period (QUIET_MIN: no txn timed yet) has
    // passed without another.
    let first = now();
    lose(&mut term, 1, "c1", 20);
    assert_eq!(term.plan_at(now()), first + QUIET_MIN);
    tokio::time::advance(Duration::from_millis(2)).await;
    lose(&mut term, 2, "c2", 30);
    assert_eq!(term.plan_at(now()), now() + QUIET_MIN);
    // A plan gap that ends later still rules.
    assert_eq!(term.plan_at(now() + HOLD_MAX), now() + HOLD_MAX);
    // Losses that keep coming hold it no longer than HOLD_MAX after the first.
    for n in 3..30 {
        tokio::time::advance(Duration::from_millis(2)).await;
        lose(&mut term, n, &format!("c{n}"), 10 * n as i64 + 40);
    }
    assert!(now() > first + HOLD_MAX);
    assert_eq!(term.plan_at(first), first + HOLD_MAX);
}

#[tokio::test(start_paused = true)]
async fn the_leaders_txns_set_how_long_a_burst_is_waited_for() {
    let (config, status, store) = parts();
    let mut term = Term::new(store, &config, Clock::system(), 5, 0x77, &status);
    let now = || tokio::time::Instant::now();
    // Eight txns that took `ms` each, timing the commit (`pace`) or not.
    async fn txns(term: &mut Term<'_>, ms: u64, pace: bool) {
        for _ in 0..8 {
            let started = tokio::time::Instant::now();
            tokio::time::advance(Duration::from_millis(ms)).await;
            let answer = chanwatch_store::TxnResponse {
                succeeded: true,
                revision: 9,
                responses: Vec::new(),
            };
            term.record_txn(&Ok(answer), started, pace);
        }
    }
    // The store commits in 5 ms (etcd on a slow disk): a loss is waited on 10 ms.
    txns(&mut term, 5, true).await;
    // Txns that do not time the commit (large, pipelined, bulk) change nothing.
    txns(&mut term, 50, false).await;
    lose(&mut term, 1, "c1", 20);
    assert_eq!(term.plan_at(now()), now() + Duration::from_millis(10));
}

/// A put planned onto a node from a view that does not yet hold its `leaving` write is
/// refused by the store (the txn compares the session's mod revision as seen, not just that
/// it exists), and the refusal's read-back puts `leaving` into the view: the put can never
/// land on a node that is about to end its session with nothing under it.
#[tokio::test]
async fn a_put_planned_before_a_nodes_leaving_write_is_refused_and_the_view_learns_it() {
    use chanwatch_core::planner::{Guard, Op, PlannedTxn};
    use chanwatch_core::{ChannelInfo, ChannelOwner, Epoch, NodeSession};
    let (config, status, store) = parts();
    let keys = config.keys.clone();
    let leader = store
        .txn(
            chanwatch_store::Txn::new()
                .and_then([chanwatch_store::TxnOp::put(keys.leader(), "{}")]),
        )
        .await
        .expect("the embedded store answers");
    let id = NodeId(1);
    let mut session = session(id);
    let put_session = |s: &NodeSession| {
        chanwatch_store::Txn::new()
            .and_then([chanwatch_store::TxnOp::put(keys.session(id), s.encode())])
    };
    let first = store.txn(put_session(&session)).await.expect("answers");
    let mut term = Term::new(
        store.clone(),
        &config,
        Clock::system(),
        leader.revision,
        0x77,
        &status,
    );
    term.state
        .apply_put(&keys.session(id), &session.encode(), first.revision);
    // The node announces `leaving`; the view has not seen it.
    session.set_leaving(true);
    store.txn(put_session(&session)).await.expect("answers");
    let channel = ChannelName::new("c").expect("valid");
    let put = |epoch| PlannedTxn {
        guards: vec![Guard {
            owner: ChannelOwner::Node(id),
            channel: channel.clone(),
            mod_revision: 0,
        }],
        ops: vec![Op::Put {
            owner: ChannelOwner::Node(id),
            info: Box::new(ChannelInfo::new(
                channel.clone(),
                Epoch(epoch),
                1,
                Default::default(),
            )),
        }],
        transitions: Vec::new(),
    };
    assert_eq!(term.execute(vec![put(1)]).await, Ok(1), "refused");
    let listed = store
        .get(&keys.channel(ChannelOwner::Node(id), &channel))
        .await;
    assert!(matches!(listed, Ok(None)), "nothing landed: {listed:?}");
    assert!(
        term.state
            .nodes()
            .get(&id)
            .is_some_and(NodeSession::leaving),
        "the refusal's read-back shows the node leaving"
    );
    // With the view up to date, the same put lands (the planner would not plan it; the
    // store guard alone is what this test is about).
    assert_eq!(term.execute(vec![put(1)]).await, Ok(0), "committed");
}
