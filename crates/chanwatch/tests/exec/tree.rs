//! Workers started as most users write them — no `exec` in the command — judged from outside
//! (`/proc`, the workers' own files): whatever the node's death, no process of a worker's tree
//! outlives it, not even when the node dies during a release's grace; a released worker
//! itself gets `SIGTERM` and its `--stop-grace`; one that ignores `SIGTERM` lives until the
//! grace ends, then is killed. Each for a simple command (`python3 W DIR`) and a compound one
//! (`cd DIR && python3 W DIR`, a shell in front).

use super::*;

/// A Python worker: once its `SIGTERM` handler is in place, writes its pid to
/// `DIR/CHANNEL.pid`; on `SIGTERM` writes the time to `DIR/CHANNEL.term` and exits 600 ms
/// later, or ignores it when `DIR/stubborn` exists.
const WORKER: &str = r#"
import os, signal, sys, time
d = sys.argv[1]
ch = os.environ["CHANWATCH_CHANNEL"]
def term(*_):
    open(os.path.join(d, ch + ".term"), "w").write(str(time.time()))
    if os.path.exists(os.path.join(d, "stubborn")):
        return
    time.sleep(0.6)
    sys.exit(0)
signal.signal(signal.SIGTERM, term)
open(os.path.join(d, ch + ".pid"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"#;

/// The two ways to write the command: (name, command) for the worker in `dir`.
fn commands(dir: &Path) -> [(&'static str, String); 2] {
    let w = dir.join("tree_worker.py");
    std::fs::write(&w, WORKER).expect("worker written");
    let (w, d) = (w.display(), dir.display());
    [
        ("simple", format!("python3 '{w}' '{d}'")),
        ("compound", format!("cd '{d}' && python3 '{w}' '{d}'")),
    ]
}

/// A node running `command` with `extra` flags, one channel `channel` added, Watched, and its
/// worker's `SIGTERM` handler in place (its pid file written).
fn run_one(w: &World, kind: &str, command: &str, extra: &[&str], channel: &str) -> Proc {
    let mut flags = vec!["--ready-on-start"];
    flags.extend_from_slice(extra);
    let node = w.node(&format!("node-{kind}"), command, &flags);
    w.add_channel(channel, &[]);
    w.watched(channel, 30);
    wait_for(
        20,
        || format!("{kind}: the worker runs: {}", node.output()),
        || w.path(&format!("{channel}.pid")).exists().then_some(()),
    );
    node
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_with_sigkill_leaves_no_process_of_a_worker_started_without_exec() {
    let w = World::start().await;
    let marker = w.dir.path().join("tree_worker.py").display().to_string();
    for (kind, command) in commands(w.dir.path()) {
        let channel = format!("kill-{kind}");
        let node = run_one(&w, kind, &command, &[], &channel);
        drop(node); // SIGKILL: no release, no SIGTERM.
        wait_for(
            3,
            || {
                format!(
                    "{kind}: left after the node's SIGKILL: {:?}",
                    procs_with(&marker)
                )
            },
            || procs_with(&marker).is_empty().then_some(()),
        );
        let (ok, _, err) = w.ctl(&["remove-channel", &channel]);
        assert!(ok, "{err}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_worker_started_without_exec_gets_sigterm_itself_and_its_stop_grace() {
    let w = World::start().await;
    let marker = w.dir.path().join("tree_worker.py").display().to_string();
    for (kind, command) in commands(w.dir.path()) {
        let channel = format!("release-{kind}");
        let node = run_one(&w, kind, &command, &["--stop-grace=5s"], &channel);
        let removed = Instant::now();
        let (ok, _, err) = w.ctl(&["remove-channel", &channel]);
        assert!(ok, "{err}");
        wait_for(
            10,
            || format!("{kind}: gone after its SIGTERM: {:?}", procs_with(&marker)),
            || procs_with(&marker).is_empty().then_some(()),
        );
        let lived = removed.elapsed();
        assert!(
            w.path(&format!("{channel}.term")).exists(),
            "{kind}: the worker never saw SIGTERM; the node's log:\n{}",
            node.output()
        );
        // It exits 600 ms after its SIGTERM: the node did not kill it before.
        assert!(
            lived >= Duration::from_millis(600),
            "{kind}: gone {lived:?} after the removal, before its own 600 ms"
        );
        drop(node);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_without_exec_that_ignores_sigterm_lives_until_the_grace_then_is_killed() {
    let w = World::start().await;
    let marker = w.dir.path().join("tree_worker.py").display().to_string();
    std::fs::write(w.path("stubborn"), "").expect("stubborn flag");
    for (kind, command) in commands(w.dir.path()) {
        let channel = format!("stubborn-{kind}");
        let node = run_one(&w, kind, &command, &["--stop-grace=3s"], &channel);
        let removed = Instant::now();
        let (ok, _, err) = w.ctl(&["remove-channel", &channel]);
        assert!(ok, "{err}");
        // Still there well into the grace, having seen its SIGTERM.
        std::thread::sleep(Duration::from_millis(2_000));
        assert!(
            !procs_with(&marker).is_empty(),
            "{kind}: killed {:?} after the removal, before the 3 s grace; the node's log:\n{}",
            removed.elapsed(),
            node.output()
        );
        assert!(
            w.path(&format!("{channel}.term")).exists(),
            "{kind}: the worker never saw SIGTERM"
        );
        wait_for(
            10,
            || format!("{kind}: killed after the grace: {:?}", procs_with(&marker)),
            || procs_with(&marker).is_empty().then_some(()),
        );
        let lived = removed.elapsed();
        assert!(
            lived >= Duration::from_millis(2_900),
            "{kind}: gone {lived:?} after the removal, before the 3 s grace"
        );
        drop(node);
    }
}

/// The node is killed (`SIGKILL`) during a release's grace, while its worker, which ignores
/// `SIGTERM`, still runs: nothing of the worker's tree may outlive the node (the guard's
/// subshell used to die of the release's `SIGTERM`, leaving the worker outside its reach).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_during_a_release_grace_leaves_no_process_of_its_worker() {
    let w = World::start().await;
    let marker = w.dir.path().join("tree_worker.py").display().to_string();
    std::fs::write(w.path("stubborn"), "").expect("stubborn flag");
    for (kind, command) in commands(w.dir.path()) {
        let channel = format!("grace-kill-{kind}");
        let node = run_one(&w, kind, &command, &["--stop-grace=30s"], &channel);
        let (ok, _, err) = w.ctl(&["remove-channel", &channel]);
        assert!(ok, "{err}");
        wait_for(
            10,
            || format!("{kind}: the worker never saw SIGTERM: {}", node.output()),
            || w.path(&format!("{channel}.term")).exists().then_some(()),
        );
        std::thread::sleep(Duration::from_millis(300));
        assert!(
            !procs_with(&marker).is_empty(),
            "{kind}: the worker is gone before the node died (it ignores SIGTERM, 30 s grace)"
        );
        drop(node); // SIGKILL, in the grace
        wait_for(
            3,
            || {
                format!(
                    "{kind}: left after the node's SIGKILL during the grace: {:?}",
                    procs_with(&marker)
                )
            },
            || procs_with(&marker).is_empty().then_some(()),
        );
    }
}
