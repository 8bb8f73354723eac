//! Bulk registration on the leader: a checked list of new channels, placed by the planner
//! ([`chanwatch_core::planner::Planner::add_channels`]) and written in packed txns, pipelined,
//! **off the leader's loop**: the loop plans the list, starts its writes and goes back to
//! the watch (nodes' acks, dead sessions), plan rounds and further requests (the next list)
//! while they commit; a finished write comes back to the loop ([`InFlight::next`]), which
//! books it into the view and answers the caller.
//!
//! Owns: [`BulkError`], the term's side of [`crate::CoordHandle::add_channels`], and the
//! names of lists being written ([`InFlight`]): until its write is booked, a name in flight
//! is refused to every other add, single or bulk (two adds of one name planned from the
//! same view could put it under two nodes: each txn only guards its own key's absence).
//! Must not: check names, sizes or duplicates (the admin API does, before anything reaches
//! the leader), or write anything but the planner's txns.

use std::collections::HashSet;
use std::sync::Arc;

use chanwatch_core::planner::{AdminError, Transition};
use chanwatch_core::{ChannelInfo, ChannelName};
use futures_util::future::BoxFuture;
use futures_util::stream::FuturesUnordered;
use futures_util::StreamExt;
use tokio::sync::{oneshot, Semaphore};
use tokio::time::Instant;
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

/// The txns of one list, each with its outcome and when it was sent.
type Outcomes = Vec<crate::execute::Sent>;

/// A list whose txns have all returned, waiting to be booked by the loop.
pub(crate) struct Written {
    outcomes: Outcomes,
    names: Vec<ChannelName>,
    reply: oneshot::Sender<Result<Vec<Transition>, BulkError>>,
    started: Instant,
    planned: Instant,
}

/// The bulk registrations of a term whose writes are in flight.
pub(crate) struct InFlight {
    writes: FuturesUnordered<BoxFuture<'static, Written>>,
    names: HashSet<ChannelName>,
    /// One list written at a time (its txns `pipeline` at once), the next planned and
    /// queued, first come first served: with each list pipelined on its own, 4 lists put
    /// 128 txns of 127 puts on etcd at once; it timed out requests (keepalives among them),
    /// nodes paused and relisted, and 50,000 channels took 60–73 s instead of 18–23 s. One
    /// at a time also answers the first list first (a caller's timeout counts from its call).
    turn: Arc<Semaphore>,
}

impl Default for InFlight {
    fn default() -> Self {
        InFlight {
            writes: FuturesUnordered::new(),
            names: HashSet::new(),
            turn: Arc::new(Semaphore::new(1)),
        }
    }
}

impl InFlight {
    /// Whether `name` is in a list being written.
    pub(crate) fn holds(&self, name: &ChannelName) -> bool {
        self.names.contains(name)
    }

    /// The next list whose write has finished; pending forever while none is in flight (for
    /// the loop's `select!`).
    pub(crate) async fn next(&mut self) -> Written {
        match self.writes.next().await {
            Some(w) => w,
            None => std::future::pending().await,
        }
    }

    /// Lists being written.
    pub(crate) fn len(&self) -> usize {
        self.writes.len()
    }
}

impl Term<'_> {
    /// Serves [`crate::CoordHandle::add_channels`]: plans the list and starts its writes;
    /// the answer goes when [`Term::bulk_written`] books them.
    pub(crate) fn add_many(
        &mut self,
        infos: Vec<ChannelInfo>,
        reply: oneshot::Sender<Result<Vec<Transition>, BulkError>>,
    ) {
        let started = self.clock.now();
        let in_flight: Vec<(usize, AdminError)> = infos
            .iter()
            .enumerate()
            .filter(|(_, i)| self.bulk.holds(&i.channel))
            .map(|(k, i)| (k, AdminError::AlreadyExists(i.channel.clone())))
            .collect();
        if !in_flight.is_empty() {
            drop(reply.send(Err(BulkError::Refused(in_flight))));
            return;
        }
        let names: Vec<ChannelName> = infos.iter().map(|i| i.channel.clone()).collect();
        let txns = match self.state.add_channels(infos, self.clock.unix_ms()) {
            Ok(t) => t,
            Err(refused) => {
                drop(reply.send(Err(BulkError::Refused(refused))));
                return;
            }
        };
        let planned = self.clock.now();
        let pipeline = self.config.pipeline.max(1);
        let turn = self.bulk.turn.clone();
        let jobs = crate::execute::sends(self.store.clone(), Arc::new(self.encoder()), txns);
        self.bulk.names.extend(names.iter().cloned());
        self.bulk.writes.push(Box::pin(async move {
            // Never closed: a failed acquire only means no turn to wait for.
            let _turn = turn.acquire_owned().await;
            let outcomes: Outcomes = futures_util::stream::iter(jobs)
                .buffered(pipeline)
                .collect()
                .await;
            Written {
                outcomes,
                names,
                reply,
                started,
                planned,
            }
        }));
    }

    /// Books a finished list into the view and answers its caller. `Err` only when a
    /// refused txn's read-back shows that leadership was lost.
    pub(crate) fn bulk_written(&mut self, w: Written) -> Result<(), String> {
        let Written {
            outcomes,
            names,
            reply,
            started,
            planned,
        } = w;
        for n in &names {
            self.bulk.names.remove(n);
        }
        let count = names.len();
        let mut added = Vec::with_capacity(count);
        let mut failed: Option<String> = None;
        let mut lost = None;
        for (t, r, started) in outcomes {
            // Not the store's pace: timed when the whole list had landed.
            self.record_txn(&r, started, false);
            match r {
                Ok(resp) if resp.succeeded => {
                    // The watch may have shown these puts already, and the nodes' acks
                    // after them (found by `bench register`: booked late, lists put their
                    // channels back to `ToWatch` in the view until the next relist, 38 s).
                    if resp.revision > self.watched_rev {
                        self.state.applied(&t, resp.revision);
                    }
                    // In the history like any transition (`ctl events`, `describe`), but
                    // logged at debug: a list is one info line, not 10,000.
                    self.events.transitions(&t.transitions);
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
            lists_in_flight = self.bulk.len(),
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
