//! The end of a run: the faults stop, the cluster must settle, and the report is made.
//!
//! Owns: the settle phase (every invariant of `Checker::settled` within
//! `SESSION_TTL + SETTLE` of the faults' end) and the last checks (single ownership in
//! time, no process exited by itself).
//! Must not: inject a fault.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::{World, SESSION_TTL, SETTLE};
use crate::check::overlaps;
use crate::Report;

impl World {
    /// Ends every fault: timed ones are undone, a coordinator is running.
    pub(super) fn stop_faults(&mut self) {
        self.log("faults stop");
        if let Some(d) = &self.data {
            d.stop.store(true, Ordering::SeqCst);
        }
        self.run_due_undos(true);
        while self.coords.len() < 2 {
            self.spawn_coord();
        }
        // The data plane must be consumed to catch up: with no node left that takes
        // channels (none, or all draining), start one.
        if self.data.is_some() {
            let draining = self.checker.draining();
            let takers = self
                .nodes
                .iter()
                .filter(|n| n.id().map_or(true, |id| !draining.contains(&id)))
                .count();
            if takers == 0 {
                self.spawn_node();
            }
        }
        for (name, b) in &self.behaviours {
            self.handler.set(name.as_str(), *b);
        }
    }

    pub(super) async fn settle(&mut self) {
        let stopped = Instant::now();
        let deadline = stopped + SESSION_TTL + SETTLE;
        let mut last = None;
        while Instant::now() < deadline {
            self.advance(Duration::from_millis(250)).await;
            self.reap_departed();
            let expected = self.expected.clone();
            last = self.checker.settled(&expected, &self.ambiguous);
            if let (None, Some(d)) = (&last, &self.data) {
                last = self.checker.data_behind(&d.log);
            }
            if last.is_none() {
                if let Some(d) = &self.data {
                    self.checker.check_data(&d.log);
                }
                let ms = u64::try_from(stopped.elapsed().as_millis()).unwrap_or(u64::MAX);
                self.report.settle_ms = Some(ms);
                self.log(&format!("settled after {ms} ms"));
                return;
            }
        }
        let why = last.unwrap_or_default();
        self.log(&format!("not settled: {why}"));
        self.report.violations.push(format!(
            "not settled {:?} after the faults stopped: {why}",
            SESSION_TTL + SETTLE
        ));
    }

    pub(super) fn finish(mut self) -> Report {
        let judged = self.checker.departures.judged;
        self.report.departures_judged = judged;
        if judged > 0 {
            self.log(&format!("planned restarts judged (undisturbed): {judged}"));
        }
        let overlap = overlaps(&self.handler.intervals(), &self.excuses);
        for o in &overlap {
            self.log(&format!("violation: {o}"));
        }
        // Invariant 10: no process gives up because the store misbehaved.
        let exited: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.proc.is_finished())
            .map(|n| format!("liveness: proc{} exited on its own", n.slot))
            .chain(
                self.coords
                    .iter()
                    .filter(|c| c.proc.is_finished())
                    .map(|c| format!("liveness: {} exited on its own", c.name)),
            )
            .collect();
        let mut report = self.report;
        let mut violations = std::mem::take(&mut self.checker.violations);
        violations.extend(exited);
        violations.extend(overlap);
        violations.append(&mut report.violations);
        report.violations = violations;
        report.sim_ms = u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX);
        report.revisions = self.checker.revision;
        report.trace_hash = std::hash::Hasher::finish(&self.trace.hash);
        report.trace_lines = self.trace.count;
        report.trace = self.trace.lines.into_iter().collect();
        for n in self.nodes {
            n.proc.kill();
        }
        for c in self.coords {
            c.proc.kill();
        }
        report
    }
}
