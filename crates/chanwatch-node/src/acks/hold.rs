//! The round hold: a node's acks wait, briefly, for the rest of a plan round's puts, so that
//! the round's channels are acknowledged in one write (DESIGN §2, "round").
//!
//! A failover's moves travel in many txns (62 moves fit etcd's 128 ops), and a node's watch
//! shows its share of them in two or three batches: acknowledging each batch as it came made
//! two or three ack txns per node, each queueing in etcd behind the moves still in flight,
//! the second waiting for the first. The coordinator now says on each put how many it writes
//! to the node in the round ([`RoundHint`]); `Watched` acks wait until the node has seen them
//! all and queued the load's outcome of each (a load that ends at once acks in the same
//! write; a progress report is not an outcome) — or until nothing of the round happened for
//! [`QUIET`] (a refused txn's puts never come; a slow load keeps the others waiting no
//! longer), or [`CAP`] after its first put. No ack waits more than [`CAP`] however rounds
//! overlap. A round given up for quiet is waited for again when more of its puts come
//! (until [`CAP`] after its first): a coordinator stalled mid-round on a busy machine (20 ms
//! between two of its move txns) made a node that had given the round up ack the rest in a
//! write per ack round trip — four to six writes where the stall cost one. A round complete or
//! past [`CAP`] is not waited for again.
//!
//! Owns: which rounds are incomplete and until when acks wait for them. Must not: write, or
//! decide what to ack (the node machine does) — and never holds commits or acks that say a
//! channel stopped (the session sends them at once, held acks riding along).

use std::collections::{HashMap, HashSet};
use std::time::Duration;

use chanwatch_core::{ChannelName, RoundHint};
use tokio::time::Instant;

/// How long acks wait for a round's next put or ack before going without the rest: a
/// failover's move txns land ~1–3 ms apart on a loaded etcd of this machine's kind.
pub(crate) const QUIET: Duration = Duration::from_millis(20);
/// The longest acks wait for any one round, however its puts trickle in.
pub(crate) const CAP: Duration = Duration::from_millis(200);

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct RoundHold {
    rounds: HashMap<u64, Round>,
    /// Rounds complete or past `CAP`, until `CAP` after: their late puts start no new wait.
    /// (A round quiet for `QUIET` stays in `rounds`, not waited for until its next put.)
    finished: HashMap<u64, Instant>,
    /// Since when acks have been waiting (the first `wait_until` that said wait).
    waiting_since: Option<Instant>,
}

#[derive(Debug)]
struct Round {
    puts: u32,
    seen: HashSet<ChannelName>,
    /// Seen, and no ack queued yet.
    loading: HashSet<ChannelName>,
    first: Instant,
    last: Instant,
}

impl Round {
    fn complete(&self) -> bool {
        self.seen.len() >= self.puts as usize && self.loading.is_empty()
    }

    fn deadline(&self) -> Instant {
        (self.last + QUIET).min(self.first + CAP)
    }
}

impl RoundHold {
    /// The watch showed a `ToWatch` put of `channel` carrying `hint`, at `now`.
    pub(crate) fn saw(&mut self, hint: RoundHint, channel: &ChannelName, now: Instant) {
        self.prune(now);
        if hint.puts <= 1 || self.finished.contains_key(&hint.id) {
            return;
        }
        let r = self.rounds.entry(hint.id).or_insert_with(|| Round {
            puts: hint.puts,
            seen: HashSet::new(),
            loading: HashSet::new(),
            first: now,
            last: now,
        });
        if r.seen.insert(channel.clone()) {
            r.loading.insert(channel.clone());
        }
        r.last = now;
    }

    /// The outcome of `channel`'s load (`Watched` or `WatchFailed`, not a progress report)
    /// or its `Released` was queued for acknowledgement at `now`.
    pub(crate) fn acked(&mut self, channel: &ChannelName, now: Instant) {
        for r in self.rounds.values_mut() {
            // A round already quiet stays so: only its next put makes acks wait again (a
            // load ending late must not hold the acks queued with it for a put that may
            // never come).
            if r.loading.remove(channel) && now < r.deadline() {
                r.last = now;
            }
        }
    }

    /// `Some(when)` while acks should wait: some round is incomplete and not quiet (a put
    /// or a load's outcome within `QUIET`, and no quiet period between them since its last
    /// put), and acks have not waited `CAP` yet (`when`: the earliest moment one of those
    /// ends).
    pub(crate) fn wait_until(&mut self, now: Instant) -> Option<Instant> {
        self.prune(now);
        let until = self
            .rounds
            .values()
            .map(Round::deadline)
            .filter(|d| *d > now)
            .min();
        let since = *self.waiting_since.get_or_insert(now);
        match until {
            Some(until) if now < since + CAP => Some(until.min(since + CAP)),
            _ => {
                self.waiting_since = None;
                None
            }
        }
    }

    /// The queued acks went (with a commit, or a full txn of them): the next wait starts now.
    pub(crate) fn sent(&mut self) {
        self.waiting_since = None;
    }

    /// Forgets every round: nothing waits any more (the session is stopping).
    pub(crate) fn clear(&mut self) {
        self.rounds.clear();
        self.waiting_since = None;
    }

