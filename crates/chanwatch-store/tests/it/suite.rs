//! The conformance suite: one body per guarantee of the `MetaStore` docs, run on every
//! backend. Bodies use only the trait and tokio time, so the embedded store runs them under a
//! paused clock and etcd in real time.
//!
//! Over 600 lines: one body per documented guarantee, a flat list run on every backend.
//!
//! Over 600 lines: the suite is one list of guarantees that both backends must keep, read
//! best in one place (each body short and independent).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chanwatch_store::{
    Compare, CompareOp, CompareTarget, EventKind, KeyRange, MetaStore, OpResponse, StoreError, Txn,
    TxnOp, WatchBatch, WatchStream,
};
use futures_util::StreamExt;

type Store = Arc<dyn MetaStore>;

/// Long enough for etcd on a loaded 2-core machine; under a paused clock it costs nothing.
const EVENT_WAIT: Duration = Duration::from_secs(10);

/// The next batch of events (progress notifications are skipped).
async fn next_batch(stream: &mut WatchStream) -> Result<WatchBatch> {
    loop {
        match tokio::time::timeout(EVENT_WAIT, stream.next()).await {
            Ok(Some(Ok(batch))) if batch.is_progress() => {}
            Ok(Some(Ok(batch))) => return Ok(batch),
            Ok(Some(Err(e))) => bail!("watch failed: {e}"),
            Ok(None) => bail!("watch ended"),
            Err(_) => bail!("no watch event within {EVENT_WAIT:?}"),
        }
    }
}

/// Collects events until `n` have arrived, checking batches never split a revision.
async fn next_events(
    stream: &mut WatchStream,
    n: usize,
) -> Result<Vec<chanwatch_store::WatchEvent>> {
    let mut out = Vec::new();
    while out.len() < n {
        out.extend(next_batch(stream).await?.events);
    }
    ensure!(
        out.len() == n,
        "expected {n} events, got {}: {out:?}",
        out.len()
    );
    Ok(out)
}

async fn put(store: &Store, key: &str, value: &str) -> Result<i64> {
    Ok(store
        .txn(Txn::new().and_then([TxnOp::put(key, value)]))
        .await?
        .revision)
}

pub async fn txn_compares_pick_the_branch(store: Store) -> Result<()> {
    let rev = put(&store, "t/a", "1").await?;
    let kv = store.get("t/a").await?.context("t/a exists")?;
    ensure!(
        kv.mod_revision == rev && kv.create_revision == rev && kv.version == 1,
        "{kv:?}"
    );

    // Every compare must hold: one false compare sends the txn to the else branch.
    let resp = store
        .txn(
            Txn::new()
                .when([
                    Compare::value("t/a", "1"),
                    Compare::mod_revision("t/a", rev + 100),
                ])
                .and_then([TxnOp::put("t/then", "x")])
                .or_else([TxnOp::put("t/else", "y"), TxnOp::get("t/a")]),
        )
        .await?;
    ensure!(
        !resp.succeeded,
        "a false mod-revision compare must fail the txn"
    );
    ensure!(
        store.get("t/then").await?.is_none(),
        "then branch must not run"
    );
    ensure!(store.get("t/else").await?.is_some(), "else branch must run");
    match &resp.responses[..] {
        [OpResponse::Put, OpResponse::Get { kv: Some(kv) }] => ensure!(kv.value == b"1"),
        other => bail!("unexpected responses {other:?}"),
    }

    let resp = store
        .txn(
            Txn::new()
                .when([
                    Compare::value("t/a", "1"),
                    Compare::mod_revision("t/a", rev),
                    Compare::create_revision("t/a", rev),
                    Compare::version("t/a", CompareOp::Equal, 1),
                    Compare::exists("t/a"),
                    Compare::absent("t/missing"),
                    Compare {
                        key: "t/a".into(),
                        op: CompareOp::Less,
                        target: CompareTarget::Value(b"2".to_vec()),
                    },
                    Compare {
                        key: "t/a".into(),
                        op: CompareOp::Greater,
                        target: CompareTarget::ModRevision(rev - 1),
                    },
                    Compare {
                        key: "t/a".into(),
                        op: CompareOp::NotEqual,
                        target: CompareTarget::Version(7),
                    },
                ])
                .and_then([TxnOp::put("t/a", "2")]),
        )
        .await?;
    ensure!(resp.succeeded, "all compares hold");
    let kv = store.get("t/a").await?.context("t/a exists")?;
    ensure!(
        kv.value == b"2"
            && kv.version == 2
            && kv.create_revision == rev
            && kv.mod_revision == resp.revision
    );
    ensure!(resp.revision > rev, "a write advances the revision");
    Ok(())
}

