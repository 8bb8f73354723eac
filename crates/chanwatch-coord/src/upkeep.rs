//! Upkeep of the store by the leader (DESIGN.md §8): compaction every `compact_interval`, and
//! the database size and quota for `chanwatch_etcd_db_bytes` / `chanwatch_etcd_quota_bytes`
//! (the quota etcd says, or the one configured when it does not: etcd before 3.6).
//!
//! Every `compact_interval` the leader compacts the store to the revision it saw one interval
//! earlier. Before it compacts it writes that revision into `{root}/coord/compact` by a
//! compare-and-swap on the key's mod revision (and on its own leader key), and it compacts
//! nothing unless that txn succeeded: so two coordinators that both think they lead compact
//! once, and a leader that finds the key written after the revision it saw one interval ago
//! (by a previous leader, just before a failover) waits one more interval. Watchers need no
//! old revision: every list-watch relists on `Compacted`.
//!
//! Owns: the decision ([`decide`]), the driver ([`Upkeep`]) and the task that runs it while a
//! term lasts ([`spawn`]). Must not: touch any key but `{root}/coord/compact`, or block the
//! leader's loop (it runs on a task of its own, ended with the term).

use std::sync::Arc;
use std::time::Duration;

use chanwatch_core::Keys;
use chanwatch_store::{Compare, KeyRange, MetaStore, Revision, StoreError, Txn, TxnOp};
use tokio_util::task::AbortOnDropHandle;
use tracing::{debug, info, warn};

use crate::metrics::CoordMetrics;

/// etcd's default `--quota-backend-bytes` (2 GiB).
pub const DEFAULT_QUOTA: u64 = 2 * 1024 * 1024 * 1024;

/// How often the leader reads the database size (etcd's maintenance `status`).
pub(crate) const STATUS_EVERY: Duration = Duration::from_secs(5);

/// What `{root}/coord/compact` holds as read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    /// The revision last compacted to (its value; 0 when it does not parse).
    pub(crate) compacted_to: Revision,
    /// The revision at which it was written.
    pub(crate) mod_revision: Revision,
}

/// What one round of upkeep does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Decision {
    /// Write `to` into the key if its mod revision is still `expect_mod` (0: the key is
    /// absent), and only then compact to `to`.
    Compact {
        /// The revision to compact to.
        to: Revision,
        /// The key's mod revision as read.
        expect_mod: Revision,
    },
    /// Nothing to do this round, and why.
    Skip(&'static str),
}

/// Decides a round: `seen` is the revision the leader saw one interval ago (at first, the
/// create revision of its leader key), `record` the compaction key as read now.
pub(crate) fn decide(seen: Option<Revision>, record: Option<Record>) -> Decision {
    let Some(to) = seen.filter(|r| *r > 0) else {
        return Decision::Skip("no revision seen one interval ago");
    };
    match record {
        Some(r) if r.mod_revision > to => {
            Decision::Skip("compacted within the last interval (by another or an earlier leader)")
        }
        Some(r) if r.compacted_to >= to => Decision::Skip("already compacted that far"),
        _ => Decision::Compact {
            to,
            expect_mod: record.map_or(0, |r| r.mod_revision),
        },
    }
}

/// What a round did (tests read it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Compacted to this revision.
    Compacted(Revision),
    /// The store had already compacted past it, or the revision was not reached (not an
    /// error: some other compaction did the work).
    AlreadyDone(Revision),
    /// The compare-and-swap failed: another coordinator wrote the key, or we no longer lead.
    Refused,
    /// Nothing to do.
    Skipped(&'static str),
}

/// The leader's upkeep for one term.
pub(crate) struct Upkeep {
    store: Arc<dyn MetaStore>,
    keys: Keys,
    /// The create revision of our leader key: the CAS also checks that we still lead.
    leader_rev: Revision,
    metrics: Arc<CoordMetrics>,
    /// The revision seen at the end of the last round.
    seen: Option<Revision>,
    /// The quota exported when the store does not say its own.
    assumed_quota: u64,
}

impl Upkeep {
    /// Upkeep for the term whose leader key was created at `leader_rev`: the revision the
    /// leader saw when its term began, so its first round (one interval later) compacts to it
    /// without a read at the start of the term.
    pub(crate) fn new(
        store: Arc<dyn MetaStore>,
        keys: Keys,
        leader_rev: Revision,
        metrics: Arc<CoordMetrics>,
    ) -> Self {
        Upkeep {
            store,
            keys,
            leader_rev,
            metrics,
            seen: Some(leader_rev),
            assumed_quota: DEFAULT_QUOTA,
        }
    }

    /// The quota to export when the store does not say its own (etcd before 3.6).
    pub(crate) fn assumed_quota(mut self, bytes: u64) -> Self {
        self.assumed_quota = bytes;
        self
    }

