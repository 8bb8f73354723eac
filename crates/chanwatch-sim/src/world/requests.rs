//! Admin requests to the leader: channel adds and removes, drains, balances, and what their
//! outcomes mean for the channels the run must end with.
//!
//! Owns: the requests' [`Fault`] kinds, `World::expected` and `World::ambiguous` (a
//! request whose outcome is unknown may or may not have happened).
//! Must not: call a coordinator other than through its [`chanwatch_coord::CoordHandle`],
//! or wait longer than `REQUEST_TIMEOUT`.

use std::time::Duration;

use chanwatch_core::{ChannelName, NodeId, VChannelInfo};
use chanwatch_node::Behaviour;
use rand::RngExt;

use super::{placement_of, NodeProc, World};
use crate::Fault;

/// How long an admin request may take before its outcome counts as unknown.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// What an admin request came to.
enum Outcome {
    Done,
    Refused,
    Unknown,
}

fn classify<E>(r: Result<Result<(), E>, tokio::time::error::Elapsed>) -> Outcome
where
    E: Into<chanwatch_coord::ApiError>,
{
    match r {
        Ok(Ok(())) => Outcome::Done,
        Ok(Err(e)) => match e.into() {
            chanwatch_coord::ApiError::Admin(_) | chanwatch_coord::ApiError::NotLeader { .. } => {
                Outcome::Refused
            }
            chanwatch_coord::ApiError::Store(_) => Outcome::Unknown,
        },
        Err(_) => Outcome::Unknown,
    }
}

impl World {
    pub(super) fn next_name(&mut self) -> ChannelName {
        let name = format!("ch-{:03}", self.next_channel);
        self.next_channel += 1;
        ChannelName::new(name).unwrap_or_else(|_| unreachable!("generated names are valid"))
    }

    /// [`Fault::ChannelAdd`]: a new channel that loads within 0.8 s.
    pub(super) async fn channel_add(&mut self) {
        self.count(Fault::ChannelAdd);
        let delay = self.ms(0, 800);
        let name = self.next_name();
        self.add_channel(name, Behaviour::Load { delay }).await;
    }

    /// Asks the leader to add `name`; a `Fail` behaviour is already set by the caller.
    pub(super) async fn add_channel(&mut self, name: ChannelName, behaviour: Behaviour) {
        let failing = behaviour == Behaviour::Fail;
        let behaviour = if failing {
            Behaviour::Load {
                delay: Duration::from_millis(100),
            }
        } else {
            behaviour
        };
        self.behaviours.push((name.clone(), behaviour));
        if !failing {
            self.handler.set(name.as_str(), behaviour);
        }
        self.checker.requested_adds.insert(name.clone());
        self.newest = Some(name.clone());
        if let Some(d) = &self.data {
            d.channels
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(name.clone());
        }
        let outcome = match self.leader() {
            None => Outcome::Refused,
            Some(h) => {
                let n = name.clone();
                self.log(&format!("request add {n}"));
                let placement = placement_of(self.seed, &n);
                let r = tokio::time::timeout(
                    REQUEST_TIMEOUT,
                    h.add_channel_with(n, VChannelInfo::default(), placement),
                )
                .await;
                classify(r.map(|r| r.map(|_| ())))
            }
        };
        self.record(&name, outcome, true);
    }

    /// [`Fault::ChannelRemove`]: with the data plane, half the time the channel added last
    /// (see `World::newest`), otherwise any channel expected.
    pub(super) async fn channel_remove(&mut self) {
        self.count(Fault::ChannelRemove);
        let newest = self
            .newest
            .clone()
            .filter(|n| self.data.is_some() && self.expected.contains(n));
        let name = match newest {
            Some(n) if self.rng.random_bool(0.5) => n,
            _ => {
                let candidates: Vec<ChannelName> = self.expected.iter().cloned().collect();
                let Some(i) = self.pick(candidates.len()) else {
                    return;
                };
                candidates[i].clone()
            }
        };
        let Some(h) = self.leader() else { return };
        self.checker.requested_removes.insert(name.clone());
        self.log(&format!("request remove {name}"));
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.remove_channel(name.clone())).await;
        let outcome = classify(r.map(|r| r.map(|_| ())));
        self.record(&name, outcome, false);
    }

    fn record(&mut self, name: &ChannelName, outcome: Outcome, add: bool) {
        let word = match outcome {
            Outcome::Done => "done",
            Outcome::Refused => "refused",
            Outcome::Unknown => "unknown",
        };
        self.log(&format!(
            "{} {name}: {word}",
            if add { "add" } else { "remove" }
        ));
        match (outcome, add) {
            (Outcome::Done, true) => {
                self.expected.insert(name.clone());
            }
            (Outcome::Done, false) => {
                self.expected.remove(name);
            }
            (Outcome::Refused, _) => {}
            (Outcome::Unknown, _) => {
                self.expected.remove(name);
                self.ambiguous.insert(name.clone());
            }
        }
    }

    /// [`Fault::Drain`] of a random node.
    pub(super) async fn drain(&mut self) {
        self.drain_node(None).await;
    }

    /// Drains `which` (if it is not draining yet) or a random node, leaving at least two
    /// nodes that take channels (until nodes die later).
    pub(super) async fn drain_node(&mut self, which: Option<NodeId>) {
        let draining = self.checker.draining();
        let ids: Vec<NodeId> = self
            .nodes
            .iter()
            .filter_map(NodeProc::id)
            .filter(|id| !draining.contains(id))
            .collect();
        if ids.len() < 3 {
            return;
        }
        let Some(i) = (match which {
            Some(id) => ids.iter().position(|n| *n == id),
            None => self.pick(ids.len()),
        }) else {
            return;
        };
        let Some(h) = self.leader() else { return };
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.drain(ids[i])).await;
        let word = match r {
            Ok(Ok(())) => "ok",
            Ok(Err(_)) => "refused",
            Err(_) => "timed out",
        };
        self.fault(Fault::Drain, &format!("node {}: {word}", ids[i]));
    }

    /// [`Fault::Balance`]: the leader is asked to balance (not forced).
    pub(super) async fn balance(&mut self) {
        let Some(h) = self.leader() else { return };
        let r = tokio::time::timeout(REQUEST_TIMEOUT, h.balance(false)).await;
        let word = match r {
            Ok(Ok(moves)) => format!("{} moves", moves.len()),
            Ok(Err(_)) => "refused".into(),
            Err(_) => "timed out".into(),
        };
        self.fault(Fault::Balance, &word);
    }
}
