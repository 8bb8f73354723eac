//! A planned restart on the node's side (DESIGN §5 "Planned restart"): the decisions of a
//! node asked to stop, as a pure machine.
//!
//! Owns: [`Departure`] — when to announce `leaving` in the session (and again, until the
//! write lands), when the node is done (no key left under its prefix, in a view reset from a
//! list read after its `leaving` write landed: the coordinator moved every channel,
//! break-before-make, while the node ran them, and no put of its can land after that write,
//! since its puts compare the session's mod revision), and when it gives up (the shutdown
//! timeout: stop everything and revoke the lease, as before v2). A timeout of 0 is that old
//! path at once.
//!
//! (changed: an empty node announced nothing and revoked its lease at once; a move the
//! coordinator had just committed to it, not yet in its view, then landed under a session
//! about to end and failed over — found by the simulation, 7 seeds of ~50,000.)
//!
//! Must not: do I/O or read the clock; the runtime (`chanwatch-node`'s session) writes the
//! session, stops runners and revokes the lease, and passes `now_ms` in.

/// What a leaving node does next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepartureStep {
    /// Write the session with `leaving: true` (the last write has not landed yet).
    Announce,
    /// Keep running: the coordinator is still moving `left` channels off.
    Wait {
        /// Keys still under the node's prefix.
        left: usize,
    },
    /// Nothing left under the prefix: stop (nothing runs), revoke the lease, exit.
    Done {
        /// Milliseconds since the departure began.
        after_ms: u64,
    },
    /// The shutdown timeout passed with `left` keys still here: stop them and revoke the
    /// lease (their channels fail over), exit.
    TimedOut {
        /// Keys still under the node's prefix.
        left: usize,
    },
}

/// One departure, from the first stop request until the node exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Departure {
    started_ms: u64,
    deadline_ms: u64,
    /// Keys under the prefix when it began.
    pub initial: usize,
    /// The revision at which the store holds the session with `leaving` (or holds no
    /// session of ours): once a list read after it is applied, no put to us can still be coming.
    announced_at: Option<i64>,
    announcing: bool,
    /// Writes that failed in a row, and when the next may go (a node that cannot reach etcd
    /// retried at once, ~10,000 times a second, at 100 % CPU: found by a newcomer).
    failures: u32,
    retry_at_ms: u64,
}

/// The first wait after a failed `leaving` write; it doubles up to [`RETRY_MAX_MS`].
pub const RETRY_FIRST_MS: u64 = 100;
/// The longest wait between two `leaving` writes.
pub const RETRY_MAX_MS: u64 = 2_000;
/// An empty node whose `leaving` write failed this many times in a row (~0.7 s: the store
/// is away) leaves without it, as before: nothing runs here, and waiting for the shutdown
/// timeout would only hold a stop (a put that lands meanwhile fails over one TTL later).
pub const EMPTY_GIVES_UP_AFTER: u32 = 3;

impl Departure {
    /// Begins leaving at `now_ms` with `held` keys under the prefix, for at most
    /// `timeout_ms`.
    pub fn begin(now_ms: u64, timeout_ms: u64, held: usize) -> Self {
        Departure {
            started_ms: now_ms,
            deadline_ms: now_ms.saturating_add(timeout_ms),
            initial: held,
            announced_at: None,
            announcing: false,
            failures: 0,
            retry_at_ms: now_ms,
        }
    }

    /// The `leaving` write landed at revision `Some(r)` (or the store answered at `r` that
    /// our session is gone) or failed at `now_ms` (`None`: it is asked for again after a
    /// back-off, [`RETRY_FIRST_MS`] doubling up to [`RETRY_MAX_MS`]).
    pub fn announce_done(&mut self, landed: Option<i64>, now_ms: u64) {
        self.announcing = false;
        if self.announced_at.is_none() {
            self.announced_at = landed;
        }
        if landed.is_some() {
            self.failures = 0;
        } else {
            let wait = RETRY_FIRST_MS
                .saturating_mul(1 << self.failures.min(10))
                .min(RETRY_MAX_MS);
            self.failures = self.failures.saturating_add(1);
            self.retry_at_ms = now_ms.saturating_add(wait);
        }
    }

    /// Whether the coordinator has been told (the `leaving` write landed).
    pub fn announced(&self) -> bool {
        self.announced_at.is_some()
    }

