"""A real S3-protocol server on 127.0.0.1 for the tests (and benchmarks/bench_remote_pipeline.py),
a small proxy in front of it that adds latency and faults, and a static HTTP server with Range
support for http:// shards.

- `S3Store.start()`: moto's standalone server (`python -m moto.server`, a real HTTP server
  speaking S3) on a free port of 127.0.0.1, with authentication on, so that a key it does not
  know, or one without a policy, gets a real 403: after the first 5 requests (which create the
  users) every request is signed and checked. `admin` may do everything; `nobody` has no policy.
- `FaultProxy`: HTTP/1.1 between the client (s3fs, fsspec's HTTP client) and a server. It keeps
  each client connection open (the client's pool reuses it), counts connections and requests,
  adds `latency_s` to every request, and injects faults into the ranged GETs a rule matches:
  `503` (S3's ServiceUnavailable, not forwarded), `reset` (the real response's headers and half
  its body, then a TCP reset) and `stall` (no answer for `stall_s`, then a reset: a client timeout).
  The faults are injected here because the server cannot be made to fail on cue; everything else
  is the real client talking to the real server.
"""

from __future__ import annotations

import http.client
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from yatt_mm.processes import die_with_parent

ALLOW_ALL = '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen | None = None, timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout_s} s")


@dataclass
class Keys:
    access_key: str
    secret_key: str

    def env(self, endpoint: str) -> dict[str, str]:
        """The standard AWS variables that point a client at `endpoint` with these keys."""
        return {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_DEFAULT_REGION": "us-east-1"}


@dataclass
class S3Store:
    proc: subprocess.Popen
    endpoint: str
    admin: Keys
    nobody: Keys  # a real user with no policy: every request of it gets 403

    @classmethod
    def start(cls, log: str | os.PathLike | None = None, auth: bool = True) -> "S3Store":
        """moto's server on a free port; `auth` False: no signature or policy checks (the
        benchmark: moto's policy check costs the cores the readers measure on)."""
        port = free_port()
        env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "5" if auth else "inf"}
        out = open(log, "ab") if log else subprocess.DEVNULL
        parent = os.getpid()  # the server ends with the process that started it, kill -9 included
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                                stdout=out, stderr=out, start_new_session=True,
                                preexec_fn=lambda: die_with_parent(signal.SIGKILL, parent))
        endpoint = f"http://127.0.0.1:{port}"
        try:
            _wait_listening(port, proc)
            import boto3

            iam = boto3.client("iam", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="setup",
                               aws_secret_access_key="setup")
            iam.create_user(UserName="admin")  # the 5 unauthenticated requests: users, policy, keys
            iam.put_user_policy(UserName="admin", PolicyName="all", PolicyDocument=ALLOW_ALL)
            admin = iam.create_access_key(UserName="admin")["AccessKey"]
            iam.create_user(UserName="nobody")
            nobody = iam.create_access_key(UserName="nobody")["AccessKey"]
        except BaseException:
            proc.kill()
            raise
        return cls(proc, endpoint, Keys(admin["AccessKeyId"], admin["SecretAccessKey"]),
                   Keys(nobody["AccessKeyId"], nobody["SecretAccessKey"]))

    def client(self, keys: Keys | None = None):
        import boto3

        k = keys or self.admin
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", aws_access_key_id=k.access_key,
                            aws_secret_access_key=k.secret_key)

    def upload_dir(self, local: str | os.PathLike, bucket: str, prefix: str, pattern: str = "*") -> str:
        """Every file of `local` matching `pattern` under s3://bucket/prefix/ (the bucket made
        when missing); returns that URL."""
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for p in sorted(Path(local).glob(pattern)):
            if p.is_file():
                s3.upload_file(str(p), bucket, f"{prefix}/{p.name}")
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@dataclass
class Fault:
    kind: str  # "503", "reset" or "stall"
    times: int  # how many matching requests get it (then the rule is spent)
    match: str = ""  # a substring of "METHOD PATH RANGE" the request must contain ("" any ranged GET)


