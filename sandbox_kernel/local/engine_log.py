"""The engine's log file, bounded by size.

A kernel starts the engine with its stdout and stderr on `engine.log` in the state dir,
and the engine would append to it for as long as it runs: what a sandbox can make it log
(refused connections, say) must not fill the host's disk. So when the engine finds its
stderr is that file, its log lines go through a handler that, past MAX_BYTES, renames the
file to `engine.log.1` (dropping the one before) and starts a new one, and points stdout
and stderr at the new file too, so what is written around logging (a traceback at exit)
lands there as well. The log then never holds much more than twice MAX_BYTES. An engine
run in a terminal (`sandbox-kernel serve`) keeps logging to the terminal.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys
from pathlib import Path

MAX_BYTES = 16 * 2**20
BACKUPS = 1  # engine.log.1
FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


class RotatingEngineLog(logging.handlers.RotatingFileHandler):
    """A size-rotated log file that also holds the process's stdout and stderr."""

    def __init__(self, path: Path, max_bytes: int = MAX_BYTES) -> None:
        super().__init__(path, maxBytes=max_bytes, backupCount=BACKUPS, encoding="utf-8")
        self.setFormatter(logging.Formatter(FORMAT))
        self._hold_standard_streams()

    def doRollover(self) -> None:
        super().doRollover()
        self._hold_standard_streams()

    def _hold_standard_streams(self) -> None:
        if self.stream is None:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        for fd in (1, 2):
            os.dup2(self.stream.fileno(), fd)


def bound_if_redirected(path: Path, max_bytes: int = MAX_BYTES) -> bool:
    """Log to a size-rotated `path` instead of stderr, when stderr is that file (the engine
    was started in the background); whether it did."""
    try:
        same = os.path.samestat(os.fstat(2), os.stat(path))
    except OSError:
        return False
    if not same:
        return False
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stderr:
            root.removeHandler(handler)
    root.addHandler(RotatingEngineLog(path, max_bytes))
    return True
