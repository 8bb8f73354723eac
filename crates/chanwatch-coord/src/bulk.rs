//! Bulk registration on the leader: a checked list of new channels, placed by the planner
//! ([`chanwatch_core::planner::Planner::add_channels`]) and written in packed txns, run
//! pipelined like a plan round.
//!
//! Owns: [`BulkError`] and the term's side of [`crate::CoordHandle::add_channels`].
//! Must not: check names, sizes or duplicates (the admin API does, before anything reaches
//! the leader), or write anything but the planner's txns.

use chanwatch_core::planner::{AdminError, PlannedTxn, Transition};
use chanwatch_core::{ChannelInfo, ChannelName};
use chanwatch_store::{StoreError, TxnResponse};
use futures_util::StreamExt;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::handle::ApiError;
use crate::term::Term;

/// Most channels in one bulk registration (one API call; `ctl add-channels` splits longer
/// files into calls of at most this many).
pub const MAX_BULK_CHANNELS: usize = 10_000;

/// Why a bulk registration did not register every channel of its list.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BulkError {
    /// These entries (index in the list, why) are refused; nothing was written.
    #[error("{} of the listed channels are refused; nothing was written", .0.len())]
    Refused(Vec<(usize, AdminError)>),
    /// The whole request was refused before anything was written.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// A txn failed after others had committed: `added` are registered, the rest of the
    /// list is not (send the rest again).
    #[error("{} channel(s) were registered before a write failed ({error}); the rest of the list was not: send it again", .added.len())]
    Partial {
        /// The channels that were written.
        added: Vec<ChannelName>,
        /// What failed.
        error: String,
    },
}

impl Term<'_> {
    /// Serves [`crate::CoordHandle::add_channels`]. `Err` only when leadership was lost.
    pub(crate) async fn add_many(
        &mut self,
        infos: Vec<ChannelInfo>,
        reply: oneshot::Sender<Result<Vec<Transition>, BulkError>>,
    ) -> Result<(), String> {
        let count = infos.len();
        let started = self.clock.now();
        let txns = match self.state.add_channels(infos, self.clock.unix_ms()) {
            Ok(t) => t,
            Err(refused) => {
                drop(reply.send(Err(BulkError::Refused(refused))));
                return Ok(());
            }
        };
        let planned = self.clock.now();
        let store = self.store.clone();
        let clock = self.clock;
        let jobs: Vec<_> = txns
            .into_iter()
            .map(|t| {
                let s = self.to_store(&t);
                let store = store.clone();
                async move {
                    let started = clock.now();
                    (t, store.txn(s).await, started)
                }
            })
            .collect();
        let results: Vec<(
            PlannedTxn,
            Result<TxnResponse, StoreError>,
            tokio::time::Instant,
        )> = futures_util::stream::iter(jobs)
            .buffered(self.config.pipeline.max(1))
            .collect()
            .await;
        let mut added = Vec::with_capacity(count);
        let mut failed: Option<String> = None;
        let mut lost = None;
        for (t, r, started) in results {
            self.record_txn(&r, started);
            match r {
                Ok(resp) if resp.succeeded => {
                    self.state.applied(&t, resp.revision);
                    for tr in &t.transitions {
                        self.config.metrics.reassigned(tr.cause.as_str());
                        debug!(channel = %tr.channel, to = ?tr.to, "coord: channel registered");
                    }
                    added.extend(t.transitions);
                }
                Ok(resp) => {
                    failed.get_or_insert_with(|| {
                        "a channel of the list was registered meanwhile by another request".into()
                    });
                    if let Err(why) = self.refresh(&t, &resp) {
                        lost = Some(why);
                    }
                }
                Err(e) => {
                    warn!(error = %e, channels = t.transitions.len(), "coord: a bulk registration txn failed");
                    failed.get_or_insert_with(|| e.to_string());
                }
            }
        }
        info!(
            listed = count,
            registered = added.len(),
            plan_ms = crate::execute::millis(planned.saturating_duration_since(started)),
            write_ms = crate::execute::millis(self.clock.now().saturating_duration_since(planned)),
            "coord: bulk registration"
        );
        let answer = match failed {
            None => Ok(added),
            Some(error) if added.is_empty() => Err(BulkError::Api(ApiError::Store(error))),
            Some(error) => Err(BulkError::Partial {
                added: added.into_iter().map(|t| t.channel).collect(),
                error,
            }),
        };
        drop(reply.send(answer));
        lost.map_or(Ok(()), Err)
    }
}
