//! When the leader plans, and what it serves: the decisions of the leader's loop, as a pure
//! state machine the coordinator's runtime (`chanwatch-coord`'s `term.rs`) only feeds.
//!
//! Owns: whether the view changed since the last round (`dirty`), the spacing of rounds (at
//! most one per [`PLAN_EVERY`], and twice as far apart as the last round's plan took), the one
//! immediate retry of a round whose txns were refused, the hold over a burst of session
//! losses ([`LossHold`]), whether the term has recovered (listed the store once) and so may
//! serve requests, when a blind leader must resign, and when the cold-start gate's wait is
//! logged.
//! Must not: read a clock, sleep or touch the store — every time is an argument, a monotonic
//! [`Duration`] since any fixed origin (the runtime uses the term's start) — or plan (the
//! [`Planner`](super::Planner) does).
//!
//! The runtime's loop, in these terms: each event calls one method ([`Pacer::changed`],
//! [`Pacer::tick`], [`Pacer::replan`], [`Pacer::lost`], [`Pacer::wrote`]); it sleeps until
//! [`Pacer::wake_at`]; after each turn it asks [`Pacer::due`], and a round is
//! [`Pacer::round_begins`] → plan → [`Pacer::round_planned`] → write →
//! [`Pacer::round_written`].

mod losses;

use std::time::Duration;

pub use losses::{LossHold, HOLD_MAX, QUIET_MAX, QUIET_MIN};

/// Least time between two rounds driven by store events (a request's replan aside).
pub const PLAN_EVERY: Duration = Duration::from_millis(10);

/// Most admin requests served in one turn of the leader's loop. Every turn ends by applying
/// what the watch delivered and planning when a round is due, so a burst of requests delays
/// a watch batch (a dead node, an ack) by at most this many requests and one round.
pub const REQUESTS_PER_TURN: usize = 16;

/// How often the cold-start gate's wait is logged.
const GATE_LOG_EVERY: Duration = Duration::from_secs(1);

/// What to log about the cold-start gate after a round ([`Pacer::gate`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GateLog {
    /// Nothing new to say.
    Quiet,
    /// It still waits for nodes: say how many (at most once a second).
    Waiting,
    /// It waited and now places channels: say so, once.
    Opened,
}

/// The leader loop's decisions (see the module docs).
#[derive(Debug)]
pub struct Pacer {
    /// The view changed since the last round: a round is wanted.
    dirty: bool,
    /// A tick came since the last round (the cluster gauges are refreshed on ticks).
    ticked: bool,
    /// No round before this (the last round's start plus its gap; a replan or a retry
    /// brings it forward).
    next_round: Duration,
    /// When the current round began.
    round_start: Duration,
    /// The last round's txns were refused and the next round was let run at once.
    retried: bool,
    /// The term has listed the store once: it may plan and serve requests.
    recovered: bool,
    /// The hold over a burst of session losses.
    losses: LossHold,
    /// Whether rounds wait for a burst of losses to be over (off only under a planted bug).
    hold_losses: bool,
    /// When the gate's wait was last logged (`None`: not waiting).
    gate_logged: Option<Duration>,
}

impl Default for Pacer {
    fn default() -> Self {
        Pacer::new(true)
    }
}

impl Pacer {
    /// A new term's pacer: not recovered, nothing to plan, the first round allowed at once.
    /// `hold_losses` false plans at the first loss of a burst (a planted bug's switch).
    pub fn new(hold_losses: bool) -> Self {
        Pacer {
            dirty: false,
            ticked: false,
            next_round: Duration::ZERO,
            round_start: Duration::ZERO,
            retried: false,
            recovered: false,
            losses: LossHold::default(),
            hold_losses,
            gate_logged: None,
        }
    }

    /// The view changed (a watch batch, a relist, a bulk write booked): a round is wanted.
    pub fn changed(&mut self) {
        self.dirty = true;
    }

    /// A tick: a recovered leader plans (timers are due), and the next round refreshes the
    /// cluster gauges.
    pub fn tick(&mut self) {
        self.dirty |= self.recovered;
        self.ticked = true;
    }

    /// A request (drain, balance) wants a round now, not after the gap (still not from a
    /// view the runtime knows is stale: [`Pacer::due`] takes `blind`).
    pub fn replan(&mut self, now: Duration) {
        self.dirty = true;
        self.next_round = self.next_round.min(now);
    }

