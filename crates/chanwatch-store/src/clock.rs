//! The one clock of chanwatch.
//!
//! Owns: reading "now" (monotonic, for timers and lease deadlines) and "now" as Unix
//! milliseconds (for values written to the store); [`millis`], the one conversion of a
//! duration to the whole milliseconds that store values and the planner's inputs count in.
//!
//! Both are derived from tokio's clock, so a test under `tokio::time::pause()` (or a
//! single-threaded simulation with paused time) controls every timer and every timestamp in
//! the system; the wall-clock base is read once, at construction, and a simulation passes a
//! fixed one with [`Clock::with_unix_base`].
//!
//! Must not: sleep on its own. Code that needs Unix time takes a `Clock` (never
//! `SystemTime`); timers may use `tokio::time` directly (`interval`, `timeout`, `sleep_until`
//! in select loops), which reads the same tokio clock, so paused time still controls them.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

/// Whole milliseconds of `d`, saturating at `u64::MAX`: durations as store values and the
/// planner's `*_ms` inputs count them.
#[must_use]
pub fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// A cheap, cloneable handle to the time source.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    base_instant: Instant,
    base_unix_ms: u64,
}

impl Clock {
    /// A clock whose Unix time starts at the system's wall clock now.
    pub fn system() -> Self {
        let unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(millis)
            .unwrap_or(0);
        Self::with_unix_base(unix_ms)
    }

    /// A clock whose Unix time starts at `unix_ms` (deterministic runs).
    pub fn with_unix_base(unix_ms: u64) -> Self {
        Clock {
            base_instant: Instant::now(),
            base_unix_ms: unix_ms,
        }
    }

    /// Monotonic now, for deadlines.
    pub fn now(&self) -> Instant {
        Instant::now()
    }

    /// Unix milliseconds now, for values written to the store.
    pub fn unix_ms(&self) -> u64 {
        let since = self.now().saturating_duration_since(self.base_instant);
        self.base_unix_ms.saturating_add(millis(since))
    }

    /// Sleeps until `deadline` on this clock.
    pub async fn sleep_until(&self, deadline: Instant) {
        tokio::time::sleep_until(deadline).await;
    }

    /// Sleeps for `d` on this clock.
    pub async fn sleep(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::system()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn millis_are_whole_and_saturate() {
        assert_eq!(millis(Duration::from_micros(2_999)), 2);
        assert_eq!(millis(Duration::from_secs(3)), 3_000);
        assert_eq!(millis(Duration::MAX), u64::MAX);
    }

    #[tokio::test(start_paused = true)]
    async fn unix_time_follows_paused_tokio_time() {
        let clock = Clock::with_unix_base(1_000);
        assert_eq!(clock.unix_ms(), 1_000);
        tokio::time::advance(Duration::from_millis(2_500)).await;
        assert_eq!(clock.unix_ms(), 3_500);
        clock.sleep(Duration::from_secs(10)).await;
        assert_eq!(clock.unix_ms(), 13_500);
    }
}
