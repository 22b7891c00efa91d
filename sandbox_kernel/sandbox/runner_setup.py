"""Starting the runner in a sandbox: upload its bundle, start its daemon, wait until it serves.

The runner (guest/runner/) is uploaded at every start and run as a daemon holding the
user's globals, under a warden (a waiting shell that becomes guest/runner/warden.py) that
records how it ended and its peak memory (how_runner_ended reads that).
Everything goes through SandboxClient (execs and file uploads), so the same code serves
CreateOS and the local engine.
"""

from __future__ import annotations

import functools
import io
import json
import logging
import posixpath
import re
import secrets
import shlex
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandbox_kernel.api import ExecResponse, ExecResult, SandboxAPIError, SandboxClient
from sandbox_kernel.guest import bundle, protocol
from sandbox_kernel.sandbox.exec_transport import encode_arg

log = logging.getLogger("sandbox_kernel.sandbox.runner_setup")

RUNNER_DIR = "/tmp/sandbox-kernel"
RUNNER_PATH = bundle.runner_path(RUNNER_DIR)
RUNNER_CLIENT_PATH = bundle.client_path(RUNNER_DIR)
# The client is imported, not run as a script: Python compiles a script at every start, while
# a module comes from bytecode (shipped with the bundle, or written by the first client that
# imports it), and each relay start and each exec client of the exec path starts sooner (a
# runner of another version has the same client.py, with the same main).
RUNNER_CLIENT_CODE = (f"import sys; sys.path.insert(0, {posixpath.dirname(RUNNER_CLIENT_PATH)!r}); "
                      "sys.exit(__import__('client').main(sys.argv[1:]))")
# Uploaded at every runner start as one tar file (one request, where its ~20 files were ~20):
# the runner's bundle (the daemon, its modules, its light client, the warden it runs under),
# whose hash the runner reports (guest/bundle.py). Unpacked by the sandbox's tar, or its
# Python's tarfile where it has no tar.
RUNNER_FILES = {path: Path(source) for path, source in bundle.runner_files().items()}  # under RUNNER_DIR
UNPACK_WITH_PYTHON = "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])"
WARDEN_PATH = f"{bundle.runner_path(RUNNER_DIR)}/warden.py"
SANDBOX_PYTHON = "python3"
RUNNER_READY_TIMEOUT = 30.0
READY_PROBE = 2.0  # seconds one readiness exec may wait in the sandbox
PROBE_INTERVAL = 0.01  # seconds between its looks for the runner's ready file
NOT_READY_YET = 3  # its exit status when the runner is still starting
# The warden's record: "STATUS PEAK_KIB" (ASCII digits, a sane size: the sandbox can rewrite it).
RUNNER_END = re.compile(r"([0-9]{1,3})(?: ([0-9]{1,12}))?\n?")


def runner_client(*args: str) -> list[str]:
    """Arguments of a runner client, guest/runner/client.py (`client.py ARGS`, from its
    bytecode), which starts in a bare interpreter's time (no site-packages, only built-in
    modules): the relay, or one per cell where there are no managed processes."""
    return ["-I", "-S", "-c", RUNNER_CLIENT_CODE, *args]


async def start_runner(client: SandboxClient, sandbox_id: str, new_sandbox: bool = False) -> dict[str, Any]:
    """Upload the runner's files and start its daemon; return what it says of itself (its
    info: Python version, bundle hash, features). An older daemon is stopped first (none
    in a new_sandbox: we just made it). RuntimeError if the runner did not start."""
    # Beside the runner's directory, in /tmp, which every sandbox has (an upload's parent
    # directory must exist): the unpacking then goes with the start, one exec for both.
    upload = f"{RUNNER_DIR}-bundle-{secrets.token_hex(4)}.tar"
    await client.upload_file(sandbox_id, upload, bundle_tar(tuple(sorted(RUNNER_FILES.items()))))
    unpack = (f"{{ {bundle.prepare_command(RUNNER_DIR)} && {{ tar -xf {upload} -C {RUNNER_DIR} 2>/dev/null || "
              f"{SANDBOX_PYTHON} -I -S -c '{UNPACK_WITH_PYTHON}' {upload} {RUNNER_DIR}; }}; }} || exit 1; "
              f"rm -f {upload}; ")
    # Detached, so the exec returns at once; `;` (not &&) so the start never waits on
    # the shutdown of a daemon that is not there.
    stop_old = shlex.join([SANDBOX_PYTHON, *runner_client("request", RUNNER_DIR, encode_arg({protocol.OP: protocol.SHUTDOWN}))])
    # The record of its warden is named by the warden's pid, so that a daemon stopped earlier
    # cannot answer for it.
    daemon = f"{SANDBOX_PYTHON} {RUNNER_PATH} serve {RUNNER_DIR}"
    start = ("" if new_sandbox else f"{stop_old} >/dev/null 2>&1; rm -f {RUNNER_DIR}/ready; ") + (
        f"nohup setsid sh -c '{watched(daemon, RUNNER_DIR + '/runner.exit.$$')}' "
        f"</dev/null >{RUNNER_DIR}/runner.log 2>&1 & echo $! >{RUNNER_DIR}/runner.pid")
    # Readiness by short execs, none held longer than READY_PROBE (a gateway may cut
    # long ones); a runner that died (no python3, a crash) is reported at once. The
    # first one also starts the runner: one round trip less (30 ms each in the cloud).
    # Each look costs one process (sleep), which takes CPU from the starting runner.
    probe = (f"pid=$(cat {RUNNER_DIR}/runner.pid); i=0; while [ $i -lt {int(READY_PROBE / PROBE_INTERVAL)} ]; do "
             f"[ -f {RUNNER_DIR}/ready ] && exec cat {RUNNER_DIR}/ready; "
             f"kill -0 $pid 2>/dev/null || "
             f"{{ tail -n 20 {RUNNER_DIR}/runner.log >&2; exit 1; }}; "
             f"i=$((i+1)); sleep {PROBE_INTERVAL}; done; exit {NOT_READY_YET}")
    deadline = time.monotonic() + RUNNER_READY_TIMEOUT
    script = f"{unpack}{start}; {probe}"
    while True:
        response = await client.exec(sandbox_id, "sh", ["-c", script])
        if response.result.exit_code != NOT_READY_YET or time.monotonic() > deadline:
            break
        script = probe
    info: dict[str, Any] = json.loads(_check(response, what="the Python runner did not start").stdout)
    return info


