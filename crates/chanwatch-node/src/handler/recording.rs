//! [`RecordingHandler`]: a test handler that records when each node ran each channel (so
//! tests can check single ownership) and loads each channel as told ([`Behaviour`]). Behind
//! the `testing` feature: a fixture, not something to run channels with.
//!
//! Must not: touch the store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, ChannelName, Epoch, NodeId};
use chanwatch_store::Clock;

use super::{ChannelContext, ChannelHandler};

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

/// How a [`RecordingHandler`] should load a channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Behaviour {
    /// Load in `delay`.
    Load {
        /// The load time.
        delay: Duration,
    },
    /// Load in `delay`, reporting progress every tenth.
    Slow {
        /// The load time.
        delay: Duration,
    },
    /// Never finish (and report nothing).
    Hang,
    /// Fail at once.
    Fail,
    /// Load at once, run for `after`, then report the channel broken
    /// ([`ChannelContext::fail`]).
    BreakAfter {
        /// How long it runs before it breaks.
        after: Duration,
    },
}

#[derive(Debug, Default)]
struct Record {
    intervals: Vec<Interval>,
    behaviours: BTreeMap<String, Behaviour>,
    default: Option<Behaviour>,
}

/// A test handler: records every run interval and loads as told per channel.
#[derive(Debug, Clone, Default)]
pub struct RecordingHandler {
    inner: Arc<Mutex<Record>>,
    clock: Option<Clock>,
}

/// Closes an interval when the load or the release ends, even if the future is dropped
/// (a killed node: its channels stop running when its tasks die).
struct CloseOnDrop {
    handler: RecordingHandler,
    index: usize,
    armed: bool,
}

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        if self.armed {
            self.handler.close(self.index);
        }
    }
}

impl RecordingHandler {
    /// A handler whose timestamps come from `clock`.
    pub fn new(clock: Clock) -> Self {
        RecordingHandler {
            inner: Arc::default(),
            clock: Some(clock),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        self.clock.unwrap_or_default().unix_ms()
    }

    /// Sets how `channel` loads from now on.
    pub fn set(&self, channel: &str, b: Behaviour) {
        self.lock().behaviours.insert(channel.to_owned(), b);
    }

    /// Sets how channels without their own behaviour load.
    pub fn set_default(&self, b: Behaviour) {
        self.lock().default = Some(b);
    }

    /// Every interval so far.
    pub fn intervals(&self) -> Vec<Interval> {
        self.lock().intervals.clone()
    }

    /// Channels running (or loading) now, by node.
    pub fn running(&self) -> BTreeMap<ChannelName, Vec<NodeId>> {
        let mut out: BTreeMap<ChannelName, Vec<NodeId>> = BTreeMap::new();
        for i in self.lock().intervals.iter().filter(|i| i.end_ms.is_none()) {
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

    /// Closes every open interval of `node` now: call it when a test kills the node, the
    /// moment its process would stop running anything.
    pub fn mark_dead(&self, node: NodeId) {
        let now = self.now();
        for i in self.lock().intervals.iter_mut() {
            if i.node == node && i.end_ms.is_none() {
                i.end_ms = Some(now);
            }
        }
    }

    fn open(&self, node: NodeId, info: &ChannelInfo) -> usize {
        let start_ms = self.now();
        let mut r = self.lock();
        r.intervals.push(Interval {
            node,
            channel: info.channel.clone(),
            epoch: info.epoch,
            start_ms,
            end_ms: None,
        });
        r.intervals.len() - 1
    }

    fn close(&self, index: usize) {
        let now = self.now();
        if let Some(i) = self.lock().intervals.get_mut(index) {
            i.end_ms.get_or_insert(now);
        }
    }

    fn find_open(&self, node: NodeId, info: &ChannelInfo) -> Option<usize> {
        self.lock()
            .intervals
            .iter()
            .rposition(|i| i.node == node && i.channel == info.channel && i.end_ms.is_none())
    }
}

#[async_trait]
impl ChannelHandler for RecordingHandler {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        let index = self.open(ctx.node, &ctx.info);
        let mut guard = CloseOnDrop {
            handler: self.clone(),
            index,
            armed: true,
        };
        let behaviour = {
            let r = self.lock();
            r.behaviours
                .get(ctx.info.channel.as_str())
                .copied()
                .or(r.default)
                .unwrap_or(Behaviour::Load {
                    delay: Duration::ZERO,
                })
        };
        let result = match behaviour {
            Behaviour::Load { delay } => {
                ctx.clock().sleep(delay).await;
                Ok(())
            }
            Behaviour::Slow { delay } => {
                for step in 0..10u8 {
                    ctx.progress(step * 10);
                    ctx.clock().sleep(delay / 10).await;
                }
                Ok(())
            }
            Behaviour::Hang => std::future::pending().await,
            Behaviour::Fail => Err("simulated load failure".to_owned()),
            Behaviour::BreakAfter { after } => {
                let ctx = ctx.clone();
                tokio::spawn(async move {
                    ctx.clock().sleep(after).await;
                    ctx.fail("simulated break of a running channel");
                });
                Ok(())
            }
        };
        // Still running after a successful load: `release`, or `mark_dead` for a killed
        // node, closes it.
        guard.armed = result.is_err();
        result
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(index) = self.find_open(node, info) {
            self.close(index);
        }
    }

    /// A paused channel does not run: its interval ends here.
    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        if let Some(index) = self.find_open(node, info) {
            self.close(index);
        }
    }

    /// And a new one begins.
    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        self.open(node, info);
    }
}
