//! Tests of the group commit: chunking, shared txns and their fallbacks, answers per txn, pipelining.

use chanwatch_core::{ChannelName, ChannelState, Epoch, VChannelInfo};
use chanwatch_store::EmbeddedStore;

use super::*;

/// Puts `n` assignments `a/0..n`; returns the writes that ack each as `Watched` against the
/// revision it was put at.
async fn assigned(store: &EmbeddedStore, n: usize) -> Vec<AckWrite> {
    let mut out = Vec::new();
    for i in 0..n {
        let name = ChannelName::new(format!("c{i}")).expect("name");
        let mut info = ChannelInfo::new(name, Epoch(1), 0, VChannelInfo::default());
        let key = format!("a/{i}");
        let rev = store
            .txn(Txn::new().and_then([TxnOp::put(&key, info.encode())]))
            .await
            .expect("put")
            .revision;
        info.state = ChannelState::Watched;
        out.push(AckWrite {
            compares: vec![Compare::mod_revision(&key, rev)],
            put: TxnOp::put(&key, info.encode()),
            what: What::Ack(info),
        });
    }
    out
}

fn committed_at(outcomes: &[(What, AckOutcome)]) -> Vec<Option<i64>> {
    outcomes
        .iter()
        .map(|(_, o)| match o {
            AckOutcome::Committed(rev) => Some(*rev),
            _ => None,
        })
        .collect()
}

#[tokio::test]
async fn a_key_written_twice_goes_to_the_next_txn_and_limits_split_the_rest() {
    let store = EmbeddedStore::new();
    let mut writes: Vec<(usize, AckWrite)> = assigned(&store, 3)
        .await
        .into_iter()
        .map(|w| (10, w))
        .collect();
    let again = assigned(&store, 1).await.into_iter().map(|w| (10, w));
    writes.extend(again); // the first channel's key once more
    let keys = |c: &Vec<AckWrite>| -> Vec<String> {
        c.iter()
            .map(|w| match &w.put {
                TxnOp::Put { key, .. } => key.clone(),
                _ => String::new(),
            })
            .collect()
    };
    let chunks = chunk(writes, 128, 1 << 20);
    assert_eq!(
        chunks.len(),
        2,
        "{:?}",
        chunks.iter().map(keys).collect::<Vec<_>>()
    );
    assert_eq!(keys(&chunks[0]).len(), 3);
    let mut first = keys(&chunks[0]);
    first.dedup();
    assert_eq!(first.len(), 3, "no key twice in one txn");
    // The op and byte limits split too.
    let writes: Vec<(usize, AckWrite)> = assigned(&store, 5)
        .await
        .into_iter()
        .map(|w| (10, w))
        .collect();
    assert_eq!(chunk(writes, 2, 1 << 20).len(), 3);
}

/// An unguarded checkpoint commit of channel `key` to key `key`, and where its answer comes.
fn commit(
    key: &str,
) -> (
    AckWrite,
    oneshot::Receiver<Result<i64, crate::checkpoint::CommitError>>,
) {
    let (reply, answer) = oneshot::channel();
    let write = AckWrite {
        what: What::Commit(ChannelName::new(key).expect("name"), reply),
        compares: Vec::new(),
        put: TxnOp::put(key, "p"),
    };
    (write, answer)
}