    /// Marks the term recovered once the view has something in it (its first list applied);
    /// `true` the one time it happens (the runtime logs it).
    pub fn recover(&mut self) -> bool {
        if self.dirty && !self.recovered {
            self.recovered = true;
            return true;
        }
        false
    }

    /// Whether the term may plan and serve requests (a request before is refused: the leader
    /// is still recovering).
    pub fn recovered(&self) -> bool {
        self.recovered
    }

    /// A node session that held channels was seen gone at `now`.
    pub fn lost(&mut self, now: Duration) {
        self.losses.lost(now);
    }

    /// A small txn of the leader's, alone in flight, took `took`: the store's pace.
    pub fn wrote(&mut self, took: Duration) {
        self.losses.wrote(took);
    }

    /// How long no other loss must be seen before a burst counts as over.
    pub fn quiet(&self) -> Duration {
        self.losses.quiet()
    }

    /// When the next round may run: not before the gap since the last, nor while a burst of
    /// losses may still be going on.
    pub fn round_at(&self) -> Duration {
        if self.hold_losses {
            self.losses.plan_at(self.next_round)
        } else {
            self.next_round
        }
    }

    /// When the runtime should wake to run a round: `None` while nothing changed, or while
    /// the view cannot be refreshed (`blind`: the store is away; its timers would fire on
    /// time that measured etcd's absence, and what it plans would be refused anyway).
    pub fn wake_at(&self, blind: bool) -> Option<Duration> {
        (self.dirty && !blind).then(|| self.round_at())
    }

    /// Whether a round runs now.
    pub fn due(&self, now: Duration, blind: bool) -> bool {
        self.wake_at(blind).is_some_and(|at| now >= at)
    }

    /// A round begins at `now`: the view it plans from is everything seen so far (a burst of
    /// losses included).
    pub fn round_begins(&mut self, now: Duration) {
        self.losses.planned();
        self.round_start = now;
        self.dirty = false;
    }

    /// The round's plan is made at `now` (its txns not yet written): the next round waits
    /// twice as long as this plan took, and at least [`PLAN_EVERY`], so planning takes at
    /// most a third of the leader's time at any size.
    pub fn round_planned(&mut self, now: Duration) {
        let took = now.saturating_sub(self.round_start);
        self.next_round = self.round_start + PLAN_EVERY.max(took * 2);
    }

    /// The round's txns were written at `now`, `refused` of them refused by their guards
    /// (the read-back fixed the view): plan again at once, without waiting for the gap — once
    /// in a row, so a view the read-back cannot fix retries at the gap's pace, not in a tight
    /// loop. A loss the read-back found still holds the retry for its quiet period.
    pub fn round_written(&mut self, now: Duration, refused: usize) {
        if refused == 0 {
            self.retried = false;
            return;
        }
        self.dirty = true;
        if !self.retried {
            self.retried = true;
            self.next_round = now;
        }
    }

    /// Whether a tick came since the last call (the runtime refreshes the cluster gauges).
    pub fn take_ticked(&mut self) -> bool {
        std::mem::take(&mut self.ticked)
    }

    /// What to log of the cold-start gate at `now`, `waiting` if it holds placements back.
    pub fn gate(&mut self, now: Duration, waiting: bool) -> GateLog {
        match (waiting, self.gate_logged) {
            (true, Some(at)) if now < at + GATE_LOG_EVERY => GateLog::Quiet,
            (true, _) => {
                self.gate_logged = Some(now);
                GateLog::Waiting
            }
            (false, Some(_)) => {
                self.gate_logged = None;
                GateLog::Opened
            }
            (false, None) => GateLog::Quiet,
        }
    }