pub async fn txn_that_writes_nothing_keeps_the_revision(store: Store) -> Result<()> {
    let rev = put(&store, "t/a", "1").await?;
    let resp = store
        .txn(Txn::new().and_then([TxnOp::get("t/a"), TxnOp::delete("t/none")]))
        .await?;
    ensure!(resp.succeeded);
    ensure!(
        resp.revision == rev,
        "read-only txn moved revision {rev} -> {}",
        resp.revision
    );
    ensure!(resp.responses[1] == OpResponse::Delete { deleted: 0 });
    ensure!(store.range("t/").await?.revision == rev);
    Ok(())
}

pub async fn compare_targets_match_etcd_for_missing_keys(store: Store) -> Result<()> {
    for (compare, expect) in [
        (Compare::absent("t/none"), true),
        (Compare::exists("t/none"), false),
        (Compare::create_revision("t/none", 0), true),
        (Compare::mod_revision("t/none", 0), true),
        // etcd: a value compare on a missing key always fails, even "not equal".
        (Compare::value("t/none", ""), false),
        (
            Compare {
                key: "t/none".into(),
                op: CompareOp::NotEqual,
                target: CompareTarget::Value(b"x".to_vec()),
            },
            false,
        ),
    ] {
        let resp = store.txn(Txn::new().when([compare.clone()])).await?;
        ensure!(
            resp.succeeded == expect,
            "{compare:?} gave {}",
            resp.succeeded
        );
    }
    // Create-if-absent: the second attempt must fail.
    for (attempt, expect) in [(1, true), (2, false)] {
        let resp = store
            .txn(
                Txn::new()
                    .when([Compare::absent("t/once")])
                    .and_then([TxnOp::put("t/once", "v")]),
            )
            .await?;
        ensure!(resp.succeeded == expect, "attempt {attempt}");
    }
    Ok(())
}

pub async fn range_returns_sorted_keys_and_its_revision(store: Store) -> Result<()> {
    for k in ["t/b", "t/a", "t/c/1", "u/a", "t"] {
        put(&store, k, k).await?;
    }
    let last = put(&store, "t/aa", "x").await?;
    let resp = store.range("t/").await?;
    let keys: Vec<&str> = resp.kvs.iter().map(|kv| kv.key.as_str()).collect();
    ensure!(keys == ["t/a", "t/aa", "t/b", "t/c/1"], "{keys:?}");
    ensure!(
        resp.revision == last,
        "range revision {} != last write {last}",
        resp.revision
    );
    ensure!(store.range("none/").await?.kvs.is_empty());
    Ok(())
}

pub async fn a_key_range_lists_and_watches_only_its_half_open_span(store: Store) -> Result<()> {
    let span = KeyRange::between("r/", "r/worker/");
    let start = put(&store, "r/worker/before", "x").await?;
    for k in [
        "r/a",
        "r/session/1",
        "r/worker/cp/1",
        "r/worker/",
        "r0",
        "q",
    ] {
        put(&store, k, k).await?;
    }
    let resp = store.range_keys(&span).await?;
    let keys: Vec<&str> = resp.kvs.iter().map(|kv| kv.key.as_str()).collect();
    ensure!(keys == ["r/a", "r/session/1"], "{keys:?}");
    // A watch from the start replays only the span's events, and then follows it.
    let mut w = store.watch_keys(&span, start).await?;
    let replayed = next_events(&mut w, 2).await?;
    let keys: Vec<&str> = replayed.iter().map(|e| e.kv.key.as_str()).collect();
    ensure!(keys == ["r/a", "r/session/1"], "{keys:?}");
    put(&store, "r/worker/cp/2", "x").await?;
    put(&store, "r/channel/1/c", "x").await?;
    let live = next_events(&mut w, 1).await?;
    ensure!(live[0].kv.key == "r/channel/1/c", "{live:?}");
    Ok(())
}