    /// What to do now, with `held` keys under the prefix in a view last reset from a list
    /// read at revision `listed` (the runtime lists again once the `leaving` write landed).
    /// [`DepartureStep::Announce`] is returned once per write: the runtime reports it with
    /// [`Departure::announce_done`], and after a failed one not before its back-off has
    /// passed (call `step` again then: the runtime steps at least every half second).
    pub fn step(&mut self, now_ms: u64, held: usize, listed: i64) -> DepartureStep {
        let store_away = self.announced_at.is_none() && self.failures >= EMPTY_GIVES_UP_AFTER;
        if held == 0 && (store_away || self.announced_at.is_some_and(|at| listed >= at)) {
            return DepartureStep::Done {
                after_ms: now_ms.saturating_sub(self.started_ms),
            };
        }
        if now_ms >= self.deadline_ms {
            return DepartureStep::TimedOut { left: held };
        }
        if self.announced_at.is_none() && !self.announcing && now_ms >= self.retry_at_ms {
            self.announcing = true;
            return DepartureStep::Announce;
        }
        DepartureStep::Wait { left: held }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_departure_announces_once_waits_and_ends_when_empty() {
        let mut d = Departure::begin(1_000, 60_000, 3);
        assert_eq!(d.step(1_000, 3, 100), DepartureStep::Announce);
        assert_eq!(
            d.step(1_100, 3, 100),
            DepartureStep::Wait { left: 3 },
            "one write at a time"
        );
        d.announce_done(None, 1_150);
        assert_eq!(
            d.step(1_200, 3, 100),
            DepartureStep::Wait { left: 3 },
            "not at once"
        );
        assert_eq!(
            d.step(1_250, 3, 100),
            DepartureStep::Announce,
            "a failed write is retried after its back-off"
        );
        d.announce_done(Some(50), 1_260);
        assert!(d.announced());
        assert_eq!(d.step(2_000, 1, 100), DepartureStep::Wait { left: 1 });
        assert_eq!(
            d.step(3_500, 0, 100),
            DepartureStep::Done { after_ms: 2_500 }
        );
    }

    /// A store that refuses every write (down, or the credentials refused) gets one
    /// `leaving` write per back-off, doubling to 2 s: a handful a minute, not a spin.
    #[test]
    fn failed_announcements_back_off_up_to_two_seconds() {
        let mut d = Departure::begin(0, 60_000, 1);
        let mut writes = Vec::new();
        for now in (0..20_000).step_by(10) {
            if d.step(now, 1, 100) == DepartureStep::Announce {
                writes.push(now);
                d.announce_done(None, now);
            }
        }
        let gaps: Vec<u64> = writes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..5], &[100, 200, 400, 800, 1_600]);
        assert!(gaps[5..].iter().all(|g| *g == 2_000), "{gaps:?}");
        assert_eq!(writes.len(), 14, "{writes:?}");
        // Between two writes it waits, running its channels.
        assert_eq!(d.step(20_000, 1, 100), DepartureStep::Wait { left: 1 });
    }

    #[test]
    fn a_departure_gives_up_at_the_timeout_and_zero_is_the_old_path() {
        let mut d = Departure::begin(0, 5_000, 2);
        d.step(0, 2, 100);
        d.announce_done(Some(50), 0);
        assert_eq!(d.step(4_999, 2, 100), DepartureStep::Wait { left: 2 });
        assert_eq!(d.step(5_000, 2, 100), DepartureStep::TimedOut { left: 2 });
        // No leader answering, no write landing: the deadline still ends it.
        let mut d = Departure::begin(0, 5_000, 2);
        d.step(0, 2, 100);
        assert_eq!(d.step(5_000, 2, 100), DepartureStep::TimedOut { left: 2 });
        let mut d = Departure::begin(0, 0, 2);
        assert_eq!(d.step(0, 2, 100), DepartureStep::TimedOut { left: 2 });
        // An empty node with a timeout of 0 leaves at once (the old path).
        let mut d = Departure::begin(0, 0, 0);
        assert_eq!(d.step(0, 0, 100), DepartureStep::TimedOut { left: 0 });
    }

    /// An empty node still announces, and leaves only once a list read after that write is empty:
    /// a move committed just before it (not yet seen) must be seen, and then waited for.
    #[test]
    fn an_empty_node_leaves_once_a_list_read_after_its_leaving_write_shows_nothing() {
        let mut d = Departure::begin(0, 60_000, 0);
        assert_eq!(d.step(0, 0, 10), DepartureStep::Announce);
        assert_eq!(d.step(5, 0, 10), DepartureStep::Wait { left: 0 });
        d.announce_done(Some(20), 6);
        assert_eq!(
            d.step(7, 0, 19),
            DepartureStep::Wait { left: 0 },
            "no list read after the write yet: a put may be on its way"
        );
        assert_eq!(
            d.step(8, 3, 20),
            DepartureStep::Wait { left: 3 },
            "it was: three channels arrived before the write; the coordinator moves them"
        );
        assert_eq!(d.step(900, 0, 25), DepartureStep::Done { after_ms: 900 });
        // A failed write never counts as announced; an empty node whose writes keep
        // failing (the store is away) leaves after the third, without waiting for the
        // shutdown timeout.
        let mut d = Departure::begin(0, 60_000, 0);
        let mut now = 0;
        for _ in 0..EMPTY_GIVES_UP_AFTER {
            while d.step(now, 0, 99) != DepartureStep::Announce {
                assert_eq!(d.step(now, 0, 99), DepartureStep::Wait { left: 0 });
                now += 10;
            }
            d.announce_done(None, now);
        }
        assert_eq!(d.step(now, 0, 99), DepartureStep::Done { after_ms: now });
        assert!(now < 1_000, "{now}");
        // One holding channels waits for the timeout.
        let mut d = Departure::begin(0, 5_000, 1);
        for t in [0, 100, 300, 700, 1_500] {
            assert_eq!(d.step(t, 1, 99), DepartureStep::Announce, "{t}");
            d.announce_done(None, t);
        }
        assert_eq!(d.step(5_000, 1, 99), DepartureStep::TimedOut { left: 1 });
    }
}
