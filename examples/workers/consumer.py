#!/usr/bin/env python3
"""A chanwatch `--exec` worker in Python (standard library only): the stream consumer.

    chanwatch node --exec 'exec python3 examples/workers/consumer.py file:/var/lib/cwlog'
    chanwatch node --log nats://127.0.0.1:4222 --exec 'exec python3 examples/workers/consumer.py agent'

It reads its channel after CHANWATCH_RESUME_POSITION — from the embedded file log directly
(`file:DIR`, the dir `produce --log file:DIR` writes), or through the agent's `GET /read`
(`agent`: any log the node was given with `--log`, NATS included) — folds every message into the same state as the Rust consumer
(count, highest sequence number, wrapping sum of FNV-1a hashes) so that `chanwatch audit` can
judge it, and commits (position, state) through the node's agent API. The commit is fenced:
only the channel's current owner can land one, and the next owner resumes from the last one
that landed, so the committed state holds every message exactly once.

File log format (crates/chanwatch-stream/src/file.rs): `DIR/CHANNEL.log` is a sequence of
records `len: u32 LE, crc: u32 LE, payload`, crc = CRC-32 (IEEE, zlib.crc32) over the length
bytes and the payload; a message's position is its record's 1-based index in the file.
"""
import http.client
import json
import os
import signal
import socket
import struct
import sys
import time
import zlib

AGENT = os.environ["CHANWATCH_AGENT_URL"]
TOKEN = os.environ["CHANWATCH_AGENT_TOKEN"]
CHANNEL = os.environ["CHANWATCH_CHANNEL"]
COMMIT_EVERY, COMMIT_INTERVAL = 100, 0.2
MASK = (1 << 64) - 1


class Agent:
    """The node's agent API over one keep-alive HTTP connection, made again after an error."""

    def __init__(self, url, token):
        self.host, port = url[len("http://"):].rsplit(":", 1)
        self.port, self.conn = int(port), None
        self.headers = {"Authorization": "Bearer " + token, "Content-Type": "application/json"}

    def call(self, method, path, body=None, timeout=10.0):
        """One request: (status, JSON answer); (None, {"error"}) when the agent did not answer
        (the node is gone or stalled: nothing is known to have happened)."""
        data = None if body is None else json.dumps(body).encode()
        for attempt in (1, 2):  # a kept-alive connection may have been closed while idle
            try:
                if self.conn is None:
                    self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
                    self.conn.connect()
                    # http.client writes headers and body apart: send each at once (Nagle).
                    self.conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.conn.sock.settimeout(timeout)
                self.conn.request(method, path, body=data, headers=self.headers)
                r = self.conn.getresponse()
                return r.status, json.loads(r.read() or b"{}")
            except (OSError, http.client.HTTPException, ValueError) as e:
                if self.conn is not None:
                    self.conn.close()
                self.conn = None
                if attempt == 2 or isinstance(e, TimeoutError):
                    return None, {"error": f"the agent did not answer: {e!r}"}


agent = Agent(AGENT, TOKEN)
call = agent.call


def fnv1a(payload):
    h = 0xCBF29CE484222325
    for b in payload:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


class AgentLog:
    """The channel through the agent's GET /read (positions are opaque strings: NATS has gaps)."""

    def __init__(self, position):
        self.after = position

    def read(self, max_records):
        """The next messages, as (position, payload); waits up to 1 s for one."""
        status, answer = call("GET", f"/read?after={self.after}&max={max_records}&wait_ms=1000")
        if status in (404, 400):
            # No log (the node was started without --log), or a position the log does not
            # take: this never changes, so say so and fail the channel rather than consume
            # nothing in silence.
            why = (f"GET /read: {answer.get('error')}; the node needs --log file:DIR or nats://HOST:PORT"
                   if status == 404 else f"GET /read after {self.after!r}: {answer.get('error')}")
            call("POST", "/fail", {"reason": why})
            sys.exit(why)
        if status in (401, 403):  # this run is over (its token revoked): the node stops us
            sys.exit(f"GET /read: {status}: {answer.get('error')}")
        if status in (None, 503):  # the node or its log is out of reach for now
            time.sleep(0.2)
            return []
        if status != 200:  # the log's own error: say it, and ask again less often
            print(f"{CHANNEL}: GET /read: {status}: {answer.get('error')}", flush=True)
            time.sleep(1)
            return []
        out = [(m["position"], bytes.fromhex(m["payload"])) for m in answer["messages"]]
        if out:
            self.after = out[-1][0]
        return out


