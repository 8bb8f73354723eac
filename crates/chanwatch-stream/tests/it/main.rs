//! Integration tests of chanwatch-stream: the conformance suite, instantiated once per backend,
//! and the file log's crash recovery.
//!
//! Every case in `suite.rs` runs twice: as `file::<case>` on a [`FileLog`] in a temporary dir,
//! and as `nats::<case>` against a real `nats-server -js` started by `chanwatch-testkit` on
//! loopback ports (a fresh process and store dir per case, killed at the end).

mod open;
mod outage;
mod recovery;
mod suite;

use std::sync::Arc;

use chanwatch_stream::{FileLog, FileLogOptions, Log, NatsConfig, NatsLog};
use chanwatch_testkit::NatsFixture;

/// A log under test and whatever keeps it alive; `restart` starts it over on the same data.
pub struct Harness {
    /// The log.
    pub log: Arc<dyn Log>,
    backend: Backend,
}

enum Backend {
    File(tempfile::TempDir),
    Nats(NatsFixture),
}

impl Harness {
    /// Drops the log and opens it again on the same data: a new `FileLog` on the same dir, or
    /// a new client after nats-server restarted on the same store dir.
    pub async fn restart(&mut self) -> anyhow::Result<()> {
        self.log = match &mut self.backend {
            Backend::File(dir) => Arc::new(FileLog::open(dir.path(), FileLogOptions::default())?),
            Backend::Nats(fixture) => {
                fixture.restart().await?;
                Arc::new(NatsLog::connect(NatsConfig::new(fixture.url(), "CHANWATCH")).await?)
            }
        };
        Ok(())
    }
}

async fn file() -> anyhow::Result<Harness> {
    let dir = tempfile::tempdir()?;
    Ok(Harness {
        log: Arc::new(FileLog::open(dir.path(), FileLogOptions::default())?),
        backend: Backend::File(dir),
    })
}

async fn nats() -> anyhow::Result<Harness> {
    let fixture = NatsFixture::start().await?;
    let log = NatsLog::connect(NatsConfig::new(fixture.url(), "CHANWATCH")).await?;
    Ok(Harness {
        log: Arc::new(log),
        backend: Backend::Nats(fixture),
    })
}

macro_rules! conformance {
    ($backend:ident, $make:path, [$($case:ident),* $(,)?]) => {
        mod $backend {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() -> anyhow::Result<()> {
                    let harness = $make().await?;
                    crate::suite::$case(harness).await
                }
            )*
        }
    };
}

macro_rules! all_backends {
    ($($case:ident),* $(,)?) => {
        conformance!(file, crate::file, [$($case),*]);
        conformance!(nats, crate::nats, [$($case),*]);
    };
}

all_backends!(
    appended_messages_read_back_in_order,
    reading_after_a_middle_position_skips_what_came_before,
    end_is_the_last_appended_position,
    a_waiting_read_wakes_on_append,
    a_read_with_nothing_new_returns_empty_after_its_wait,
    channels_are_independent,
    positions_survive_a_restart,
    bad_names_and_oversized_messages_are_refused,
    a_reader_following_concurrent_appends_misses_nothing,
);