    /// One round: read the key, decide, CAS, compact.
    ///
    /// # Errors
    /// Any store error of the read, the txn or the compaction (but `Compacted` and
    /// `FutureRevision`, which are [`Outcome::AlreadyDone`]); the next round tries again.
    pub(crate) async fn round(&mut self) -> Result<Outcome, StoreError> {
        let (decision, read_at) = self.plan().await?;
        self.carry_out(decision, read_at).await
    }

    /// Reads the compaction key and decides; also returns the revision it read at.
    async fn plan(&self) -> Result<(Decision, Revision), StoreError> {
        let key = self.keys.compact();
        let read = self
            .store
            .range_keys(&KeyRange::between(key.clone(), format!("{key}\0")))
            .await?;
        let record = read.kvs.iter().find(|kv| kv.key == key).map(|kv| Record {
            compacted_to: std::str::from_utf8(&kv.value)
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or_else(|| {
                    warn!(key, "coord: the compaction key does not hold a decimal revision; overwriting it");
                    0
                }),
            mod_revision: kv.mod_revision,
        });
        Ok((decide(self.seen, record), read.revision))
    }

    /// Carries `decision` out (made from a read at `read_at`): the CAS, then the compaction.
    async fn carry_out(
        &mut self,
        decision: Decision,
        read_at: Revision,
    ) -> Result<Outcome, StoreError> {
        let (to, expect_mod) = match decision {
            Decision::Skip(why) => {
                self.seen = Some(read_at);
                debug!(why, "coord: no compaction this round");
                return Ok(Outcome::Skipped(why));
            }
            Decision::Compact { to, expect_mod } => (to, expect_mod),
        };
        let key = self.keys.compact();
        let txn = Txn::new()
            .when([
                Compare::mod_revision(key.clone(), expect_mod),
                Compare::create_revision(self.keys.leader(), self.leader_rev),
            ])
            .and_then([TxnOp::put(key.clone(), to.to_string())]);
        let resp = self.store.txn(txn).await?;
        self.seen = Some(resp.revision.max(read_at));
        if !resp.succeeded {
            debug!(
                to,
                "coord: the compaction key changed or we no longer lead; not compacting"
            );
            return Ok(Outcome::Refused);
        }
        match self.store.compact(to).await {
            Ok(()) => {
                self.metrics.compactions.inc();
                info!(revision = to, "coord: compacted the store");
                Ok(Outcome::Compacted(to))
            }
            Err(e @ (StoreError::Compacted { .. } | StoreError::FutureRevision { .. })) => {
                debug!(revision = to, error = %e, "coord: compaction already done");
                Ok(Outcome::AlreadyDone(to))
            }
            Err(e) => Err(e),
        }
    }

    /// Reads the database size into `chanwatch_etcd_db_bytes`, and its quota (the store's, or
    /// the assumed one) into `chanwatch_etcd_quota_bytes`. `false` when the store has no
    /// database size (the embedded store): no need to ask again.
    async fn read_size(&self) -> bool {
        match self.store.status().await {
            Ok(Some(s)) => {
                self.metrics.set_db_bytes(s.db_size);
                self.metrics.set_quota_bytes(quota(&s, self.assumed_quota));
                true
            }
            Ok(None) => false,
            Err(e) => {
                debug!(error = %e, "coord: cannot read the store's size; trying again");
                true
            }
        }
    }
}

/// The quota the store says, else `assumed`.
fn quota(s: &chanwatch_store::StoreStatus, assumed: u64) -> i64 {
    if s.db_size_quota > 0 {
        s.db_size_quota
    } else {
        i64::try_from(assumed).unwrap_or(i64::MAX)
    }
}

