"""The metrics endpoint: Prometheus' text format over HTTP, from a daemon thread of the agent.

Runs in: the agent.

Plain ``http.server`` from the standard library: one scrape every few seconds needs nothing more,
and the launcher gains no dependency.  ``GET /metrics`` returns :meth:`Registry.render`;
``GET /`` says where the metrics are.  The server binds 127.0.0.1 unless told otherwise
(``ELASTRUN_METRICS_HOST``), because the numbers describe the job and a scrape costs the agent
a little CPU: exposing them beyond the host is an operator's choice.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: Content type of Prometheus' text exposition format.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class MetricsServer:
    """Serves ``render()`` at ``http://host:port/metrics`` until :meth:`close`; port 0 picks a free one."""

    def __init__(self, render: Callable[[], str], host: str = "127.0.0.1", port: int = 0) -> None:
        handler = _make_handler(render)
        self._httpd = ThreadingHTTPServer((host, port), handler)
        self._httpd.daemon_threads = True
        self.host = host
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.5}, name="elastrun-metrics"
        )
        self._thread.daemon = True
        self._thread.start()

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port (returns within about half a second)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=2.0)


def _make_handler(render: Callable[[], str]) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "elastrun-metrics"

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._reply(200, render(), CONTENT_TYPE)
            elif path == "/":
                self._reply(200, "elastrun agent: metrics at /metrics\n", "text/plain; charset=utf-8")
            else:
                self._reply(404, f"not found: {path}; metrics are at /metrics\n", "text/plain; charset=utf-8")

        def _reply(self, code: int, text: str, content_type: str) -> None:
            body = text.encode("utf-8")
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - scrapes are not worth a line each
            return

    return Handler
