//! Unit tests of the reference consumer.

use super::*;

fn payload(seq: u64, rest: &[u8]) -> Vec<u8> {
    let mut p = seq.to_be_bytes().to_vec();
    p.extend_from_slice(rest);
    p
}

#[test]
fn the_fold_counts_tracks_the_highest_sequence_and_ignores_order() {
    let msgs: Vec<_> = (1..=5).map(|i| payload(i, &[i as u8; 3])).collect();
    let mut forward = StreamState::default();
    msgs.iter().for_each(|m| forward.fold(m));
    let mut backward = StreamState::default();
    msgs.iter().rev().for_each(|m| backward.fold(m));
    assert_eq!(forward, backward);
    assert_eq!((forward.count, forward.max_seq), (5, 5));
}

#[test]
fn a_message_folded_twice_or_missed_changes_the_state() {
    let msgs: Vec<_> = (1..=4).map(|i| payload(i, b"xyz")).collect();
    let mut once = StreamState::default();
    msgs.iter().for_each(|m| once.fold(m));
    let mut twice = once;
    twice.fold(&msgs[2]);
    assert_ne!(once, twice);
    let mut missed = StreamState::default();
    msgs[..3].iter().for_each(|m| missed.fold(m));
    assert_ne!(once, missed);
    assert_ne!(once.digest, missed.digest);
}

#[test]
fn the_state_round_trips_through_its_checkpoint_form_exactly() {
    let s = StreamState {
        count: 7,
        max_seq: 9,
        digest: u64::MAX - 3,
    };
    assert_eq!(StreamState::from_json(&s.to_json()), Ok(s));
    assert!(StreamState::from_json(&json!({"count": 1})).is_err());
}

/// A run whose commits are answered only when this test says so: the run's first commit
/// stays in flight while the run reads to the end of the channel; no second commit starts
/// before the first is answered; the next one carries the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reading_goes_on_while_a_commit_is_in_flight() {
    use crate::checkpoint::{CommitShared, Committer};
    use chanwatch_core::{Checkpoint, Epoch, Keys, VChannelInfo};
    use chanwatch_store::{Clock, EmbeddedStore, TxnOp};
    use chanwatch_stream::{FileLog, FileLogOptions};
    use tokio::sync::mpsc;

    let dir = tempfile::tempdir().expect("temp dir");
    let log = Arc::new(FileLog::open(dir.path(), FileLogOptions::default()).expect("log"));
    for seq in 1..=1000 {
        log.append("c-0", payload(seq, b"x").into())
            .await
            .expect("append");
    }
    let (tx, mut commits) = mpsc::unbounded_channel();
    let shared = Arc::new(CommitShared {
        store: Arc::new(EmbeddedStore::new()),
        tx,
        keys: Keys::default(),
        node: NodeId(1),
        clock: Clock::system(),
        metrics: Arc::new(crate::metrics::NodeMetrics::new()),
        planted: crate::config::Planted::default(),
    });
    let channel = ChannelName::new("c-0").expect("valid");
    let info = ChannelInfo::new(channel.clone(), Epoch(1), 0, VChannelInfo::default());
    let (events, _events) = mpsc::unbounded_channel();
    let ctx = ChannelContext {
        node: NodeId(1),
        info: info.clone(),
        clock: Clock::system(),
        events,
        last_progress: Arc::default(),
        progress_interval: Duration::from_secs(5),
        generation: 1,
        committer: Some(Committer::new(shared, channel.clone(), Epoch(1), 1)),
    };
    let consumer = StreamConsumer::new(
        log,
        ConsumerOptions {
            commit_every: 100,
            commit_interval: Duration::from_secs(60),
            batch: 100,
        },
    );
    consumer.load(ctx).await.expect("load");
    let first = tokio::time::timeout(Duration::from_secs(10), commits.recv())
        .await
        .expect("a first commit")
        .expect("open");
    let end = Position::from_raw(1000);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while consumer.folded(NodeId(1), &channel).map(|f| f.0) != Some(end) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "reading stalled behind the unanswered commit at {:?}",
            consumer.folded(NodeId(1), &channel).map(|f| f.0)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(
        commits.try_recv().is_err(),
        "a second commit started while the first was in flight"
    );
    first
        .reply
        .send(Ok(5))
        .expect("the run waits for its answer");
    let second = tokio::time::timeout(Duration::from_secs(10), commits.recv())
        .await
        .expect("a second commit")
        .expect("open");
    let TxnOp::Put { value, .. } = &second.put else {
        panic!("a commit is a put: {:?}", second.put);
    };
    let cp = Checkpoint::decode(value).expect("a checkpoint");
    assert_eq!(cp.position, "1000");
    let state = StreamState::from_json(cp.state.as_ref().expect("state")).expect("state");
    assert_eq!((state.count, state.max_seq), (1000, 1000));
    second.reply.send(Ok(6)).expect("answered");
    consumer.release(NodeId(1), &info).await;
}

#[test]
fn the_hash_and_the_sequence_are_stable() {
    assert_eq!(payload_hash(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(payload_hash(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(payload_seq(&payload(42, b"r")), Some(42));
    assert_eq!(payload_seq(b"short"), None);
}
