//! Keeping a lease alive: the one renewal loop of every part that holds a lease (a node's
//! session, the coordinator's leader key).
//!
//! Owns: the cadence (every ttl/3; every 500 ms while renewals fail, so a part learns within a
//! second that the store is back; at once after one that went unanswered — the store sends it
//! to the next etcd member), the per-attempt timeout (ttl/6), what a success means (the
//! [`Renewal`]: when the request was *sent* — the lease runs from when the store got it, which
//! is no earlier — and the revision the answer named), the log lines, and the least TTL this
//! cadence can keep alive ([`MIN_SESSION_TTL`]). Must not: decide what a failing lease means
//! for its holder (a node pauses, a leader steps down): it reports, the holder decides.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tracing::{info, warn};

use crate::{Clock, LeaseId, MetaStore, Revision, StoreError};

/// A renewal that succeeded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal {
    /// When the request was sent: the lease cannot expire before `sent + ttl`.
    pub sent: Instant,
    /// The store's revision in the answer (`0`: unknown). A watch that has not reached it is
    /// behind.
    pub revision: Revision,
}

/// Most renewals [`UnreachedRenewals`] remembers; the earliest are the ones that count.
const UNREACHED_CAP: usize = 64;

/// Renewals whose revision a list-watch has not reached yet, oldest first: how a lease
/// holder tells a quiet watch from a stalled one. Each renewal's answer names the store's
/// revision then; a watch that is live reaches it soon after (by an event or a progress
/// notification). One that has not reached the revision of a renewal sent long ago is stalled
/// or lagging, and its holder's view may hide anything written since. A node pauses on it; a
/// leader relists.
#[derive(Debug, Default)]
pub struct UnreachedRenewals(std::collections::VecDeque<Renewal>);

impl UnreachedRenewals {
    /// Notes a renewal unless the watch (at `reached`) has got to its revision already.
    pub fn renewed(&mut self, r: Renewal, reached: Revision) {
        let newer = !matches!(self.0.back(), Some(b) if r.revision <= b.revision);
        if r.revision > reached && newer && self.0.len() < UNREACHED_CAP {
            self.0.push_back(r);
        }
    }

    /// Forgets the renewals the watch has caught up with.
    pub fn reached(&mut self, reached: Revision) {
        while self.0.front().is_some_and(|r| r.revision <= reached) {
            self.0.pop_front();
        }
    }

    /// The oldest renewal the watch has not reached.
    #[must_use]
    pub fn oldest(&self) -> Option<Renewal> {
        self.0.front().copied()
    }

    /// Forgets every renewal (the holder relisted: a list reaches them all).
    pub fn clear(&mut self) {
        self.0.clear();
    }
}

/// The shortest session TTL a coordinator or node accepts: below it a lease can expire between
/// two keepalives of a loaded process. The node's library refuses a shorter one, and so does
/// the binary's `--session-ttl` (`coord`, `node`, `standalone`).
pub const MIN_SESSION_TTL: Duration = Duration::from_secs(2);

/// How long before a lease could expire its holder stops acting on it (a node pauses, a
/// leader steps down) when renewals fail: `max(1 s, ttl / 5)`. The one definition for
/// coordinators, and the default and least value for nodes (`node --fence-margin` may
/// raise it).
#[must_use]
pub fn fence_margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_secs(1))
}

/// How often a failing renewal is tried again.
const RETRY: Duration = Duration::from_millis(500);

