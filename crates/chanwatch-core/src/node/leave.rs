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
}

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
        }
    }

    /// The `leaving` write landed (`true`) or failed (`false`: it is asked for again).
    pub fn announce_done(&mut self, landed: bool) {
        self.announcing = false;
        self.announced |= landed;
    }

    /// Whether the coordinator has been told (the `leaving` write landed).
    pub fn announced(&self) -> bool {
        self.announced
    }

    /// What to do now, with `held` keys under the prefix. [`DepartureStep::Announce`] is
    /// returned once per write: the runtime reports it with [`Departure::announce_done`].
    pub fn step(&mut self, now_ms: u64, held: usize) -> DepartureStep {
        if held == 0 {
            return DepartureStep::Done {
                after_ms: now_ms.saturating_sub(self.started_ms),
            };
        }
        if now_ms >= self.deadline_ms {
            return DepartureStep::TimedOut { left: held };
        }
        if !self.announced && !self.announcing {
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
        d.announce_done(false);
        assert_eq!(
            d.step(1_200, 3),
            DepartureStep::Announce,
            "a failed write is retried"
        );
        d.announce_done(true);
        assert!(d.announced());
        assert_eq!(d.step(2_000, 1), DepartureStep::Wait { left: 1 });
        assert_eq!(d.step(3_500, 0), DepartureStep::Done { after_ms: 2_500 });
    }

    #[test]
    fn a_departure_gives_up_at_the_timeout_and_zero_is_the_old_path() {
        let mut d = Departure::begin(0, 5_000, 2);
        d.step(0, 2);
        d.announce_done(true);
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
