//! Whether the store was away from the leader, and for how long: the planner's timers (load,
//! release and balance timeouts) stand still that long, since nodes could not ack meanwhile.
//!
//! The store is away from a leader in two ways: it cannot list or watch it (an outage, an
//! expired auth token), or it refuses writes for lack of space (etcd's NOSPACE alarm).
//!
//! Owns: when each stretch began, and how long timers must stand still when it ends.
//! Must not: touch the planner, the store or the clock — the term passes the time in and hands
//! what this returns to `Planner::store_was_away`.

use std::time::Duration;

use tokio::time::Instant;

/// Stretches of a term in which the store was away.
#[derive(Debug)]
pub(crate) struct StoreAvailability {
    /// Added to a stretch without list or watch: nodes need a moment to see their assignments
    /// again (their own list-watch may be in back-off) before a release is late. One session
    /// TTL.
    reach_grace: Duration,
    /// What the first list of a term stands timers still for: the term knows nothing of what
    /// came before it. One watch timeout.
    first_list_grace: Duration,
    /// Since when the list-watch has been failing, as last reported.
    unreachable_since: Option<Instant>,
    /// Since when the store has refused our writes (NOSPACE).
    writes_refused_since: Option<Instant>,
    /// When the last full list was taken: it shows the store as of then, so a failing
    /// stretch reported as begun before it (the list-watch's `blind` mark stays set from the
    /// list until its new watch runs) is already over.
    listed_at: Option<Instant>,
}

impl StoreAvailability {
    /// A tracker for a new term.
    pub(crate) fn new(reach_grace: Duration, first_list_grace: Duration) -> Self {
        StoreAvailability {
            reach_grace,
            first_list_grace,
            unreachable_since: None,
            writes_refused_since: None,
            listed_at: None,
        }
    }

    /// The list-watch has been failing since `since`. The earliest report of a stretch
    /// counts.
    pub(crate) fn unreachable(&mut self, since: Instant) {
        // The old mark, still set for a moment after a relist: that stretch ended with the
        // list. Counted again, it opened a stretch that only the next relist closed, and timers
        // stood still for all of it (found by the simulation, seed 555001927: 53 s after a
        // term's first list, so a hung load was never timed out before the run ended).
        if self.listed_at.is_some_and(|listed| since < listed) {
            return;
        }
        self.unreachable_since.get_or_insert(since);
    }

    /// The list-watch listed the whole store at `now` (`first`: the term's first list). How
    /// long timers must stand still: the stretch it ends plus [`Self::reach_grace`], the
    /// first-list grace when there was no stretch, zero otherwise.
    pub(crate) fn relisted(&mut self, now: Instant, first: bool) -> Duration {
        self.listed_at = Some(now);
        match self.unreachable_since.take() {
            Some(since) => now.saturating_duration_since(since) + self.reach_grace,
            None if first => self.first_list_grace,
            None => Duration::ZERO,
        }
    }

    /// A write was refused for lack of space; it was sent at `at`. The first refusal of a
    /// stretch counts.
    pub(crate) fn write_refused(&mut self, at: Instant) {
        self.writes_refused_since.get_or_insert(at);
    }

    /// Ends a stretch of refused writes at `now` (a write committed, or a plan round is about
    /// to start — a round that writes nothing must not keep timers frozen for ever) and says
    /// how long it lasted; `None` when writes were not being refused.
    pub(crate) fn writes_taken(&mut self, now: Instant) -> Option<Duration> {
        self.writes_refused_since
            .take()
            .map(|since| now.saturating_duration_since(since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TTL: Duration = Duration::from_secs(10);
    const WATCH_TIMEOUT: Duration = Duration::from_secs(30);
    const S: Duration = Duration::from_secs(1);

    fn tracker() -> StoreAvailability {
        StoreAvailability::new(TTL, WATCH_TIMEOUT)
    }

    #[test]
    fn the_first_list_of_a_term_stands_timers_still_one_watch_timeout() {
        let t0 = Instant::now();
        let mut a = tracker();
        assert_eq!(a.relisted(t0, true), WATCH_TIMEOUT);
        assert_eq!(a.relisted(t0 + S, false), Duration::ZERO, "a later relist");
    }

    #[test]
    fn an_outage_counts_from_its_first_report_plus_a_ttl_once() {
        let t0 = Instant::now();
        let mut a = tracker();
        a.relisted(t0, true);
        a.unreachable(t0 + S);
        a.unreachable(t0 + 3 * S); // the tick reports the same stretch again
        assert_eq!(a.relisted(t0 + 5 * S, false), 4 * S + TTL);
        assert_eq!(
            a.relisted(t0 + 6 * S, false),
            Duration::ZERO,
            "the stretch is over"
        );
    }

    /// The list-watch's blind mark stays set for a moment after a relist (until its new
    /// watch runs); the tick reporting it then opens no new stretch: the list ended it.
    #[test]
    fn a_blind_mark_from_before_a_relist_opens_no_new_stretch() {
        let t0 = Instant::now();
        let mut a = tracker();
        a.relisted(t0, true);
        a.unreachable(t0 + S);
        assert_eq!(a.relisted(t0 + 5 * S, false), 4 * S + TTL);
        a.unreachable(t0 + S); // the same mark, reported once more after the list
        assert_eq!(a.relisted(t0 + 60 * S, false), Duration::ZERO);
        // A failure after the list is a stretch of its own.
        a.unreachable(t0 + 61 * S);
        assert_eq!(a.relisted(t0 + 63 * S, false), 2 * S + TTL);
    }

    #[test]
    fn an_outage_before_the_first_list_replaces_the_first_list_grace() {
        let t0 = Instant::now();
        let mut a = tracker();
        a.unreachable(t0);
        assert_eq!(a.relisted(t0 + 2 * S, true), 2 * S + TTL);
    }

    #[test]
    fn refused_writes_count_from_the_first_refusal_until_taken_once() {
        let t0 = Instant::now();
        let mut a = tracker();
        assert_eq!(a.writes_taken(t0), None, "nothing refused");
        a.write_refused(t0 + S);
        a.write_refused(t0 + 2 * S);
        assert_eq!(a.writes_taken(t0 + 4 * S), Some(3 * S));
        assert_eq!(a.writes_taken(t0 + 5 * S), None, "the stretch is over");
    }

    #[test]
    fn refused_writes_and_an_outage_are_separate_stretches() {
        let t0 = Instant::now();
        let mut a = tracker();
        a.write_refused(t0);
        a.unreachable(t0 + S);
        assert_eq!(a.relisted(t0 + 2 * S, false), S + TTL);
        assert_eq!(a.writes_taken(t0 + 2 * S), Some(2 * S));
    }
}
