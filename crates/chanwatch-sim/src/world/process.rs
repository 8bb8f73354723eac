//! Faults of the processes themselves: crashes, starts, freezes, planned restarts, and nodes
//! whose handler misbehaves (sick, breaking, hung loads).
//!
//! Owns: one function per such [`Fault`], each drawing what it needs from the world's seeded
//! RNG in a fixed order and scheduling its own undo.
//! Must not: check anything (the checker does) or touch a process other than through its
//! harness handle, its [`chanwatch_store::FaultyStore`] switches and its handler.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::ChannelName;
use chanwatch_node::Behaviour;
use rand::RngExt;

use super::{NodeProc, World, SESSION_TTL};
use crate::check::Scope;
use crate::Fault;

impl World {
    /// [`Fault::NodeRestart`]: a node is asked to leave (SIGTERM) and a replacement starts
    /// under a fresh ID; the leaving node ends by itself once the coordinator has moved its
    /// channels off (`departures.rs` judges it).
    pub(super) fn node_restart(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let node = &self.nodes[i];
        let (slot, Some(id)) = (node.slot, node.id()) else {
            return;
        };
        if node.proc.paused() || self.leaving.contains(&slot) {
            return;
        }
        node.proc.leave();
        self.leaving.insert(slot);
        self.checker.planned_restart(id);
        let recent = self
            .last_undo_at
            .is_some_and(|at| at + SESSION_TTL > tokio::time::Instant::now());
        if !self.undo.is_empty() || recent {
            // A timed fault is still on, or ended (or a node crashed) less than a session TTL
            // ago — a keepalive loss that just ended can still expire the lease (seed 2590),
            // a crashed node's session still looks alive and may be picked as a target
            // (seed 1516): not judged.
            self.checker.departures.disturb();
        }
        self.fault(
            Fault::NodeRestart,
            &format!("proc{slot} (node {id}) leaves; a new node starts"),
        );
        self.spawn_node();
    }

    /// Forgets the nodes that left by themselves after a planned restart.
    pub(super) fn reap_departed(&mut self) {
        let (gone, kept): (Vec<NodeProc>, Vec<NodeProc>) = std::mem::take(&mut self.nodes)
            .into_iter()
            .partition(|n| self.leaving.contains(&n.slot) && n.proc.is_finished());
        self.nodes = kept;
        for n in gone {
            self.leaving.remove(&n.slot);
            self.log(&format!("proc{} left", n.slot));
        }
    }

    /// [`Fault::NodeCrash`]: the process dies without revoking its lease; a drain or a
    /// balance may follow during the failover.
    pub(super) async fn node_crash(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let node = self.nodes.remove(i);
        let id = node.id();
        node.proc.kill();
        if let Some(id) = id {
            self.handler.mark_dead(id);
        }
        // Its session lives on for up to a TTL: a leader may still pick it meanwhile.
        self.last_undo_at = Some(tokio::time::Instant::now());
        self.fault(
            Fault::NodeCrash,
            &format!("proc{} (node {id:?})", node.slot),
        );
        // Admin requests during the failover.
        match self.rng.random_range(0..4) {
            0 => self.drain().await,
            1 => self.balance().await,
            _ => {}
        }
    }

    /// [`Fault::NodeStart`], up to [`crate::SimOptions::max_nodes`].
    pub(super) fn node_start(&mut self) {
        if self.nodes.len() < self.options.max_nodes {
            self.count(Fault::NodeStart);
            self.spawn_node();
        }
    }

    /// [`Fault::NodePause`]: frozen (SIGSTOP), often past the TTL; on waking it must not ack
    /// anything. Its runs are excused from single ownership meanwhile.
    pub(super) fn node_pause(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let ttl = u64::try_from(SESSION_TTL.as_millis()).unwrap_or(4_000);
        let d = self.ms(1_000, 3 * ttl);
        let node = &self.nodes[i];
        if node.proc.paused() {
            return;
        }
        let (slot, id) = (node.slot, node.id());
        node.proc.pause(true);
        node.faults.hold(true);
        let (pause, faults) = (node.proc.pause_switch(), node.faults.clone());
        if let Some(id) = id {
            self.excuse(Scope::Node(id), d.as_millis() as u64 + ttl);
        }
        self.fault(
            Fault::NodePause,
            &format!("proc{slot} (node {id:?}) for {d:?}"),
        );
        self.schedule(
            d,
            format!("pause of proc{slot}"),
            Box::new(move || {
                faults.hold(false);
                pause.send_replace(false);
            }),
        );
    }

