"""Input history for history_request, kept on the host like IPython's history database.

Frontends ask the kernel for earlier input: `jupyter console` preloads its Up-arrow history
with the tail, and clients can fetch a range or search. Each kernel process is one session;
cells are stored with their execution count in a private SQLite file in the state dir, so
history survives kernel restarts. The sandbox never sees this file.
"""

from __future__ import annotations

import fnmatch
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("sandbox_kernel.kernel.history")

Entry = tuple[int, int, str]  # (session, line number = execution count, source)


class History:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        # Kernels run in separate processes; SQLite's own locking keeps writers apart.
        self.db = sqlite3.connect(str(path), timeout=10, isolation_level=None)
        # Recorded on every cell, before it runs: with the default rollback journal each
        # record is a synced transaction (measured 1 to 20 ms on a busy disk, most of a
        # trivial cell). A write-ahead log synced only at checkpoints makes it ~20 µs; a
        # crash of the machine may lose the last few lines of history, nothing else.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.execute("CREATE TABLE IF NOT EXISTS sessions (session INTEGER PRIMARY KEY, started REAL)")
        self.db.execute("CREATE TABLE IF NOT EXISTS history (session INTEGER, line INTEGER, source TEXT, "
                        "PRIMARY KEY (session, line))")
        self.session = self.db.execute("INSERT INTO sessions (started) VALUES (?)", (time.time(),)).lastrowid

    def record(self, line: int, source: str) -> None:
        try:
            self.db.execute("INSERT OR REPLACE INTO history VALUES (?, ?, ?)", (self.session, line, source))
        except sqlite3.Error as exc:  # a locked or broken file must not fail the cell
            log.warning("input history not saved: %s", exc)

    def tail(self, n: int) -> list[Entry]:
        rows = self.db.execute("SELECT session, line, source FROM history "
                               "ORDER BY session DESC, line DESC LIMIT ?", (n,)).fetchall()
        return rows[::-1]

    def range(self, session: int, start: int, stop: int | None) -> list[Entry]:
        """Lines start <= line < stop of a session: 0 is this one, -1 the one before, and so on."""
        if session <= 0:
            session = self.session + session  # sessions are numbered in the order kernels started
        return self.db.execute(
            "SELECT session, line, source FROM history WHERE session = ? AND line >= ? AND line < ? "
            "ORDER BY line", (session, start, stop if stop is not None else 2**62)).fetchall()

    def search(self, pattern: str, n: int | None, unique: bool) -> list[Entry]:
        """Cells matching a glob pattern, oldest first; the last n of them if n is given."""
        rows = self.db.execute("SELECT session, line, source FROM history ORDER BY session, line").fetchall()
        matches = [row for row in rows if fnmatch.fnmatchcase(row[2], pattern)]
        if unique:
            latest = {row[2]: row for row in matches}  # the latest occurrence of each source
            matches = sorted(latest.values())
        return matches[-n:] if n else matches

    def reply(self, hist_access_type: str, output: bool = False, session: int | None = None,
              start: int | None = None, stop: int | None = None, n: int | None = None,
              pattern: str | None = None, unique: bool = False, **_: Any) -> list[tuple[Any, ...]]:
        """The history a history_request asks for. Outputs are not kept: with output=True each
        entry is (session, line, (source, None)), as IPython answers for a cell without output."""
        entries: list[Entry] = []
        if hist_access_type == "tail":
            entries = self.tail(n or 10)
        elif hist_access_type == "range":
            entries = self.range(session or 0, start or 1, stop)
        elif hist_access_type == "search":
            entries = self.search(pattern or "*", n, unique)
        return [(s, line, (source, None)) for s, line, source in entries] if output else entries


def open_history(path: Path) -> History | None:
    """The history in `path`, or None (history requests answer nothing) if it cannot be opened."""
    try:
        return History(path)
    except (OSError, sqlite3.Error) as exc:
        log.warning("no input history: %s", exc)
        return None
