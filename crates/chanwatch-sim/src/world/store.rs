//! Faults between the processes and the store: lost and delayed keepalives, broken and
//! stalled watches, compaction, failed and hung calls, partitions, a store-wide outage,
//! NOSPACE, expired tokens and slow calls.
//!
//! Owns: one function per such [`Fault`], each drawing what it needs from the world's seeded
//! RNG in a fixed order and scheduling its own undo.
//! Must not: check anything (the checker does) or reach a store other than through the
//! shared [`chanwatch_store::EmbeddedStore`]'s own switches and each process's
//! [`chanwatch_store::FaultyStore`].

use std::time::Duration;

use chanwatch_store::MetaStore;
use rand::RngExt;
use tokio::time::Instant;

use super::{World, LATENCY, SESSION_TTL};
use crate::Fault;

impl World {
    /// [`Fault::KeepaliveLoss`]: a node's keepalives fail for 0.5-8 s.
    pub(super) fn keepalive_loss(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let d = self.ms(500, 8_000);
        let node = &self.nodes[i];
        let (slot, faults) = (node.slot, node.faults.clone());
        faults.fail_keepalives(true);
        self.fault(Fault::KeepaliveLoss, &format!("proc{slot} for {d:?}"));
        self.schedule(
            d,
            format!("keepalive loss of proc{slot}"),
            Box::new(move || faults.fail_keepalives(false)),
        );
    }

    /// [`Fault::KeepaliveDelay`]: a process's keepalives take 0.1-2 s more for 1-8 s.
    pub(super) fn keepalive_delay(&mut self) {
        let (who, faults) = self.any_actor();
        let Some(faults) = faults else { return };
        let delay = self.ms(100, 2_000);
        let d = self.ms(1_000, 8_000);
        faults.delay_keepalives(delay);
        self.fault(
            Fault::KeepaliveDelay,
            &format!("{who} by {delay:?} for {d:?}"),
        );
        self.schedule(
            d,
            format!("keepalive delay of {who}"),
            Box::new(move || faults.delay_keepalives(Duration::ZERO)),
        );
    }

    /// [`Fault::WatchBreak`]: every watch stream ends at once.
    pub(super) fn watch_break(&mut self) {
        self.store.break_watches();
        self.fault(Fault::WatchBreak, "every watch stream");
    }

    /// [`Fault::Compaction`] at one of the last 20 revisions.
    pub(super) async fn compaction(&mut self) {
        let back = self.rng.random_range(0..20);
        let rev = self.store.revision() - back;
        let r = self.store.compact(rev).await;
        self.fault(
            Fault::Compaction,
            &format!("at r{rev}: {}", if r.is_ok() { "ok" } else { "refused" }),
        );
    }

    /// [`Fault::TxnFailures`]: a process's txns fail for 0.2-3 s.
    pub(super) fn txn_failures(&mut self) {
        let (who, faults) = self.any_actor();
        let Some(faults) = faults else { return };
        let d = self.ms(200, 3_000);
        faults.fail_txns(true);
        self.fault(Fault::TxnFailures, &format!("{who} for {d:?}"));
        self.schedule(
            d,
            format!("txn failures of {who}"),
            Box::new(move || faults.fail_txns(false)),
        );
    }

    /// [`Fault::NodeStall`]: a stalled connection, calls hang (neither fail nor land) while
    /// the process runs; its fencing must stop the channels before the lease can expire.
    pub(super) fn node_stall(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let d = self.ms(1_000, 12_000);
        let node = &self.nodes[i];
        if node.faults.held() {
            return;
        }
        let (slot, faults) = (node.slot, node.faults.clone());
        faults.hold(true);
        self.fault(Fault::NodeStall, &format!("proc{slot} for {d:?}"));
        self.schedule(
            d,
            format!("stall of proc{slot}"),
            Box::new(move || faults.hold(false)),
        );
    }

    /// [`Fault::NodePartition`]: cut off from the store, every call fails and its watches
    /// end.
    pub(super) fn node_partition(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let d = self.ms(1_000, 12_000);
        let node = &self.nodes[i];
        let (slot, faults) = (node.slot, node.faults.clone());
        faults.partition(true);
        self.fault(Fault::NodePartition, &format!("proc{slot} for {d:?}"));
        self.schedule(
            d,
            format!("partition of proc{slot}"),
            Box::new(move || faults.partition(false)),
        );
    }

