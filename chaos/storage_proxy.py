"""A fault-injecting HTTP proxy to put in front of an S3 endpoint.

Why: storage faults are the ones a training job meets most (throttling, 5xx, dropped connections,
slow uploads, revoked credentials) and the hardest to produce on demand. Point a client's
`endpoint_url` at this proxy and it forwards every request to the real endpoint, except those it
is told to break: answered with an S3 error, delayed, cut off without an answer, or refused for as
long as an outage lasts. Faults change at run time, are drawn from a seeded generator, and each is
logged and kept (`injected`) so a run's timeline can be reconstructed.

    with FaultyStorageProxy("http://127.0.0.1:5000") as proxy:
        proxy.set_faults(StorageFaults(error_rate=0.3, methods=frozenset({"PUT"})))
        ...  # s3fs.S3FileSystem(endpoint_url=proxy.url, ...)
"""

from __future__ import annotations

import argparse
import http.client
import logging
import random
import socket
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

_S3_CODES = {403: "AccessDenied", 500: "InternalError", 503: "SlowDown"}
_HOP_BY_HOP = {"connection", "keep-alive", "expect", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass(frozen=True)
class StorageFaults:
    """What to break. Rates are per matching request; `outage_status` refuses every matching one."""

    error_rate: float = 0.0
    error_status: int = 503
    latency_s: float = 0.0
    drop_rate: float = 0.0
    outage_status: int | None = None
    methods: frozenset[str] | None = None  # only these HTTP methods (None: all)
    path_contains: str | None = None  # only paths containing this (None: all)

    def matches(self, method: str, path: str) -> bool:
        return (self.methods is None or method in self.methods) and (
            self.path_contains is None or self.path_contains in path
        )


class FaultyStorageProxy:
    """A threaded reverse proxy to `upstream` that injects `StorageFaults`."""

    def __init__(self, upstream: str, host: str = "127.0.0.1", port: int = 0, seed: int = 0):
        target = urlsplit(upstream)
        self.upstream_host, self.upstream_port = target.hostname or "127.0.0.1", target.port or 80
        self._faults = StorageFaults()
        self._random = random.Random(seed)
        self._lock = threading.Lock()
        self.injected: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {"requests": 0, "faults": {}}
        self._server = ThreadingHTTPServer((host, port), self._handler_class())
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    # -- control ----------------------------------------------------------------------------------
    def start(self) -> "FaultyStorageProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="storage-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def set_faults(self, faults: StorageFaults) -> None:
        with self._lock:
            self._faults = faults
        logger.info("storage faults now %s", faults)

    def clear(self) -> None:
        self.set_faults(StorageFaults())

    def __enter__(self) -> "FaultyStorageProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the decision per request ---------------------------------------------------------------
    def _decide(self, method: str, path: str) -> tuple[str | None, float, int]:
        """(fault kind or None, latency, status) for one request."""
        with self._lock:
            faults = self._faults
            self.stats["requests"] += 1
            if not faults.matches(method, path):
                return None, 0.0, 0
            kind, status = None, 0
            if faults.outage_status is not None:
                kind, status = "outage", faults.outage_status
            elif self._random.random() < faults.drop_rate:
                kind = "drop"
            elif self._random.random() < faults.error_rate:
                kind, status = "error", faults.error_status
            if kind is not None:
                self.stats["faults"][kind] = self.stats["faults"].get(kind, 0) + 1
            if kind is not None or faults.latency_s:
                record = {"time": time.time(), "kind": kind or "latency", "method": method, "path": path,
                          "status": status or None, "latency_s": faults.latency_s}
                self.injected.append(record)
                logger.info("storage fault: %s", record)
            return kind, faults.latency_s, status

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
                logger.debug(format, *args)

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    chunks = []
                    while (size := int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)) > 0:
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length", 0) or 0))

            def _handle(self) -> None:
                body = self._body()
                kind, latency, status = proxy._decide(self.command, self.path)
                if latency:
                    time.sleep(latency)  # the injected fault itself: a slow endpoint
                if kind == "drop":
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                    return
                if kind is not None:
                    self._send_error(status)
                    return
                self._forward(body)

            def _send_error(self, status: int) -> None:
                code = _S3_CODES.get(status, str(status))
                payload = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                           f"<Message>injected by chaos.storage_proxy</Message></Error>").encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            def _forward(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower() or body:
                    headers["Content-Length"] = str(len(body))
                upstream = http.client.HTTPConnection(proxy.upstream_host, proxy.upstream_port, timeout=60)
                try:
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    response = upstream.getresponse()
                    payload = response.read()
                finally:
                    upstream.close()
                self.send_response(response.status, response.reason)
                for key, value in response.getheaders():
                    if key.lower() not in _HOP_BY_HOP and key.lower() != "content-length":
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(payload)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description="Fault-injecting proxy in front of an S3 endpoint.")
    parser.add_argument("--upstream", required=True, help="the S3 endpoint, e.g. http://127.0.0.1:5000")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--error-rate", type=float, default=0.0)
    parser.add_argument("--error-status", type=int, default=503)
    parser.add_argument("--latency-s", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0)
    parser.add_argument("--outage-status", type=int, default=None)
    parser.add_argument("--methods", default=None, help="comma-separated HTTP methods to break (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    proxy = FaultyStorageProxy(args.upstream, port=args.port, seed=args.seed)
    proxy.set_faults(StorageFaults(
        error_rate=args.error_rate, error_status=args.error_status, latency_s=args.latency_s,
        drop_rate=args.drop_rate, outage_status=args.outage_status,
        methods=frozenset(args.methods.upper().split(",")) if args.methods else None,
    ))
    logger.info("proxying %s -> %s:%d", proxy.url, proxy.upstream_host, proxy.upstream_port)
    proxy._server.serve_forever()


if __name__ == "__main__":
    main()
