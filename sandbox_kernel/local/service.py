"""Running the local engine as a service, and finding (or starting) it from a kernel.

One engine per state directory, for its whole life (engine_lock.py). It listens on a
unix socket (state_dir/engine.sock, 0600) and on a random loopback port, and writes where
in state_dir/engine.json.

An engine serves one Python environment: its sandboxes see the engine's own environment
(read-only), so a package installed in another one would never reach them. The first
environment to use a state dir owns its engine (state_dir/environment.json says which);
every other environment's engine lives in state_dir/engines/<name>-<hash> (engine_dir).
A kernel, and `sandbox-kernel ls/rm/gc/serve`, reach the engine of the environment they
run in. Its token lives in state_dir/token (0600); every route but the
public ones needs it in `X-Api-Key`, exactly as CreateOS needs its key. An engine started
on demand exits after an idle period with no sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import http.client
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

import httpx

from sandbox_kernel.api.kept_connections import KeptConnections
from sandbox_kernel.paths import write_private
from sandbox_kernel.local.engine_log import bound_if_redirected
from sandbox_kernel.local.engine_lock import EngineLock, serving_engine

log = logging.getLogger("sandbox_kernel.service")

ENGINE_FILE = "engine.json"
TOKEN_FILE = "token"
SOCKET_FILE = "engine.sock"
LOG_FILE = "engine.log"  # size-rotated by the engine itself (engine_log.py)
ENVIRONMENT_FILE = "environment.json"  # the Python environment this dir's engine serves
ENGINES_DIR = "engines"  # the engines of the other environments, one dir each
START_TIMEOUT = 30.0  # for a new engine to take the state dir's lock
ENGINE_WAIT = 60.0  # for a live engine to answer, before a kernel gives up (it never starts a second)
# How long an engine that broke a connection is watched for signs that it is dying (its
# process gone, or its socket taking no connection), before it is taken for a live engine
# that dropped the connection.
DYING_GRACE = 0.5
SUN_PATH_MAX = 107
KEEP_ALIVE_SECONDS = 65


@dataclass(frozen=True)
class EngineEndpoint:
    """How to reach a running engine: loopback URL, unix socket (if usable) and token."""

    url: str
    socket: str | None
    token: str
    pid: int


def load_or_create_token(state_dir: Path) -> str:
    path = state_dir / TOKEN_FILE
    with contextlib.suppress(FileNotFoundError):
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    write_private(path, token)
    return token


@dataclass(frozen=True)
class PythonEnvironment:
    """A Python environment, as its engine's sandboxes see it: its prefix (resolved: two
    spellings of one venv are one environment) and the interpreter that runs it."""

    prefix: str
    python: str

    @classmethod
    def current(cls) -> PythonEnvironment:
        return cls(prefix=os.path.realpath(sys.prefix), python=sys.executable)

    @property
    def key(self) -> str:
        """Its engine's dir name under state_dir/engines: readable, and unique per prefix."""
        digest = hashlib.sha256(self.prefix.encode()).hexdigest()[:10]
        name = "".join(c if c.isalnum() or c in "._-" else "_" for c in Path(self.prefix).name)[:24]
        return f"{name}-{digest}"


class OtherEnvironment(RuntimeError):
    """The dir's engine serves another Python environment than this process's."""


def engine_dir(state_dir: Path, environment: PythonEnvironment | None = None) -> Path:
    """The dir of the engine that serves `environment` (this process's by default):
    state_dir itself if that environment owns it (or is the first to ask), else
    state_dir/engines/<key>. An environment's dir never changes, so its sandboxes stay
    where its kernels and `sandbox-kernel ls` look for them."""
    environment = environment or PythonEnvironment.current()
    if environment_of(state_dir, claim=environment) == environment.prefix:
        return state_dir
    own = state_dir / ENGINES_DIR / environment.key
    environment_of(own, claim=environment)
    return own


def environment_of(directory: Path, claim: PythonEnvironment | None = None) -> str | None:
    """The prefix of the environment whose engine `directory` holds; an unclaimed dir is
    claimed for `claim` (atomically: of two environments asking at once, one wins)."""
    path = directory / ENVIRONMENT_FILE
    with contextlib.suppress(FileNotFoundError, ValueError, KeyError, TypeError):
        return str(json.loads(path.read_text())["prefix"])
    if claim is None:
        return None
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    # An engine of an earlier version records no environment: the one it runs in owns the dir.
    owner = _unrecorded_engine_environment(directory) or claim
    tmp = directory / f"{ENVIRONMENT_FILE}.{secrets.token_hex(8)}.tmp"  # one per claim, threads included
    write_private(tmp, json.dumps({"prefix": owner.prefix, "python": owner.python}))
    try:
        os.link(tmp, path)  # fails if another claim came first: its answer stands
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return environment_of(directory)


