//! What the chaos run reads from the nodes' handler logs (`KIND NODE CHANNEL EPOCH UNIX_MS`
//! lines, `--handler-log`) and the processes' output: which channels run now, the runs of
//! each channel and their overlaps (single ownership), and why nodes fenced themselves.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The last `n` lines of a file.
pub fn tail(path: &Path, n: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A handler log line `KIND NODE CHANNEL EPOCH UNIX_MS` without the time.
pub fn parse_line(line: &str) -> Option<(&str, u64, &str, u64)> {
    let f: Vec<&str> = line.split(' ').collect();
    let [what, node, channel, epoch, _ms] = f[..] else {
        return None;
    };
    Some((what, node.parse().ok()?, channel, epoch.parse().ok()?))
}

/// One run of a channel: node, channel, epoch, start ms, end ms, the process's log.
pub type Run = (u64, String, u64, u64, u64, PathBuf);

/// Runs of channels by nodes, from the handler logs.
pub fn intervals(logs: &[PathBuf], killed: &[(PathBuf, u64)], end: u64) -> Vec<Run> {
    let mut out = Vec::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let cut = killed.iter().find(|(p, _)| p == log).map(|(_, t)| *t);
        let mut open: BTreeMap<(u64, String, u64), u64> = BTreeMap::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            let [what, node, channel, epoch, ms] = f[..] else {
                continue;
            };
            let (Ok(node), Ok(epoch), Ok(ms)) = (node.parse(), epoch.parse(), ms.parse()) else {
                continue;
            };
            let key = (node, channel.to_owned(), epoch);
            // A paused channel does not run: `pause` ends a run, `resume` starts one.
            match what {
                "start" | "resume" => {
                    open.insert(key, ms);
                }
                "stop" | "pause" => {
                    if let Some(s) = open.remove(&key) {
                        out.push((node, key.1, epoch, s, ms, log.clone()));
                    }
                }
                _ => {}
            }
        }
        for ((node, channel, epoch), s) in open {
            out.push((node, channel, epoch, s, cut.unwrap_or(end), log.clone()));
        }
    }
    out
}

/// The node IDs that ran any channel according to these handler logs.
pub fn nodes_in(logs: &[PathBuf]) -> BTreeSet<u64> {
    logs.iter()
        .flat_map(|log| {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            text.lines()
                .filter_map(|l| parse_line(l).map(|(_, node, _, _)| node))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// (node, channel, epoch) that run now according to these handler logs: started or resumed,
/// and not stopped or paused since.
pub fn running<'a>(logs: impl Iterator<Item = &'a Path>) -> BTreeSet<(u64, String, u64)> {
    let mut out = BTreeSet::new();
    for log in logs {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        for line in text.lines() {
            let Some((what, node, channel, epoch)) = parse_line(line) else {
                continue;
            };
            let key = (node, channel.to_owned(), epoch);
            match what {
                "start" | "resume" => {
                    out.insert(key);
                }
                "stop" | "pause" => {
                    out.remove(&key);
                }
                _ => {}
            }
        }
    }
    out
}

/// Every handler log line in `dir` about `channel`, with its file's name.
pub fn history(dir: &Path, channel: &str) -> String {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return String::new();
    };
    let mut logs: Vec<PathBuf> = entries.filter_map(|e| e.ok().map(|e| e.path())).collect();
    logs.sort();
    for log in logs
        .iter()
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
    {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let name = log.file_name().unwrap_or_default().to_string_lossy();
        out.extend(
            text.lines()
                .filter(|l| parse_line(l).is_some_and(|(_, _, c, _)| c == channel))
                .map(|l| format!("  {name}: {l}")),
        );
    }
    out.join("\n")
}

/// Two nodes running one channel at the same instant, one message each; runs of a process
/// while it was frozen (`frozen`: log, from, to) are excused.
pub fn overlaps(runs: &[Run], frozen: &[(PathBuf, u64, u64)]) -> Vec<String> {
    let is_frozen = |log: &Path, from: u64, to: u64| {
        frozen
            .iter()
            .any(|(p, f, t)| p == log && *f <= to && from <= *t)
    };
    let mut by_channel: BTreeMap<&str, Vec<&Run>> = BTreeMap::new();
    for r in runs {
        by_channel.entry(r.1.as_str()).or_default().push(r);
    }
    let mut out = Vec::new();
    for (channel, rs) in &by_channel {
        for (k, a) in rs.iter().enumerate() {
            for b in &rs[k + 1..] {
                let (from, to) = (a.3.max(b.3), a.4.min(b.4));
                if a.0 == b.0 || from >= to {
                    continue;
                }
                if is_frozen(&a.5, from, to) || is_frozen(&b.5, from, to) {
                    continue;
                }
                out.push(format!(
                    "{channel} ran on node {} (epoch {}) and node {} (epoch {}) during {from}..{to}",
                    a.0, a.2, b.0, b.2
                ));
            }
        }
    }
    out
}

/// How often nodes fenced themselves, by reason, from the `*.out` files in `dir`.
pub fn fence_reasons(dir: &Path) -> BTreeMap<String, usize> {
    let mut fences = BTreeMap::new();
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "out") {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            for line in text.lines().filter(|l| l.contains("fenced itself")) {
                let line = strip_ansi(line);
                let reason = line.split("reason=").nth(1).unwrap_or(&line);
                *fences.entry(reason.to_owned()).or_default() += 1;
            }
        }
    }
    fences
}

/// `line` without ANSI colour sequences (`ESC [ ... m`).
fn strip_ansi(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars();
    while let Some(ch) = chars.next() {
        if ch == '\u{1b}' {
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(ch);
        }
    }
    out
}
