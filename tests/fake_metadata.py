"""A fake cloud metadata server on 127.0.0.1 that speaks the three preemption-notice APIs:
AWS IMDSv2 (`PUT /latest/api/token`, `GET /latest/meta-data/spot/instance-action`), GCP
(`GET /computeMetadata/v1/instance/preempted`, header Metadata-Flavor: Google) and Azure Scheduled
Events (`GET /metadata/scheduledevents`, header Metadata: true). `post_notice(seconds)` posts a
notice on all three at once; each API also checks its required header, as the real ones do."""

from __future__ import annotations

import datetime
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psutil


class FakeMetadataServer:
    def __init__(self) -> None:
        self._deadline: datetime.datetime | None = None
        self._pids: set[int] | None = None
        self.requests: list[str] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes = b"") -> None:
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_PUT(self) -> None:  # noqa: N802 - http.server's naming
                server.requests.append(f"PUT {self.path}")
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, b"token-123")
                else:
                    self._send(400)

            def do_GET(self) -> None:  # noqa: N802
                server.requests.append(f"GET {self.path}")
                deadline = server._deadline if server._noticed(self.client_address[1]) else None
                if self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "token-123":
                        self._send(401)
                    elif deadline is None:
                        self._send(404)
                    else:
                        self._send(200, json.dumps({"action": "terminate",
                                                    "time": deadline.strftime("%Y-%m-%dT%H:%M:%SZ")}).encode())
                elif self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403)
                    else:
                        self._send(200, b"TRUE" if deadline else b"FALSE")
                elif self.path.startswith("/metadata/scheduledevents"):
                    if self.headers.get("Metadata") != "true":
                        self._send(400)
                    else:
                        events = [] if deadline is None else [{
                            "EventId": "1", "EventType": "Preempt", "ResourceType": "VirtualMachine",
                            "Resources": ["vm0"], "EventStatus": "Scheduled",
                            "NotBefore": deadline.strftime("%Y-%m-%dT%H:%M:%SZ")}]
                        self._send(200, json.dumps({"DocumentIncarnation": 1, "Events": events}).encode())
                else:
                    self._send(404)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def post_notice(self, seconds: float, pids: set[int] | None = None) -> None:
        """Post a notice, `seconds` ahead; only to clients in processes `pids`, if given (every
        worker on this machine polls the same server, where in a cloud each node has its own)."""
        self._pids = pids
        self._deadline = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(seconds=seconds)

    def _noticed(self, client_port: int) -> bool:
        if self._pids is None:
            return True
        server_port = self._server.server_address[1]
        return any(c.pid in self._pids for c in psutil.net_connections(kind="tcp")
                   if c.laddr and c.laddr.port == client_port and c.raddr and c.raddr.port == server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