def _unrecorded_engine_environment(directory: Path) -> PythonEnvironment | None:
    """The environment of a live engine serving `directory` that recorded none (started by
    an earlier version), from the interpreter it was started with (`python -m sandbox_kernel
    serve`: the interpreter's dir is the environment's bin/)."""
    serving = serving_engine(directory)
    if serving is None or serving.pid == os.getpid():
        return None
    try:
        python = Path(f"/proc/{serving.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, UnicodeDecodeError):
        return None
    if not os.path.isabs(python):
        return None
    return PythonEnvironment(prefix=os.path.realpath(os.path.dirname(os.path.dirname(python))), python=python)


def other_engines(state_dir: Path) -> list[tuple[PythonEnvironment, dict[str, str | None]]]:
    """The engines of state_dir that serve other Python environments than this one, each
    with its live sandboxes (id -> name, from their records): a listing says where they are,
    and gc keeps the ownership records of them."""
    from sandbox_kernel.local.registry import load

    me = PythonEnvironment.current()
    found = []
    for directory in [state_dir, *sorted((state_dir / ENGINES_DIR).glob("*"))]:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = json.loads((directory / ENVIRONMENT_FILE).read_text())
            if data["prefix"] != me.prefix:
                sandboxes = {record["id"]: record.get("name") for record in load(directory / "sandboxes")}
                found.append((PythonEnvironment(prefix=data["prefix"], python=data["python"]), sandboxes))
    return found


def read_endpoint(state_dir: Path) -> EngineEndpoint | None:
    """The engine serving state_dir (engine_lock.py), if it answers /healthz."""
    try:
        info = json.loads((state_dir / ENGINE_FILE).read_text())
        token = (state_dir / TOKEN_FILE).read_text().strip()
    except (FileNotFoundError, ValueError):
        return None
    serving = serving_engine(state_dir)
    if serving is None or info.get("pid") != serving.pid:  # an address left by an engine now gone
        return None
    endpoint = EngineEndpoint(url=info["url"], socket=info.get("socket"), token=token,
                              pid=serving.pid)
    # The standard library's client: httpx's would bring httpcore, h11 and anyio into the
    # kernel's process for this one request (~30 ms of its start's CPU); its own requests
    # to the engine go over kept_connections.py.
    where = urlsplit(endpoint.url)
    connection = http.client.HTTPConnection(where.hostname or "127.0.0.1", where.port, timeout=2.0)
    try:
        connection.request("GET", "/healthz")
        healthy = connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()
    return endpoint if healthy else None


def ensure_engine(state_dir: Path, idle_timeout: float = 600.0) -> EngineEndpoint:
    """Return the engine of state_dir that serves this Python environment (engine_dir),
    starting one in the background if none lives.

    An engine that is alive (engine_lock.py) but does not answer yet (stopped, busy,
    taking sandboxes over) is waited for, never replaced, up to ENGINE_WAIT: a second
    engine would take the first one's sandboxes from under it.
    """
    state_dir = engine_dir(state_dir)
    deadline = time.monotonic() + ENGINE_WAIT
    while (endpoint := read_endpoint(state_dir)) is None:
        serving = serving_engine(state_dir)
        if serving is None:
            _start_engine(state_dir, idle_timeout)
        elif time.monotonic() > deadline:
            raise RuntimeError(f"the local engine (pid {serving.pid}) has not answered for {ENGINE_WAIT:.0f} s; "
                               f"not starting a second one on {state_dir}: see {state_dir / LOG_FILE}")
        else:
            time.sleep(0.1)
    return endpoint


def _start_engine(state_dir: Path, idle_timeout: float) -> None:
    """Start an engine for state_dir; return once one is recorded as serving it (ours, or
    one started meanwhile by another kernel). A lock file makes kernels that start at
    once start one engine, not one each."""
    state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open_private(state_dir / "engine.lock") as starting:
        fcntl.flock(starting, fcntl.LOCK_EX)
        if serving_engine(state_dir) is not None:
            return
        with open_private(state_dir / LOG_FILE) as log_file:
            process = subprocess.Popen(
                [sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(state_dir),
                 "--idle-timeout", str(idle_timeout)],
                stdin=subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                start_new_session=True)  # the engine outlives the kernel that started it
        deadline = time.monotonic() + START_TIMEOUT
        while serving_engine(state_dir) is None:
            if process.poll() is not None and serving_engine(state_dir) is None:
                raise RuntimeError(f"the local engine failed to start; see {state_dir / LOG_FILE}")
            if time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"the local engine did not start within {START_TIMEOUT:.0f} s")
            time.sleep(0.02)


