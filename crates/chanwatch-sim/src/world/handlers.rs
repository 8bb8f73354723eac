//! What the simulated nodes run: the recording handler with switches a fault can flip
//! (sick, breaking), and with the data plane the stream consumer on an in-memory log fed by a
//! producer task.
//!
//! Owns: [`Sickly`], [`Consuming`], [`DataPlane`] and its producer.
//! Must not: decide anything about a channel (the node's machine does) or read a clock other
//! than tokio's paused one.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::{ChannelName, NodeId};
use chanwatch_node::handler::{ConsumerOptions, StreamConsumer};
use chanwatch_node::{ChannelHandler, RecordingHandler};
use chanwatch_stream::Log;

use crate::MemLog;

/// Data plane: the producer appends one message to every channel this often.
const PRODUCE_EVERY: Duration = Duration::from_millis(200);

/// The data plane of a run: the log, the consumer every node runs, and the producer.
pub(super) struct DataPlane {
    pub(super) log: MemLog,
    pub(super) consumer: Arc<StreamConsumer>,
    /// Channels the producer appends to (every channel asked for, in name order).
    pub(super) channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>>,
    /// Set when the producer must stop.
    pub(super) stop: Arc<AtomicBool>,
}

impl DataPlane {
    pub(super) fn new(seed: u64) -> Self {
        let log = MemLog::new();
        // Commits every 3 s (the node's default is 1 s): a run's first commit comes late
        // enough that a remove often lands before it, the window in which only the
        // assignment's create revision fences the release's last commit.
        let consumer = Arc::new(StreamConsumer::new(
            Arc::new(log.clone()),
            ConsumerOptions {
                commit_interval: Duration::from_secs(3),
                ..ConsumerOptions::default()
            },
        ));
        let channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>> = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        tokio::spawn(produce(log.clone(), channels.clone(), stop.clone(), seed));
        DataPlane {
            log,
            consumer,
            channels,
            stop,
        }
    }
}

/// The producer: every [`PRODUCE_EVERY`], one message to every channel, with the channel's
/// next sequence number (big-endian, first 8 bytes) and bytes hashed from the seed.
async fn produce(
    log: MemLog,
    channels: Arc<std::sync::Mutex<BTreeSet<ChannelName>>>,
    stop: Arc<AtomicBool>,
    seed: u64,
) {
    let mut seqs: std::collections::BTreeMap<ChannelName, u64> = Default::default();
    while !stop.load(Ordering::SeqCst) {
        let now: Vec<ChannelName> = channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .iter()
            .cloned()
            .collect();
        for c in now {
            let seq = seqs.entry(c.clone()).or_default();
            *seq += 1;
            let mut payload = seq.to_be_bytes().to_vec();
            let salt = chanwatch_node::handler::consumer::payload_hash(
                format!("{seed}/{c}/{seq}").as_bytes(),
            );
            payload.extend_from_slice(&salt.to_be_bytes());
            let _ = log.append(c.as_str(), payload.into()).await;
        }
        tokio::time::sleep(PRODUCE_EVERY).await;
    }
}

/// The recording handler (with the data plane: it, then the consumer), except that every
/// load fails while `sick` is set, and reports its channel broken while `breaking` is.
pub(super) struct Sickly {
    pub(super) inner: Arc<dyn ChannelHandler>,
    pub(super) sick: Arc<AtomicBool>,
    pub(super) breaking: Arc<AtomicBool>,
}

#[async_trait::async_trait]
impl ChannelHandler for Sickly {
    async fn load(&self, ctx: chanwatch_node::ChannelContext) -> Result<(), String> {
        if self.sick.load(Ordering::SeqCst) {
            return Err("the node is sick (simulated)".into());
        }
        if self.breaking.load(Ordering::SeqCst) {
            ctx.fail("the channel broke while it loaded (simulated)");
        }
        self.inner.load(ctx).await
    }

    async fn release(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.release(node, info).await;
    }

    async fn pause(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.pause(node, info).await;
    }

    async fn resume(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.inner.resume(node, info).await;
    }
}

/// Data plane: the recording handler (load behaviour, intervals), then the stream consumer.
pub(super) struct Consuming {
    pub(super) recording: RecordingHandler,
    pub(super) consumer: Arc<StreamConsumer>,
}

#[async_trait::async_trait]
impl ChannelHandler for Consuming {
    async fn load(&self, ctx: chanwatch_node::ChannelContext) -> Result<(), String> {
        self.recording.load(ctx.clone()).await?;
        self.consumer.load(ctx).await
    }

    /// The recording's interval ends first: the consumer's release may spend up to 3 s on a
    /// last commit (fenced, so harmless to the data, which the checkpoint invariants check),
    /// and the overlap check is about when the node let the channel go.
    async fn release(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.recording.release(node, info).await;
        self.consumer.release(node, info).await;
    }

    async fn pause(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.consumer.pause(node, info).await;
        self.recording.pause(node, info).await;
    }

    async fn resume(&self, node: NodeId, info: &chanwatch_core::ChannelInfo) {
        self.consumer.resume(node, info).await;
        self.recording.resume(node, info).await;
    }
}
