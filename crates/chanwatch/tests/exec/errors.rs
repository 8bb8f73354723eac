//! A worker's wrong requests to its agent — a path the agent does not have, a method a path
//! does not take, a body over the limit — get JSON errors, and the agent goes on serving the
//! same worker. The real `coord` and `node` binaries, a Python worker (standard library only)
//! that records each answer in a file; judged from that file and `ctl`.

use super::*;

/// The worker: asks, records `{name: {status, allow, body}}` in `DIR/CHANNEL.probe`, then
/// says it is ready and idles.
const PROBE: &str = r#"
import http.client, json, os, sys, time, urllib.parse
url = urllib.parse.urlsplit(os.environ["CHANWATCH_AGENT_URL"])
token = os.environ["CHANWATCH_AGENT_TOKEN"]
seen = {}
def ask(name, method, path, headers=()):
    c = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    c.putrequest(method, path)
    c.putheader("Authorization", "Bearer " + token)
    for k, v in headers:
        c.putheader(k, v)
    c.endheaders()  # the head alone: a large body is never sent
    r = c.getresponse()
    body = r.read()
    seen[name] = {"status": r.status, "allow": r.getheader("Allow"),
                  "body": json.loads(body) if body else None}
    c.close()
ask("missing", "GET", "/nope")
ask("method", "GET", "/commit")
ask("head", "HEAD", "/state")
ask("large", "POST", "/commit", [("Content-Length", str(2 << 20)), ("Expect", "100-continue")])
ask("ready", "POST", "/ready", [("Content-Length", "0")])
path = os.path.join(sys.argv[1], os.environ["CHANWATCH_CHANNEL"] + ".probe")
with open(path + ".tmp", "w") as f:
    json.dump(seen, f)
os.rename(path + ".tmp", path)
while True:
    time.sleep(1)
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_wrong_requests_get_json_errors_and_the_agent_goes_on_serving_it() {
    let w = World::start().await;
    let script = w.path("probe.py");
    std::fs::write(&script, PROBE).expect("write the worker");
    let exec = format!(
        "exec python3 '{}' '{}'",
        script.display(),
        w.dir.path().display()
    );
    let node = w.node("node", &exec, &[]);
    w.wait_nodes(1);
    w.add_channel("probe-0", &[]);
    let file = w.path("probe-0.probe");
    let seen: serde_json::Value = wait_for(
        30,
        || format!("{} written; node log:\n{}", file.display(), node.output()),
        || serde_json::from_str(&std::fs::read_to_string(&file).ok()?).ok(),
    );
    let answer = |name: &str| &seen[name];
    let error = |name: &str| {
        answer(name)["body"]["error"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    };
    assert_eq!(answer("missing")["status"], 404, "{seen}");
    assert!(
        error("missing").contains("/commit"),
        "names the endpoints: {seen}"
    );
    assert_eq!(answer("method")["status"], 405, "{seen}");
    assert_eq!(answer("method")["allow"], "POST", "{seen}");
    assert!(error("method").contains("POST"), "{seen}");
    assert_eq!(answer("head")["status"], 200, "HEAD where GET: {seen}");
    assert_eq!(answer("head")["body"], serde_json::Value::Null, "{seen}");
    assert_eq!(answer("large")["status"], 413, "{seen}");
    assert!(!error("large").is_empty(), "a JSON error: {seen}");
    assert_eq!(answer("ready")["status"], 200, "{seen}");
    // The ready after the errors counted: the channel runs.
    w.watched("probe-0", 30);
}
