//! [`OwnershipLog`]: an in-memory record of when each node ran each channel, and the
//! single-ownership audit over it ([`OwnershipLog::overlaps`]). `demo` checks invariant 1 with
//! it; the test fixture `RecordingHandler` (feature `testing`) records into one.
//!
//! Owns: the intervals and the arithmetic of overlaps. Must not: touch the store or decide
//! anything — a handler opens and closes intervals as its channels load, stop, pause, resume.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use chanwatch_core::{ChannelInfo, ChannelName, Epoch, NodeId};
use chanwatch_store::Clock;

/// One stretch of time during which a node ran (or loaded) a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interval {
    /// The node.
    pub node: NodeId,
    /// The channel.
    pub channel: ChannelName,
    /// The epoch of the assignment.
    pub epoch: Epoch,
    /// Unix ms when the load began.
    pub start_ms: u64,
    /// Unix ms when it was released or cancelled (`None`: still running).
    pub end_ms: Option<u64>,
}

/// Who ran what, when: shared by clones (one log for every node of an in-process cluster).
#[derive(Debug, Clone, Default)]
pub struct OwnershipLog {
    intervals: Arc<Mutex<Vec<Interval>>>,
    clock: Option<Clock>,
}

impl OwnershipLog {
    /// An empty log whose timestamps come from `clock`.
    pub fn new(clock: Clock) -> Self {
        OwnershipLog {
            intervals: Arc::default(),
            clock: Some(clock),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Interval>> {
        self.intervals
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        self.clock.unwrap_or_default().unix_ms()
    }

    /// Every interval so far.
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock().clone()
    }

    /// Channels running (or loading) now, by node.
    pub fn running(&self) -> BTreeMap<ChannelName, Vec<NodeId>> {
        let mut out: BTreeMap<ChannelName, Vec<NodeId>> = BTreeMap::new();
        for i in self.lock().iter().filter(|i| i.end_ms.is_none()) {
            out.entry(i.channel.clone()).or_default().push(i.node);
        }
        out
    }

    /// Pairs of intervals of one channel on two different nodes that overlap in time:
    /// violations of single ownership. `end` equal to the other's `start` does not overlap.
    pub fn overlaps(&self) -> Vec<(Interval, Interval)> {
        let intervals = self.intervals();
        let mut out = Vec::new();
        for (i, a) in intervals.iter().enumerate() {
            for b in &intervals[i + 1..] {
                if a.channel != b.channel || a.node == b.node {
                    continue;
                }
                let a_end = a.end_ms.unwrap_or(u64::MAX);
                let b_end = b.end_ms.unwrap_or(u64::MAX);
                if a.start_ms < b_end && b.start_ms < a_end {
                    out.push((a.clone(), b.clone()));
                }
            }
        }
        out
    }

    /// Closes every open interval of `node` now: call it when a node is killed, the moment
    /// its process would stop running anything.
    pub fn mark_dead(&self, node: NodeId) {
        let now = self.now();
        for i in self.lock().iter_mut() {
            if i.node == node && i.end_ms.is_none() {
                i.end_ms = Some(now);
            }
        }
    }

    /// Opens an interval of `info`'s channel on `node`, now; returns its index.
    pub fn open(&self, node: NodeId, info: &ChannelInfo) -> usize {
        let start_ms = self.now();
        let mut intervals = self.lock();
        intervals.push(Interval {
            node,
            channel: info.channel.clone(),
            epoch: info.epoch,
            start_ms,
            end_ms: None,
        });
        intervals.len() - 1
    }

    /// Closes the interval at `index` now (if it is still open).
    pub fn close(&self, index: usize) {
        let now = self.now();
        if let Some(i) = self.lock().get_mut(index) {
            i.end_ms.get_or_insert(now);
        }
    }

    /// Closes the latest open interval of `info`'s channel on `node`, if any: its release or
    /// pause.
    pub fn close_open(&self, node: NodeId, info: &ChannelInfo) {
        let index = self
            .lock()
            .iter()
            .rposition(|i| i.node == node && i.channel == info.channel && i.end_ms.is_none());
        if let Some(index) = index {
            self.close(index);
        }
    }

    /// Opens an interval that closes when the returned guard drops, unless
    /// [`OpenGuard::keep`] is called: a load whose future is dropped (a killed node's) or that
    /// fails stops running there.
    pub fn open_guarded(&self, node: NodeId, info: &ChannelInfo) -> OpenGuard {
        OpenGuard {
            log: self.clone(),
            index: self.open(node, info),
            armed: true,
        }
    }
}

/// An interval that closes on drop unless kept ([`OwnershipLog::open_guarded`]).
#[derive(Debug)]
pub struct OpenGuard {
    log: OwnershipLog,
    index: usize,
    armed: bool,
}

impl OpenGuard {
    /// The load succeeded: the interval stays open until the channel's release or pause.
    pub fn keep(mut self) {
        self.armed = false;
    }
}

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if self.armed {
            self.log.close(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(channel: &str) -> ChannelInfo {
        ChannelInfo::new(
            ChannelName::new(channel).expect("a valid name"),
            Epoch(1),
            0,
            Default::default(),
        )
    }

    #[test]
    fn two_nodes_running_one_channel_at_once_overlap_and_a_handover_does_not() {
        let log = OwnershipLog::default();
        let a = log.open(NodeId(1), &info("c"));
        log.close(a);
        log.open(NodeId(2), &info("c"));
        assert_eq!(
            log.overlaps(),
            vec![],
            "end == start is a handover, not an overlap"
        );
        log.open(NodeId(3), &info("c"));
        assert_eq!(log.overlaps().len(), 1);
        log.mark_dead(NodeId(2));
        assert_eq!(
            log.running().get(&ChannelName::new("c").expect("valid")),
            Some(&vec![NodeId(3)])
        );
    }

    #[test]
    fn a_guard_dropped_unkept_closes_its_interval_and_a_kept_one_stays_open() {
        let log = OwnershipLog::default();
        drop(log.open_guarded(NodeId(1), &info("c")));
        assert!(log.intervals()[0].end_ms.is_some());
        log.open_guarded(NodeId(1), &info("d")).keep();
        assert_eq!(log.intervals()[1].end_ms, None);
        log.close_open(NodeId(1), &info("d"));
        assert!(log.intervals()[1].end_ms.is_some());
    }
}