class EngineRestarting(httpx.AsyncBaseTransport):
    """The kernel's way to its local engine over the unix socket. When no engine answers
    there (it was stopped, killed or is being upgraded), it waits for the engine while it
    lives and starts one in its place once it is gone (ensure_engine), and sends the
    request again where that is safe (below): a new engine has taken the sandboxes over (registry.py), so the kernel carries on where it was."""

    def __init__(self, socket_path: str, state_dir: Path, idle_timeout: float, engine_pid: int | None = None) -> None:
        self.socket_path = socket_path
        # Our own kept-alive connections, not httpx's pool: httpcore's asyncio side runs on
        # anyio, which the kernel would import for this alone (~20 ms of the start's CPU,
        # taken from ipykernel's imports), and costs ~3 ms of CPU a request more
        # (kept_connections.py).
        self.inner = KeptConnections(uds=socket_path)
        self.state_dir = state_dir
        self.idle_timeout = idle_timeout
        self.engine_pid = engine_pid  # of the engine serving now, when known

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        serving = self.engine_pid
        lost: httpx.TransportError | None = None  # an answer lost with a request the engine may have run
        try:
            return await self.inner.handle_async_request(request)
        except httpx.ConnectError:
            log.warning("the local engine is not answering: starting it again")
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError) as exc:
            # No answer, from an engine that is now dead (a kill between two requests leaves
            # a kept-alive connection to nobody). A live engine that dropped the connection
            # may have acted on the request: not sent again. A dead one may have too, if it
            # read the whole request before it died, so the next engine gets it again only if
            # it could not have (a failed write) or if repeating it is harmless: not a POST
            # (a second sandbox create would orphan the first, an exec would run twice), except
            # the channel's lines to its relay (a cell the runner has is not run again, an
            # acknowledgement counts once).
            if serving is None or not await self._is_dying(serving):
                raise
            if (request.method == "POST" and not request.url.path.endswith("/input")
                    and not isinstance(exc, httpx.WriteError)):
                lost = exc
            log.warning("the local engine died: starting it again%s",
                        f" ({request.method} {request.url.path} is not repeated)" if lost else "")
        endpoint = await asyncio.to_thread(ensure_engine, self.state_dir, self.idle_timeout)
        self.engine_pid = endpoint.pid
        if lost is not None:
            raise lost
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()

    async def _is_dying(self, pid: int) -> bool:
        """Whether the engine `pid` that broke a connection is gone or going. A process that
        exits closes its files before it is gone, its listening socket among them, so its
        connections break while it still looks alive for a moment (long on a loaded
        machine); a live engine that dropped one connection still takes the next."""
        from sandbox_kernel.local.registry import start_time

        deadline = time.monotonic() + DYING_GRACE
        while start_time(pid) is not None and _takes_connections(self.socket_path):
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
        return True


def _takes_connections(socket_path: str) -> bool:
    """Does something listen on the unix socket (a full backlog counts: it is busy, not gone)?"""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(socket_path)
        except BlockingIOError:
            return True
        except OSError:
            return False
    return True


