//! The data-plane checks: checkpoints land only from the channel's live owner and never go
//! back, and after the run every committed state is exactly what the log holds up to its
//! position.
//!
//! Owns: nothing of its own; methods of [`Checker`] over its shadow of the key space.
//! Must not: drive the cluster.

use super::*;

impl Checker {
    /// Fenced checkpoints (invariant 3 for data): a put to `{root}/worker/checkpoint/{c}` lands only
    /// from the process whose live session owns `c`'s assignment key right before it, and a
    /// channel's committed position never goes back.
    pub(super) fn check_checkpoints(
        &mut self,
        rev: Revision,
        writer: &Writer,
        events: &[WatchEvent],
    ) {
        for e in events {
            let Ok(channel) = self.keys.parse_checkpoint(&e.kv.key) else {
                continue;
            };
            if e.kind == EventKind::Delete {
                self.positions.remove(&channel);
                continue;
            }
            let Writer::Node(slot) = writer else {
                self.violation(rev, format!("{writer} wrote the checkpoint of {channel}"));
                continue;
            };
            let proc = format!("proc{slot}");
            let owner = self
                .owners
                .get(&channel)
                .and_then(|o| o.iter().next().copied());
            let owner_proc = match owner {
                Some(ChannelOwner::Node(n)) => self
                    .kv
                    .get(&self.keys.session(n))
                    .and_then(|kv| chanwatch_core::NodeSession::decode(&kv.value).ok())
                    .map(|s| (n, s.admin_addr)),
                _ => None,
            };
            match owner_proc {
                Some((_, p)) if p == proc => {}
                other => self.violation(
                    rev,
                    format!(
                        "stale checkpoint: {proc} committed {channel} while its assignment is {}",
                        match (owner, other) {
                            (Some(o), Some((_, p))) => format!("on {o} ({p})"),
                            (Some(o), None) => format!("on {o} (no live session)"),
                            (None, _) => "gone".to_owned(),
                        }
                    ),
                ),
            }
            match chanwatch_core::Checkpoint::decode(&e.kv.value)
                .ok()
                .and_then(|cp| cp.position.parse::<u64>().ok())
            {
                Some(pos) => {
                    let last = self.positions.insert(channel.clone(), pos);
                    if let Some(last) = last.filter(|l| *l > pos) {
                        self.violation(
                            rev,
                            format!("{channel}: committed position went back from {last} to {pos} (by {proc})"),
                        );
                    }
                }
                None => self.violation(
                    rev,
                    format!("{channel}: checkpoint by {proc} has no numeric position"),
                ),
            }
        }
    }

    /// Data plane, after the producer stopped: why some present channel's committed position
    /// is not yet the end of its log (`None`: every one caught up).
    pub fn data_behind(&self, log: &crate::MemLog) -> Option<String> {
        let mut behind = Vec::new();
        for (channel, owners) in &self.owners {
            if owners.is_empty() {
                continue;
            }
            let end = log
                .messages(
                    channel.as_str(),
                    chanwatch_stream::Position::from_raw(u64::MAX),
                )
                .len() as u64;
            let at = self.positions.get(channel).copied().unwrap_or(0);
            if at != end {
                behind.push(format!("{channel} at {at} of {end}"));
            }
        }
        (!behind.is_empty())
            .then(|| format!("committed positions behind the log: {}", behind.join(", ")))
    }

    /// Invariant 8: every present channel's committed state is exactly the fold of its log up
    /// to its committed position. Each difference becomes a violation.
    pub fn check_data(&mut self, log: &crate::MemLog) {
        let mut found = Vec::new();
        for (channel, owners) in &self.owners {
            if owners.is_empty() {
                continue;
            }
            let Some(kv) = self.kv.get(&self.keys.checkpoint(channel)) else {
                if !log
                    .messages(channel.as_str(), chanwatch_stream::Position::from_raw(1))
                    .is_empty()
                {
                    found.push(format!("{channel}: messages in the log but no checkpoint"));
                }
                continue;
            };
            let cp = match chanwatch_core::Checkpoint::decode(&kv.value) {
                Ok(cp) => cp,
                Err(e) => {
                    found.push(format!("{channel}: checkpoint does not decode: {e}"));
                    continue;
                }
            };
            let Ok(at) = cp.position.parse::<chanwatch_stream::Position>() else {
                found.push(format!(
                    "{channel}: checkpoint position {:?} is not a position",
                    cp.position
                ));
                continue;
            };
            let mut expected = chanwatch_node::handler::StreamState::default();
            for m in log.messages(channel.as_str(), at) {
                expected.fold(&m);
            }
            let got = cp
                .state
                .as_ref()
                .map(chanwatch_node::handler::StreamState::from_json)
                .unwrap_or(Ok(chanwatch_node::handler::StreamState::default()));
            if got.as_ref() != Ok(&expected) {
                found.push(format!(
                    "not exactly-once: {channel} at {at} committed {got:?}, the log folds to {expected:?}"
                ));
            }
        }
        let rev = self.revision;
        for f in found {
            self.violation(rev, f);
        }
    }
}