    /// [`Fault::LeaderWatchStall`]: the leader's watch stalls silently while its keepalives
    /// and txns work; it must find out from its keepalives' revisions (the resync is far
    /// off) and relist, not time out channels whose acks it cannot see.
    pub(super) fn leader_watch_stall(&mut self) {
        let Some(i) = self.leader_index() else { return };
        let d = self.ms(3_000, 12_000);
        let (name, faults) = (self.coords[i].name.clone(), self.coords[i].faults.clone());
        faults.stall_watches(true);
        self.fault(Fault::LeaderWatchStall, &format!("{name} for {d:?}"));
        self.schedule(
            d,
            format!("watch stall of {name}"),
            Box::new(move || faults.stall_watches(false)),
        );
    }

    /// [`Fault::WatchStall`]: a watch that silently stops delivering while keepalives and
    /// txns work (a proxy holding back one stream), then a drain of that node: its channels
    /// sit in ToRelease unseen. A forced move must fence it first (found from outside: a
    /// blind owner ran 7 channels beside their new owner for ~6 s).
    pub(super) async fn watch_stall(&mut self) {
        let Some(i) = self.pick(self.nodes.len()) else {
            return;
        };
        let d = self.ms(6_000, 14_000);
        let node = &self.nodes[i];
        let (slot, id, faults) = (node.slot, node.id(), node.faults.clone());
        faults.stall_watches(true);
        self.fault(
            Fault::WatchStall,
            &format!("proc{slot} (node {id:?}) for {d:?}"),
        );
        self.schedule(
            d,
            format!("watch stall of proc{slot}"),
            Box::new(move || faults.stall_watches(false)),
        );
        if let Some(id) = id {
            self.drain_node(Some(id)).await;
        }
    }

    /// [`Fault::StoreOutage`]: the whole store goes away (etcd crash, restart, lost quorum):
    /// every call of every client fails, no lease expires, and on return every lease gets a
    /// whole TTL again. Channels pause; none may move and no node may register again
    /// (invariant 9). Other faults end first, so that what happens is the outage's doing.
    pub(super) async fn store_outage(&mut self) {
        let d = self.ms(1_000, 15_000);
        self.run_due_undos(true);
        self.checker.poll(&mut |_, _| {});
        self.checker.outage_began(SESSION_TTL / 2);
        self.store.set_outage(true);
        self.fault(Fault::StoreOutage, &format!("for {d:?}"));
        self.advance(d).await;
        self.store.set_outage(false);
        self.checker.outage_ended(Instant::now());
        self.log("end store outage");
    }

    /// [`Fault::Nospace`]: writes with a put and lease grants are refused, deletes pass.
    pub(super) fn nospace(&mut self) {
        let d = self.ms(1_000, 10_000);
        self.store.set_nospace(true);
        self.fault(Fault::Nospace, &format!("for {d:?}"));
        let store = self.store.clone();
        self.schedule(
            d,
            "NOSPACE alarm".into(),
            Box::new(move || store.set_nospace(false)),
        );
    }

    /// [`Fault::AuthExpired`]: an expired auth token, every call of one process but
    /// keepalives fails.
    pub(super) fn auth_expired(&mut self) {
        let (who, faults) = self.any_actor();
        let Some(faults) = faults else { return };
        let d = self.ms(500, 6_000);
        faults.expire_auth(true);
        self.fault(Fault::AuthExpired, &format!("{who} for {d:?}"));
        self.schedule(
            d,
            format!("expired token of {who}"),
            Box::new(move || faults.expire_auth(false)),
        );
    }

    /// [`Fault::SlowStore`]: every call of one process takes up to 1.5 s (an etcd member
    /// under a compaction or a slow disk).
    pub(super) fn slow_store(&mut self) {
        let (who, faults) = self.any_actor();
        let Some(faults) = faults else { return };
        let d = self.ms(2_000, 10_000);
        let seed = self.seed ^ 0x5eed;
        faults.latency(Duration::from_millis(1_500), seed);
        self.fault(Fault::SlowStore, &format!("{who} for {d:?}"));
        self.schedule(
            d,
            format!("slow store of {who}"),
            Box::new(move || faults.latency(LATENCY, seed)),
        );
    }
}
