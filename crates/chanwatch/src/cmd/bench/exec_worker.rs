//! `bench exec-worker` (hidden): the compiled child `bench exec` spawns per channel — what a
//! lean worker in a compiled language does with the agent API: blocking HTTP/1.1 on one
//! keep-alive connection, to `CHANWATCH_AGENT_SOCKET` when the node gives one (`--tcp` or
//! none: to `CHANWATCH_AGENT_URL`, with `TCP_NODELAY`), each request in one write; it calls
//! `/ready`, then commits 1, 2, 3, … until the agent says its run is over (403, 409) or the
//! node stops it. With `--ping` it asks `GET /state` over and over instead: the same round
//! trips with no store behind them, the ceiling of the agent's transport.
//!
//! A commit costs it no allocation: the request is built in one buffer kept across commits
//! and the answer read into another, parsed in place (`httparse`). That measured no faster
//! than a `String` per header line (docs/BENCHMARKS.md, 2026-12-05: a commit's cost in the
//! worker is the kernel's); it is what a lean worker does, and the ping mode shares it.
//!
//! An answer it does not expect (a status other than 200, 403, 409, or 503 to a commit) ends
//! it with an error, rather than asking again in a loop.
//!
//! Owns: one child's commit loop. Must not: be anything but a benchmark's worker (it trusts
//! the agent's answers to fit in 4 KiB).

use std::io::{Read, Write};

use anyhow::{bail, Context, Result};

/// A Unix socket read only once `poll` says it is readable, as an event-loop client (Go's
/// netpoller, Java NIO, tokio) reads. A task blocked in `read` on a Unix stream socket is
/// woken each time its peer reads what it wrote (the kernel's "write space" wake-up does not
/// tell reader from writer; `poll` filters it): without this, every commit cost the child a
/// spurious wake-up and the node the work of waking it (a tenth of the node's CPU in `perf`).
struct Polled(std::os::unix::net::UnixStream);

impl Read for Polled {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        use rustix::event::{poll, PollFd, PollFlags};
        loop {
            match poll(&mut [PollFd::new(&self.0, PollFlags::IN)], None) {
                Ok(_) => return self.0.read(buf),
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }
}

/// The largest answer the worker reads: the agent's are under 400 bytes.
const ANSWER: usize = 4096;

/// Reads one answer on `r` into `buf`: its status, once its body is in too.
fn answer(r: &mut impl Read, buf: &mut [u8; ANSWER]) -> Result<u16> {
    let mut have = 0;
    loop {
        let n = read(r, &mut buf[have..])?;
        if n == 0 {
            bail!("the agent closed the connection mid-answer");
        }
        have += n;
        let mut headers = [httparse::EMPTY_HEADER; 16];
        let mut parsed = httparse::Response::new(&mut headers);
        let head = match parsed.parse(&buf[..have]) {
            Ok(httparse::Status::Complete(head)) => head,
            Ok(httparse::Status::Partial) if have < ANSWER => continue,
            Ok(httparse::Status::Partial) => bail!("the agent's answer head is over 4 KiB"),
            Err(e) => bail!("the agent's answer is not HTTP/1.1: {e}"),
        };
        let status = parsed.code.context("an answer with no status")?;
        // The agent's answers are whole bodies with a length; anything else would leave the
        // connection out of step.
        let len = parsed
            .headers
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case("content-length"))
            .and_then(|h| {
                std::str::from_utf8(h.value)
                    .ok()?
                    .trim()
                    .parse::<usize>()
                    .ok()
            })
            .context("the agent's answer has no valid Content-Length")?;
        let end = head + len;
        if end > ANSWER {
            bail!("the agent's answer is over 4 KiB");
        }
        if have > end {
            bail!("the agent sent more than the answer to the request in flight");
        }
        while have < end {
            let n = read(r, &mut buf[have..end])?;
            if n == 0 {
                bail!("the agent closed the connection mid-answer");
            }
            have += n;
        }
        return Ok(status);
    }
}