/// Renews `lease` until the store says it no longer exists, then returns. Publishes every
/// success on `renewed`, and signals `recovered` (if given) when a renewal succeeds after
/// failures. `who` names the holder in log lines (`node`, `coord`).
pub async fn keep_lease(
    store: Arc<dyn MetaStore>,
    lease: LeaseId,
    ttl: Duration,
    clock: Clock,
    renewed: watch::Sender<Renewal>,
    recovered: Option<mpsc::UnboundedSender<()>>,
    who: &'static str,
) {
    let period = ttl / 3;
    // Half the period: a renewal that goes unanswered (a member that hangs or is cut off) is
    // followed at once by one to the next member, and both fit before the holder's limit
    // (`ttl − margin`, at least 2·ttl/3 with the largest margin a node accepts). With a
    // whole period each and a 500 ms pause, one hung renewal paused a node of a 4 s TTL.
    let answer_within = period / 2;
    let mut failing = 0u32;
    let mut at_once = false;
    // When the last renewal was sent: the next is due a period after it (not after its
    // answer, which may have taken a while), so the holder's limit keeps its room.
    let mut last_sent = clock.now();
    loop {
        if !std::mem::take(&mut at_once) {
            if failing > 0 {
                clock.sleep(RETRY.min(period)).await;
            } else {
                clock.sleep_until(last_sent + period).await;
            }
        }
        let sent = clock.now();
        last_sent = sent;
        let attempt = tokio::time::timeout(answer_within, store.keepalive(lease)).await;
        let error = match attempt {
            Ok(Ok(revision)) => {
                if failing > 0 {
                    info!(lease, failures = failing, "{who}: keepalive succeeds again");
                    if let Some(r) = &recovered {
                        let _ = r.send(());
                    }
                }
                failing = 0;
                let _ = renewed.send(Renewal { sent, revision });
                continue;
            }
            Ok(Err(StoreError::LeaseNotFound(_))) => {
                warn!(lease, "{who}: the store says our lease is gone");
                return;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => {
                at_once = true;
                format!("no answer within {answer_within:?}")
            }
        };
        failing += 1;
        // One line when the trouble starts, then one every 20 attempts (10 s or less).
        if failing % 20 == 1 {
            warn!(lease, failures = failing, error = %error, "{who}: keepalive failed; retrying every 500 ms");
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_renewal_counts_until_the_watch_reaches_its_revision() {
        let t0 = Instant::now();
        let r = |rev| Renewal {
            sent: t0,
            revision: rev,
        };
        let mut u = UnreachedRenewals::default();
        u.renewed(r(5), 5);
        assert_eq!(u.oldest(), None, "already reached");
        u.renewed(r(7), 5);
        u.renewed(r(7), 5);
        u.renewed(r(9), 5);
        assert_eq!(u.oldest(), Some(r(7)), "the oldest unreached one counts");
        u.reached(8);
        assert_eq!(u.oldest(), Some(r(9)));
        u.reached(9);
        assert_eq!(u.oldest(), None);
    }

    use super::*;
    use crate::{EmbeddedStore, FaultyStore};

    #[tokio::test(start_paused = true)]
    async fn renewals_are_published_retried_fast_while_failing_and_end_when_the_lease_is_gone() {
        let inner = EmbeddedStore::new();
        let (store, faults) = FaultyStore::new(inner.clone());
        let lease = inner
            .grant(Duration::from_secs(3))
            .await
            .map(|l| l.id)
            .unwrap_or_default();
        let start = Renewal {
            sent: Instant::now(),
            revision: 0,
        };
        let (tx, mut rx) = watch::channel(start);
        let (rec_tx, mut rec_rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(keep_lease(
            Arc::new(store),
            lease,
            Duration::from_secs(3),
            Clock::system(),
            tx,
            Some(rec_tx),
            "test",
        ));
        // Every ttl/3 = 1 s.
        tokio::time::sleep(Duration::from_millis(1_050)).await;
        assert!(rx.has_changed().unwrap_or(false), "renewed after 1 s");
        rx.borrow_and_update();
        // Failing: tried again every 500 ms; the first success after says so.
        faults.fail_keepalives(true);
        tokio::time::sleep(Duration::from_millis(1_100)).await;
        assert!(
            !rx.has_changed().unwrap_or(true),
            "no success while failing"
        );
        faults.fail_keepalives(false);
        tokio::time::sleep(Duration::from_millis(600)).await;
        assert!(
            rx.has_changed().unwrap_or(false),
            "renewed within 500 ms of recovery"
        );
        assert!(rec_rx.try_recv().is_ok(), "recovery signalled");
        // A renewal that goes unanswered is given ttl/6 (500 ms) and followed at once by the
        // next: renewed again within the second after the hang began, well inside the limit.
        tokio::time::sleep(Duration::from_millis(1_050)).await;
        rx.borrow_and_update();
        let hung_from = Instant::now();
        faults.delay_keepalives(Duration::from_secs(60));
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        faults.delay_keepalives(Duration::ZERO);
        tokio::time::timeout(Duration::from_secs(2), rx.changed())
            .await
            .ok();
        let after = rx.borrow_and_update().sent - hung_from;
        assert!(
            after < Duration::from_millis(1_600),
            "renewed {after:?} after renewals began to hang for 1 s (at once after each \
             unanswered one, not 500 ms later after a whole period)"
        );
        // Gone: the loop ends.
        inner.revoke(lease).await.ok();
        let ended = tokio::time::timeout(Duration::from_secs(2), task).await;
        assert!(ended.is_ok(), "the keeper returns once the lease is gone");
    }
}
