//! When the leader may plan after node sessions are lost: the hold over a burst of losses.
//!
//! Owns: the burst's first and last loss, and the pace at which the store commits writes
//! (from the leader's own txns), which sets how long a burst is waited for.
//! Must not: plan, write, or read the store or a clock — the [`Pacer`](super::Pacer) asks it
//! when the next plan may run and tells it what the leader saw, with the time as an argument
//! (monotonic, since any fixed origin).
//!
//! Why a hold: nodes that die together (a rack; etcd revokes the expired leases it finds
//! together, each in a revoke of its own) are seen in several watch batches, and a round
//! planned on the first batch puts channels on nodes the next batch shows dead — refused by
//! their session guards, or worse committed and moved a second time (the failover bench:
//! runs whose losses were seen in two batches took 72 ms instead of 36–46).
//!
//! Why the pace: those revokes reach the leader one etcd commit apart (proposals that arrive
//! while one is being committed wait for the next), so how long "together" lasts is etcd's
//! commit time — under 1 ms on a fast disk, several ms on a slow one, where a fixed 2 ms
//! quiet period would split every burst. What the pace does not cover: revokes that run late
//! on a CPU-starved machine (the burst-of-losses black-box test under three CPU hogs saw
//! them ~10 ms apart with the pace at 2 ms). Such a split burst costs a refused round and its
//! retry — the session guards keep every put off a node already gone.

use std::time::Duration;

/// Least quiet period after a loss (the whole of it before the pace was measured).
pub const QUIET_MIN: Duration = Duration::from_millis(2);
/// Most quiet period after a loss, however slow the store commits.
pub const QUIET_MAX: Duration = Duration::from_millis(20);
/// Losses that keep coming hold the plan no longer than this after the first.
pub const HOLD_MAX: Duration = Duration::from_millis(40);

/// The hold over a burst of session losses (see the module docs).
#[derive(Debug, Default)]
pub struct LossHold {
    /// When the first and the last loss of the current burst were seen.
    burst: Option<(Duration, Duration)>,
    /// How long the leader's last [`PACE_TXNS`] small txns sent alone took (the caller
    /// picks them: txns of a round queue behind each other, and a large one times etcd's
    /// apply as much as its commit), oldest overwritten first; the least of them is the
    /// store's commit time (a slow one among fast ones is not the store's pace; a busy spell
    /// shows in every one). Kept over idle spells: a new term starts from [`QUIET_MIN`].
    recent: Vec<Duration>,
    /// Where the next txn's time goes in `recent` once it is full.
    next: usize,
}

/// How many of the leader's latest txns the commit time is taken from.
const PACE_TXNS: usize = 8;

impl LossHold {
    /// Notes a txn of the leader's that took `took` from send to answer.
    pub fn wrote(&mut self, took: Duration) {
        if self.recent.len() < PACE_TXNS {
            self.recent.push(took);
        } else {
            self.recent[self.next] = took;
        }
        self.next = (self.next + 1) % PACE_TXNS;
    }

    /// Notes a session lost at `now` that held channels.
    pub fn lost(&mut self, now: Duration) {
        self.burst = Some((self.burst.map_or(now, |(first, _)| first), now));
    }

    /// How long no other loss must be seen before the burst counts as over: twice the
    /// store's commit time, within [`QUIET_MIN`, `QUIET_MAX`].
    pub fn quiet(&self) -> Duration {
        self.recent
            .iter()
            .min()
            .map_or(QUIET_MIN, |p| p.saturating_mul(2))
            .clamp(QUIET_MIN, QUIET_MAX)
    }

    /// When the next plan may run: not before `not_before`, nor while a burst may still be
    /// going on.
    pub fn plan_at(&self, not_before: Duration) -> Duration {
        match self.burst {
            Some((first, last)) => not_before.max((last + self.quiet()).min(first + HOLD_MAX)),
            None => not_before,
        }
    }

    /// A plan round ran: the burst is planned.
    pub fn planned(&mut self) {
        self.burst = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn the_quiet_period_follows_the_stores_commit_time() {
        let mut h = LossHold::default();
        assert_eq!(h.quiet(), QUIET_MIN, "not measured yet");
        h.wrote(Duration::from_micros(400));
        assert_eq!(h.quiet(), QUIET_MIN, "a fast store: the floor");
        // A busy spell: once the last eight txns took 6 ms or more, the quiet period is 12 ms.
        for n in 0..PACE_TXNS as u64 {
            assert_eq!(h.quiet(), QUIET_MIN, "{n} slow txns");
            h.wrote(ms(6 + n));
        }
        assert_eq!(h.quiet(), ms(12));
        // One fast txn brings it down; one slow one among fast ones does not raise it.
        h.wrote(ms(1) + Duration::from_micros(500));
        assert_eq!(h.quiet(), ms(3));
        h.wrote(ms(100));
        assert_eq!(h.quiet(), ms(3));
        // However slow, no more than QUIET_MAX.
        for _ in 0..PACE_TXNS {
            h.wrote(ms(500));
        }
        assert_eq!(h.quiet(), QUIET_MAX);
    }

    #[test]
    fn a_burst_holds_the_plan_until_it_is_quiet_or_held_long_enough() {
        let t0 = ms(1000);
        let mut h = LossHold::default();
        assert_eq!(h.plan_at(t0), t0, "no loss: no hold");
        h.wrote(ms(3));
        let quiet = h.quiet();
        assert_eq!(quiet, ms(6));
        h.lost(t0);
        assert_eq!(h.plan_at(t0), t0 + quiet);
        // Another loss restarts the quiet period.
        h.lost(t0 + ms(4));
        assert_eq!(h.plan_at(t0), t0 + ms(4) + quiet);
        // A later plan gap still rules.
        assert_eq!(h.plan_at(t0 + ms(30)), t0 + ms(30));
        // Losses that keep coming hold it no longer than HOLD_MAX after the first.
        for n in 1..30 {
            h.lost(t0 + ms(4 * n));
        }
        assert_eq!(h.plan_at(t0), t0 + HOLD_MAX);
        h.planned();
        assert_eq!(
            h.plan_at(t0),
            t0,
            "planned: the next loss starts a new burst"
        );
    }
}
