//! The coordinator as a library: started with `Coordinator::builder(..).spawn()`, talked to
//! and stopped through its `CoordHandle` (what `examples/embed_coordinator.rs` shows).

use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use chanwatch_coord::{CoordError, CoordHandle, Coordinator};
use chanwatch_core::{ChannelName, ChannelState, VChannelInfo};
use chanwatch_store::{EmbeddedStore, MetaStore, StoreError};

use crate::leader::FailingGrants;

/// Long enough that only a resignation, never an expired lease, lets a standby lead in the
/// time these tests allow.
const LONG_TTL: Duration = Duration::from_secs(30);

async fn ready(handle: &CoordHandle, within: Duration) -> Result<()> {
    let mut status = handle.watch_status();
    tokio::time::timeout(within, status.wait_for(|s| s.ready))
        .await
        .context("the coordinator did not become ready in time")?
        .context("the coordinator ended")?;
    Ok(())
}

fn embedded() -> Arc<dyn MetaStore> {
    Arc::new(EmbeddedStore::new())
}

/// The steps of `examples/embed_coordinator.rs`: spawn, wait until ready, add a channel,
/// read it back, stop.
#[tokio::test(start_paused = true)]
async fn a_spawned_coordinator_leads_serves_requests_and_registers_its_metrics() -> Result<()> {
    let registry = prometheus::Registry::new();
    let handle = Coordinator::builder(embedded())
        .id("embedded")
        .session_ttl(Duration::from_secs(3))
        .registry(registry.clone())
        .spawn()?;
    ready(&handle, Duration::from_secs(10)).await?;
    let name = ChannelName::new("orders-0")?;
    handle
        .add_channel(name.clone(), VChannelInfo::default())
        .await?;
    let rows = handle.channels().await?;
    ensure!(
        rows.len() == 1 && rows[0].channel == name && rows[0].node.is_none(),
        "with no node the channel waits under remaining: {rows:?}"
    );
    ensure!(rows[0].state == ChannelState::ToWatch, "{rows:?}");
    let text = chanwatch_coord::metrics::render(&registry);
    ensure!(text.contains("chanwatch_leader 1"), "{text}");
    ensure!(
        chanwatch_coord::metrics::render(handle.registry()) == text,
        "the handle serves the registry it was given"
    );
    tokio::time::timeout(Duration::from_secs(5), handle.stop()).await??;
    ensure!(!handle.status().leader, "{:?}", handle.status());
    let text = chanwatch_coord::metrics::render(&registry);
    ensure!(text.contains("chanwatch_leader 0"), "{text}");
    match handle.channels().await {
        Err(chanwatch_coord::ApiError::Store(_)) => Ok(()),
        other => bail!("a stopped coordinator must refuse requests, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn stop_resigns_leadership_so_a_standby_leads_at_once() -> Result<()> {
    let store = embedded();
    let a = Coordinator::builder(store.clone())
        .id("a")
        .session_ttl(LONG_TTL)
        .spawn()?;
    ready(&a, Duration::from_secs(10)).await?;
    let b = Coordinator::builder(store)
        .id("b")
        .session_ttl(LONG_TTL)
        .spawn()?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(!b.status().leader, "b stands by while a leads");
    tokio::time::timeout(Duration::from_secs(5), a.stop()).await??;
    ready(&b, Duration::from_secs(5))
        .await
        .context("the standby did not lead at once after stop()")?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn dropping_the_last_handle_stops_the_coordinator() -> Result<()> {
    let store = embedded();
    let a = Coordinator::builder(store.clone())
        .id("a")
        .session_ttl(LONG_TTL)
        .spawn()?;
    ready(&a, Duration::from_secs(10)).await?;
    let a2 = a.clone();
    let b = Coordinator::builder(store)
        .id("b")
        .session_ttl(LONG_TTL)
        .spawn()?;
    drop(a);
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        a2.status().leader && !b.status().leader,
        "a clone still holds the coordinator"
    );
    drop(a2);
    ready(&b, Duration::from_secs(5))
        .await
        .context("the standby did not lead at once after the last handle was dropped")?;
    Ok(())
}

#[tokio::test(start_paused = true)]
async fn a_configuration_error_ends_a_spawned_coordinator_and_stopped_reports_it() -> Result<()> {
    let store = Arc::new(FailingGrants::new(embedded(), 1, || {
        StoreError::Config("unreadable TLS file".into())
    }));
    let handle = Coordinator::builder(store).spawn()?;
    match tokio::time::timeout(Duration::from_secs(10), handle.stopped()).await? {
        Err(CoordError::Store(StoreError::Config(_))) => {}
        other => bail!("expected a configuration error, got {other:?}"),
    }
    ensure!(
        handle.stopped().await.is_ok(),
        "the error goes to the first caller only"
    );
    Ok(())
}

#[test]
fn spawning_outside_a_tokio_runtime_is_an_error_not_a_panic() {
    // The embedded store itself needs a runtime to be made; the spawn happens outside one.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a runtime");
    let store = {
        let _inside = runtime.enter();
        embedded()
    };
    match Coordinator::builder(store).spawn() {
        Err(e @ CoordError::NoRuntime) => assert!(e.to_string().contains("build()"), "{e}"),
        other => panic!("expected NoRuntime, got {other:?}"),
    }
}

#[tokio::test]
async fn a_registry_that_already_holds_coordinator_metrics_is_refused() -> Result<()> {
    let registry = prometheus::Registry::new();
    let _first = Coordinator::builder(embedded())
        .registry(registry.clone())
        .spawn()?;
    match Coordinator::builder(embedded()).registry(registry).spawn() {
        Err(e @ CoordError::Metrics(_)) => {
            ensure!(e.to_string().contains("a registry of its own"), "{e}");
            Ok(())
        }
        Err(e) => bail!("wrong error: {e}"),
        Ok(_) => bail!("two coordinators registered the same metrics"),
    }
}
