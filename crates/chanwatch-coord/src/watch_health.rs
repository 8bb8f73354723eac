//! Whether the leader's list-watch is live, and when it relists anyway.
//!
//! Owns: two decisions of the term loop. (1) A **stalled watch**: each renewal of the leader
//! lease names the store's revision; a live watch reaches it soon after, by an event or a
//! progress notification. One that has not reached the revision of a renewal sent
//! [`stall_limit`] ago is stalled or lagging (etcd answers keepalives while the watch delivers
//! nothing: a stuck proxy, an isolated member), and the leader's view may hide acks and
//! sessions: [`StallCheck::stalled`] says so, and the term relists. (2) The **resync**: a full
//! relist every `--resync-interval`, jittered ([`resync_wait`]), only as a last resort — at
//! 100,000 channels a list is tens of MB, so liveness comes from progress, not from lists.
//!
//! Must not: touch the store or the planner; the term acts on what this says.

use std::hash::{Hash, Hasher};
use std::time::Duration;

use chanwatch_store::{Renewal, Revision, UnreachedRenewals};
use tokio::sync::watch;

/// How long a watch may stay behind a renewal's revision before the leader relists:
/// half a session TTL, at least 3 s (etcd answers a progress request within a second).
#[must_use]
pub(crate) fn stall_limit(ttl: Duration) -> Duration {
    (ttl / 2).max(Duration::from_secs(3))
}

/// The `n`-th wait between two resyncs of leader `who`: 80-100 % of `interval`, from a hash
/// (fixed keys), so standbys that take over together do not relist in step, and a
/// simulation run is the same every time.
#[must_use]
pub(crate) fn resync_wait(interval: Duration, who: &str, n: u64) -> Duration {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (who, n).hash(&mut h);
    interval.mul_f64(0.8 + (h.finish() % 1000) as f64 / 5000.0)
}

/// Follows the leader lease's renewals and the list-watch's progress.
pub(crate) struct StallCheck {
    /// `None` when the term has no lease keeper (a unit test's term).
    renewals: Option<watch::Receiver<Renewal>>,
    reached: watch::Receiver<Revision>,
    unreached: UnreachedRenewals,
    /// The last renewal noted.
    noted: Option<Renewal>,
    limit: Duration,
}

impl StallCheck {
    pub(crate) fn new(
        renewals: Option<watch::Receiver<Renewal>>,
        reached: watch::Receiver<Revision>,
        limit: Duration,
    ) -> Self {
        StallCheck {
            renewals,
            reached,
            unreached: UnreachedRenewals::default(),
            noted: None,
            limit,
        }
    }

    /// When the oldest renewal the watch has not reached yet was sent, as of the last poll
    /// of [`StallCheck::stalled`]: how long the leader's view is known to be behind.
    pub(crate) fn behind_since(&self) -> Option<tokio::time::Instant> {
        self.unreached.oldest().map(|r| r.sent)
    }

    /// Returns once the watch has not reached the revision of a renewal sent `limit` ago:
    /// that renewal. Forgets it and every later one (the caller relists, and a list reaches
    /// them all). Cancel-safe: what it has seen is kept in `self`.
    pub(crate) async fn stalled(&mut self) -> Renewal {
        loop {
            let reached = *self.reached.borrow_and_update();
            // Compared with the last one noted, not by `has_changed`: `changed()` below marks
            // a renewal seen before this loop gets to note it.
            if let Some(rx) = &mut self.renewals {
                let r = *rx.borrow_and_update();
                if self.noted != Some(r) {
                    self.noted = Some(r);
                    tracing::trace!(revision = r.revision, reached, "coord: keepalive answered");
                    self.unreached.renewed(r, reached);
                }
            }
            self.unreached.reached(reached);
            let oldest = self.unreached.oldest();
            let deadline = oldest.map(|r| r.sent + self.limit);
            let step = {
                let Self {
                    renewals, reached, ..
                } = &mut *self;
                let renewed = async {
                    match renewals {
                        Some(rx) => rx.changed().await.is_ok(),
                        None => std::future::pending().await,
                    }
                };
                let at = deadline.unwrap_or_else(tokio::time::Instant::now);
                tokio::select! {
                    live = renewed => if live { Step::Changed } else { Step::RenewalsGone },
                    live = reached.changed() => if live.is_ok() { Step::Changed } else { Step::WatchGone },
                    () = tokio::time::sleep_until(at), if deadline.is_some() => Step::Stalled,
                }
            };
            match (step, oldest) {
                (Step::Changed, _) => {}
                // The keeper is gone (the term is ending): stop following it.
                (Step::RenewalsGone, _) => self.renewals = None,
                // The list-watch is gone: the term ends on it; nothing more to say.
                (Step::WatchGone, _) => std::future::pending::<()>().await,
                (Step::Stalled, Some(r)) => {
                    self.unreached.clear();
                    return r;
                }
                (Step::Stalled, None) => {}
            }
        }
    }
}

/// What woke [`StallCheck::stalled`].
enum Step {
    Changed,
    RenewalsGone,
    WatchGone,
    Stalled,
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn resync_waits_are_jittered_within_80_to_100_percent_and_repeatable() {
        let i = Duration::from_secs(300);
        let waits: Vec<Duration> = (0..50).map(|n| resync_wait(i, "c1", n)).collect();
        assert!(waits.iter().all(|w| *w >= i.mul_f64(0.8) && *w <= i));
        assert!(waits.windows(2).any(|p| p[0] != p[1]), "jittered");
        assert_eq!(waits[7], resync_wait(i, "c1", 7), "repeatable");
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_reaches_each_renewal_is_never_stalled_and_one_that_does_not_is_after_the_limit(
    ) {
        let t0 = tokio::time::Instant::now();
        let (renew, renewals) = watch::channel(Renewal {
            sent: t0,
            revision: 0,
        });
        let (reach, reached) = watch::channel(10);
        let mut check = StallCheck::new(Some(renewals), reached, 3 * S);
        // Live: each renewal's revision is reached a moment later.
        for rev in 11..15 {
            renew.send_replace(Renewal {
                sent: tokio::time::Instant::now(),
                revision: rev,
            });
            tokio::time::sleep(S / 2).await;
            reach.send_replace(rev);
            let quiet = tokio::time::timeout(S, check.stalled()).await;
            assert!(quiet.is_err(), "a live watch is not stalled");
        }
        // Stalled: a renewal comes while the check is already waiting; the watch stays at 14.
        let started = tokio::time::Instant::now();
        let renewer = tokio::spawn(async move {
            tokio::time::sleep(S).await;
            renew.send_replace(Renewal {
                sent: tokio::time::Instant::now(),
                revision: 20,
            });
            renew
        });
        let stalled = check.stalled().await;
        assert_eq!(stalled.revision, 20);
        assert_eq!(tokio::time::Instant::now() - started, 4 * S);
        drop(renewer.await);
    }
}
