//! [`RecordingHandler`]: a test handler that records when each node ran each channel into an
//! [`OwnershipLog`] (so tests can check single ownership) and loads each channel as told
//! ([`Behaviour`]). Behind the `testing` feature: a fixture, not something to run channels with.
//!
//! Must not: touch the store.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use chanwatch_core::{ChannelInfo, ChannelName, NodeId};
use chanwatch_store::Clock;

use super::ownership::{Interval, OwnershipLog};
use super::{ChannelContext, ChannelHandler};

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
    behaviours: BTreeMap<String, Behaviour>,
    default: Option<Behaviour>,
}

/// A test handler: records every run interval and loads as told per channel.
#[derive(Debug, Clone, Default)]
pub struct RecordingHandler {
    inner: Arc<Mutex<Record>>,
    log: OwnershipLog,
}

impl RecordingHandler {
    /// A handler whose timestamps come from `clock`.
    pub fn new(clock: Clock) -> Self {
        RecordingHandler {
            inner: Arc::default(),
            log: OwnershipLog::new(clock),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Record> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Sets how `channel` loads from now on.
    pub fn set(&self, channel: &str, b: Behaviour) {
        self.lock().behaviours.insert(channel.to_owned(), b);
    }

    /// Sets how channels without their own behaviour load.
    pub fn set_default(&self, b: Behaviour) {
        self.lock().default = Some(b);
    }

    /// The log it records into.
    pub fn log(&self) -> &OwnershipLog {
        &self.log
    }

    /// Every interval so far.
    pub fn intervals(&self) -> Vec<Interval> {
        self.log.intervals()
    }

    /// Channels running (or loading) now, by node.
    pub fn running(&self) -> BTreeMap<ChannelName, Vec<NodeId>> {
        self.log.running()
    }

    /// Overlapping intervals of one channel on two nodes ([`OwnershipLog::overlaps`]).
    pub fn overlaps(&self) -> Vec<(Interval, Interval)> {
        self.log.overlaps()
    }

    /// Closes every open interval of `node` now ([`OwnershipLog::mark_dead`]).
    pub fn mark_dead(&self, node: NodeId) {
        self.log.mark_dead(node);
    }
}

#[async_trait]
impl ChannelHandler for RecordingHandler {
    async fn load(&self, ctx: ChannelContext) -> Result<(), String> {
        // Closed if the load fails or its future is dropped (a killed node); kept open after
        // a successful load until `release`, or `mark_dead` for a killed node.
        let guard = self.log.open_guarded(ctx.node, &ctx.info);
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
        if result.is_ok() {
            guard.keep();
        }
        result
    }

    async fn release(&self, node: NodeId, info: &ChannelInfo) {
        self.log.close_open(node, info);
    }

    /// A paused channel does not run: its interval ends here.
    async fn pause(&self, node: NodeId, info: &ChannelInfo) {
        self.log.close_open(node, info);
    }

    /// And a new one begins.
    async fn resume(&self, node: NodeId, info: &ChannelInfo) {
        self.log.open(node, info);
    }
}