    /// [`Fault::CoordCrash`]: the leader dies without revoking its lease.
    pub(super) fn coord_crash(&mut self) {
        let Some(i) = self.leader_index() else { return };
        let c = self.coords.remove(i);
        c.proc.kill();
        self.fault(Fault::CoordCrash, &c.name);
    }

    /// [`Fault::CoordStart`], while fewer than two coordinators run.
    pub(super) fn coord_start(&mut self) {
        if self.coords.len() < 2 {
            self.count(Fault::CoordStart);
            self.spawn_coord();
        }
    }

    /// [`Fault::CoordPause`]: a deposed leader, frozen past its TTL while a standby takes
    /// over, then running again with its old view.
    pub(super) fn coord_pause(&mut self) {
        let Some(i) = self.leader_index() else { return };
        let d = self.ms(4_000, 12_000);
        let c = &self.coords[i];
        c.proc.pause(true);
        c.faults.hold(true);
        let (pause, faults) = (c.proc.pause_switch(), c.faults.clone());
        let name = c.name.clone();
        self.fault(Fault::CoordPause, &format!("{name} for {d:?}"));
        self.schedule(
            d,
            format!("pause of {name}"),
            Box::new(move || {
                faults.hold(false);
                pause.send_replace(false);
            }),
        );
    }

    /// [`Fault::SickNode`]: every load on a node fails for a while. Its channels move off and
    /// must not be fed back to it by balance (found from outside: 601 transitions in 7 s,
    /// epochs in the hundreds).
    pub(super) fn sick_node(&mut self) {
        self.troubled_node(Fault::SickNode, "sickness", |n| n.sick.clone());
    }

    /// [`Fault::BreakingNode`]: every load on a node reports its channel broken while it
    /// loads, then succeeds: each such run must stop before it is acknowledged `WatchFailed`
    /// (found from outside: a worker's `/fail` before `/ready` was dropped as stale).
    pub(super) fn breaking_node(&mut self) {
        self.troubled_node(Fault::BreakingNode, "breaking", |n| n.breaking.clone());
    }

    /// Sets the handler switch `flag` of a random node for 5-20 s.
    fn troubled_node(
        &mut self,
        kind: Fault,
        what: &str,
        flag: impl FnOnce(&NodeProc) -> Arc<AtomicBool>,
    ) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let d = self.ms(5_000, 20_000);
        let node = &self.nodes[i];
        let (slot, flag) = (node.slot, flag(node));
        flag.store(true, Ordering::SeqCst);
        self.fault(kind, &format!("proc{slot} for {d:?}"));
        self.schedule(
            d,
            format!("{what} of proc{slot}"),
            Box::new(move || flag.store(false, Ordering::SeqCst)),
        );
    }

    /// [`Fault::HungLoad`]: loads of one channel hang for a while, then behave as before.
    pub(super) fn hung_load(&mut self) {
        let candidates: Vec<ChannelName> = self.expected.iter().cloned().collect();
        let Some(i) = self.pick(candidates.len()) else {
            return;
        };
        let name = candidates[i].clone();
        let d = self.ms(2_000, 15_000);
        self.handler.set(name.as_str(), Behaviour::Hang);
        self.fault(Fault::HungLoad, &format!("{name} for {d:?}"));
        let restore = self.behaviours.iter().find(|(n, _)| n == &name).map_or(
            Behaviour::Load {
                delay: Duration::ZERO,
            },
            |(_, b)| *b,
        );
        let handler = self.handler.clone();
        self.schedule(
            d,
            format!("hung loads of {name}"),
            Box::new(move || handler.set(name.as_str(), restore)),
        );
    }
}
