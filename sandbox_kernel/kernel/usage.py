"""The kernel's usage_reply (JupyterLab's kernel usage panel): the sandbox's CPU and memory.

The runner samples them inside the sandbox (runner.UsageMeter, the `usage` op); this turns a
sample into the fields ipykernel's usage_reply has, so the panel shows the sandbox and not
the kernel's own process on the host.

Every reply has every field the panel (jupyter-resource-usage) reads, from the first one: it
reads `host_virtual_memory.active` unguarded, so one reply without it breaks the panel for
the page's life. A value not known (yet) is null, never a made-up number. While there is no
sample to give (the sandbox is starting, or did not answer), the reply also carries a
`reason`, as jupyter-resource-usage's own server does: the panel then shows "Loading…" (or
the reason) instead of reading the nulls.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.usage")

# The fields of psutil's virtual_memory() that ipykernel sends on Linux and the panel shows
# (it also shows macOS's `wired`, which Linux has not, as ipykernel on Linux does not send it).
MEMORY_FIELDS = ("total", "available", "percent", "used", "free", "active", "inactive")
LOADING = "loading"  # the panel's own word for "no numbers yet": it shows "Loading…"
USAGE_WAIT = 5.0  # seconds a usage_request waits for the sandbox's answer


def unknown_usage(reason: str, **details: Any) -> dict[str, Any]:
    """A reply without a sample: every field, null, and why (see the module's docstring)."""
    return {"hostname": "", "pid": None, "cpu_count": None, "kernel_cpu": None, "kernel_memory": None,
            "host_cpu_percent": None, "host_virtual_memory": dict.fromkeys(MEMORY_FIELDS),
            "reason": reason, **details}


def _number(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
    return value if ok else None


def usage_reply(sample: dict[str, Any], memory_limit: int) -> dict[str, Any]:
    """ipykernel's usage_reply fields from the runner's sample (runner.UsageMeter). The
    sandbox's memory is its shape's; where that is less than the machine it runs on shows
    (a local sandbox sees the host's /proc/meminfo), what its processes hold is what it uses,
    and the machine's active/inactive counts say nothing about it (null). Only numbers are
    taken: the sample comes from the sandbox."""
    reply: dict[str, Any] = {"hostname": str(sample.get("hostname", ""))[:256]}
    for field in ("pid", "cpu_count", "kernel_cpu", "kernel_memory", "host_cpu_percent"):
        reply[field] = _number(sample.get(field))  # host_cpu_percent: null until a second sample
    meminfo = sample.get("meminfo") if isinstance(sample.get("meminfo"), dict) else {}
    memory: dict[str, Any] = dict.fromkeys(MEMORY_FIELDS)
    reply["host_virtual_memory"] = memory
    machine, available = _number(meminfo.get("total")), _number(meminfo.get("available"))
    if machine is None or available is None:
        return reply
    if memory_limit and memory_limit < machine:
        total, used = memory_limit, min(_number(sample.get("sandbox_processes_memory")) or 0, memory_limit)
    else:
        total, used = machine, max(machine - available, 0)
        memory.update(active=_number(meminfo.get("active")), inactive=_number(meminfo.get("inactive")))
    memory.update(total=total, available=total - used, used=used, free=total - used,
                  percent=round(100 * used / total, 1) if total else 0.0)
    return reply


class UsageReporter:
    """Answers usage_request from the sandbox's sample."""

    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        self.memory_limits: dict[str, int] = {}  # bytes, per sandbox id (its shape's memory)

    async def request(self, stream, ident, parent):  # type: ignore[no-untyped-def]
        """JupyterLab's kernel usage panel: the sandbox's CPU and memory (not this process's),
        in the fields of ipykernel's usage_reply; without a sample, the same fields (null) and
        the reason (unknown_usage)."""
        try:
            content = await self.kernel.on_main_loop(asyncio.wait_for(self._sandbox_usage(), USAGE_WAIT))
        except asyncio.TimeoutError:
            content = unknown_usage("timeout", timeout_ms=int(USAGE_WAIT * 1000))  # the panel's word for it
        except Exception as exc:
            log.warning("usage: %s", exc)
            content = unknown_usage("the sandbox did not answer")
        self.kernel.session.send(stream, "usage_reply", content, parent, ident=ident)

    async def _sandbox_usage(self) -> dict[str, Any]:
        boot, sandbox = self.kernel.boot, self.kernel.sandbox
        if not boot.ready():
            return unknown_usage("no sandbox: it did not start" if boot.failed() else LOADING)
        assert sandbox is not None
        sample = await sandbox.runner_request({protocol.OP: protocol.USAGE})
        sandbox_id = sandbox.sandbox_id or ""
        if sandbox_id not in self.memory_limits:
            self.memory_limits[sandbox_id] = ((await sandbox.view()).mem_mib or 0) * 2**20
        return usage_reply(sample, self.memory_limits[sandbox_id])
