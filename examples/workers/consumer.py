#!/usr/bin/env python3
"""A chanwatch `--exec` worker in Python (standard library only): the stream consumer.

    chanwatch node --exec 'exec python3 examples/workers/consumer.py file:/var/lib/cwlog'

It reads its channel from the embedded file log (`--log file:DIR` of `produce`) after
CHANWATCH_RESUME_POSITION, folds every message into the same state as the Rust consumer
(count, highest sequence number, wrapping sum of FNV-1a hashes) so that `chanwatch audit` can
judge it, and commits (position, state) through the node's agent API. The commit is fenced:
only the channel's current owner can land one, and the next owner resumes from the last one
that landed, so the committed state holds every message exactly once.

File log format (crates/chanwatch-stream/src/file.rs): `DIR/CHANNEL.log` is a sequence of
records `len: u32 LE, crc: u32 LE, payload`, crc = CRC-32 (IEEE, zlib.crc32) over the length
bytes and the payload; a message's position is its record's 1-based index in the file.
"""
import json
import os
import signal
import struct
import sys
import time
import urllib.error
import urllib.request
import zlib

AGENT = os.environ["CHANWATCH_AGENT_URL"]
TOKEN = os.environ["CHANWATCH_AGENT_TOKEN"]
CHANNEL = os.environ["CHANWATCH_CHANNEL"]
COMMIT_EVERY, COMMIT_INTERVAL = 100, 0.2
MASK = (1 << 64) - 1


def call(method, path, body=None):
    """One agent request: (status, JSON answer)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(AGENT + path, data=data, method=method, headers={
        "Authorization": "Bearer " + TOKEN, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def fnv1a(payload):
    h = 0xCBF29CE484222325
    for b in payload:
        h = ((h ^ b) * 0x100000001B3) & MASK
    return h


class Log:
    """One channel file of the embedded log, read record by record from a byte offset."""

    def __init__(self, path):
        self.path, self.file, self.offset = path, None, 0

    def read(self, max_records):
        """The next complete, checksummed records (a torn or unfinished tail waits)."""
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
            out.append(payload)
            i += 8 + length
        self.offset += i
        return out


def main():
    log_url = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("CHANWATCH_LOG", "")
    if not log_url.startswith("file:"):
        sys.exit("usage: consumer.py file:DIR (the embedded log's data dir)")
    log = Log(os.path.join(log_url[len("file:"):], CHANNEL + ".log"))
    stopping = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))

    position = int(os.environ.get("CHANWATCH_RESUME_POSITION") or 0)
    state = json.loads(os.environ.get("CHANWATCH_RESUME_STATE") or "null") or {}
    count, max_seq = state.get("count", 0), state.get("max_seq", 0)
    digest = int(state.get("digest", "0"), 16)
    skip = position  # records up to the resume position were folded by an earlier run
    while skip > 0 and not stopping:
        n = len(log.read(skip))
        skip -= n
        if not n:
            time.sleep(0.05)
    call("POST", "/ready")
    print(f"{CHANNEL}: consuming after position {position} (count {count})", flush=True)

    committed, pending, last_commit, paused = position, 0, time.monotonic(), False
    last_state_check = 0.0

    def commit():
        body = {"position": str(position), "state": {
            "count": count, "max_seq": max_seq, "digest": f"{digest:016x}"}}
        status, answer = call("POST", "/commit", body)
        if status in (409, 401, 403):  # fenced: someone else owns the channel now
            print(f"{CHANNEL}: commit refused ({status}: {answer.get('error')}); exiting", flush=True)
            sys.exit(0)
        return status == 200

    while not stopping:
        now = time.monotonic()
        if paused or now - last_state_check > 0.5:  # the node pauses when it cannot reach etcd
            paused = call("GET", "/state")[1].get("state") == "paused"
            last_state_check = now
            if paused:
                time.sleep(0.1)
                continue
        batch = log.read(1000)
        for payload in batch:
            count += 1
            if len(payload) >= 8:
                max_seq = max(max_seq, struct.unpack_from(">Q", payload)[0])
            digest = (digest + fnv1a(payload)) & MASK
            position += 1
        pending += len(batch)
        due = now - last_commit >= COMMIT_INTERVAL
        if position != committed and (pending >= COMMIT_EVERY or due):
            if commit():
                committed, pending = position, 0
            last_commit = now
        if not batch:
            time.sleep(0.05)
    # Released (SIGTERM): one last commit, so that the next owner re-reads less.
    if position != committed and not paused:
        commit()


if __name__ == "__main__":
    main()