    /// Moves complete rounds and those `CAP` past their first put to `finished`, and forgets
    /// those finished `CAP` ago.
    fn prune(&mut self, now: Instant) {
        let finished = &mut self.finished;
        self.rounds.retain(|id, r| {
            let keep = !r.complete() && now < r.first + CAP;
            if !keep {
                finished.insert(*id, now);
            }
            keep
        });
        finished.retain(|_, at| *at + CAP > now);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(id: u64, puts: u32) -> RoundHint {
        RoundHint { id, puts }
    }

    fn name(s: &str) -> ChannelName {
        ChannelName::new(s).expect("name")
    }

    #[tokio::test(start_paused = true)]
    async fn acks_wait_until_every_put_of_the_round_is_seen_and_acked() {
        let mut h = RoundHold::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        assert_eq!(h.wait_until(t0), None, "nothing seen: nothing waits");
        h.saw(hint(7, 3), &name("a"), t0);
        h.saw(hint(7, 3), &name("b"), t0);
        h.acked(&name("a"), t0);
        // The same put seen again (an event replayed) does not count twice, nor load again.
        h.saw(hint(7, 3), &name("a"), t0 + ms(1));
        assert_eq!(h.wait_until(t0 + ms(2)), Some(t0 + ms(1) + QUIET));
        h.saw(hint(7, 3), &name("c"), t0 + ms(3));
        h.acked(&name("c"), t0 + ms(3));
        assert_eq!(
            h.wait_until(t0 + ms(3)),
            Some(t0 + ms(3) + QUIET),
            "every put seen, b still loading"
        );
        h.acked(&name("b"), t0 + ms(4));
        assert_eq!(h.wait_until(t0 + ms(4)), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_whose_puts_stop_coming_is_given_up_after_the_quiet_period_or_the_cap() {
        let mut h = RoundHold::default();
        let t0 = Instant::now();
        h.saw(hint(1, 10), &name("a"), t0);
        h.acked(&name("a"), t0);
        let quiet = t0 + QUIET;
        assert_eq!(h.wait_until(quiet - Duration::from_millis(1)), Some(quiet));
        assert_eq!(h.wait_until(quiet), None, "no put for QUIET: acks go");
        // Puts that keep trickling in hold acks no longer than CAP after the first.
        let mut t = quiet;
        h.saw(hint(2, 1_000), &name("a"), t);
        for i in 0.. {
            if t >= quiet + CAP {
                break;
            }
            assert!(h.wait_until(t).is_some());
            t += QUIET / 2;
            h.saw(hint(2, 1_000), &name(&format!("c{i}")), t);
        }
        assert_eq!(h.wait_until(quiet + CAP), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_stalled_round_is_waited_for_again_until_the_cap_and_overlapping_rounds_wait_at_most_the_cap(
    ) {
        let mut h = RoundHold::default();
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        h.saw(hint(1, 3), &name("a"), t0);
        assert_eq!(h.wait_until(t0 + QUIET), None, "given up");
        // More of it comes after a stall: acks wait for the rest again, a quiet period more.
        h.saw(hint(1, 3), &name("b"), t0 + QUIET + ms(1));
        assert_eq!(
            h.wait_until(t0 + QUIET + ms(1)),
            Some(t0 + QUIET + ms(1) + QUIET),
            "a stalled round's next put"
        );
        h.acked(&name("a"), t0 + QUIET + ms(1));
        // Quiet again; a load that ends now does not make acks wait for the rest.
        let later = t0 + QUIET * 3;
        assert_eq!(h.wait_until(later), None, "quiet again");
        h.acked(&name("b"), later);
        assert_eq!(
            h.wait_until(later),
            None,
            "a late load's end revives nothing"
        );
        // Its next put, close to the cap: the wait ends CAP after the round's first put.
        h.saw(hint(1, 4), &name("c"), t0 + CAP - ms(10));
        assert_eq!(
            h.wait_until(t0 + CAP - ms(10)),
            Some(t0 + CAP),
            "never past the cap"
        );
        // Past CAP after its first put, it is given up for good, and forgotten: its last
        // put starts no wait.
        h.saw(hint(1, 4), &name("d"), t0 + CAP + ms(1));
        assert_eq!(h.wait_until(t0 + CAP + ms(1)), None, "past the cap");
        assert!(h.rounds.is_empty(), "a round past the cap is not kept");
        h.sent();
        // A chain of rounds, each new one before the last is given up: acks wait from the
        // first "wait" on, and never more than CAP.
        let t1 = t0 + CAP + ms(2);
        let mut t = t1;
        let mut id = 10;
        while t < t1 + CAP {
            h.saw(hint(id, 2), &name("x"), t);
            assert!(h.wait_until(t).is_some_and(|until| until <= t1 + CAP));
            id += 1;
            t += ms(15);
        }
        assert_eq!(h.wait_until(t1 + CAP), None);
        // Acks sent meanwhile (a commit took them): the next wait counts from then.
        h.sent();
        h.saw(hint(99, 2), &name("y"), t1 + CAP);
        assert!(h.wait_until(t1 + CAP).is_some());
    }

    #[tokio::test(start_paused = true)]
    async fn a_single_put_and_a_cleared_hold_make_nothing_wait() {
        let mut h = RoundHold::default();
        let t0 = Instant::now();
        h.saw(hint(3, 1), &name("a"), t0);
        assert_eq!(h.wait_until(t0), None);
        h.saw(hint(4, 2), &name("a"), t0);
        h.saw(hint(5, 2), &name("b"), t0 + Duration::from_millis(5));
        assert_eq!(
            h.wait_until(t0),
            Some(t0 + QUIET),
            "the earlier deadline first"
        );
        h.clear();
        assert_eq!(h.wait_until(t0), None);
    }
}