/// `r.read(buf)`, again when a signal interrupted it.
fn read(r: &mut impl Read, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match r.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

/// Sends `head` + `Content-Length` + `body` in one write on `w` (one segment: no wait on the
/// agent's ACK, Nagle), building it in `req`.
fn send(w: &mut impl Write, req: &mut Vec<u8>, head: &[u8], body: &[u8]) -> Result<()> {
    req.clear();
    req.extend_from_slice(head);
    write!(req, "Content-Length: {}\r\n\r\n", body.len())?;
    req.extend_from_slice(body);
    w.write_all(req)?;
    Ok(())
}

/// Commits 1, 2, 3, … on `(w, r)` after `/ready` (with `ping`: asks `GET /state` instead,
/// which the agent answers at once), until the agent says the run is over.
fn commit_loop(
    w: &mut impl Write,
    r: &mut impl Read,
    host: &str,
    token: &str,
    ping: bool,
) -> Result<()> {
    let head = |method: &str, path: &str| {
        format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {token}\r\nContent-Type: application/json\r\n")
            .into_bytes()
    };
    let (ready, commit) = (head("POST", "/ready"), head("POST", "/commit"));
    let (mut req, mut body) = (Vec::with_capacity(512), Vec::with_capacity(64));
    let mut buf = [0u8; ANSWER];
    send(w, &mut req, &ready, b"{}")?;
    match answer(r, &mut buf)? {
        200 => {}
        403 => return Ok(()),
        other => bail!("the agent answered POST /ready with {other}"),
    }
    if ping {
        let state = head("GET", "/state");
        loop {
            send(w, &mut req, &state, b"")?;
            match answer(r, &mut buf)? {
                200 => {}
                // The run is over: exit.
                403 => return Ok(()),
                other => bail!("the agent answered GET /state with {other}"),
            }
        }
    }
    let mut n = 0u64;
    loop {
        body.clear();
        write!(body, r#"{{"position":"{}","state":{{}}}}"#, n + 1)?;
        send(w, &mut req, &commit, &body)?;
        match answer(r, &mut buf)? {
            200 => n += 1,
            // The run is over (released, fenced): exit.
            403 | 409 => return Ok(()),
            // Not landed (the node paused, the store out of reach): the same commit, later.
            503 => std::thread::sleep(std::time::Duration::from_millis(10)),
            other => bail!("the agent answered POST /commit with {other}"),
        }
    }
}

/// Runs the worker (see the module's docs).
///
/// # Errors
/// Not run by `bench exec` (no agent in the environment), or the agent gone.
pub fn run(args: &super::BenchExecWorkerArgs) -> Result<()> {
    let url = std::env::var("CHANWATCH_AGENT_URL")
        .context("CHANWATCH_AGENT_URL is not set: `bench exec` runs this as its worker")?;
    let token = std::env::var("CHANWATCH_AGENT_TOKEN")
        .context("CHANWATCH_AGENT_TOKEN is not set: `bench exec` runs this as its worker")?;
    let socket = std::env::var("CHANWATCH_AGENT_SOCKET").unwrap_or_default();
    if !socket.is_empty() && !args.tcp {
        let mut w = std::os::unix::net::UnixStream::connect(&socket)?;
        let mut r = Polled(w.try_clone()?);
        return commit_loop(&mut w, &mut r, "agent", &token, args.ping);
    }
    let addr = url
        .strip_prefix("http://")
        .context("CHANWATCH_AGENT_URL is not http://HOST:PORT")?;
    let mut w = std::net::TcpStream::connect(addr)?;
    w.set_nodelay(true)?;
    let mut r = w.try_clone()?;
    commit_loop(&mut w, &mut r, addr, &token, args.ping)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `answer` reads an answer that comes in pieces, up to its end and no further, and
    /// refuses one it cannot keep in step with.
    #[test]
    fn an_answer_in_pieces_is_read_to_its_end() {
        struct Pieces(Vec<&'static [u8]>);
        impl Read for Pieces {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.0.is_empty() {
                    return Ok(0);
                }
                let piece = self.0.remove(0);
                let n = piece.len().min(buf.len());
                buf[..n].copy_from_slice(&piece[..n]);
                if n < piece.len() {
                    self.0.insert(0, &piece[n..]);
                }
                Ok(n)
            }
        }
        let mut buf = [0u8; ANSWER];
        let mut r = Pieces(vec![
            b"HTTP/1.1 409 Conflict\r\ncontent-",
            b"length: 11\r\n\r\n{\"erro",
            b"r\":1}",
        ]);
        assert_eq!(answer(&mut r, &mut buf).expect("a whole answer"), 409);
        let mut cut = Pieces(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 11\r\n\r\n{\"ok\"",
        ]);
        assert!(
            answer(&mut cut, &mut buf).is_err(),
            "a body cut short is an error"
        );
        let mut more = Pieces(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}HTTP/1.1",
        ]);
        assert!(
            answer(&mut more, &mut buf).is_err(),
            "bytes past the answer are an error (one request is in flight)"
        );
        let mut no_length = Pieces(vec![b"HTTP/1.1 200 OK\r\n\r\n{}"]);
        assert!(
            answer(&mut no_length, &mut buf).is_err(),
            "an answer without a length is an error"
        );
        // Read up to its end and no further: the next answer is still to come.
        let mut two = Pieces(vec![
            b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}",
            b"HTTP/1.1 403 Forbidden\r\ncontent-length: 2\r\n\r\n{}",
        ]);
        assert_eq!(answer(&mut two, &mut buf).expect("the first"), 200);
        assert_eq!(answer(&mut two, &mut buf).expect("the second"), 403);
    }
}