pub async fn delete_prefix_removes_only_the_prefix(store: Store) -> Result<()> {
    for k in ["t/1/a", "t/1/b", "t/10/a", "t/2/a"] {
        put(&store, k, "v").await?;
    }
    let resp = store
        .txn(Txn::new().and_then([TxnOp::delete_prefix("t/1/")]))
        .await?;
    ensure!(
        resp.responses == [OpResponse::Delete { deleted: 2 }],
        "{:?}",
        resp.responses
    );
    let keys: Vec<String> = store
        .range("t/")
        .await?
        .kvs
        .into_iter()
        .map(|kv| kv.key)
        .collect();
    ensure!(keys == ["t/10/a", "t/2/a"], "{keys:?}");
    Ok(())
}

pub async fn duplicate_key_in_one_branch_is_refused(store: Store) -> Result<()> {
    let err = store
        .txn(Txn::new().and_then([TxnOp::put("t/a", "1"), TxnOp::put("t/a", "2")]))
        .await
        .expect_err("two puts of one key in one txn");
    ensure!(matches!(err, StoreError::InvalidArgument(_)), "{err:?}");
    let err = store
        .txn(Txn::new().and_then([TxnOp::put("t/a/x", "1"), TxnOp::delete_prefix("t/a/")]))
        .await
        .expect_err("put and delete of one key in one txn");
    ensure!(matches!(err, StoreError::InvalidArgument(_)), "{err:?}");
    ensure!(
        store.range("t/").await?.kvs.is_empty(),
        "a refused txn wrote something"
    );
    Ok(())
}

pub async fn watch_delivers_ordered_events_with_their_values(store: Store) -> Result<()> {
    let start = put(&store, "other", "x").await?;
    let mut w = store.watch("t/", start + 1).await?;
    put(&store, "t/a", "1").await?;
    put(&store, "skip/a", "1").await?;
    put(&store, "t/a", "2").await?;
    store
        .txn(Txn::new().and_then([TxnOp::delete("t/a")]))
        .await?;
    put(&store, "t/b", "1").await?;

    let events = next_events(&mut w, 4).await?;
    let revs: Vec<i64> = events.iter().map(|e| e.kv.mod_revision).collect();
    ensure!(
        revs.windows(2).all(|p| p[0] < p[1]),
        "not ordered: {revs:?}"
    );
    ensure!(
        events.iter().all(|e| e.kv.key.starts_with("t/")),
        "prefix filter leaked"
    );

    let e = &events[0];
    ensure!(
        e.kind == EventKind::Put && e.kv.value == b"1" && e.kv.version == 1,
        "{e:?}"
    );
    let e = &events[1];
    ensure!(
        e.kind == EventKind::Put && e.kv.value == b"2" && e.kv.version == 2,
        "{e:?}"
    );
    let e = &events[2];
    ensure!(
        e.kind == EventKind::Delete && e.kv.key == "t/a" && e.kv.value.is_empty(),
        "{e:?}"
    );
    ensure!(events[3].kv.key == "t/b");
    Ok(())
}

pub async fn one_txn_is_one_batch(store: Store) -> Result<()> {
    let mut w = store.watch("t/", 0).await?;
    let ops: Vec<TxnOp> = (0..100)
        .map(|i| TxnOp::put(format!("t/{i:03}"), "v"))
        .collect();
    let rev = store.txn(Txn::new().and_then(ops)).await?.revision;
    let batch = next_batch(&mut w).await?;
    ensure!(
        batch.events.len() == 100,
        "one revision split: first batch has {}",
        batch.events.len()
    );
    ensure!(batch.events.iter().all(|e| e.kv.mod_revision == rev));
    Ok(())
}

