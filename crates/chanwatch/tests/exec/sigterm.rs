//! The Python worker released (`SIGTERM`) while its commit waits on a slow store exits at
//! once: the node gives a released worker only `--stop-grace` before `SIGKILL`, and, in the
//! chaos run, workers whose commit hung (a fenced session, etcd out of space) outlived the
//! grace while another node was about to start their channels. Against a fake agent that
//! never answers `/commit`.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// Serves one keep-alive connection: `/ready`, `/state` (running), `/read` (one message, then
/// none), and `/commit` never answered (it only sets `committed`).
fn serve(stream: std::net::TcpStream, committed: Arc<AtomicBool>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut out = stream;
    let mut served = false;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let mut len = 0;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut body = vec![0; len];
        let _ = reader.read_exact(&mut body);
        let answer = if line.starts_with("POST /commit") {
            committed.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_secs(3600));
            return;
        } else if line.starts_with("GET /state") {
            r#"{"state":"running"}"#.to_owned()
        } else if line.starts_with("GET /read") {
            if served {
                std::thread::sleep(Duration::from_millis(300));
                r#"{"messages":[]}"#.to_owned()
            } else {
                served = true;
                r#"{"messages":[{"position":"1","payload":"00000000000000016869"}]}"#.to_owned()
            }
        } else {
            "{}".to_owned()
        };
        let _ = write!(
            out,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{answer}",
            answer.len()
        );
    }
}

#[test]
fn the_python_worker_released_while_its_commit_hangs_exits_at_once() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let committed = Arc::new(AtomicBool::new(false));
    let c = committed.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let c = c.clone();
            std::thread::spawn(move || serve(stream, c));
        }
    });
    let mut child = Command::new("python3")
        .arg(workers().join("consumer.py"))
        .arg("agent")
        .env("CHANWATCH_AGENT_URL", &url)
        .env("CHANWATCH_AGENT_TOKEN", "t")
        .env("CHANWATCH_CHANNEL", "c-0")
        .env("CHANWATCH_RESUME_POSITION", "")
        .stdin(Stdio::null())
        .spawn()
        .expect("python3 runs");
    wait_for(
        20,
        || "the worker commits".into(),
        || committed.load(Ordering::SeqCst).then_some(()),
    );
    std::thread::sleep(Duration::from_millis(200));
    let sent = Instant::now();
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let status = wait_for(
        10,
        || "the worker exits on SIGTERM".into(),
        || child.try_wait().ok().flatten(),
    );
    eprintln!("exited {:?} after SIGTERM: {status}", sent.elapsed());
    assert!(
        sent.elapsed() < Duration::from_secs(3),
        "took {:?}",
        sent.elapsed()
    );
}
