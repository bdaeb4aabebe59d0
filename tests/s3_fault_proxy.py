"""An S3 fault injector in front of moto: ``python -m tests.s3_fault_proxy UPSTREAM``.

A plain HTTP proxy (its own process, for the same GIL reason as
`tests.moto_server`) that forwards every request to moto unchanged, except:

* with probability ``--unavailable``, it answers ``503 SlowDown`` without
  forwarding (S3's throttling answer; the request had no effect);
* with probability ``--ambiguous`` (always, if its path contains
  ``--ambiguous-always``), a PUT of a Delta log entry (``_delta_log/*.json``)
  is forwarded, applied by moto, and then answered ``500 InternalError``:
  the commit landed but the writer is told it failed.
  Real S3 does this when a request times out after the write; the writer's
  retry of the conditional put then finds its own entry there (412).

It prints ``PORT <n>`` once listening, answers ``GET /__faults__`` with the
counts of what it injected (and the paths of the ambiguous PUTs), and stops
when its stdin closes.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}
_ERROR = "<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{message}</Message></Error>"


class _Faults:
    def __init__(self, seed: int, unavailable: float, ambiguous: float, ambiguous_always: str | None) -> None:
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.unavailable = unavailable
        self.ambiguous = ambiguous
        self.ambiguous_always = ambiguous_always
        self.counts: dict[str, object] = {"requests": 0, "unavailable": 0, "ambiguous": 0, "log_puts": 0}
        self.ambiguous_paths: list[str] = []

    def draw(self, kind: str, probability: float) -> bool:
        with self._lock:
            hit = self._random.random() < probability
            if hit:
                self.counts[kind] += 1
            return hit

    def count(self, kind: str) -> None:
        with self._lock:
            self.counts[kind] += 1

    def make_ambiguous(self, path: str) -> bool:
        forced = self.ambiguous_always is not None and self.ambiguous_always in path
        if not (forced or self.draw("ambiguous", self.ambiguous)):
            return False
        with self._lock:
            if forced:
                self.counts["ambiguous"] += 1
            self.ambiguous_paths.append(path)
        return True

    def report(self) -> bytes:
        with self._lock:
            return json.dumps({**self.counts, "ambiguous_paths": self.ambiguous_paths}).encode()


def _handler(upstream: str, faults: _Faults) -> type[BaseHTTPRequestHandler]:
    target = urlsplit(upstream)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:  # one line per request drowns test output
            pass

        def _body(self) -> bytes:
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                chunks = []
                while True:
                    size = int(self.rfile.readline().split(b";")[0], 16)
                    if size == 0:
                        while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                            pass  # trailers
                        return b"".join(chunks)
                    chunks.append(self.rfile.read(size))
                    self.rfile.readline()
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _reply(self, status: int, body: bytes, headers: list[tuple[str, str]] = ()) -> None:
            self.send_response(status)
            for name, value in headers:
                # A HEAD's answer has no body but the object's length (a reader sizes a file by it).
                if name.lower() not in _HOP_BY_HOP and (name.lower() != "content-length" or self.command == "HEAD"):
                    self.send_header(name, value)
            if self.command != "HEAD" or not any(name.lower() == "content-length" for name, _ in headers):
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            body = _ERROR.format(code=code, message=message).encode()
            self._reply(status, body, [("Content-Type", "application/xml")])

        def _proxy(self) -> None:
            try:
                self._forward()
            except (BrokenPipeError, ConnectionResetError):
                # The client hung up (a reader that had what it needed, or a
                # process that exited): nothing to answer.
                self.close_connection = True

        def _forward(self) -> None:
            body = self._body()
            if self.path == "/__faults__":
                self._reply(200, faults.report(), [("Content-Type", "application/json")])
                return
            faults.count("requests")
            if faults.draw("unavailable", faults.unavailable):
                self._error(503, "SlowDown", "Please reduce your request rate (injected).")
                return
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
            headers["Content-Length"] = str(len(body))
            connection = http.client.HTTPConnection(target.hostname, target.port, timeout=120)
            try:
                connection.request(self.command, self.path, body=body, headers=headers)
                response = connection.getresponse()
                payload = response.read()
            finally:
                connection.close()
            is_log_put = self.command == "PUT" and "/_delta_log/" in self.path and self.path.split("?")[0].endswith(".json")
            if is_log_put:
                faults.count("log_puts")
            if is_log_put and response.status == 200 and faults.make_ambiguous(self.path):
                self._error(500, "InternalError", "We encountered an internal error. Please try again (injected).")
                return
            self._reply(response.status, payload, response.getheaders())

        do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _proxy

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("upstream", help="moto's endpoint, e.g. http://127.0.0.1:5000")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--unavailable", type=float, default=0.0, help="share of requests answered 503")
    parser.add_argument("--ambiguous", type=float, default=0.0, help="share of log-entry PUTs applied, then answered 500")
    parser.add_argument("--ambiguous-always", metavar="SUBSTRING", help="log-entry PUTs whose path has this: always so")
    args = parser.parse_args()
    faults = _Faults(args.seed, args.unavailable, args.ambiguous, args.ambiguous_always)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(args.upstream, faults))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"PORT {server.server_address[1]}", flush=True)
    sys.stdin.read()  # until the parent closes the pipe or exits
    server.shutdown()


if __name__ == "__main__":
    main()