pub async fn watch_from_an_old_revision_replays_history(store: Store) -> Result<()> {
    let first = put(&store, "t/a", "1").await?;
    put(&store, "t/a", "2").await?;
    put(&store, "t/b", "1").await?;
    let mut w = store.watch("t/", first).await?;
    let events = next_events(&mut w, 3).await?;
    let got: Vec<(String, Vec<u8>)> = events
        .iter()
        .map(|e| (e.kv.key.clone(), e.kv.value.clone()))
        .collect();
    ensure!(
        got == [
            ("t/a".into(), b"1".to_vec()),
            ("t/a".into(), b"2".to_vec()),
            ("t/b".into(), b"1".to_vec())
        ],
        "{got:?}"
    );
    // Live events follow the replay with no gap.
    put(&store, "t/c", "1").await?;
    ensure!(next_events(&mut w, 1).await?[0].kv.key == "t/c");
    Ok(())
}

pub async fn watch_after_compaction_fails_with_compacted(store: Store) -> Result<()> {
    let old = put(&store, "t/a", "1").await?;
    put(&store, "t/a", "2").await?;
    let compact_at = put(&store, "t/a", "3").await?;
    // A watch that is already running keeps working across compaction.
    let mut live = store.watch("t/", compact_at + 1).await?;
    store.compact(compact_at).await?;

    let mut w = store.watch("t/", old).await?;
    match tokio::time::timeout(EVENT_WAIT, w.next()).await {
        Ok(Some(Err(StoreError::Compacted { compact_revision }))) => {
            ensure!(
                compact_revision == compact_at,
                "compact revision {compact_revision} != {compact_at}"
            )
        }
        other => bail!("expected Compacted, got {other:?}"),
    }
    // From the compaction revision itself history is still there.
    let mut w = store.watch("t/", compact_at).await?;
    ensure!(next_events(&mut w, 1).await?[0].kv.value == b"3");

    put(&store, "t/b", "1").await?;
    ensure!(next_events(&mut live, 1).await?[0].kv.key == "t/b");

    let err = store
        .compact(compact_at + 1000)
        .await
        .expect_err("future revision");
    ensure!(matches!(err, StoreError::FutureRevision { .. }), "{err:?}");
    let err = store.compact(old).await.expect_err("already compacted");
    ensure!(matches!(err, StoreError::Compacted { .. }), "{err:?}");
    Ok(())
}

pub async fn lease_expiry_deletes_attached_keys(store: Store) -> Result<()> {
    let lease = store.grant(Duration::from_secs(2)).await?;
    ensure!(
        lease.ttl >= Duration::from_secs(2),
        "granted {:?}",
        lease.ttl
    );
    let rev = store
        .txn(Txn::new().and_then([
            TxnOp::put_with_lease("t/s1", "a", lease.id),
            TxnOp::put_with_lease("t/s2", "b", lease.id),
            TxnOp::put("t/plain", "c"),
        ]))
        .await?
        .revision;
    ensure!(store.get("t/s1").await?.and_then(|kv| kv.lease) == Some(lease.id));
    let mut w = store.watch("t/", rev + 1).await?;
    // Expiry takes the TTL plus the store's expiry check period (etcd: 500 ms).
    let events = next_events(&mut w, 2).await?;
    ensure!(
        events.iter().all(|e| e.kind == EventKind::Delete),
        "{events:?}"
    );
    ensure!(
        events[0].kv.mod_revision == events[1].kv.mod_revision,
        "expiry split over revisions"
    );
    let keys: BTreeSet<&str> = events.iter().map(|e| e.kv.key.as_str()).collect();
    ensure!(keys == BTreeSet::from(["t/s1", "t/s2"]));
    ensure!(
        store.get("t/plain").await?.is_some(),
        "a key without the lease was deleted"
    );
    let err = store.keepalive(lease.id).await.expect_err("expired lease");
    ensure!(
        matches!(err, StoreError::LeaseNotFound(id) if id == lease.id),
        "{err:?}"
    );
    Ok(())
}

