"""The kernel's usage_reply (JupyterLab's kernel usage panel): the sandbox's CPU and memory.

The runner samples them inside the sandbox (runner.UsageMeter, the `usage` op); this turns a
sample into the fields ipykernel's usage_reply has, so the panel shows the sandbox and not
the kernel's own process on the host.
"""

from __future__ import annotations

import math
from typing import Any


def usage_reply(sample: dict[str, Any], memory_limit: int) -> dict[str, Any]:
    """ipykernel's usage_reply fields from the runner's sample (runner.UsageMeter). The
    sandbox's memory is its shape's; where that is less than the machine it runs on shows
    (a local sandbox sees the host's /proc/meminfo), what its processes hold is what it uses.
    Only numbers are taken: the sample comes from the sandbox."""
    def number(value: Any) -> float | None:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value >= 0
        return value if ok else None

    reply: dict[str, Any] = {"hostname": str(sample.get("hostname", ""))[:256]}
    for field in ("pid", "cpu_count", "kernel_cpu", "kernel_memory", "host_cpu_percent"):
        if number(sample.get(field)) is not None:
            reply[field] = sample[field]
    meminfo = sample.get("meminfo") if isinstance(sample.get("meminfo"), dict) else {}
    machine, available = number(meminfo.get("total")), number(meminfo.get("available"))
    if machine is None or available is None:
        return reply
    if memory_limit and memory_limit < machine:
        total, used = memory_limit, min(number(sample.get("sandbox_processes_memory")) or 0, memory_limit)
    else:
        total, used = machine, max(machine - available, 0)
    reply["host_virtual_memory"] = {"total": total, "available": total - used, "used": used,
                                    "free": total - used, "percent": round(100 * used / total, 1) if total else 0.0}
    return reply
