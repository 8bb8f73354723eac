//! What a platform team deploys, checked against the real thing: the Prometheus alert rules
//! (`promtool check rules`, and each alert's unit test with `promtool test rules`), the
//! Grafana dashboard and the rules querying only metrics a real coordinator and node export,
//! the systemd units (`systemd-analyze verify`), every YAML manifest under `deploy/`,
//! `tools/protoc` finding protoc where it is, the Dockerfile as far as it can be judged without
//! a container daemon, and `standalone`'s `/metrics`.
//!
//! Over 600 lines: one flat list of independent checks of deployable artifacts, sharing one
//! harness.
//!
//! promtool comes with Debian's `prometheus` package, systemd-analyze with `systemd`; a
//! missing tool fails its test with how to install it.
//!
//! Over 600 lines: one test per deployed artifact, each independent, sharing the few helpers
//! that start a real coordinator and node for the metric checks.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use chanwatch_testkit::EtcdFixture;

mod procs;
use procs::{bin, free_port, spawn};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Runs `tool ARGS`, failing with how to install it when it is missing.
fn run_tool(tool: &str, package: &str, args: &[&str], dir: &Path) -> (bool, String) {
    let out = Command::new(tool)
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!("cannot run {tool} ({e}); install it: apt-get install -y {package}")
        });
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn yaml(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).expect("readable");
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            <serde_json::Value as serde::Deserialize>::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()))
        })
        .filter(|v| !v.is_null())
        .collect()
}

/// The alert rules: name → PromQL.
fn alert_rules() -> Vec<(String, String)> {
    let doc = yaml(&repo().join("docs/ops/alerts.yml")).remove(0);
    let mut out = Vec::new();
    for group in doc["groups"].as_array().expect("groups") {
        for rule in group["rules"].as_array().expect("rules") {
            out.push((
                rule["alert"].as_str().expect("an alert").to_owned(),
                rule["expr"].as_str().expect("an expr").to_owned(),
            ));
        }
    }
    out
}

/// The PromQL of every dashboard panel.
fn dashboard_queries() -> Vec<String> {
    let text =
        std::fs::read_to_string(repo().join("docs/ops/grafana-dashboard.json")).expect("readable");
    let doc: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    for panel in doc["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            out.push(target["expr"].as_str().expect("an expr").to_owned());
        }
    }
    out
}

/// Metric names in PromQL: identifiers of ours (`chanwatch_*`) or the process collector's.
fn metric_names(promql: &str) -> BTreeSet<String> {
    promql
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
        .filter(|t| t.starts_with("chanwatch_") || t.starts_with("process_"))
        .map(str::to_owned)
        .collect()
}

/// Sample names in a Prometheus text exposition.
fn exported(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| l.split(['{', ' ']).next().unwrap_or("").to_owned())
        .collect()
}

#[test]
fn the_alert_rules_pass_promtool_and_every_alert_has_a_unit_test() {
    let dir = repo().join("docs/ops");
    let (ok, out) = run_tool(
        "promtool",
        "prometheus",
        &["check", "rules", "alerts.yml"],
        &dir,
    );
    assert!(ok, "promtool check rules:\n{out}");
    let (ok, out) = run_tool(
        "promtool",
        "prometheus",
        &["test", "rules", "alerts_test.yml"],
        &dir,
    );
    assert!(ok, "promtool test rules:\n{out}");
    let tests = std::fs::read_to_string(dir.join("alerts_test.yml")).expect("tests");
    let rules = alert_rules();
    assert!(rules.len() >= 8, "{rules:?}");
    for (alert, _) in rules {
        // A test that expects the alert to fire: its name followed by a non-empty exp_alerts.
        let fires = tests
            .split(&format!("alertname: {alert}\n"))
            .skip(1)
            .any(|after| {
                after
                    .lines()
                    .next()
                    .is_some_and(|l| l.trim() == "exp_alerts:")
            });
        assert!(fires, "no unit test in alerts_test.yml fires {alert}");
    }
}