def stop_engine(state_dir: Path, timeout: float = 30.0) -> bool:
    """End the engine of state_dir, leaving its sandboxes running (or paused) for the next
    one; False if none was running. (Found by its record, not by asking it: an engine that
    does not answer can be stopped too.)"""
    serving = serving_engine(state_dir)
    if serving is None:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(serving.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if serving_engine(state_dir) != serving:  # gone (or a zombie its parent has yet to reap)
            return True
        time.sleep(0.05)
    raise RuntimeError(f"the local engine (pid {serving.pid}) did not stop within {timeout:.0f} s")


def _exit_after_cleanup(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def open_private(path: Path) -> BinaryIO:
    """Open for appending a file only its owner may read (made so if it already exists)."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "ab")


def _listen_tcp(host: str, port: int) -> socket.socket:
    # proto=IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
    # without it every response written in two parts waits ~40 ms for a delayed ACK.
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def _listen_unix(path: Path) -> socket.socket | None:
    if len(str(path)) > SUN_PATH_MAX:
        log.warning("state dir path too long for a unix socket; serving loopback TCP only")
        return None
    path.unlink(missing_ok=True)
    sock = socket.socket(socket.AF_UNIX)
    old_umask = os.umask(0o177)  # created 0600: no window where others may connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old_umask)
    return sock


async def serve(state_dir: Path, host: str = "127.0.0.1", port: int = 0,
                idle_timeout: float = 0.0) -> None:
    """Run the engine until SIGINT/SIGTERM, or until idle_timeout s pass with no sandboxes."""
    import uvicorn

    from sandbox_kernel.local.engine import Engine
    from sandbox_kernel.local.engine_server import EngineServer
    from sandbox_kernel.local.server import create_app

    # Everything the engine creates (sandbox dirs, logs, disk images) is its user's alone.
    # (The agent sets the usual 022 again for the sandbox's own files.)
    os.umask(0o077)
    # Its sandboxes will see this process's Python environment: a dir whose sandboxes saw
    # another one is not served (ensure_engine never asks for it; `serve --state-dir` may).
    me = PythonEnvironment.current()
    if (owner := environment_of(state_dir, claim=me)) != me.prefix:
        raise OtherEnvironment(f"{state_dir} holds the engine of the Python environment {owner}, not of this "
                               f"one ({me.prefix}), whose packages its sandboxes would not see; serve another "
                               "--state-dir, or none (each environment then gets an engine of its own)")
    # Before anything an earlier engine left is looked at; held until this process ends,
    # past the removal of its socket and address below (which a successor would have
    # remade). `serve --state-dir NEW` makes the dir.
    lock = EngineLock.take(state_dir)
    bound_if_redirected(state_dir / LOG_FILE)
    token = load_or_create_token(state_dir)
    engine = Engine(state_dir, lock)
    tcp = _listen_tcp(host, port)
    bound_host, bound_port = tcp.getsockname()[:2]
    # Known before any sandbox's egress opens, adopted ones included: no rule may open them.
    await engine.start_adopted(api_addresses=[(bound_host, bound_port)])
    app = create_app(engine, token)
    unix = _listen_unix(state_dir / SOCKET_FILE)
    sockets = [s for s in (tcp, unix) if s is not None]
    # Idle keep-alive connections are kept well past the 5 s after which httpx (the vendor
    # SDK's client) drops its own: with uvicorn's default, also 5 s, the engine could close
    # one just as a client reuses it, failing a POST the client may not retry.
    server = EngineServer(engine, uvicorn.Config(app, log_level="warning", access_log=False,
                                                 timeout_graceful_shutdown=5,
                                                 timeout_keep_alive=KEEP_ALIVE_SECONDS))
    url_host = f"[{bound_host}]" if ":" in bound_host else bound_host

    async def announce_and_watch_idle() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        write_private(state_dir / ENGINE_FILE, json.dumps({
            "url": f"http://{url_host}:{bound_port}",
            "socket": str(state_dir / SOCKET_FILE) if unix else None,
            "pid": os.getpid()}))
        log.info("engine listening on %s:%s", url_host, bound_port)
        while idle_timeout > 0:
            await asyncio.sleep(min(idle_timeout, 5.0))
            idle = time.monotonic() - engine.last_activity
            if engine.live_count == 0 and idle >= idle_timeout:
                log.info("idle for %.0f s with no sandboxes: exiting", idle)
                server.should_exit = True
                return

    watcher = asyncio.get_running_loop().create_task(announce_and_watch_idle())
    # uvicorn stops on SIGTERM, then raises the signal again under the handler it found:
    # by default that kills the process before the cleanup below (running commands ended,
    # every sandbox's record saved for the next engine). This handler turns it into
    # SystemExit instead.
    signal.signal(signal.SIGTERM, _exit_after_cleanup)
    try:
        await server.serve(sockets=sockets)
    finally:
        watcher.cancel()
        await engine.close()
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError):
            if json.loads((state_dir / ENGINE_FILE).read_text())["pid"] == os.getpid():
                (state_dir / ENGINE_FILE).unlink()
        if unix:
            (state_dir / SOCKET_FILE).unlink(missing_ok=True)
        lock.release()
