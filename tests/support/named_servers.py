"""HTTP servers on the host's loopback that answer every GET with their own name: a sandbox's
egress rules are checked by which of them it reaches (through the engine's proxy, as
host.sandbox.internal or 127.0.0.1 with the port)."""
from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator

from sandbox_kernel.api.local_engine import HOST_ALIAS

# Code for a cell: fetch(port) is what the sandbox gets from the host's server on that port (its
# name), "HTTP 403" when the egress proxy refuses (detail=True: with the proxy's reason), or the
# name of the error when the connection itself fails.
FETCH = f"""
import urllib.request, urllib.error
def fetch(port, detail=False):
    try:
        return urllib.request.urlopen(f"http://{HOST_ALIAS}:{{port}}/", timeout=10).read().decode()
    except urllib.error.HTTPError as exc:
        return f"HTTP {{exc.code}}: {{exc.read().decode().strip()}}" if detail else f"HTTP {{exc.code}}"
    except OSError as exc:
        return type(exc).__name__
"""


class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def named_servers(*names: str) -> Iterator[tuple[int, ...]]:
    """One server per name; their ports, in order."""
    started = []
    for name in names:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answer)
        server.name = name  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
    try:
        yield tuple(server.server_address[1] for server in started)
    finally:
        for server in started:
            server.shutdown()
