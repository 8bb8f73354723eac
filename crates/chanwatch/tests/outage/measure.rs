//! The measurement of the outage test, kept apart from the processes and faults: parsing
//! the nodes' handler logs into runs (a `pause` ends a run, a `resume` starts one) and turning
//! runs and two snapshots of the keys into the numbers of one scenario.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

/// What a handler log line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Start,
    Stop,
    Pause,
    Resume,
}

/// One stretch of a channel running on a node (`to: None`: still running).
#[derive(Debug, Clone)]
pub struct Run {
    pub node: u64,
    pub channel: String,
    pub epoch: u64,
    pub from: u64,
    pub to: Option<u64>,
    /// Begun by a `resume` (warm, after a pause), not a `start` (a load).
    pub resumed: bool,
}

/// The runs in one handler log. Unknown kinds and malformed lines are errors; an incomplete
/// last line (being written) is skipped; a second `stop` is harmless.
pub fn parse_log(text: &str) -> Result<Vec<Run>, String> {
    let complete = text.rfind('\n').map_or("", |i| &text[..=i]);
    let mut runs = Vec::new();
    let mut open: BTreeMap<(u64, String, u64), usize> = BTreeMap::new();
    for line in complete.lines() {
        let bad = || format!("malformed handler log line {line:?}");
        let f: Vec<&str> = line.split(' ').collect();
        let [kind, node, channel, epoch, ms] = f[..] else {
            return Err(bad());
        };
        let kind = match kind {
            "start" => Kind::Start,
            "stop" => Kind::Stop,
            "pause" => Kind::Pause,
            "resume" => Kind::Resume,
            other => return Err(format!("unknown handler log kind {other:?} in {line:?}")),
        };
        let (node, epoch, ms): (u64, u64, u64) = (
            node.parse().map_err(|_| bad())?,
            epoch.parse().map_err(|_| bad())?,
            ms.parse().map_err(|_| bad())?,
        );
        let key = (node, channel.to_owned(), epoch);
        match kind {
            Kind::Start | Kind::Resume => {
                if !open.contains_key(&key) {
                    open.insert(key.clone(), runs.len());
                    runs.push(Run {
                        node,
                        channel: key.1,
                        epoch,
                        from: ms,
                        to: None,
                        resumed: kind == Kind::Resume,
                    });
                }
            }
            Kind::Stop | Kind::Pause => {
                if let Some(i) = open.remove(&key) {
                    runs[i].to = Some(ms);
                }
            }
        }
    }
    Ok(runs)
}

pub fn read_runs(logs: &[PathBuf]) -> Result<Vec<Run>, String> {
    let mut all = Vec::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        all.extend(parse_log(&text).map_err(|e| format!("{}: {e}", log.display()))?);
    }
    Ok(all)
}

/// Channel → (node, epoch) of its key, and the live sessions.
pub struct Snapshot {
    pub owners: BTreeMap<String, (u64, u64)>,
    pub sessions: BTreeSet<u64>,
}

/// The numbers of one scenario.
pub struct Measured {
    pub not_running_during_ms: u64,
    pub not_running_after_ms: u64,
    pub interrupted: usize,
    /// Channels whose key ends on another node or at another epoch.
    pub reassigned: Vec<String>,
    /// Channels loaded again (a `start`, not a `resume`) at or after the fault.
    pub reloaded: Vec<String>,
    /// Node IDs beyond the sessions from before (in the logs or the keys after).
    pub reregistered: Vec<u64>,
    /// From etcd's return until every channel runs (and keeps running); None: some never did.
    pub recovery_ms: Option<u64>,
    /// From the fault until the first channel stopped or paused (None: none did).
    pub first_stop_ms: Option<u64>,
    pub overlaps: Vec<String>,
    pub exits: Vec<String>,
}

fn overlap_ms(runs: &[(u64, u64)], from: u64, to: u64) -> u64 {
    // `runs` sorted by start and merged.
    runs.iter()
        .map(|&(a, b)| b.min(to).saturating_sub(a.max(from)))
        .sum()
}

