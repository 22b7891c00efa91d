"""Forking the runner daemon into another sandbox: the one-shot op ``fork``.

Part of the runner's bundle (stdlib-only, Python 3.8+); its words are protocol.py's
("Following a fork"). ``{"op": "fork", "join_pid": N | null, "dir": str | null, "env": {...}}`` forks the
daemon with os.fork(). The child carries the user's live interpreter state, joins the
namespaces of process ``join_pid`` (a new sandbox prepared by someone else: the local
engine's agent) and/or serves at ``dir``, and becomes an independent daemon; the parent
answers ``{"ok": true, "child_pid": P}`` once the child is ready. With
``SANDBOX_FORKABLE_DIR`` set, every daemon registers itself there as ``<pid>.json`` so the
sandbox's agent can ask it to fork along.

This module holds the process side of a fork: checking the request, forking with the
daemon's locks held, the parent's wait for the child's report, and the child's move into
the new sandbox (namespaces, capabilities, open files, stale files of the parent). What
the daemon re-creates of its own state in the child (cells, output threads, the socket)
is the daemon's: it offers these to a fork (see daemon.Daemon):

    daemon.state_dir, socket_path, ready_path, registration_path
    daemon.fork_locks() -> [(acquire, release), ...]   taken in this order around os.fork()
    daemon.leave_parent()          child: drop the parent's connections and server socket
    daemon.set_state_dir(path)     child: serve at another directory
    daemon.take_over()             child: re-create threads, locks and cells; start serving
    daemon.serve_cells()           child: run cells forever (never returns)
    daemon.log(text)               the daemon's log
"""
from __future__ import annotations

import json
import os
import platform
import select
import signal
import threading
import time
import warnings

from .. import protocol

FORK_READY_TIMEOUT = 30.0  # seconds a forked child has to report that it serves
# Joined in this order: the user namespace first grants the capabilities for the others.
FORK_NAMESPACES = ("user", "mnt", "uts", "ipc", "net")
CAPABILITY_VERSION_3 = 0x20080522  # _LINUX_CAPABILITY_VERSION_3, for capset()

_one_at_a_time = threading.Lock()


def fork(daemon, request: dict) -> dict:
    """Fork `daemon` into a new sandbox; answer once the child serves, or failed.

    Allowed at any time (the engine pauses the sandbox mid-anything): a cell that is
    running or queued stays with the parent; the child ends it with a ForkError for its
    clients. Runs in a socket thread of the parent; the child runs nothing else.
    """
    join_pid, new_dir, env = _checked(request)
    with _one_at_a_time:
        read_fd, write_fd = os.pipe()
        try:
            pid = _fork_consistently(daemon)
        except BaseException:
            os.close(read_fd)
            os.close(write_fd)
            raise
        if pid == 0:
            os.close(read_fd)
            _become_fork(daemon, write_fd, join_pid, new_dir, env)  # never returns
        os.close(write_fd)
        return _await_fork(pid, read_fd)


def _checked(request: dict) -> tuple:
    """(join_pid, new_dir, env) of a fork request, or ValueError saying what is wrong."""
    join_pid = request.get(protocol.JOIN_PID)
    if join_pid is not None and (not isinstance(join_pid, int) or isinstance(join_pid, bool) or join_pid <= 0):
        raise ValueError("join_pid must be a pid or null")
    new_dir = request.get(protocol.FORK_DIR)
    if new_dir is not None and (not isinstance(new_dir, str) or not new_dir):
        raise ValueError("dir must be a path or null")
    if join_pid is None and new_dir is None:
        raise ValueError("fork needs join_pid or dir: the child cannot serve at this daemon's DIR")
    env = request.get(protocol.FORK_ENV) or {}  # what the local agent sends along for the new sandbox
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError("env must map strings to strings")
    return join_pid, os.path.abspath(new_dir) if new_dir is not None else None, env


