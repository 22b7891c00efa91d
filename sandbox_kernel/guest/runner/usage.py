"""CPU and memory of the runner and of the whole sandbox, from /proc: the usage op's answer."""
from __future__ import annotations

import os
import socket
import threading
import time


class UsageMeter:
    """CPU and memory of this daemon (with its children) and of the whole sandbox, for
    the kernel's usage_reply, read from /proc. CPU is a percentage since the previous
    sample (0 for the first, as psutil's cpu_percent)."""

    def __init__(self) -> None:
        self._last: tuple[float, float, int, int] | None = None  # time, our cpu s, busy and all ticks
        self._lock = threading.Lock()

    def sample(self) -> dict:
        ticks, page = os.sysconf("SC_CLK_TCK"), os.sysconf("SC_PAGE_SIZE")
        processes = _processes()
        ours = _descendants(os.getpid(), processes)
        cpu_seconds = sum(processes[pid][1] for pid in ours) / ticks
        busy, total = _cpu_ticks()
        now = time.monotonic()
        usage = {
            "hostname": socket.gethostname(), "pid": os.getpid(),
            "cpu_count": len(os.sched_getaffinity(0)),
            "kernel_memory": sum(processes[pid][2] for pid in ours) * page,
            "sandbox_processes_memory": sum(rss for _, _, rss in processes.values()) * page,
            "meminfo": _meminfo(),
        }
        with self._lock:
            last, self._last = self._last, (now, cpu_seconds, busy, total)
        usage["kernel_cpu"] = 0.0
        if last is not None and now > last[0]:
            usage["kernel_cpu"] = round(100.0 * max(cpu_seconds - last[1], 0.0) / (now - last[0]), 1)
            if total > last[3]:
                usage["host_cpu_percent"] = round(100.0 * (busy - last[2]) / (total - last[3]), 1)
        return usage


def _processes() -> dict:
    """pid: (parent pid, cpu ticks used, resident pages) of every process this sandbox shows."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % name) as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command: state, ppid, ... utime (12th), stime (13th), ... rss (22nd).
        found[int(name)] = (int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[21]))
    return found


def _descendants(root: int, processes: dict) -> list:
    children: dict = {}
    for pid, (parent, _, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    tree, pending = [], [root]
    while pending:
        pid = pending.pop()
        if pid in processes:
            tree.append(pid)
            pending.extend(children.get(pid, []))
    return tree


def _cpu_ticks() -> tuple[int, int]:
    """(busy, all) CPU ticks of the machine so far, from /proc/stat."""
    with open("/proc/stat") as stat:
        values = [int(value) for value in stat.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle and iowait
    return sum(values) - idle, sum(values)


def _meminfo() -> dict:
    """MemTotal, MemAvailable, MemFree, Active and Inactive in bytes."""
    wanted = {"MemTotal": "total", "MemAvailable": "available", "MemFree": "free",
              "Active": "active", "Inactive": "inactive"}
    found = {}
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            key, _, rest = line.partition(":")
            if key in wanted:
                found[wanted[key]] = int(rest.split()[0]) * 1024
    return found