pub async fn keepalive_keeps_a_lease_alive(store: Store) -> Result<()> {
    let lease = store.grant(Duration::from_secs(2)).await?;
    put_leased(&store, "t/s", lease.id).await?;
    // Keep it alive for three TTLs.
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        store.keepalive(lease.id).await?;
    }
    ensure!(
        store.get("t/s").await?.is_some(),
        "key expired despite keepalives"
    );
    // Then let it go: it must expire.
    let deadline = tokio::time::Instant::now() + lease.ttl + Duration::from_secs(5);
    while store.get("t/s").await?.is_some() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "lease never expired after keepalives stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn put_leased(store: &Store, key: &str, lease: i64) -> Result<i64> {
    Ok(store
        .txn(Txn::new().and_then([TxnOp::put_with_lease(key, "v", lease)]))
        .await?
        .revision)
}

pub async fn revoke_deletes_attached_keys(store: Store) -> Result<()> {
    let lease = store.grant(Duration::from_secs(60)).await?;
    let rev = put_leased(&store, "t/s", lease.id).await?;
    let mut w = store.watch("t/", rev + 1).await?;
    store.revoke(lease.id).await?;
    let events = next_events(&mut w, 1).await?;
    ensure!(events[0].kind == EventKind::Delete && events[0].kv.key == "t/s");
    ensure!(store.get("t/s").await?.is_none());
    let err = store.revoke(lease.id).await.expect_err("revoked twice");
    ensure!(matches!(err, StoreError::LeaseNotFound(_)), "{err:?}");
    Ok(())
}

pub async fn put_on_a_dead_lease_is_refused(store: Store) -> Result<()> {
    let lease = store.grant(Duration::from_secs(60)).await?;
    store.revoke(lease.id).await?;
    let err = store
        .txn(Txn::new().and_then([
            TxnOp::put("t/ok", "v"),
            TxnOp::put_with_lease("t/s", "v", lease.id),
        ]))
        .await
        .expect_err("put on a revoked lease");
    ensure!(matches!(err, StoreError::LeaseNotFound(_)), "{err:?}");
    ensure!(
        store.get("t/ok").await?.is_none(),
        "a refused txn wrote part of itself"
    );
    Ok(())
}

pub async fn txn_over_the_op_limit_is_refused(store: Store) -> Result<()> {
    let max = store.limits().max_txn_ops;
    let ops = |n: usize| {
        (0..n)
            .map(|i| TxnOp::put(format!("t/{i}"), "v"))
            .collect::<Vec<_>>()
    };
    let err = store
        .txn(Txn::new().and_then(ops(max + 1)))
        .await
        .expect_err("over the op limit");
    ensure!(
        matches!(err, StoreError::TooManyOps { ops, max: m } if ops == max + 1 && m == max),
        "{err:?}"
    );
    ensure!(
        store.range("t/").await?.kvs.is_empty(),
        "a refused txn wrote something"
    );
    store
        .txn(Txn::new().and_then(ops(max)))
        .await
        .context("exactly the limit is allowed")?;

    let big = vec![b'x'; store.limits().max_request_bytes];
    let err = store
        .txn(Txn::new().and_then([TxnOp::put("t/big", big)]))
        .await
        .expect_err("too large");
    ensure!(matches!(err, StoreError::RequestTooLarge { .. }), "{err:?}");
    Ok(())
}

pub async fn concurrent_cas_increments_are_unique(store: Store) -> Result<()> {
    const TASKS: usize = 8;
    const EACH: usize = 25;
    let mut handles = Vec::new();
    for _ in 0..TASKS {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            while mine.len() < EACH {
                let current = store.get("t/counter").await?;
                let (n, compare) = match &current {
                    Some(kv) => (
                        std::str::from_utf8(&kv.value)?.parse::<u64>()?,
                        Compare::mod_revision("t/counter", kv.mod_revision),
                    ),
                    None => (0, Compare::absent("t/counter")),
                };
                let resp = store
                    .txn(
                        Txn::new()
                            .when([compare])
                            .and_then([TxnOp::put("t/counter", (n + 1).to_string())]),
                    )
                    .await?;
                if resp.succeeded {
                    mine.push(n + 1);
                }
                tokio::task::yield_now().await;
            }
            anyhow::Ok(mine)
        }));
    }
    let mut all = BTreeSet::new();
    for h in handles {
        for v in h.await?? {
            ensure!(all.insert(v), "value {v} handed out twice");
        }
    }
    let total = (TASKS * EACH) as u64;
    ensure!(
        all == (1..=total).collect::<BTreeSet<_>>(),
        "values are not 1..={total}"
    );
    Ok(())
}