def _fork_consistently(daemon) -> int:
    """os.fork() holding the daemon's locks, so that no other thread is half-way through
    changing what they protect (the child replaces them all)."""
    releases = []
    try:
        for acquire, release in daemon.fork_locks():
            acquire()
            releases.append(release)
        with warnings.catch_warnings():
            # 3.12+ warns that the process has threads: written to sys.stderr, that
            # would need the router's lock, which this thread holds.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
    except BaseException:
        for release in reversed(releases):
            release()
        raise
    if pid != 0:
        for release in reversed(releases):
            release()
    return pid


def _await_fork(pid: int, read_fd: int) -> dict:
    """Parent: wait for the child's one-line report; never leave a half-born child."""
    deadline = time.monotonic() + FORK_READY_TIMEOUT
    poller = select.poll()
    poller.register(read_fd, select.POLLIN)
    data = b""
    try:
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            if poller.poll(min(remaining, 1.0) * 1000):
                chunk = os.read(read_fd, 4096)
                if not chunk:
                    break
                data += chunk
    finally:
        os.close(read_fd)
    try:
        report = json.loads(data.split(b"\n", 1)[0]) if b"\n" in data else None
    except ValueError:
        report = None
    if isinstance(report, dict) and report.get("ok") is True:
        threading.Thread(target=_reap, args=(pid,), name="reap-%d" % pid, daemon=True).start()
        return {"ok": True, protocol.CHILD_PID: pid}
    if isinstance(report, dict) and report.get("error"):
        error = str(report["error"])
    elif b"\n" not in data and time.monotonic() >= deadline:
        error = "the forked child did not get ready within %gs" % FORK_READY_TIMEOUT
    else:
        error = "the forked child exited before it was ready"
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    _reap(pid)
    return {"ok": False, "error": error}


def _become_fork(daemon, ready_fd: int, join_pid: int | None, new_dir: str | None, env: dict) -> None:
    """Child: set up, report to the parent, then be the daemon. Never returns
    (this thread's stack is the parent's socket handler's)."""
    try:
        try:
            _setup_fork(daemon, join_pid, new_dir, env)
        except BaseException as exc:
            _report(ready_fd, {"ok": False, "error": "%s: %s" % (type(exc).__name__, exc)})
            os._exit(1)
        _report(ready_fd, {"ok": True})
        daemon.serve_cells()
    except BaseException:
        try:
            import traceback

            daemon.log("the forked daemon failed:\n" + traceback.format_exc())
        except BaseException:
            pass
    finally:
        os._exit(1)


def _report(ready_fd: int, report: dict) -> None:
    with os.fdopen(ready_fd, "wb") as pipe:  # closes the fd: the parent reads to its end
        pipe.write(json.dumps(report).encode() + b"\n")


def _setup_fork(daemon, join_pid: int | None, new_dir: str | None, env: dict) -> None:
    """Child: move into the new sandbox, then let the daemon re-create its own state.

    Single-threaded until the daemon's threads start again (joining a user namespace
    requires it). Python made this thread the main thread, which gets the signals.
    """
    global _one_at_a_time
    _one_at_a_time = threading.Lock()  # held by the parent's thread, which the child lacks
    daemon.leave_parent()
    parent_dir = _stat_or_none(daemon.state_dir)
    parent_registration = daemon.registration_path
    registration_dir = _stat_or_none(os.path.dirname(parent_registration)) if parent_registration else None
    daemon.registration_path = None

    if join_pid is not None:
        _join_namespaces(join_pid)
        if hasattr(platform, "_uname_cache"):
            platform._uname_cache = None  # the hostname may have changed
    os.environ.update(env)
    if new_dir is not None:
        daemon.set_state_dir(new_dir)
    if _same_file(parent_dir, _stat_or_none(daemon.state_dir)):
        raise RuntimeError("%s is the original daemon's own directory here; fork with a dir" % daemon.state_dir)
    # After joining: stale copies of the parent's files (the preparer copied them).
    _remove_if_exists(daemon.socket_path)
    _remove_if_exists(daemon.ready_path)
    if parent_registration and not _same_file(registration_dir,
                                              _stat_or_none(os.path.dirname(parent_registration))):
        _remove_if_exists(parent_registration)
    daemon.take_over()


