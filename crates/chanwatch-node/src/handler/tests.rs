//! Tests of the handlers: the test switches of [`SimulatedLoad`], and that the handler log
//! writes one `start` and one `stop` per run.

use super::*;
use chanwatch_core::VChannelInfo;
use std::collections::BTreeMap;

fn ctx(node: u64, channel: &str, epoch: u64) -> ChannelContext {
    let (events, _rx) = mpsc::unbounded_channel();
    ChannelContext {
        node: NodeId(node),
        info: ChannelInfo::new(
            ChannelName::new(channel).expect("valid"),
            Epoch(epoch),
            0,
            VChannelInfo::default(),
        ),
        clock: Clock::system(),
        events,
        last_progress: Arc::default(),
        progress_interval: Duration::from_secs(5),
        generation: 7,
        committer: None,
    }
}

/// What the node's runner (`runtime::run_channel`) does: load, unless cancelled first;
/// then, after a successful load, run until cancelled; then release.
async fn run(h: &dyn ChannelHandler, ctx: ChannelContext, cancel_after: Duration) {
    let (node, info) = (ctx.node, ctx.info.clone());
    let _ = tokio::time::timeout(cancel_after, h.load(ctx)).await;
    h.release(node, &info).await;
}

/// A fresh file path under the temp dir, removed when dropped.
struct TempPath(std::path::PathBuf);
impl Drop for TempPath {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn name_patterns_are_comma_separated_star_globs() {
    let p: NamePatterns = "p1*, *-bad ,exact,a*b*c".parse().expect("infallible");
    for yes in [
        "p1", "p1-x", "x-bad", "-bad", "exact", "abc", "a-b-c", "aXbYbZc",
    ] {
        assert!(p.matches(yes), "{yes}");
    }
    for no in ["p2", "xp1", "x-bad2", "exact2", "ab", "acb", ""] {
        assert!(!p.matches(no), "{no}");
    }
    let none: NamePatterns = "".parse().expect("infallible");
    assert!(none.is_empty() && !none.matches("x") && !none.matches(""));
    let all: NamePatterns = "*".parse().expect("infallible");
    assert!(all.matches("") && all.matches("anything"));
}

#[tokio::test(start_paused = true)]
async fn the_simulated_loads_test_switches_fail_or_hang_matching_channels() {
    let load = SimulatedLoad {
        load_delay: Duration::from_millis(100),
        fail_load: "bad-*".parse().expect("infallible"),
        hang_load: "stuck".parse().expect("infallible"),
        ..SimulatedLoad::default()
    };
    let err = load
        .load(ctx(1, "bad-1", 1))
        .await
        .expect_err("--fail-load matches");
    assert!(err.contains("--fail-load"), "{err}");
    let hung = tokio::time::timeout(Duration::from_secs(3600), load.load(ctx(1, "stuck", 1)));
    assert!(hung.await.is_err(), "--hang-load: never finishes");
    let ok = tokio::time::timeout(Duration::from_secs(1), load.load(ctx(1, "stuck-2", 1)));
    assert_eq!(ok.await, Ok(Ok(())), "others load as usual");
}

#[tokio::test(start_paused = true)]
async fn the_fail_running_switch_reports_a_loaded_channel_broken_after_the_delay() {
    let load = SimulatedLoad {
        fail_running: "brk*".parse().expect("infallible"),
        fail_running_after: Duration::from_millis(500),
        ..SimulatedLoad::default()
    };
    let (events, mut rx) = mpsc::unbounded_channel();
    let mut c = ctx(1, "brk-1", 3);
    c.events = events;
    let t0 = tokio::time::Instant::now();
    assert_eq!(load.load(c.clone()).await, Ok(()), "it loads");
    match rx.recv().await {
        Some(RunnerEvent {
            generation,
            event:
                chanwatch_core::node::NodeEvent::Broke {
                    channel,
                    epoch,
                    reason,
                },
        }) => {
            assert_eq!(
                (channel.as_str(), epoch, generation),
                ("brk-1", Epoch(3), 7)
            );
            assert!(reason.contains("--fail-running"), "{reason}");
        }
        other => panic!("expected Broke, got {other:?}"),
    }
    assert_eq!(t0.elapsed(), Duration::from_millis(500));
    let mut other = c;
    other.info.channel = ChannelName::new("ok").expect("valid");
    assert_eq!(load.load(other).await, Ok(()));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        rx.try_recv().is_err(),
        "a channel not matching keeps running"
    );
}

#[tokio::test]
async fn the_handler_log_has_exactly_one_start_and_one_stop_per_run() {
    let path = TempPath(std::env::temp_dir().join(format!(
        "chanwatch-handler-log-{}-{}.log",
        std::process::id(),
        Clock::system().unix_ms()
    )));
    let inner = RecordingHandler::new(Clock::system());
    inner.set("fails", Behaviour::Fail);
    inner.set("hangs", Behaviour::Hang);
    let log = AuditLog::open(inner, &path.0, Clock::system()).expect("temp file");
    let short = Duration::from_millis(20);
    run(&log, ctx(1, "loads", 1), short).await; // loaded, then released
    run(&log, ctx(1, "fails", 1), short).await; // load failed
    run(&log, ctx(1, "hangs", 1), short).await; // load cancelled
    run(&log, ctx(2, "fails", 2), short).await;
    run(&log, ctx(1, "loads", 1), short).await; // the same run key again, later
    let text = std::fs::read_to_string(&path.0).expect("written");
    let mut counts: BTreeMap<(String, String, String), (usize, usize)> = BTreeMap::new();
    for line in text.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        assert_eq!(f.len(), 5, "KIND NODE CHANNEL EPOCH UNIX_MS: {line:?}");
        let c = counts
            .entry((f[1].to_owned(), f[2].to_owned(), f[3].to_owned()))
            .or_default();
        match f[0] {
            "start" => c.0 += 1,
            "stop" => c.1 += 1,
            other => panic!("unexpected kind {other:?} in {line:?}"),
        }
    }
    let want: BTreeMap<(String, String, String), (usize, usize)> = [
        (("1", "loads", "1"), (2, 2)),
        (("1", "fails", "1"), (1, 1)),
        (("1", "hangs", "1"), (1, 1)),
        (("2", "fails", "2"), (1, 1)),
    ]
    .into_iter()
    .map(|((n, c, e), v)| ((n.to_owned(), c.to_owned(), e.to_owned()), v))
    .collect();
    assert_eq!(counts, want, "log:\n{text}");
}