/// GET `url`: the status code and the body.
async fn get(client: &reqwest::Client, url: &str) -> Option<(u16, String)> {
    let resp = client.get(url).send().await.ok()?;
    let code = resp.status().as_u16();
    Some((code, resp.text().await.ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alert_rules_query_only_metrics_a_real_coordinator_and_node_export() {
    let fixture = EtcdFixture::start().await.expect("etcd");
    let endpoint = format!("--endpoints={}", fixture.endpoint());
    let dir = tempfile::tempdir().expect("tempdir");
    let coord_addr = format!("127.0.0.1:{}", free_port());
    let node_addr = format!("127.0.0.1:{}", free_port());
    let mut coord = spawn(
        dir.path(),
        "coord",
        &[
            "coord".into(),
            endpoint.clone(),
            format!("--admin={coord_addr}"),
        ],
    );
    let mut node = spawn(
        dir.path(),
        "node",
        &[
            "node".into(),
            endpoint.clone(),
            format!("--admin={node_addr}"),
            "--name=ops-node".into(),
            "--session-ttl=2s".into(),
        ],
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    let mut wanted = BTreeSet::new();
    for q in dashboard_queries() {
        wanted.extend(metric_names(&q));
    }
    for (_, q) in alert_rules() {
        wanted.extend(metric_names(&q));
    }
    assert!(wanted.len() > 15, "{wanted:?}");
    // A channel, so that the by-state, by-cause and by-result series exist; the db size is
    // read every 5 s.
    let start = Instant::now();
    let (coord_text, node_text) = loop {
        let _ = Command::new(bin())
            .args(["ctl", &endpoint, "add-channel", "c1"])
            .stdin(Stdio::null())
            .output();
        let c = get(&client, &format!("http://{coord_addr}/metrics")).await;
        let n = get(&client, &format!("http://{node_addr}/metrics")).await;
        if let (Some((200, c)), Some((200, n))) = (c, n) {
            let mut have = exported(&c);
            have.extend(exported(&n));
            if wanted.is_subset(&have) {
                break (c, n);
            }
            assert!(
                start.elapsed() < Duration::from_secs(40),
                "queried but never exported: {:?}\ncoord:\n{}\nnode:\n{}",
                wanted.difference(&have).collect::<Vec<_>>(),
                coord.output(),
                node.output()
            );
        } else {
            assert!(
                start.elapsed() < Duration::from_secs(40),
                "no /metrics:\ncoord:\n{}\nnode:\n{}",
                coord.output(),
                node.output()
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    };
    // Both say which build they are; every node series names its node.
    for text in [&coord_text, &node_text] {
        assert!(
            text.lines().any(|l| l.starts_with("chanwatch_build_info{")),
            "{text}"
        );
    }
    for line in node_text.lines().filter(|l| !l.starts_with('#')) {
        assert!(line.contains("node=\"ops-node\""), "no node label: {line}");
    }
    assert!(coord_text.lines().any(|l| l == "chanwatch_leader 1"));
    assert!(coord.running() && node.running());
    // The node's log lines carry its name (a span field).
    assert!(
        node.output().contains("node{name=ops-node}"),
        "{}",
        node.output()
    );
    // Logs to a file carry no colour codes.
    for (name, out) in [("coord", coord.output()), ("node", node.output())] {
        assert!(out.contains("INFO"), "{name}:\n{out}");
        assert!(
            !out.contains('\x1b'),
            "{name} logs ANSI codes to a file:\n{out}"
        );
    }
    let (code, body) = get(&client, &format!("http://{node_addr}/readyz"))
        .await
        .expect("readyz answers");
    assert_eq!(code, 200, "{body}");
    // The name reaches the coordinator's API — once its watch has brought the session: the
    // metrics can be complete before that (found: the whole loop above took 0.4 s and the
    // leader had not seen the node's session yet).
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (_, nodes) = get(&client, &format!("http://{coord_addr}/api/v1/nodes"))
            .await
            .expect("nodes");
        if nodes.contains("\"name\":\"ops-node\"") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{nodes}\ncoord:\n{}\nnode:\n{}",
            coord.output(),
            node.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[test]
fn the_systemd_units_pass_systemd_analyze_verify() {
    let dir = tempfile::tempdir().expect("tempdir");
    let units = repo().join("deploy/systemd");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(&units).expect("deploy/systemd") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "service") {
            // The unit names the installed binary; point it at the one under test.
            let text = std::fs::read_to_string(&path)
                .expect("unit")
                .replace("/usr/local/bin/chanwatch", &bin().display().to_string());
            let name = path.file_name().expect("name").to_owned();
            std::fs::write(dir.path().join(&name), text).expect("copy");
            names.push(name.to_string_lossy().into_owned());
        }
    }
    names.sort();
    assert_eq!(names, ["chanwatch-coord.service", "chanwatch-node.service"]);
    let mut args = vec!["verify", "--man=no"];
    let paths: Vec<String> = names.iter().map(|n| format!("./{n}")).collect();
    args.extend(paths.iter().map(String::as_str));
    let (ok, out) = run_tool("systemd-analyze", "systemd", &args, dir.path());
    assert!(
        ok && out.trim().is_empty(),
        "systemd-analyze verify:\n{out}"
    );
    // A node's SIGTERM drains it for up to its --shutdown-timeout (60 s by default): the
    // unit must wait longer before SIGKILL (it said 60, cutting the drain's last step off).
    let node = std::fs::read_to_string(units.join("chanwatch-node.service")).expect("unit");
    let stop: u64 = node
        .lines()
        .find_map(|l| l.strip_prefix("TimeoutStopSec="))
        .and_then(|v| v.trim().parse().ok())
        .expect("TimeoutStopSec=SECONDS in the node's unit");
    assert!(stop > node_shutdown_timeout_secs(), "TimeoutStopSec={stop}");
    for unit in [
        &node,
        &std::fs::read_to_string(units.join("chanwatch-coord.service")).expect("unit"),
    ] {
        assert!(
            unit.contains("#operating-and-deploying"),
            "the docs/OPERATING.md#operating-and-deploying link"
        );
    }
}

/// The node's default `--shutdown-timeout`, in seconds, as `chanwatch node --help` says.
fn node_shutdown_timeout_secs() -> u64 {
    let out = std::process::Command::new(bin())
        .args(["node", "--help"])
        .output()
        .expect("chanwatch node --help");
    let help = String::from_utf8_lossy(&out.stdout);
    let after = help
        .split("--shutdown-timeout <")
        .nth(1)
        .expect("--shutdown-timeout in node --help");
    after
        .split("[default: ")
        .nth(1)
        .and_then(|d| d.split("s]").next())
        .and_then(|d| d.parse().ok())
        .unwrap_or_else(|| panic!("no default in seconds for --shutdown-timeout: {after}"))
}

#[test]
fn every_deploy_manifest_parses_and_the_kubernetes_objects_are_the_ones_documented() {
    let mut docs = Vec::new();
    let mut files = 0;
    let mut stack = vec![repo().join("deploy")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).expect("readable") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
                files += 1;
                let in_k8s = path.components().any(|c| c.as_os_str() == "kubernetes");
                for doc in yaml(&path) {
                    if in_k8s {
                        docs.push(doc);
                    }
                }
            }
        }
    }
    assert!(files >= 7, "{files} YAML files");
    let kind =
        |k: &str| -> Vec<&serde_json::Value> { docs.iter().filter(|d| d["kind"] == k).collect() };
    let deploy = kind("Deployment");
    assert_eq!(deploy.len(), 1);
    assert_eq!(deploy[0]["spec"]["replicas"], 2);
    assert_eq!(kind("PodDisruptionBudget").len(), 1);
    let sts = kind("StatefulSet");
    assert_eq!(sts.len(), 1);
    let grace = sts[0]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        .as_u64()
        .expect("the nodes' terminationGracePeriodSeconds");
    assert!(
        grace > node_shutdown_timeout_secs(),
        "the kubelet would SIGKILL a draining node at {grace} s"
    );
    let env = &sts[0]["spec"]["template"]["spec"]["containers"][0]["env"];
    assert!(
        env.as_array()
            .expect("env")
            .iter()
            .any(|e| e["name"] == "CHANWATCH_NODE_NAME"
                && e["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"),
        "the node's name is not its pod's: {env}"
    );
    assert!(kind("Service").len() >= 2);
    assert_eq!(kind("ConfigMap").len(), 1);
    for d in &docs {
        assert!(
            d["apiVersion"].is_string() && d["metadata"]["name"].is_string(),
            "{d}"
        );
    }
}

#[test]
fn tools_protoc_finds_protoc_on_path_and_in_protoc_not_only_in_usr_bin() {
    let dir = tempfile::tempdir().expect("tempdir");
    let fake = dir.path().join("protoc");
    std::fs::write(&fake, "#!/bin/sh\necho fake-protoc \"$@\"\n").expect("write");
    let mut perm = std::fs::metadata(&fake).expect("meta").permissions();
    std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
    std::fs::set_permissions(&fake, perm).expect("chmod");
    let script = repo().join("tools/protoc");
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |envs: &[(&str, &str)]| {
        let out = Command::new(&script)
            .arg("--version")
            .env_remove("PROTOC")
            .envs(envs.iter().copied())
            .output()
            .expect("runs");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert_eq!(run(&[("PATH", &path)]), "fake-protoc --version\n");
    let fake = fake.display().to_string();
    assert_eq!(run(&[("PROTOC", &fake)]), "fake-protoc --version\n");
    // PROTOC naming the script itself (as .cargo/config.toml does) is skipped, not looped on.
    let own = script.display().to_string();
    assert_eq!(
        run(&[("PROTOC", &own), ("PATH", &path)]),
        "fake-protoc --version\n"
    );
}

/// Not built here (no container daemon on the test machine): its shape only.
#[test]
fn the_dockerfile_is_multi_stage_on_debian_and_runs_unprivileged() {
    let text = std::fs::read_to_string(repo().join("deploy/Dockerfile")).expect("Dockerfile");
    let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "{froms:?}");
    assert!(
        froms.iter().all(|f| f.contains("bookworm")),
        "Debian stages: {froms:?}"
    );
    for want in [
        "cargo build --release --locked -p chanwatch",
        "COPY --from=build",
        "USER 10001",
        "ENTRYPOINT [\"/usr/bin/tini\", \"--\", \"/usr/local/bin/chanwatch\"]",
        "CHANWATCH_GIT_SHA",
    ] {
        assert!(text.contains(want), "the Dockerfile lacks {want}");
    }
    let ignore = std::fs::read_to_string(repo().join(".dockerignore")).expect(".dockerignore");
    assert!(
        ignore.lines().any(|l| l == "target/"),
        "the build context must leave target/ out"
    );
}

/// `standalone` exports what `coord` and `node` do on its one `/metrics`: its build and
/// process metrics, the coordinator's gauges, and node series labelled with their node (they
/// had no `node` label, and there was no `chanwatch_build_info` or `process_*`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standalone_exports_build_and_process_metrics_and_labels_its_node_series() {
    let dir = tempfile::tempdir().expect("tempdir");
    let admin = format!("127.0.0.1:{}", free_port());
    let mut standalone = spawn(
        dir.path(),
        "standalone",
        &[
            "standalone".into(),
            format!("--admin={admin}"),
            "--nodes=2".into(),
            "--channels=2".into(),
        ],
    );
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("client");
    let start = Instant::now();
    let text = loop {
        if let Some((200, text)) = get(&client, &format!("http://{admin}/metrics")).await {
            if text
                .lines()
                .any(|l| l.starts_with("chanwatch_node_channels_running{") && l.ends_with(" 2"))
            {
                break text;
            }
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no node metrics with 2 channels running:\n{}",
            standalone.output()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(
        text.lines().any(|l| l.starts_with("chanwatch_build_info{")),
        "{text}"
    );
    let have = exported(&text);
    for want in [
        "process_resident_memory_bytes",
        "process_cpu_seconds_total",
        "chanwatch_leader",
        "chanwatch_nodes_alive",
    ] {
        assert!(have.contains(want), "no {want} in\n{text}");
    }
    let node_series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("chanwatch_node_"))
        .collect();
    assert!(node_series.len() > 10, "{text}");
    for line in node_series {
        assert!(line.contains("node=\""), "no node label: {line}");
    }
    assert!(standalone.running(), "{}", standalone.output());
}

/// The Dockerfile's instructions, continuation lines joined, comments left out.
fn dockerfile_instructions(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in text.lines() {
        let t = line.trim();
        if cur.is_empty() && (t.is_empty() || t.starts_with('#')) {
            continue;
        }
        match t.strip_suffix('\\') {
            Some(head) => {
                cur.push_str(head);
                cur.push(' ');
            }
            None => {
                cur.push_str(t);
                out.push(std::mem::take(&mut cur));
            }
        }
    }
    out
}

/// Whether a `.dockerignore` pattern (the simple forms: `dir/`, `**/dir/`, a path) leaves
/// `path` (relative to the context, `/`-separated) out of the build context.
fn docker_ignores(patterns: &[&str], path: &str) -> bool {
    patterns.iter().any(|p| {
        let p = p.trim_end_matches('/');
        match p.strip_prefix("**/") {
            Some(tail) => path.split('/').any(|c| c == tail),
            None => path == p || path.starts_with(&format!("{p}/")),
        }
    })
}

/// No container daemon here: what can be judged without one. Every `COPY` source exists in
/// the build context (the repository, as the header's `docker build … .` says) and is not
/// dockerignored, nor is anything `cargo build --locked` reads; the binary copied out of the
/// build stage is the one `cargo build -p` makes (its name from `cargo metadata`) and is what
/// the entry point runs; protoc (the etcd-client build runs it) is installed where `PROTOC`
/// points; `RUN --mount` has the syntax line BuildKit's cache mounts need (it had none).
#[test]
fn the_dockerfile_copies_what_exists_and_ships_the_binary_cargo_builds() {
    let root = repo();
    let text = std::fs::read_to_string(root.join("deploy/Dockerfile")).expect("Dockerfile");
    let ignore_text = std::fs::read_to_string(root.join(".dockerignore")).expect(".dockerignore");
    let ignored: Vec<&str> = ignore_text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let steps = dockerfile_instructions(&text);
    // BuildKit's cache mounts.
    if steps.iter().any(|s| s.starts_with("RUN --mount")) {
        assert!(
            text.lines()
                .next()
                .is_some_and(|l| l.starts_with("# syntax=docker/dockerfile:1")),
            "RUN --mount needs `# syntax=docker/dockerfile:1` as the first line"
        );
    }
    // What the build reads is in the context.
    for needed in [
        "Cargo.toml",
        "Cargo.lock",
        ".cargo/config.toml",
        "crates/chanwatch/Cargo.toml",
        "crates/chanwatch-coord/src/status.html",
    ] {
        assert!(root.join(needed).exists(), "{needed} is missing");
        assert!(
            !docker_ignores(&ignored, needed),
            ".dockerignore leaves {needed} out of the build context"
        );
    }
    // Every COPY from the context names something there.
    let mut copies = 0;
    for step in steps.iter().filter(|s| s.starts_with("COPY ")) {
        let words: Vec<&str> = step.split_whitespace().skip(1).collect();
        if words.iter().any(|w| w.starts_with("--from=")) {
            continue;
        }
        let args: Vec<&str> = words
            .iter()
            .copied()
            .filter(|w| !w.starts_with("--"))
            .collect();
        assert!(args.len() >= 2, "{step}");
        for src in &args[..args.len() - 1] {
            let src = src.trim_start_matches("./");
            if src == "." {
                continue;
            }
            assert!(root.join(src).exists(), "COPY {src}: not in the repository");
            assert!(!docker_ignores(&ignored, src), "COPY {src}: dockerignored");
        }
        copies += 1;
    }
    assert!(copies >= 1, "no COPY from the context: {steps:?}");
    // The package built and its binary's name, as cargo sees them.
    let build = steps
        .iter()
        .find(|s| s.contains("cargo build"))
        .expect("a cargo build step");
    let package = build
        .split_whitespace()
        .skip_while(|w| *w != "-p")
        .nth(1)
        .expect("cargo build -p PACKAGE");
    assert!(build.contains("--release"), "{build}");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "metadata",
            "--no-deps",
            "--offline",
            "--format-version",
            "1",
        ])
        .current_dir(&root)
        .output()
        .expect("cargo metadata");
    assert!(out.status.success(), "{out:?}");
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let pkg = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .find(|p| p["name"] == package)
        .unwrap_or_else(|| panic!("cargo build -p {package}: no such workspace package"));
    let bins: Vec<&str> = pkg["targets"]
        .as_array()
        .expect("targets")
        .iter()
        .filter(|t| {
            t["kind"]
                .as_array()
                .is_some_and(|k| k.iter().any(|k| k == "bin"))
        })
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert_eq!(bins.len(), 1, "{bins:?}");
    let built = format!("target/release/{}", bins[0]);
    // The build stage copies that binary out; the runtime stage takes it from there; the
    // entry point runs it.
    let cp_to = build
        .split("&&")
        .map(str::trim)
        .find_map(|c| c.strip_prefix(&format!("cp {built} ")))
        .unwrap_or_else(|| panic!("the build step does not copy {built} out: {build}"))
        .trim()
        .to_owned();
    let from_build = steps
        .iter()
        .find(|s| s.starts_with("COPY --from=build "))
        .expect("COPY --from=build");
    let words: Vec<&str> = from_build.split_whitespace().collect();
    assert_eq!(words[2], cp_to, "{from_build}");
    let installed = words[3];
    let entry = steps
        .iter()
        .rfind(|s| s.starts_with("ENTRYPOINT "))
        .expect("ENTRYPOINT");
    assert!(entry.contains(&format!("\"{installed}\"")), "{entry}");
    // protoc for etcd-client's build script, where PROTOC says.
    let lock = std::fs::read_to_string(root.join("Cargo.lock")).expect("Cargo.lock");
    if lock.contains("name = \"etcd-client\"") {
        let build_stage: Vec<&String> = steps
            .iter()
            .take_while(|s| !s.starts_with("FROM debian"))
            .collect();
        assert!(
            build_stage
                .iter()
                .any(|s| s.contains("apt-get install") && s.contains("protobuf-compiler")),
            "the build stage does not install protoc"
        );
        assert!(
            build_stage
                .iter()
                .any(|s| s.starts_with("ENV ") && s.contains("PROTOC=/usr/bin/protoc")),
            "PROTOC does not point at Debian's protoc"
        );
    }
    // tini, which the entry point starts, is installed in the runtime stage.
    let runtime: Vec<&String> = steps
        .iter()
        .skip_while(|s| !s.starts_with("FROM debian"))
        .collect();
    if entry.contains("/usr/bin/tini") {
        assert!(
            runtime
                .iter()
                .any(|s| s.contains("apt-get install") && s.contains(" tini")),
            "ENTRYPOINT runs tini, which the runtime stage does not install"
        );
    }
}

/// docs/DATA-PLANE.md shows the example workers whole, as they are in `examples/workers/` (its
/// listings had drifted from the files: a newcomer found lines missing).
#[test]
fn the_data_plane_doc_shows_the_example_workers_as_they_are() {
    let doc = std::fs::read_to_string(repo().join("docs/DATA-PLANE.md")).expect("the doc");
    for (anchor, fence, file) in [
        ("A worker in a dozen lines of shell", "```sh\n", "worker.sh"),
        (
            "A complete consumer in Python",
            "```python\n",
            "consumer.py",
        ),
    ] {
        let from = doc
            .find(anchor)
            .unwrap_or_else(|| panic!("{anchor:?} in docs/DATA-PLANE.md"));
        let start = doc[from..].find(fence).expect("the listing") + from + fence.len();
        let end = doc[start..].find("\n```\n").expect("its end") + start;
        let path = repo().join("examples/workers").join(file);
        let text = std::fs::read_to_string(&path).expect("the example");
        assert_eq!(
            &doc[start..end],
            text.trim_end_matches('\n'),
            "docs/DATA-PLANE.md's listing of {file} differs from the file"
        );
    }
}
