"""A PEP 503 simple package index with one tiny wheel, built on the spot and served on the
host's loopback, so install tests need no internet. A sandbox reaches it by the host
alias (its own 127.0.0.1 is its own loopback); plain http, so pip is told to trust it."""

from __future__ import annotations

import base64
import contextlib
import functools
import hashlib
import http.server
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sandbox_kernel.api.local_engine import HOST_ALIAS

PACKAGE = "hello-sandbox"


@contextlib.contextmanager
def serving_index(root: Path, package: str = PACKAGE) -> Iterator[str]:
    """Serve an index holding `package` 1.0 from root; yields its URL (…/simple)."""
    wheel = build_wheel(root / "files", package)
    project = root / "simple" / package
    project.mkdir(parents=True)
    (project / "index.html").write_text(f'<a href="/files/{wheel.name}">{wheel.name}</a>\n')
    with serving(root) as port:
        yield f"http://{HOST_ALIAS}:{port}/simple"


def build_wheel(directory: Path, package: str = PACKAGE) -> Path:
    """A pure-Python wheel for `package` 1.0, with a correct RECORD."""
    module, dist_info = package.replace("-", "_"), f"{package.replace('-', '_')}-1.0.dist-info"
    files = {
        f"{module}/__init__.py": b"GREETING = 'installed from the host index'\n",
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: 1.0\n".encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [f"{name},sha256={record_hash(data)},{len(data)}" for name, data in files.items()]
    files[f"{dist_info}/RECORD"] = ("\n".join(record + [f"{dist_info}/RECORD,,"]) + "\n").encode()
    directory.mkdir(parents=True)
    path = directory / f"{module}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return path


def record_hash(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@contextlib.contextmanager
def serving(root: Path) -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(QuietHandler, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
