"""Where sandbox-kernel keeps per-user state (engine token, sandboxes, hand-off files)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def state_dir() -> Path:
    """The per-user state directory, created 0700 on first use.

    SANDBOX_KERNEL_STATE_DIR overrides it (tests give each run its own engine that way).
    """
    explicit = os.environ.get("SANDBOX_KERNEL_STATE_DIR")
    if explicit:
        path = Path(explicit)
    else:
        base = os.environ.get("XDG_STATE_HOME") or os.path.join(Path.home(), ".local", "state")
        path = Path(base) / "sandbox-kernel"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def connection_file_argument(argv: list[str]) -> str | None:
    """The connection file a kernel's command line names (`-f FILE`), if it names one."""
    for index, arg in enumerate(argv):
        if arg == "-f" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith(("-f=", "--f=")):
            return arg.split("=", 1)[1]
    return None


def handoff_path(connection_file: str) -> Path:
    """Where a restarting kernel leaves its sandbox for its successor, which jupyter_client
    starts with the same connection file."""
    key = hashlib.sha256(str(Path(connection_file).resolve()).encode()).hexdigest()[:24]
    return state_dir() / "handoff" / f"{key}.json"


def write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read, atomically (readers never see half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)
