//! [`FaultyStore`]'s switches wake what they hold in a fixed order: the calls a hold kept
//! waiting go on in the order they were made, and stalled or partitioned watch streams resume
//! or end in the order they were opened. The deterministic simulation replays a seed byte for
//! byte only if that order is the same in every run (tokio's `watch` woke its waiters in an
//! order drawn from a randomly seeded RNG).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use chanwatch_store::{EmbeddedStore, FaultyStore, MetaStore, Txn, TxnOp};
use futures_util::StreamExt;

const CALLS: usize = 16;

fn push(order: &Mutex<Vec<usize>>, i: usize) {
    order
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(i);
}

fn taken(order: &Mutex<Vec<usize>>) -> Vec<usize> {
    std::mem::take(
        &mut *order
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    )
}

#[tokio::test(start_paused = true)]
async fn held_calls_go_on_in_the_order_they_were_made() -> Result<()> {
    // Several rounds: a random order matches by chance about once in 10^9 rounds.
    let (store, faults) = FaultyStore::new(EmbeddedStore::new());
    let store = Arc::new(store);
    let order = Arc::new(Mutex::new(Vec::new()));
    for round in 0..3 {
        faults.hold(true);
        let mut calls = Vec::new();
        for i in 0..CALLS {
            let (store, order) = (store.clone(), order.clone());
            calls.push(tokio::spawn(async move {
                let _ = store.get("k").await;
                push(&order, i);
            }));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(taken(&order).is_empty(), "round {round}: held calls wait");
        faults.hold(false);
        for call in calls {
            call.await?;
        }
        let expected: Vec<usize> = (0..CALLS).collect();
        assert_eq!(taken(&order), expected, "round {round}");
    }
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn stalled_and_partitioned_watch_streams_go_on_in_the_order_they_were_opened() -> Result<()> {
    let (store, faults) = FaultyStore::new(EmbeddedStore::new());
    let store = Arc::new(store);
    let delivered = Arc::new(Mutex::new(Vec::new()));
    let ended = Arc::new(Mutex::new(Vec::new()));
    let mut readers = Vec::new();
    for i in 0..CALLS {
        let mut stream = store.watch("p/", 0).await?;
        let (delivered, ended) = (delivered.clone(), ended.clone());
        readers.push(tokio::spawn(async move {
            while stream.next().await.is_some() {
                push(&delivered, i);
            }
            push(&ended, i);
        }));
    }
    faults.stall_watches(true);
    store
        .txn(Txn::new().and_then([TxnOp::put("p/a", "1")]))
        .await?;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        taken(&delivered).is_empty(),
        "a stalled watch delivers nothing"
    );
    faults.stall_watches(false);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let expected: Vec<usize> = (0..CALLS).collect();
    assert_eq!(taken(&delivered), expected, "resumed in order");

    faults.partition(true);
    for reader in readers {
        reader.await?;
    }
    assert_eq!(taken(&ended), expected, "ended in order");
    Ok(())
}