@dataclass
class FaultProxy:
    """See the module doc. `rules` are tried in order; each matching request spends one use."""

    upstream_port: int
    latency_s: float = 0.0
    stall_s: float = 5.0
    rules: list[Fault] = field(default_factory=list)
    connections: int = 0
    requests: list[str] = field(default_factory=list)  # "METHOD PATH RANGE", in order
    injected: list[str] = field(default_factory=list)  # "KIND METHOD PATH RANGE"

    def __post_init__(self):
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def reset_counts(self) -> None:
        with self._lock:
            self.connections, self.requests, self.injected = 0, [], []

    def ranged_gets(self) -> list[str]:
        return [r for r in self.requests if r.startswith("GET ") and "bytes=" in r]

    def whole_reads(self) -> list[str]:
        """The requests that are neither a ranged GET nor a listing: an object read whole (GCS's
        `alt=media` or S3's GET without a range), or anything else the reader should not send.
        gcsfs at times lists a shard's name as a folder (`?delimiter=/&prefix=...`) before
        opening it, in a worker whose listings cache missed it: a metadata call, not a read."""
        ranged = set(self.ranged_gets())
        return [r for r in self.requests if r not in ranged and "delimiter=" not in r]

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _fault_for(self, what: str) -> str | None:
        with self._lock:
            self.requests.append(what)
            if not (what.startswith("GET ") and "bytes=" in what):
                return None
            for rule in self.rules:
                if rule.times > 0 and rule.match in what:
                    rule.times -= 1
                    self.injected.append(f"{rule.kind} {what}")
                    return rule.kind
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=60)
        reader = client.makefile("rb")
        try:
            while True:
                line = reader.readline()
                if not line:
                    return
                method, path, _ = line.decode("latin-1").split(" ", 2)
                headers = []
                while (h := reader.readline()) not in (b"\r\n", b"\n", b""):
                    name, value = h.decode("latin-1").split(":", 1)
                    headers.append((name.strip(), value.strip()))
                lower = {k.lower(): v for k, v in headers}
                assert "chunked" not in lower.get("transfer-encoding", ""), "the proxy reads Content-Length bodies"
                if lower.get("expect", "").lower() == "100-continue":  # botocore's uploads wait for it
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    headers = [(k, v) for k, v in headers if k.lower() != "expect"]
                body = reader.read(int(lower.get("content-length", 0) or 0))
                fault = self._fault_for(f"{method} {path} {lower.get('range', '')}".strip())
                if self.latency_s:
                    time.sleep(self.latency_s)
                if fault == "503":
                    xml = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ServiceUnavailable</Code>"
                           b"<Message>Please reduce your request rate.</Message></Error>")
                    client.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/xml\r\n"
                                   + f"Content-Length: {len(xml)}\r\n\r\n".encode() + xml)
                    continue
                if fault == "stall":
                    time.sleep(self.stall_s)
                    _reset(client)
                    return
                try:
                    upstream.request(method, path, body=body or None, headers=dict(headers))
                    resp = upstream.getresponse()
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    # the server closed the kept-alive connection while it was idle: once more on a
                    # new one, as any proxy does (else the client would wait for its read timeout)
                    upstream.close()
                    upstream.request(method, path, body=body or None, headers=dict(headers))
                    resp = upstream.getresponse()
                data = resp.read()
                keep = ("transfer-encoding", "connection") + (() if method == "HEAD" else ("content-length",))
                head = f"HTTP/1.1 {resp.status} {resp.reason}\r\n" + "".join(
                    f"{k}: {v}\r\n" for k, v in resp.getheaders() if k.lower() not in keep)
                head += "\r\n" if method == "HEAD" else f"Content-Length: {len(data)}\r\n\r\n"
                if fault == "reset":  # the whole length promised, half of it sent, then a reset
                    client.sendall(head.encode("latin-1") + data[: len(data) // 2])
                    _reset(client)
                    return
                client.sendall(head.encode("latin-1") + data)
        except (OSError, ValueError):
            return
        finally:
            upstream.close()
            try:
                reader.close()  # the socket's file: while it is open, closing the socket keeps the connection
                client.close()
            except OSError:
                pass

    def close(self) -> None:
        self._sock.close()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP reset (RST), as a peer that dies or a middlebox that drops it does."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _RangeHandler(SimpleHTTPRequestHandler):
    """Static files with single byte ranges (`Range: bytes=a-b`), as web servers and CDNs serve
    them; the standard library's handler ignores Range."""

    protocol_version = "HTTP/1.1"  # keep-alive: the client's pool reuses connections

    def log_message(self, *args) -> None:  # quiet
        pass

    def send_head(self):
        rng = self.headers.get("Range", "")
        path = self.translate_path(self.path)
        if not rng.startswith("bytes=") or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        a, _, b = rng[len("bytes="):].partition("-")
        start, end = int(a), min(int(b) if b else size - 1, size - 1)
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.end_headers()
        self._left = end - start + 1
        return f

    def copyfile(self, source, outputfile):
        left = getattr(self, "_left", None)
        if left is None:
            return super().copyfile(source, outputfile)
        outputfile.write(source.read(left))
        self._left = None


def serve_directory(root: str | os.PathLike) -> tuple[ThreadingHTTPServer, str]:
    """An HTTP server of the files under `root` on a free port of 127.0.0.1, and its URL."""
    handler = lambda *a, **k: _RangeHandler(*a, directory=str(root), **k)  # noqa: E731
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True, name="range-http").start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"
