//! Acknowledgements: group commit of a session's acks, one txn for many when it can, one per
//! ack when the shared one is refused.
//!
//! Owns: chunking acks to the store's limits, the write in flight and booking its outcomes.
//! Must not: decide what to ack (the node machine does) or run channels.

use chanwatch_core::node::NodeEvent;
use chanwatch_core::{ChannelInfo, ChannelState};
use chanwatch_store::{Compare, MetaStore, Txn, TxnOp};
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::config::PlantedBug;
use crate::session::Session;

/// One acknowledgement to write.
pub(crate) struct AckWrite {
    pub(crate) info: ChannelInfo,
    /// The key's mod revision must be unchanged (`None` only under a planted bug).
    pub(crate) compare: Option<Compare>,
    pub(crate) put: TxnOp,
}

/// How one acknowledgement write ended.
#[derive(Debug)]
pub(crate) enum AckOutcome {
    Committed(i64),
    /// A compare failed: the assignment changed (or the session ended) meanwhile.
    Refused,
    Failed(String),
}

/// Writes acks in one shared txn (one compare per key, plus the session guard), and falls
/// back to one txn per ack when the shared one fails, so that one changed assignment cannot
/// hold back the others (DESIGN.md §4).
pub(crate) async fn write_acks(
    store: &dyn MetaStore,
    session: Option<&Compare>,
    chunk: Vec<AckWrite>,
) -> Vec<(ChannelInfo, AckOutcome)> {
    if chunk.len() > 1 {
        let compares = session
            .cloned()
            .into_iter()
            .chain(chunk.iter().filter_map(|w| w.compare.clone()));
        let puts = chunk.iter().map(|w| w.put.clone());
        match store.txn(Txn::new().when(compares).and_then(puts)).await {
            Ok(r) if r.succeeded => {
                return chunk
                    .into_iter()
                    .map(|w| (w.info, AckOutcome::Committed(r.revision)))
                    .collect();
            }
            Ok(_) => debug!(
                acks = chunk.len(),
                "node: a batched ack's compare failed; acking one by one"
            ),
            Err(e) => warn!(error = %e, "node: batched ack failed; acking one by one"),
        }
    }
    let mut out = Vec::with_capacity(chunk.len());
    for w in chunk {
        let compares = session.cloned().into_iter().chain(w.compare);
        let outcome = match store.txn(Txn::new().when(compares).and_then([w.put])).await {
            Ok(r) if r.succeeded => AckOutcome::Committed(r.revision),
            Ok(_) => AckOutcome::Refused,
            Err(e) => AckOutcome::Failed(e.to_string()),
        };
        out.push((w.info, outcome));
    }
    out
}

impl Session {
    /// Sends what is queued for acknowledgement, unless a write is already in flight: then
    /// it goes when that one returns, together with whatever queued meanwhile (group
    /// commit). The event loop does not wait for the store, so it keeps starting channels
    /// while acks travel; with the loop blocked on each ack, a node under a burst of
    /// assignments started its next channels only one ack round trip later, and ack
    /// latency grew with the burst (the `ack` bench).
    pub(crate) fn send_acks(&mut self) {
        if self.ack_in_flight || self.ack_queue.is_empty() {
            return;
        }
        // A paused node claims nothing: `Watched` waits for the resume. Saying it has stopped
        // a channel (`Released`, `WatchFailed`) is true paused or not, and lets the channel
        // move without a fence when the node can write but not watch (a stalled watch).
        let paused = self.pause.borrow().is_some();
        let (now, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.ack_queue)
            .into_iter()
            .partition(|(info, _)| !paused || info.state != ChannelState::Watched);
        self.ack_queue = later;
        if now.is_empty() {
            return;
        }
        let unguarded = self.planted_bug == Some(PlantedBug::UnguardedAck);
        let session = (!unguarded).then(|| self.session_guard());
        // One compare slot is the session guard. Values are capped at 64 KiB, so a byte
        // budget of half the request limit also bounds a chunk.
        let max_keys = self.store.limits().max_txn_ops.saturating_sub(1).max(1);
        let max_bytes = self.store.limits().max_request_bytes / 2;
        let mut chunks: Vec<Vec<AckWrite>> = vec![Vec::new()];
        let mut bytes = 0;
        // In channel order: runners woken together (a resume) queue their acks in whatever
        // order the scheduler woke them (tokio's watch wakes its waiters through randomly
        // chosen shards), and a simulation must replay the same txns.
        let mut queue = now;
        queue.sort_by(|a, b| a.0.channel.cmp(&b.0.channel));
        for (info, expect) in queue {
            let key = self.key(&info.channel);
            let value = info.encode();
            let last = chunks.last().map_or(0, Vec::len);
            if last > 0 && (last >= max_keys || bytes + value.len() > max_bytes) {
                chunks.push(Vec::new());
                bytes = 0;
            }
            bytes += value.len();
            let write = AckWrite {
                compare: (!unguarded).then(|| Compare::mod_revision(&key, expect)),
                put: TxnOp::put(key, value),
                info,
            };
            if let Some(c) = chunks.last_mut() {
                c.push(write);
            }
        }
        self.ack_in_flight = true;
        let store = self.store.clone();
        let done = self.acks_done_tx.clone();
        self.ack_task = Some(AbortOnDropHandle::new(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for chunk in chunks {
                outcomes.extend(write_acks(store.as_ref(), session.as_ref(), chunk).await);
            }
            let _ = done.send(outcomes);
        })));
    }

    /// Books the outcomes of one ack write and sends what queued meanwhile.
    pub(crate) async fn acks_done(&mut self, outcomes: Vec<(ChannelInfo, AckOutcome)>) {
        self.ack_in_flight = false;
        let mut cmds = Vec::new();
        for (info, outcome) in outcomes {
            let committed = match outcome {
                AckOutcome::Committed(rev) => {
                    self.metrics.acks("committed", 1);
                    debug!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack committed");
                    self.observe_ack(&info);
                    Some(rev)
                }
                AckOutcome::Refused => {
                    self.metrics.acks("refused", 1);
                    info!(node = %self.reg.id, channel = %info.channel, state = %info.state, "node: ack refused: the assignment changed meanwhile");
                    None
                }
                AckOutcome::Failed(e) => {
                    self.metrics.acks("error", 1);
                    self.retry_acks
                        .store(true, std::sync::atomic::Ordering::Relaxed);
                    warn!(node = %self.reg.id, channel = %info.channel, error = %e, "node: ack failed; retrying after a relist");
                    None
                }
            };
            cmds.extend(self.machine.step(NodeEvent::AckDone {
                channel: info.channel,
                committed,
            }));
        }
        self.execute_or_fence(cmds).await;
        self.send_acks();
    }

    fn observe_ack(&mut self, info: &ChannelInfo) {
        if info.state == chanwatch_core::ChannelState::Watched {
            if let Some(seen) = self.seen_at.remove(&info.channel) {
                let secs = self
                    .clock
                    .now()
                    .saturating_duration_since(seen)
                    .as_secs_f64();
                self.metrics.ack_latency.observe(secs);
            }
        }
    }
}

#[cfg(test)]
mod tests {
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
                compare: Some(Compare::mod_revision(&key, rev)),
                put: TxnOp::put(&key, info.encode()),
                info,
            });
        }
        out
    }

    fn committed_at(outcomes: &[(ChannelInfo, AckOutcome)]) -> Vec<Option<i64>> {
        outcomes
            .iter()
            .map(|(_, o)| match o {
                AckOutcome::Committed(rev) => Some(*rev),
                _ => None,
            })
            .collect()
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
}