class FileLog:
    """One channel file of the embedded log, read record by record from a byte offset; a
    message's position is its record's 1-based index."""

    def __init__(self, path, position):
        self.path, self.file, self.offset, self.index = path, None, 0, 0
        skip = int(position or 0)  # records up to the resume position were folded already
        while skip > 0:
            n = len(self.read(skip))
            skip -= n
            if not n:
                time.sleep(0.05)

    def read(self, max_records):
        """The next complete, checksummed records as (position, payload); a torn or
        unfinished tail waits."""
        if self.file is None:
            if not os.path.exists(self.path):
                return []
            self.file = open(self.path, "rb")
        self.file.seek(self.offset)
        data = self.file.read(4 << 20)
        out, i = [], 0
        while len(out) < max_records and len(data) - i >= 8:
            length, crc = struct.unpack_from("<II", data, i)
            if len(data) - i - 8 < length:
                break
            payload = data[i + 8:i + 8 + length]
            if zlib.crc32(data[i:i + 4] + payload) != crc:
                break
            self.index += 1
            out.append((str(self.index), payload))
            i += 8 + length
        self.offset += i
        return out


def main():
    source = sys.argv[1] if len(sys.argv) > 1 else ""

    position = os.environ.get("CHANWATCH_RESUME_POSITION") or ""
    state = json.loads(os.environ.get("CHANWATCH_RESUME_STATE") or "null") or {}
    count, max_seq = state.get("count", 0), state.get("max_seq", 0)
    digest = int(state.get("digest", "0"), 16)
    if source.startswith("file:"):
        log = FileLog(os.path.join(source[len("file:"):], CHANNEL + ".log"), position)
    elif source == "agent":
        log = AgentLog(position)
    else:
        sys.exit("usage: consumer.py file:DIR | agent")
    stopping, committing = [], []

    def released(*_):
        """SIGTERM (release): end the loop after one last commit; during a commit that waits
        on a slow store, exit at once (the node books that commit whatever we do, and the
        next owner resumes from what landed)."""
        if committing:
            sys.exit(0)
        stopping.append(True)

    signal.signal(signal.SIGTERM, released)
    if call("POST", "/ready")[0] != 200:
        sys.exit("the agent refused or did not answer POST /ready")
    print(f"{CHANNEL}: consuming after position {position!r} (count {count})", flush=True)

    committed, pending, last_commit, paused = position, 0, time.monotonic(), False
    last_state_check = 0.0

    def commit(timeout=120):
        body = {"position": position, "state": {
            "count": count, "max_seq": max_seq, "digest": f"{digest:016x}"}}
        # The node answers once the commit landed or was refused; while etcd is away that can
        # take long, and giving up early would only make the next commit reconcile.
        committing.append(True)
        status, answer = call("POST", "/commit", body, timeout=timeout)
        committing.clear()
        if status in (409, 401, 403):  # fenced: someone else owns the channel now
            print(f"{CHANNEL}: commit refused ({status}: {answer.get('error')}); exiting", flush=True)
            sys.exit(0)
        return status == 200

    while not stopping:
        now = time.monotonic()
        if paused or now - last_state_check > 1:  # the node pauses when it cannot reach etcd
            status, answer = call("GET", "/state")
            if status == 200:  # no answer: keep what we knew (commits are fenced anyway)
                paused = answer.get("state") == "paused"
            last_state_check = now
            if paused:
                time.sleep(0.25)
                continue
        batch = log.read(1000)
        for position, payload in batch:
            count += 1
            if len(payload) >= 8:
                max_seq = max(max_seq, struct.unpack_from(">Q", payload)[0])
            digest = (digest + fnv1a(payload)) & MASK
        pending += len(batch)
        due = now - last_commit >= COMMIT_INTERVAL
        if position != committed and (pending >= COMMIT_EVERY or due):
            if commit():
                committed, pending = position, 0
            last_commit = now
        if not batch:
            time.sleep(0.05)
    # Released (SIGTERM): one last commit, so that the next owner re-reads less; briefly (the
    # node waits for us before the next owner may start).
    if position != committed and not paused:
        commit(timeout=2)


if __name__ == "__main__":
    main()