pub fn measure(
    runs: &[Run],
    before: &Snapshot,
    after: &Snapshot,
    (t_fault, t_return, t_end): (u64, u64, u64),
) -> Measured {
    let mut by_channel: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_channel.entry(r.channel.as_str()).or_default().push(r);
    }
    let mut m = Measured {
        not_running_during_ms: 0,
        not_running_after_ms: 0,
        interrupted: 0,
        reassigned: Vec::new(),
        reloaded: Vec::new(),
        reregistered: Vec::new(),
        recovery_ms: Some(0),
        first_stop_ms: runs
            .iter()
            .filter_map(|r| r.to)
            .filter(|&to| to >= t_fault)
            .min()
            .map(|to| to - t_fault),
        overlaps: Vec::new(),
        exits: Vec::new(),
    };
    let mut all_from = 0;
    for channel in before.owners.keys() {
        let rs = by_channel
            .get(channel.as_str())
            .cloned()
            .unwrap_or_default();
        // Single ownership: runs on two nodes may not overlap.
        for (k, a) in rs.iter().enumerate() {
            for b in &rs[k + 1..] {
                let from = a.from.max(b.from);
                let to = a.to.unwrap_or(t_end).min(b.to.unwrap_or(t_end));
                if a.node != b.node && from < to {
                    m.overlaps.push(format!(
                        "{channel} ran on node {} (epoch {}) and node {} (epoch {}) for {} ms from {from}",
                        a.node, a.epoch, b.node, b.epoch, to - from
                    ));
                }
            }
        }
        let mut spans: Vec<(u64, u64)> =
            rs.iter().map(|r| (r.from, r.to.unwrap_or(t_end))).collect();
        spans.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::new();
        for (a, b) in spans {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        let during = (t_return - t_fault) - overlap_ms(&merged, t_fault, t_return);
        let after_return = (t_end - t_return) - overlap_ms(&merged, t_return, t_end);
        m.not_running_during_ms += during;
        m.not_running_after_ms += after_return;
        if during + after_return > 0 {
            m.interrupted += 1;
        }
        match merged.iter().find(|(a, b)| *a <= t_end && *b >= t_end) {
            Some(&(a, _)) => all_from = all_from.max(a),
            None => m.recovery_ms = None,
        }
        if after.owners.get(channel) != before.owners.get(channel) {
            m.reassigned.push(channel.clone());
        }
        if rs.iter().any(|r| !r.resumed && r.from >= t_fault) {
            m.reloaded.push(channel.clone());
        }
    }
    if m.recovery_ms.is_some() {
        m.recovery_ms = Some(all_from.saturating_sub(t_return));
    }
    let ids: BTreeSet<u64> = runs
        .iter()
        .map(|r| r.node)
        .chain(after.sessions.iter().copied())
        .collect();
    m.reregistered = ids.difference(&before.sessions).copied().collect();
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_handler_log_parser_treats_a_pause_as_not_running_and_rejects_unknown_kinds() {
        let runs = parse_log(
            "start 1 a 1 100\npause 1 a 1 200\nresume 1 a 1 300\nstop 1 a 1 400\nstop 1 a 1 400\n\
             start 2 b 3 50\npartial 2",
        )
        .expect("parses");
        let spans: Vec<(u64, u64, Option<u64>)> =
            runs.iter().map(|r| (r.node, r.from, r.to)).collect();
        assert_eq!(
            spans,
            vec![(1, 100, Some(200)), (1, 300, Some(400)), (2, 50, None)]
        );
        assert!(parse_log("evict 1 a 1 100\n").is_err());
        assert!(parse_log("start 1 a x 100\n").is_err());
    }

    #[test]
    fn the_measurement_counts_paused_time_as_not_running_and_finds_overlaps() {
        let snap = |owners: &[(&str, u64, u64)], sessions: &[u64]| Snapshot {
            owners: owners
                .iter()
                .map(|&(c, n, e)| (c.to_owned(), (n, e)))
                .collect(),
            sessions: sessions.iter().copied().collect(),
        };
        let before = snap(&[("a", 1, 1), ("b", 2, 1)], &[1, 2]);
        // `a` pauses 1000..3000 and resumes on node 1; `b` stops on node 2 at 1500 and starts on
        // node 4 (a re-registration) at 2500 while node 2 runs it again 2000..2600: an overlap.
        let log = "start 1 a 1 0\nstart 2 b 1 0\npause 1 a 1 1000\nstop 2 b 1 1500\n\
                   start 2 b 1 2000\nstart 4 b 2 2500\nstop 2 b 1 2600\nresume 1 a 1 3000\n";
        let runs = parse_log(log).expect("parses");
        let after = snap(&[("a", 1, 1), ("b", 4, 2)], &[1, 4]);
        let m = measure(&runs, &before, &after, (500, 2000, 4000));
        assert_eq!(m.not_running_during_ms, 1000 + 500);
        assert_eq!(m.not_running_after_ms, 1000);
        assert_eq!(m.interrupted, 2);
        assert_eq!(m.reassigned, vec!["b".to_owned()]);
        assert_eq!(
            m.reloaded,
            vec!["b".to_owned()],
            "b started again; a resumed"
        );
        assert_eq!(m.reregistered, vec![4]);
        assert_eq!(m.recovery_ms, Some(1000));
        assert_eq!(m.first_stop_ms, Some(500));
        assert_eq!(m.overlaps.len(), 1, "{:?}", m.overlaps);
    }
}
