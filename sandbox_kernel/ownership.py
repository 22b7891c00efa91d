"""Which kernel process on this machine uses which sandbox, so `sandbox-kernel gc` can find
the sandboxes a crashed or killed kernel left behind (they would go on costing money).

A kernel claims each sandbox it creates, forks or attaches to, in a 0600 file
state_dir/owners/<sandbox id>.json listing the pids of the kernels using it, and releases
the claim when it destroys the sandbox or shuts down cleanly (whatever its shutdown
policy). A sandbox whose claimants are all gone (or are no longer sandbox kernels) is an
orphan. Sandboxes nobody on this machine claimed are never touched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .paths import state_dir, write_private

KERNEL_MARKER = b"sandbox_kernel.kernel"  # in the command line of every sandbox kernel


def _claims() -> Path:
    path = state_dir() / "owners"
    path.mkdir(mode=0o700, exist_ok=True)
    return path


def _owners(sandbox_id: str) -> list[int]:
    try:
        return [int(pid) for pid in json.loads((_claims() / f"{sandbox_id}.json").read_text())["pids"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []


def _write(sandbox_id: str, pids: list[int]) -> None:
    path = _claims() / f"{sandbox_id}.json"
    if pids:
        write_private(path, json.dumps({"pids": pids}))
    else:
        path.unlink(missing_ok=True)


def claim(sandbox_id: str) -> None:
    """This kernel uses the sandbox (several kernels may: attach)."""
    owners = _owners(sandbox_id)
    if os.getpid() not in owners:
        _write(sandbox_id, [*owners, os.getpid()])


def release(sandbox_id: str) -> None:
    """This kernel is done with the sandbox (destroyed it, or shut down cleanly)."""
    _write(sandbox_id, [pid for pid in _owners(sandbox_id) if pid != os.getpid()])


def kernel_alive(pid: int) -> bool:
    try:
        return KERNEL_MARKER in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def orphaned(sandbox_ids: list[str]) -> list[str]:
    """Those of sandbox_ids claimed on this machine only by kernels that no longer run."""
    return [sandbox_id for sandbox_id in sandbox_ids
            if (owners := _owners(sandbox_id)) and not any(kernel_alive(pid) for pid in owners)]


def forget(sandbox_id: str) -> None:
    _write(sandbox_id, [])
