"""A real HTTP server on loopback for the unit tests of HTTP clients: one route function
``(method, path) -> (status, body)``; a str body goes out as text, anything else as JSON."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

Route = Callable[[str, str], tuple[int, object]]


class Loopback:
    """Serves ``route`` on 127.0.0.1 (a free port: ``url``) in a daemon thread until ``close``."""

    def __init__(self, route: Route) -> None:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _serve(self, method: str) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                status, body = route(method, self.path)
                text = isinstance(body, str)
                data = body.encode() if text else json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._serve("GET")

            def do_POST(self) -> None:
                self._serve("POST")

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


class BlindCluster:
    """Mixin for a unit test's fake ``Cluster``: no logs, no placement, no mode lines to show
    (what the nemesis and schedule runners never read), so a fake names only what it fakes."""

    def logs(self, service: str | None = None, tail: int | None = None) -> str:
        return ""

    def placement(self) -> list:
        return []

    def mode_lines(self) -> list[str]:
        return []
