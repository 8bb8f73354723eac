//! The node's self-fencing watchdog: when to pause every channel, and when it is safe to
//! resume.
//!
//! Owns: the decision, from three inputs — the last renewal that succeeded (when it was sent
//! and the store revision its answer named), since when the list-watch has been failing, and
//! the revision up to which the list-watch has handed over every change. It pauses when any of
//! them has been bad for `limit` (ttl − margin):
//! - no renewal was sent successfully for `limit`: the lease may expire soon;
//! - the list-watch has failed for `limit`: the node cannot see its assignments;
//! - the watch has not reached the revision of a renewal sent `limit` ago: it is stalled or
//!   lagging silently (etcd answers keepalives but the watch delivers nothing, as behind a
//!   stuck proxy or on an isolated member), so a release request may be waiting unseen and
//!   the coordinator will fence this node.
//!
//! It resumes when a renewal succeeds again within `limit`, the list-watch runs and has caught
//! up with every renewal's revision.
//!
//! Must not: touch the store, the runners or the handler; it only sets the `pause` signal the
//! runners follow and asks the event loop to relist when renewals succeed while paused.

use std::time::Duration;

use chanwatch_store::Revision;
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

pub(crate) use chanwatch_store::Renewal;

/// Why to pause now, if a deadline has passed.
fn verdict(
    now: Instant,
    last: Renewal,
    blind_since: Option<Instant>,
    behind: Option<Renewal>,
    limit: Duration,
) -> Result<Instant, String> {
    if now >= last.sent + limit {
        return Err(format!(
            "no keepalive succeeded for {limit:?}: the store is down or out of reach"
        ));
    }
    if blind_since.is_some_and(|since| now >= since + limit) {
        return Err(format!(
            "its watch has failed for {limit:?}: it cannot see its assignments"
        ));
    }
    if let Some(r) = behind.filter(|r| now >= r.sent + limit) {
        return Err(format!(
            "its watch has not reached revision {} (named by a keepalive answer {limit:?} ago): \
             it is stalled or lagging and may hide a release request",
            r.revision
        ));
    }
    let mut deadline = last.sent + limit;
    if let Some(since) = blind_since {
        deadline = deadline.min(since + limit);
    }
    if let Some(r) = behind {
        deadline = deadline.min(r.sent + limit);
    }
    Ok(deadline)
}

/// Runs until the session ends (a sender is dropped). See the module docs.
pub(crate) async fn watchdog(
    mut last_ok: watch::Receiver<Renewal>,
    mut blind: watch::Receiver<Option<Instant>>,
    mut reached: watch::Receiver<Revision>,
    limit: Duration,
    pause: watch::Sender<Option<String>>,
    renewals: mpsc::UnboundedSender<()>,
) {
    let mut behind = chanwatch_store::UnreachedRenewals::default();
    let mut seen: Option<Renewal> = None;
    loop {
        let last = *last_ok.borrow_and_update();
        let caught_up = *reached.borrow_and_update();
        if seen != Some(last) {
            seen = Some(last);
            behind.renewed(last, caught_up);
        }
        behind.reached(caught_up);
        let blind_since = *blind.borrow_and_update();
        let now = Instant::now();
        let decided = verdict(now, last, blind_since, behind.oldest(), limit);
        if pause.borrow().is_none() {
            let deadline = match decided {
                Err(why) => {
                    pause.send_replace(Some(why));
                    continue;
                }
                Ok(deadline) => deadline,
            };
            tokio::select! {
                biased;
                changed = last_ok.changed() => if changed.is_err() { return },
                changed = blind.changed() => if changed.is_err() { return },
                changed = reached.changed() => if changed.is_err() { return },
                () = tokio::time::sleep_until(deadline) => {}
            }
        } else {
            if decided.is_ok() {
                pause.send_replace(None);
                continue;
            }
            tokio::select! {
                biased;
                changed = last_ok.changed() => {
                    if changed.is_err() { return }
                    // Renewed while paused: the event loop relists at once, which also
                    // replaces a stalled watch with a fresh one.
                    let _ = renewals.send(());
                }
                changed = blind.changed() => if changed.is_err() { return },
                changed = reached.changed() => if changed.is_err() { return },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: Duration = Duration::from_secs(3);

    struct Rig {
        last_ok: watch::Sender<Renewal>,
        _blind: watch::Sender<Option<Instant>>,
        reached: watch::Sender<Revision>,
        pause: watch::Receiver<Option<String>>,
        relists: mpsc::UnboundedReceiver<()>,
        _task: tokio::task::JoinHandle<()>,
    }

    fn rig() -> Rig {
        let start = Renewal {
            sent: Instant::now(),
            revision: 10,
        };
        let (last_ok, last_rx) = watch::channel(start);
        let (blind, blind_rx) = watch::channel(None);
        let (reached, reached_rx) = watch::channel(10);
        let (pause_tx, pause) = watch::channel(None);
        let (renewals, relists) = mpsc::unbounded_channel();
        let task = tokio::spawn(watchdog(
            last_rx, blind_rx, reached_rx, LIMIT, pause_tx, renewals,
        ));
        Rig {
            last_ok,
            _blind: blind,
            reached,
            pause,
            relists,
            _task: task,
        }
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    fn renew(rig: &Rig, revision: Revision) {
        rig.last_ok.send_replace(Renewal {
            sent: Instant::now(),
            revision,
        });
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_keeps_up_never_pauses() {
        let rig = rig();
        for rev in 11..40 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            renew(&rig, rev);
            rig.reached.send_replace(rev);
            settle().await;
            // At every step, not only at the end: a pause that came and went is a pause.
            assert_eq!(*rig.pause.borrow(), None, "paused at revision {rev}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_behind_its_keepalives_for_the_limit_pauses_and_resumes_once_caught_up() {
        let mut rig = rig();
        // Renewals go on, but the watch stays at 10 while they name 11, 12, ...
        for rev in 11..=13 {
            tokio::time::sleep(Duration::from_secs(1)).await;
            renew(&rig, rev);
        }
        settle().await;
        // 3 s after the renewal that named 11 (sent at t = 1 s): at t = 4 s.
        assert_eq!(*rig.pause.borrow(), None, "not yet: at t = 3 s");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let why = rig.pause.borrow().clone().unwrap_or_default();
        assert!(why.contains("has not reached revision 11"), "{why}");
        // A renewal while paused asks for a relist; the fresh list catches up.
        renew(&rig, 14);
        settle().await;
        assert!(rig.relists.try_recv().is_ok(), "a relist is asked for");
        assert!(rig.pause.borrow().is_some(), "still behind: still paused");
        rig.reached.send_replace(14);
        settle().await;
        assert_eq!(*rig.pause.borrow(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_watch_that_catches_up_in_time_does_not_pause() {
        let rig = rig();
        renew(&rig, 20);
        tokio::time::sleep(Duration::from_secs(2)).await;
        rig.reached.send_replace(20);
        renew(&rig, 21);
        tokio::time::sleep(Duration::from_millis(2_500)).await;
        rig.reached.send_replace(21);
        tokio::time::sleep(Duration::from_secs(2)).await;
        renew(&rig, 21);
        settle().await;
        assert_eq!(*rig.pause.borrow(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn no_renewal_for_the_limit_pauses() {
        let rig = rig();
        tokio::time::sleep(LIMIT + Duration::from_millis(1)).await;
        let why = rig.pause.borrow().clone().unwrap_or_default();
        assert!(why.contains("no keepalive succeeded"), "{why}");
        renew(&rig, 10);
        settle().await;
        assert_eq!(*rig.pause.borrow(), None);
    }
}
