//! Every channel's checkpoint as the admin API and the status page show it, read straight
//! from the store: one range of `{root}/worker/checkpoint/` per request.
//!
//! Not from the coordinator's view: its list-watch leaves `{root}/worker/checkpoint/` out (every
//! commit of every node would otherwise reach the leader), so the leader does not know them.
//!
//! Owns: that read and its rows. Must not: write, or feed anything it reads to the planner.

use chanwatch_core::Keys;
use chanwatch_store::{Clock, MetaStore};
use serde::{Deserialize, Serialize};

/// One channel's checkpoint, without the handler's state (it can be 64 KiB a channel, and
/// only the handler reads it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRow {
    /// The channel.
    pub channel: String,
    /// The epoch of the assignment it was written under.
    pub epoch: u64,
    /// Opaque stream position.
    pub position: String,
    /// When it was written (Unix ms, the writer's clock).
    pub updated_at_ms: u64,
    /// `now_ms - updated_at_ms` (0 when the writer's clock is ahead).
    pub age_ms: u64,
}

/// The answer to `GET /api/v1/checkpoints`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoints {
    /// The coordinator's clock when it read them (Unix ms): ages are measured from it.
    pub now_ms: u64,
    /// The store revision of the read.
    pub revision: i64,
    /// Every checkpoint, in key order.
    pub checkpoints: Vec<CheckpointRow>,
    /// Keys under the prefix that are not a checkpoint (bad name or value), and why.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub corrupt: Vec<(String, String)>,
}

/// What this read decodes of a stored [`chanwatch_core::Checkpoint`]: the fields it shows.
/// The handler's state (up to 64 KiB) and unknown fields are skipped, not built.
#[derive(Deserialize)]
struct Head {
    epoch: u64,
    position: String,
    updated_at_ms: u64,
}

/// Reads every checkpoint with one range.
///
/// # Errors
/// The store's error, as text (the store is out of reach: retry).
pub(crate) async fn read(
    store: &dyn MetaStore,
    keys: &Keys,
    clock: Clock,
) -> Result<Checkpoints, String> {
    let list = store
        .range(&keys.checkpoints_prefix())
        .await
        .map_err(|e| e.to_string())?;
    let now_ms = clock.unix_ms();
    let mut out = Checkpoints {
        now_ms,
        revision: list.revision,
        checkpoints: Vec::with_capacity(list.kvs.len()),
        corrupt: Vec::new(),
    };
    for kv in list.kvs {
        let decoded = keys
            .parse_checkpoint(&kv.key)
            .map_err(|e| e.to_string())
            .and_then(|c| {
                serde_json::from_slice::<Head>(&kv.value)
                    .map(|cp| (c, cp))
                    .map_err(|e| format!("not a checkpoint: {e}"))
            });
        match decoded {
            Ok((channel, cp)) => out.checkpoints.push(CheckpointRow {
                channel: channel.to_string(),
                epoch: cp.epoch,
                position: cp.position,
                updated_at_ms: cp.updated_at_ms,
                age_ms: now_ms.saturating_sub(cp.updated_at_ms),
            }),
            Err(why) => out.corrupt.push((kv.key, why)),
        }
    }
    Ok(out)
}
