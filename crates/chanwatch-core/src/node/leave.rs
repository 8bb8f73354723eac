//! A planned restart on the node's side (DESIGN §5 "Planned restart"): the decisions of a
//! node asked to stop, as a pure machine.
//!
//! Owns: [`Departure`] — when to announce `leaving` in the session (and again, until the
//! write lands), when the node is done (no key left under its prefix: the coordinator moved
//! every channel, break-before-make, while the node ran them), and when it gives up (the
//! shutdown timeout: stop everything and revoke the lease, as before v2). A timeout of 0 is
//! that old path at once.
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
    announced: bool,
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

impl Departure {
    /// Begins leaving at `now_ms` with `held` keys under the prefix, for at most
    /// `timeout_ms`.
    pub fn begin(now_ms: u64, timeout_ms: u64, held: usize) -> Self {
        Departure {
            started_ms: now_ms,
            deadline_ms: now_ms.saturating_add(timeout_ms),
            initial: held,
            announced: false,
            announcing: false,
            failures: 0,
            retry_at_ms: now_ms,
        }
    }

    /// The `leaving` write landed (`true`) or failed at `now_ms` (`false`: it is asked for
    /// again after a back-off, [`RETRY_FIRST_MS`] doubling up to [`RETRY_MAX_MS`]).
    pub fn announce_done(&mut self, landed: bool, now_ms: u64) {
        self.announcing = false;
        self.announced |= landed;
        if landed {
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
        self.announced
    }

    /// What to do now, with `held` keys under the prefix. [`DepartureStep::Announce`] is
    /// returned once per write: the runtime reports it with [`Departure::announce_done`], and
    /// after a failed one not before its back-off has passed (call `step` again then: the
    /// runtime steps at least every half second).
    pub fn step(&mut self, now_ms: u64, held: usize) -> DepartureStep {
        if held == 0 {
            return DepartureStep::Done {
                after_ms: now_ms.saturating_sub(self.started_ms),
            };
        }
        if now_ms >= self.deadline_ms {
            return DepartureStep::TimedOut { left: held };
        }
        if !self.announced && !self.announcing && now_ms >= self.retry_at_ms {
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
        assert_eq!(d.step(1_000, 3), DepartureStep::Announce);
        assert_eq!(
            d.step(1_100, 3),
            DepartureStep::Wait { left: 3 },
            "one write at a time"
        );
        d.announce_done(false, 1_150);
        assert_eq!(
            d.step(1_200, 3),
            DepartureStep::Wait { left: 3 },
            "not at once"
        );
        assert_eq!(
            d.step(1_250, 3),
            DepartureStep::Announce,
            "a failed write is retried after its back-off"
        );
        d.announce_done(true, 1_260);
        assert!(d.announced());
        assert_eq!(d.step(2_000, 1), DepartureStep::Wait { left: 1 });
        assert_eq!(d.step(3_500, 0), DepartureStep::Done { after_ms: 2_500 });
    }

    /// A store that refuses every write (down, or the credentials refused) gets one
    /// `leaving` write per back-off, doubling to 2 s: a handful a minute, not a spin.
    #[test]
    fn failed_announcements_back_off_up_to_two_seconds() {
        let mut d = Departure::begin(0, 60_000, 1);
        let mut writes = Vec::new();
        for now in (0..20_000).step_by(10) {
            if d.step(now, 1) == DepartureStep::Announce {
                writes.push(now);
                d.announce_done(false, now);
            }
        }
        let gaps: Vec<u64> = writes.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..5], &[100, 200, 400, 800, 1_600]);
        assert!(gaps[5..].iter().all(|g| *g == 2_000), "{gaps:?}");
        assert_eq!(writes.len(), 14, "{writes:?}");
        // Between two writes it waits, running its channels.
        assert_eq!(d.step(20_000, 1), DepartureStep::Wait { left: 1 });
    }

    #[test]
    fn a_departure_gives_up_at_the_timeout_and_zero_is_the_old_path() {
        let mut d = Departure::begin(0, 5_000, 2);
        d.step(0, 2);
        d.announce_done(true, 0);
        assert_eq!(d.step(4_999, 2), DepartureStep::Wait { left: 2 });
        assert_eq!(d.step(5_000, 2), DepartureStep::TimedOut { left: 2 });
        // No leader answering, no write landing: the deadline still ends it.
        let mut d = Departure::begin(0, 5_000, 2);
        d.step(0, 2);
        assert_eq!(d.step(5_000, 2), DepartureStep::TimedOut { left: 2 });
        let mut d = Departure::begin(0, 0, 2);
        assert_eq!(d.step(0, 2), DepartureStep::TimedOut { left: 2 });
        // An empty node leaves at once, whatever the timeout.
        let mut d = Departure::begin(0, 0, 0);
        assert_eq!(d.step(0, 0), DepartureStep::Done { after_ms: 0 });
    }
}