def _open_regular_files() -> list:
    """(fd, path, flags, offset) of every open regular file, read before leaving the
    source sandbox's mount namespace."""
    import stat

    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            path = os.readlink("/proc/self/fd/%d" % fd)
            if not stat.S_ISREG(os.fstat(fd).st_mode) or not path.startswith("/") or path.endswith(" (deleted)"):
                continue
            with open("/proc/self/fdinfo/%d" % fd) as info:
                flags = next(int(line.split()[1], 8) for line in info if line.startswith("flags:"))
            found.append((fd, path, flags, os.lseek(fd, 0, os.SEEK_CUR)))
        except (OSError, StopIteration, ValueError):
            continue
    return found


def _reopen_in_this_mount_namespace(open_files: list) -> None:
    """Point inherited file descriptors at the new sandbox's copy of their file.

    A descriptor names an inode, not a path: without this, a file object the user
    opened before the fork would keep writing into the original sandbox's file. Files
    both sandboxes share read-only (/usr, the Python environment) stay as they are.
    """
    for fd, path, flags, offset in open_files:
        try:
            fresh = os.open(path, flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC | os.O_CLOEXEC))
        except OSError:
            continue  # not in the copy (e.g. a deleted or unreachable file): keep the original
        try:
            if _same_file(os.fstat(fresh), os.fstat(fd)):
                continue
            os.lseek(fresh, offset, os.SEEK_SET)
            os.dup2(fresh, fd, inheritable=not flags & os.O_CLOEXEC)
        finally:
            os.close(fresh)


def _join_namespaces(pid: int) -> None:
    """setns() into pid's namespaces (FORK_NAMESPACES order), skipping those we are in.

    All are opened first: once in the new mount namespace, /proc may be another one.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)  # the interpreter's libc (os.setns is 3.12+)
    try:
        cwd = os.getcwd()
    except OSError:
        cwd = "/"
    targets = []
    open_files = _open_regular_files()
    try:
        for name in FORK_NAMESPACES:
            path = "/proc/%d/ns/%s" % (pid, name)
            fd = os.open(path, os.O_RDONLY)
            targets.append((name, fd))
            if _same_file(os.fstat(fd), _stat_or_none("/proc/self/ns/" + name)):
                targets[-1] = (name, -1)  # already there (joining one's own user namespace fails)
                os.close(fd)
        for name, fd in targets:
            if fd < 0:
                continue
            if libc.setns(fd, 0) != 0:
                error = ctypes.get_errno()
                raise OSError(error, "setns to the %s namespace of pid %d: %s" % (name, pid, os.strerror(error)))
            if name == "mnt":  # setns reset the root and cwd
                try:
                    os.chdir(cwd)
                except OSError:
                    os.chdir("/")
                _reopen_in_this_mount_namespace(open_files)
        _drop_capabilities(libc)
    finally:
        for _, fd in targets:
            if fd >= 0:
                os.close(fd)


def _drop_capabilities(libc) -> None:
    """Give up the capabilities that joining the fork's user namespace granted.

    setns() into a user namespace gives the caller every capability in it. Cell code of
    the forked runner must not keep them: it could remount the fork's read-only agent
    directory and impersonate its agent. Our uid is not 0 there, so nothing that is
    executed later gets them back. Capabilities are per thread; a process that may
    setns() into a user namespace has only one.
    """
    import ctypes

    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)  # this thread
    no_capabilities = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable (x2 words)
    if libc.capset(header, no_capabilities) != 0:
        error = ctypes.get_errno()
        raise OSError(error, "dropping capabilities in the fork: %s" % os.strerror(error))


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def _stat_or_none(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _same_file(first: os.stat_result | None, second: os.stat_result | None) -> bool:
    return first is not None and second is not None and (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino)


def _remove_if_exists(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