def watched(daemon: str, record: str, warden: str = WARDEN_PATH, python: str = SANDBOX_PYTHON) -> str:
    """A shell script (no single quote in it) that runs the `daemon` command under its warden:
    the shell waits for the daemon, then becomes `warden` (guest/runner/warden.py), which
    writes `record`, "STATUS PEAK_KIB", how the daemon ended and the most memory it held.

    A shell, not a Python, waits: 0.15 MiB where a Python cost 3.6 (PSS, in every sandbox).
    It ignores SIGINT, which a cell's os.killpg(0, SIGINT) sends it too: it would end without
    a record. Started in the background (`&`, as start_runner does), it ignores SIGINT already
    (POSIX: an asynchronous list without job control), and so does the daemon, which inherits
    that and sets its own handling as it starts, as it did under the Python warden."""
    return f'trap "" INT; {daemon}; exec {python} -I -S {warden} {record} $?'


@functools.cache
def bundle_tar(files: tuple[tuple[str, Path], ...]) -> bytes:
    """The runner's files (path under the runner's directory, file on the host) as one tar
    file of plain regular files, made once per process.

    With each module goes the host's bytecode of it, where the host has it (an installed
    package does), and the module keeps its modification time, which that bytecode names:
    a sandbox with the host's Python (the local engine's) imports it instead of compiling
    the runner at its first start (tens of ms before the runner is ready, and what the
    compiler used stays in the daemon's heap). Another Python ignores it (its cache tag
    differs) and one that finds it stale compiles, as without it."""
    import importlib.util
    import tarfile  # only for a new runner's upload: a kernel on a pooled sandbox makes none

    archive = io.BytesIO()
    with tarfile.open(fileobj=archive, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, source in files:
            modified = int(Path(source).stat().st_mtime)
            _add_file(tar, path, Path(source).read_bytes(), modified)
            cached = Path(importlib.util.cache_from_source(str(source))) if path.endswith(".py") else None
            if cached is not None and cached.is_file():
                _add_file(tar, posixpath.join(posixpath.dirname(path), "__pycache__", cached.name),
                          cached.read_bytes(), modified)
    return archive.getvalue()


def _add_file(tar: Any, path: str, data: bytes, modified: int) -> None:
    import tarfile

    member = tarfile.TarInfo(path)
    member.size, member.mode, member.mtime = len(data), 0o644, modified
    tar.addfile(member, io.BytesIO(data))


@dataclass(frozen=True)
class RunnerEnd:
    """How the runner daemon ended, as its warden recorded it."""

    status: int  # exit code, or 128+N: killed by signal N
    peak_mib: int | None  # the most memory it held (None: a record without it)

    def killed_by(self, signum: int) -> bool:
        return self.status == 128 + signum

    def cause(self) -> str:
        if self.status > 128 and (name := _signal_name(self.status - 128)):
            return f"killed by {name}"
        return f"exit code {self.status}"


async def how_runner_ended(client: SandboxClient, sandbox_id: str) -> RunnerEnd | None:
    """How the runner daemon ended, from its warden's record (written as it ends: waited
    for briefly); None if unknown. The record is the sandbox's word: only two small
    numbers are taken from it."""
    exit_file = f"{RUNNER_DIR}/runner.exit.$(cat {RUNNER_DIR}/runner.pid)"
    script = (f"i=0; while [ ! -f {exit_file} ] && [ $i -lt 100 ]; do sleep 0.01; i=$((i+1)); done; "
              f"head -c 64 {exit_file}")
    try:
        return parse_runner_end((await client.exec(sandbox_id, "sh", ["-c", script])).result.stdout)
    except (SandboxAPIError, ValueError) as exc:
        log.warning("how the runner ended is not known: %s", exc)
        return None


def parse_runner_end(record: str) -> RunnerEnd:
    """A warden's "STATUS PEAK_KIB" line (or an older runner's shell's "STATUS"); ValueError
    if it is neither."""
    found = RUNNER_END.fullmatch(record)
    if found is None or int(found[1]) > 255:
        raise ValueError(f"not a runner's end: {record[:64]!r}")
    return RunnerEnd(int(found[1]), int(found[2]) // 1024 if found[2] else None)


def _check(response: ExecResponse, what: str = "sandbox command failed") -> ExecResult:
    """The exec's result if it succeeded, else RuntimeError with `what` and its last words."""
    result = response.result
    if result.exit_code != 0 or result.error:
        detail = (result.error or result.stderr).strip().splitlines()
        raise RuntimeError(f"{what}: {detail[-1] if detail else f'exit {result.exit_code}'}")
    return result


def _signal_name(number: int) -> str | None:
    try:
        return signal.Signals(number).name
    except ValueError:
        return None