/// Runs `upkeep` until the handle is dropped (the term ends): a round every `interval` (none
/// when it is zero), and the database size every [`STATUS_EVERY`].
pub(crate) fn spawn(mut upkeep: Upkeep, interval: Duration) -> AbortOnDropHandle<()> {
    AbortOnDropHandle::new(tokio::spawn(async move {
        let start = tokio::time::Instant::now();
        let mut compact_at = (!interval.is_zero()).then(|| start + interval);
        let mut size_at = Some(start);
        loop {
            let next = match (compact_at, size_at) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => return,
            };
            tokio::time::sleep_until(next).await;
            let now = tokio::time::Instant::now();
            if size_at.is_some_and(|t| t <= now) {
                size_at = upkeep.read_size().await.then(|| now + STATUS_EVERY);
            }
            if compact_at.is_some_and(|t| t <= now) {
                if let Err(e) = upkeep.round().await {
                    warn!(error = %e, "coord: compaction round failed; trying again next interval");
                }
                compact_at = Some(now + interval);
            }
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use chanwatch_store::EmbeddedStore;
    use futures_util::StreamExt;

    /// `chanwatch_etcd_quota_bytes`: what etcd says (3.6+), else `--quota-backend-bytes`.
    #[test]
    fn the_exported_quota_is_etcds_own_else_the_configured_one() {
        let status = |q| chanwatch_store::StoreStatus {
            db_size: 1 << 20,
            db_size_in_use: 0,
            revision: 7,
            db_size_quota: q,
        };
        assert_eq!(quota(&status(0), 32 << 20), 32 << 20);
        assert_eq!(quota(&status(8 << 30), 32 << 20), 8 << 30);
        assert_eq!(quota(&status(0), u64::MAX), i64::MAX);
    }

    #[test]
    fn a_round_compacts_to_the_revision_seen_one_interval_ago_unless_someone_did_meanwhile() {
        let rec = |compacted_to, mod_revision| {
            Some(Record {
                compacted_to,
                mod_revision,
            })
        };
        // First round of a term: nothing seen yet.
        assert!(matches!(decide(None, None), Decision::Skip(_)));
        // Never compacted: compact to what was seen, the key must still be absent.
        assert_eq!(
            decide(Some(100), None),
            Decision::Compact {
                to: 100,
                expect_mod: 0
            }
        );
        // Our own last round wrote the key at 90 and saw 100 since.
        assert_eq!(
            decide(Some(100), rec(80, 90)),
            Decision::Compact {
                to: 100,
                expect_mod: 90
            }
        );
        // Written after the revision we saw one interval ago: someone compacted within the
        // interval (another leader before a failover).
        assert!(matches!(decide(Some(100), rec(95, 120)), Decision::Skip(_)));
        // Already compacted past it.
        assert!(matches!(
            decide(Some(100), rec(100, 100)),
            Decision::Skip(_)
        ));
    }

    async fn put(store: &EmbeddedStore, key: &str, value: &str) -> Revision {
        store
            .txn(Txn::new().and_then([TxnOp::put(key, value)]))
            .await
            .expect("put")
            .revision
    }

    async fn compacted_below(store: &EmbeddedStore, rev: Revision) -> bool {
        let mut w = store.watch("", rev - 1).await.expect("watch");
        matches!(w.next().await, Some(Err(StoreError::Compacted { .. })))
    }

    #[tokio::test(start_paused = true)]
    async fn the_driver_compacts_after_a_successful_cas_only() {
        let store = EmbeddedStore::new();
        let keys = Keys::default();
        let leader_rev = put(&store, &keys.leader(), "me").await;
        let metrics = Arc::new(CoordMetrics::new());
        let mut up = Upkeep::new(
            Arc::new(store.clone()),
            keys.clone(),
            leader_rev,
            metrics.clone(),
        );
        put(&store, "chanwatch/x", "0").await;
        // The first round (one interval into the term) compacts to where the term began.
        assert!(matches!(up.round().await, Ok(Outcome::Compacted(r)) if r == leader_rev));
        let seen = store.range("none/").await.expect("range").revision;
        put(&store, "chanwatch/x", "1").await;
        put(&store, "chanwatch/x", "2").await;
        // Then to what the previous round saw, after writing it into the key.
        let Ok(Outcome::Compacted(to)) = up.round().await else {
            panic!("no compaction")
        };
        assert_eq!(to, seen);
        assert!(compacted_below(&store, to).await);
        assert_eq!(metrics.compactions.get(), 2);
        let kv = store
            .get(&keys.compact())
            .await
            .expect("get")
            .expect("the key");
        assert_eq!(kv.value, to.to_string().into_bytes());
        put(&store, "chanwatch/x", "4").await;

        // The key changes between the read and the CAS (another coordinator's round): the
        // CAS is refused and nothing is compacted.
        put(&store, "chanwatch/x", "3").await;
        let (decision, read_at) = up.plan().await.expect("read");
        assert!(matches!(decision, Decision::Compact { .. }), "{decision:?}");
        put(&store, &keys.compact(), &read_at.to_string()).await;
        assert!(matches!(
            up.carry_out(decision, read_at).await,
            Ok(Outcome::Refused)
        ));
        assert_eq!(metrics.compactions.get(), 2, "compacted without the CAS");
        put(&store, "chanwatch/x", "4").await;

        // Another coordinator wrote the key after what `up` saw: it skips this interval.
        put(&store, &keys.compact(), "1").await;
        assert!(matches!(up.round().await, Ok(Outcome::Skipped(_))));

        // A deposed leader (its leader key re-created by someone else) is refused.
        let mut deposed = Upkeep::new(
            Arc::new(store.clone()),
            keys.clone(),
            leader_rev,
            metrics.clone(),
        );
        put(&store, "chanwatch/x", "5").await;
        deposed.round().await.expect("first round");
        store
            .txn(Txn::new().and_then([TxnOp::delete(keys.leader())]))
            .await
            .expect("delete");
        put(&store, &keys.leader(), "someone else").await;
        put(&store, "chanwatch/x", "6").await;
        assert!(matches!(deposed.round().await, Ok(Outcome::Refused)));
        assert_eq!(metrics.compactions.get(), 2, "compacted without the CAS");
    }
}
