//! Jittered exponential back-off: how long a part waits before it tries a failed store call
//! again (a coordinator's campaign, a list-watch's relist, a node's registration).
//!
//! Owns: the schedule (a first wait, doubling up to a cap) and its jitter (up to half the
//! wait, so that parts that failed together, e.g. at an etcd restart, do not retry together).
//! Must not: wait (the caller sleeps on its [`Clock`](crate::Clock) or in its `select!`), or
//! draw randomness from the wall clock or the OS: the jitter is a hash of a seed the caller
//! names, with fixed keys, so a simulation on paused time replays the same waits.

use std::hash::{Hash, Hasher};
use std::time::Duration;

/// A back-off schedule: retry `n` (from 1) waits `first × 2^(n-1)`, at most `max`, less a
/// jitter of up to half of that.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The wait before the first retry (before jitter): short, so that a blip costs little.
    pub first: Duration,
    /// The longest wait (before jitter): how late, at worst, a part notices the store is back.
    pub max: Duration,
}

impl Backoff {
    /// A schedule from `first`, doubling up to `max`.
    #[must_use]
    pub const fn new(first: Duration, max: Duration) -> Self {
        Backoff { first, max }
    }

    /// The wait before retry `retry` (from 1; 0 counts as 1), without jitter.
    #[must_use]
    pub fn nominal(&self, retry: u32) -> Duration {
        let doublings = retry.saturating_sub(1);
        self.first
            .saturating_mul(2u32.saturating_pow(doublings))
            .min(self.max)
    }

    /// The wait before retry `retry`: [`nominal`](Self::nominal) less a jitter of up to
    /// half, picked by hashing `seed`. The seed names the waiter and the wait (e.g. its ID
    /// and `retry`): waiters with different seeds spread out; the same seed gives the same
    /// wait in every run.
    #[must_use]
    pub fn wait(&self, retry: u32, seed: impl Hash) -> Duration {
        let full = self.nominal(retry);
        // `DefaultHasher::new()` has fixed keys: unlike an OS RNG or the wall clock, it gives
        // the same waits in every run of a deterministic simulation.
        let mut h = std::collections::hash_map::DefaultHasher::new();
        seed.hash(&mut h);
        full.saturating_sub(full.mul_f64((h.finish() % 500) as f64 / 1000.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: Backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));

    #[test]
    fn the_nominal_wait_doubles_from_the_first_up_to_the_cap() {
        let ms: Vec<u128> = (0..=9).map(|n| B.nominal(n).as_millis()).collect();
        assert_eq!(
            ms,
            [100, 100, 200, 400, 800, 1_600, 3_200, 5_000, 5_000, 5_000]
        );
        assert_eq!(B.nominal(u32::MAX), B.max);
    }

    #[test]
    fn a_wait_lies_between_half_its_nominal_and_it_and_repeats_for_the_same_seed() {
        for retry in 1..40 {
            for who in ["a", "b", "c"] {
                let w = B.wait(retry, (who, retry));
                let nominal = B.nominal(retry);
                assert!(w <= nominal && w >= nominal / 2, "{who} {retry}: {w:?}");
                assert_eq!(w, B.wait(retry, (who, retry)), "{who} {retry}");
            }
        }
    }

    #[test]
    fn different_seeds_spread_the_same_retry() {
        let waits: std::collections::BTreeSet<Duration> =
            (0..16u64).map(|who| B.wait(3, (who, 3u32))).collect();
        assert!(waits.len() > 1, "{waits:?}");
    }
}