/// Holds every txn after the first until released.
struct HoldAfterFirst {
    txns: std::sync::atomic::AtomicUsize,
    release: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl chanwatch_store::Layer for HoldAfterFirst {
    async fn txn(
        &self,
        inner: &dyn MetaStore,
        txn: Txn,
    ) -> chanwatch_store::StoreResult<chanwatch_store::TxnResponse> {
        if self.txns.fetch_add(1, std::sync::atomic::Ordering::SeqCst) > 0 {
            self.release.notified().await;
        }
        inner.txn(txn).await
    }
}

#[tokio::test]
async fn a_txns_commits_are_answered_before_the_next_txn_of_the_write_lands() {
    let store = std::sync::Arc::new(chanwatch_store::Layered::new(
        std::sync::Arc::new(EmbeddedStore::new()),
        HoldAfterFirst {
            txns: Default::default(),
            release: tokio::sync::Notify::new(),
        },
    ));
    let ((a, mut a_answer), (b, mut b_answer)) = (commit("a"), commit("b"));
    let writing = tokio::spawn({
        let store = store.clone();
        async move {
            write_chunks(
                &*store,
                None,
                vec![vec![a], vec![b]],
                chanwatch_core::NodeId(1),
            )
            .await
        }
    });
    let first = tokio::time::timeout(std::time::Duration::from_secs(5), &mut a_answer)
        .await
        .expect("the first txn's commit is answered while the second txn is held")
        .expect("answered");
    assert!(first.is_ok(), "{first:?}");
    assert!(
        b_answer.try_recv().is_err(),
        "the held txn's commit is not answered yet"
    );
    store.layer().release.notify_one();
    let acks = writing.await.expect("joined");
    assert!(acks.is_empty(), "no acks in this write: {acks:?}");
    assert!(b_answer.await.expect("answered").is_ok());
}

/// Counts txns in flight, and holds each until two are (or 200 ms passed).
#[derive(Default)]
struct InFlight {
    now: std::sync::atomic::AtomicUsize,
    most: std::sync::atomic::AtomicUsize,
}

#[async_trait::async_trait]
impl chanwatch_store::Layer for InFlight {
    async fn txn(
        &self,
        inner: &dyn MetaStore,
        txn: Txn,
    ) -> chanwatch_store::StoreResult<chanwatch_store::TxnResponse> {
        use std::sync::atomic::Ordering::SeqCst;
        let now = self.now.fetch_add(1, SeqCst) + 1;
        self.most.fetch_max(now, SeqCst);
        for _ in 0..200 {
            if self.most.load(SeqCst) >= 2 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
        let r = inner.txn(txn).await;
        self.now.fetch_sub(1, SeqCst);
        r
    }
}

/// The most txns in flight at once while `keys` are written as commits, one txn each.
async fn most_in_flight(keys: &[&str]) -> usize {
    let store = std::sync::Arc::new(chanwatch_store::Layered::new(
        std::sync::Arc::new(EmbeddedStore::new()),
        InFlight::default(),
    ));
    let chunks = keys.iter().map(|k| vec![commit(k).0]).collect();
    write_chunks(&*store, None, chunks, chanwatch_core::NodeId(1)).await;
    store.layer().most.load(std::sync::atomic::Ordering::SeqCst)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writes_txns_go_together_unless_one_key_is_written_twice() {
    assert!(
        most_in_flight(&["a", "b", "c"]).await >= 2,
        "txns of distinct keys are pipelined"
    );
    assert_eq!(
        most_in_flight(&["a", "b", "a"]).await,
        1,
        "a key written twice: its second write must follow the first"
    );
}

#[tokio::test]
async fn acks_that_all_hold_share_one_txn() {
    let store = EmbeddedStore::new();
    let writes = assigned(&store, 3).await;
    let before = store.range("a/").await.expect("range").revision;
    let out = write_acks(&store, None, writes).await;
    // One revision for all three: one txn.
    assert_eq!(committed_at(&out), vec![Some(before + 1); 3]);
}

#[tokio::test]
async fn one_changed_assignment_does_not_hold_back_the_others() {
    let store = EmbeddedStore::new();
    let writes = assigned(&store, 3).await;
    // The coordinator changed a/1 meanwhile: its ack must be refused, the others land.
    store
        .txn(Txn::new().and_then([TxnOp::put("a/1", "moved")]))
        .await
        .expect("put");
    let out = write_acks(&store, None, writes).await;
    assert!(matches!(out[1].1, AckOutcome::Refused), "{:?}", out[1].1);
    let at = committed_at(&out);
    assert!(at[0].is_some() && at[2].is_some(), "{out:?}");
    let kv = store.get("a/1").await.expect("get").expect("a/1");
    assert_eq!(kv.value, b"moved", "the refused ack wrote nothing");
}

#[tokio::test]
async fn a_session_guard_that_fails_refuses_every_ack() {
    let store = EmbeddedStore::new();
    let writes = assigned(&store, 2).await;
    // The session key does not exist (the session is gone): nothing may be acked.
    let guard = Compare::create_revision("session/9", 5);
    let out = write_acks(&store, Some(&guard), writes).await;
    assert!(
        out.iter().all(|(_, o)| matches!(o, AckOutcome::Refused)),
        "{out:?}"
    );
}