/// A watch of a quiet prefix still tells how far it has got: after a keepalive answered at
/// revision R (writes elsewhere moved the store on), a progress notification at R or later
/// arrives, without events. A node relies on it to tell a quiet prefix from a stalled watch.
pub async fn a_quiet_watch_reports_progress_up_to_a_keepalive_revision(store: Store) -> Result<()> {
    let mut stream = store.watch("quiet/", 0).await?;
    put(&store, "busy/a", "1").await?;
    let last = put(&store, "busy/b", "2").await?;
    let lease = store.grant(Duration::from_secs(30)).await?.id;
    store.keepalive(lease).await?;
    let answered = store.keepalive(lease).await?;
    ensure!(
        answered >= last,
        "a keepalive answers at the store's revision ({answered} < {last})"
    );
    loop {
        match tokio::time::timeout(EVENT_WAIT, stream.next()).await {
            Ok(Some(Ok(batch))) => {
                ensure!(batch.is_progress(), "no event under quiet/: {batch:?}");
                if batch.revision >= answered {
                    return Ok(());
                }
            }
            Ok(Some(Err(e))) => bail!("watch failed: {e}"),
            Ok(None) => bail!("watch ended"),
            Err(_) => bail!("no progress up to {answered} within {EVENT_WAIT:?}"),
        }
    }
}

/// Each in-process node is a client of its own (`MetaStore::new_client`, else the store
/// itself): its watch sees what other clients write, in one batch per txn, and a keepalive
/// through it brings its quiet watch up to the keepalive's revision, while watches of many
/// other clients on other prefixes share nothing with it.
pub async fn a_client_of_its_own_sees_every_write_and_its_own_progress(store: Store) -> Result<()> {
    let me = store.new_client().unwrap_or_else(|| store.clone());
    let others: Vec<Store> = (0..20)
        .map(|_| store.new_client().unwrap_or_else(|| store.clone()))
        .collect();
    let mut mine = me.watch("node/1/", 0).await?;
    let mut theirs = Vec::new();
    for (i, o) in others.iter().enumerate() {
        theirs.push(o.watch(&format!("node/1{i}/"), 0).await?);
    }
    let r = store
        .txn(Txn::new().and_then([
            TxnOp::put("node/1/a", "1"),
            TxnOp::put("node/10/a", "1"),
            TxnOp::put("node/1/b", "1"),
        ]))
        .await?;
    let batch = next_batch(&mut mine).await?;
    let keys: Vec<&str> = batch.events.iter().map(|e| e.kv.key.as_str()).collect();
    ensure!(keys == ["node/1/a", "node/1/b"], "node/1/ saw {keys:?}");
    let batch = next_batch(&mut theirs[0]).await?;
    ensure!(
        batch.events.len() == 1 && batch.revision == r.revision,
        "node/10/ saw {batch:?}"
    );
    // Writes elsewhere move the store on; my keepalive's answer names that revision.
    let last = put(&store, "elsewhere/x", "1").await?;
    let lease = me.grant(Duration::from_secs(30)).await?.id;
    me.keepalive(lease).await?;
    let answered = me.keepalive(lease).await?;
    ensure!(answered >= last, "keepalive answered {answered} < {last}");
    loop {
        match tokio::time::timeout(EVENT_WAIT, mine.next()).await {
            Ok(Some(Ok(batch))) => {
                ensure!(
                    batch.is_progress(),
                    "no more events under node/1/: {batch:?}"
                );
                if batch.revision >= answered {
                    return Ok(());
                }
            }
            Ok(Some(Err(e))) => bail!("watch failed: {e}"),
            Ok(None) => bail!("watch ended"),
            Err(_) => bail!("no progress up to {answered} within {EVENT_WAIT:?}"),
        }
    }
}