    /// Whether a leader that could not list or watch the store since `blind_since` must
    /// resign at `now` (and for how long it was blind): after one session TTL, as after a
    /// TTL of failed renewals — it plans from a stale view and holds the key from a standby
    /// that might do better (e.g. its auth token expired while its renewals, which need
    /// none, still pass).
    pub fn resign_blind(
        now: Duration,
        blind_since: Option<Duration>,
        ttl: Duration,
    ) -> Option<Duration> {
        let for_ = now.saturating_sub(blind_since?);
        (for_ >= ttl).then_some(for_)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn nothing_changed_nothing_planned_and_a_change_is_planned_at_once() {
        let mut p = Pacer::default();
        assert_eq!(p.wake_at(false), None);
        assert!(!p.due(ms(5), false));
        p.changed();
        assert_eq!(p.wake_at(false), Some(Duration::ZERO));
        assert!(p.due(ms(5), false));
        assert!(!p.due(ms(5), true), "a blind leader plans nothing");
        assert_eq!(p.wake_at(true), None);
    }

    #[test]
    fn rounds_are_spaced_by_plan_every_or_twice_the_plan_time() {
        let mut p = Pacer::default();
        p.changed();
        p.round_begins(ms(100));
        p.round_planned(ms(101));
        p.round_written(ms(102), 0);
        p.changed();
        assert_eq!(p.round_at(), ms(110), "a cheap plan: PLAN_EVERY");
        assert!(!p.due(ms(109), false));
        assert!(p.due(ms(110), false));
        p.round_begins(ms(110));
        p.round_planned(ms(140));
        p.round_written(ms(150), 0);
        p.changed();
        assert_eq!(p.round_at(), ms(170), "a 30 ms plan: 60 ms until the next");
    }

    #[test]
    fn a_refused_round_is_retried_at_once_but_only_once_in_a_row() {
        let mut p = Pacer::default();
        p.changed();
        p.round_begins(ms(0));
        p.round_planned(ms(1));
        p.round_written(ms(3), 2);
        assert!(p.due(ms(3), false), "retried at once, within the gap");
        p.round_begins(ms(3));
        p.round_planned(ms(4));
        p.round_written(ms(5), 1);
        assert!(
            !p.due(ms(5), false),
            "a second refusal in a row waits for the gap"
        );
        assert!(p.due(ms(13), false));
        p.round_begins(ms(13));
        p.round_planned(ms(14));
        p.round_written(ms(15), 0);
        p.changed();
        p.round_begins(ms(30));
        p.round_planned(ms(31));
        p.round_written(ms(32), 1);
        assert!(p.due(ms(32), false), "a success in between: at once again");
    }

    #[test]
    fn a_burst_of_losses_holds_the_round_until_quiet_unless_the_hold_is_off() {
        for hold in [true, false] {
            let mut p = Pacer::new(hold);
            p.changed();
            p.lost(ms(50));
            p.lost(ms(51));
            let quiet = p.quiet();
            assert_eq!(quiet, QUIET_MIN);
            assert_eq!(p.due(ms(51), false), !hold, "hold {hold}");
            assert!(p.due(ms(51) + quiet, false));
            p.round_begins(ms(60));
            p.round_planned(ms(61));
            p.changed();
            assert_eq!(p.round_at(), ms(70), "the burst was planned");
        }
    }

    #[test]
    fn a_replan_runs_a_round_at_once_and_ticks_plan_only_once_recovered() {
        let mut p = Pacer::default();
        p.tick();
        assert!(!p.due(ms(0), false), "not recovered: a tick plans nothing");
        assert!(p.take_ticked());
        assert!(!p.take_ticked(), "taken");
        assert!(!p.recover(), "nothing listed yet");
        p.changed();
        assert!(p.recover());
        assert!(!p.recover(), "once");
        assert!(p.recovered());
        p.round_begins(ms(0));
        p.round_planned(ms(30));
        p.round_written(ms(31), 0);
        p.tick();
        assert!(!p.due(ms(40), false), "a tick waits for the gap");
        assert!(p.due(ms(60), false));
        p.replan(ms(40));
        assert!(p.due(ms(40), false), "a request's replan does not");
    }

    #[test]
    fn the_gate_is_logged_once_a_second_while_it_waits_and_once_when_it_opens() {
        let mut p = Pacer::default();
        assert_eq!(p.gate(ms(0), false), GateLog::Quiet);
        assert_eq!(p.gate(ms(0), true), GateLog::Waiting);
        assert_eq!(p.gate(ms(500), true), GateLog::Quiet);
        assert_eq!(p.gate(ms(1000), true), GateLog::Waiting);
        assert_eq!(p.gate(ms(1100), false), GateLog::Opened);
        assert_eq!(p.gate(ms(1200), false), GateLog::Quiet);
    }

    #[test]
    fn a_leader_blind_for_a_ttl_resigns() {
        let ttl = ms(10_000);
        assert_eq!(Pacer::resign_blind(ms(50_000), None, ttl), None);
        assert_eq!(Pacer::resign_blind(ms(50_000), Some(ms(45_000)), ttl), None);
        assert_eq!(
            Pacer::resign_blind(ms(50_000), Some(ms(40_000)), ttl),
            Some(ttl)
        );
    }
}
