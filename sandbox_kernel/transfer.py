"""Moving files and directories between the notebook's machine and its sandbox (`%upload`,
`%download`), through the CreateOS files API.

That API moves one whole file per request and holds it in memory, so files larger than
CHUNK travel in pieces: an upload sends each piece to a temporary file in the sandbox and
appends it to the target with one exec; a download cuts a piece out with `dd` and fetches
it. Neither the kernel nor the engine ever holds more than one piece, and a progress line
counts the pieces. A file over MAX_FILE is refused before anything moves.

Paths: a relative host path is the notebook's directory (the kernel's working directory),
a relative sandbox path is under WORKSPACE. What the sandbox lists for a directory download
is not trusted: every name must stay inside the target directory on the host.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .api import SandboxAPIError, SandboxClient

WORKSPACE = "/workspace"
CHUNK = 8 * 2**20
MAX_FILE = 2 * 2**30
STAGING = "/tmp/.sandbox-kernel-transfer"
MAX_ENTRIES = 100_000  # files and directories in one directory download (bounds the listing)
# Lists a directory in the sandbox as JSON [[relative path, size or -1 for a directory], ...];
# symlinks are listed as files only when they point at a regular file (and are read as such).
LIST_SCRIPT = """\
import json, os, sys
root, most = sys.argv[1], int(sys.argv[2])
if os.path.isfile(root):
    print(json.dumps({"file": os.path.getsize(root)}))
    sys.exit()
if not os.path.isdir(root):
    print(json.dumps({"missing": True}))
    sys.exit()
entries = []
for here, dirs, files in os.walk(root):
    rel = os.path.relpath(here, root)
    if rel != ".":
        entries.append([rel, -1])
    for name in files:
        path = os.path.join(here, name)
        if os.path.isfile(path):
            entries.append([os.path.normpath(os.path.join(rel, name)), os.path.getsize(path)])
    if len(entries) > most:
        print(json.dumps({"too_many": most}))
        sys.exit()
print(json.dumps({"dir": entries}))
"""

Report = Callable[[str], None]


class TransferError(Exception):
    """A transfer that cannot be done; the message is one line for the user."""


def sandbox_path(path: str) -> str:
    """An absolute path in the sandbox: relative ones are under WORKSPACE."""
    return posixpath.normpath(posixpath.join(WORKSPACE, path))


def host_path(path: str) -> Path:
    """A host path: relative ones are in the notebook's directory (the kernel's cwd)."""
    return Path(os.path.expanduser(path)).absolute()


def describe_size(size: int) -> str:
    if size < 2**10:
        return f"{size} B"
    if size < 2**20:
        return f"{size / 2**10:.1f} KiB"
    if size < 2**30:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**30:.2f} GiB"


@dataclass
class Tally:
    """What one command moved, for its progress line and its summary."""

    files: int = 0
    count: int = 0  # files to move
    done: int = 0
    total: int = 0
    started: float = 0.0

    def summary(self) -> str:
        files = "1 file" if self.files == 1 else f"{self.files} files"
        return f"{files}, {describe_size(self.done)} in {time.monotonic() - self.started:.1f} s"


class Transfer:
    """One %upload or %download: client and sandbox, and a report callback for progress."""

    def __init__(self, client: SandboxClient, sandbox_id: str, report: Report) -> None:
        self.client = client
        self.sandbox_id = sandbox_id
        self.report = report
        self.tally = Tally(started=time.monotonic())

    async def _exec(self, script: str, *args: str) -> str:
        response = await self.client.exec(self.sandbox_id, "sh", ["-c", script, "sh", *args])
        if response.result.exit_code != 0:
            detail = (response.result.stderr or response.result.stdout).strip().splitlines()
            raise TransferError(detail[-1] if detail else f"exit status {response.result.exit_code}")
        return response.result.stdout

    def _progress(self) -> None:
        tally = self.tally
        files = f", {tally.files} of {tally.count} files" if tally.count > 1 else ""
        self.report(f"{describe_size(tally.done)} of {describe_size(tally.total)}{files}")

    async def _clean_up(self, *paths: str) -> None:
        """Remove staging files; after a failure this may fail too, and must not hide it."""
        with contextlib.suppress(SandboxAPIError, TransferError):
            await self._exec('rm -f -- "$@"', *paths)

    # -- upload ---------------------------------------------------------------------------

    async def upload(self, local: Path, remote: str) -> str:
        if local.is_dir():
            below = sorted(local.rglob("*"))
            dirs = [remote] + [posixpath.join(remote, p.relative_to(local).as_posix()) for p in below if p.is_dir()]
            targets = [(p, posixpath.join(remote, p.relative_to(local).as_posix())) for p in below if p.is_file()]
        elif local.is_file():
            dirs = [posixpath.dirname(remote)]
            targets = [(local, remote)]
        else:
            raise TransferError(f"{local}: no such file or directory on this machine")
        for path, _ in targets:
            check_size(path.stat().st_size, str(path))
        self.tally.total = sum(path.stat().st_size for path, _ in targets)
        self.tally.count = len(targets)
        await self._exec('mkdir -p -- "$@"', *dirs)
        for path, target in targets:
            await self._upload_file(path, target)
        return f"Uploaded {self.tally.summary()} to {remote}"

    async def _upload_file(self, local: Path, remote: str) -> None:
        size = local.stat().st_size
        with local.open("rb") as source:
            if size <= CHUNK:
                await self.client.upload_file(self.sandbox_id, remote, source.read())
                self.tally.done += size
            else:
                await self._upload_in_pieces(source, remote)
        self.tally.files += 1
        self._progress()

    async def _upload_in_pieces(self, source: BinaryIO, remote: str) -> None:
        piece = f"{STAGING}/{uuid.uuid4().hex}"
        partial = f"{remote}.partial-{uuid.uuid4().hex[:8]}"
        await self._exec(f"mkdir -p {STAGING} && : > \"$1\"", partial)
        try:
            while data := source.read(CHUNK):
                await self.client.upload_file(self.sandbox_id, piece, data)
                await self._exec('cat "$1" >> "$2" && rm -f "$1"', piece, partial)
                self.tally.done += len(data)
                self._progress()
            await self._exec('mv -f "$1" "$2"', partial, remote)
        finally:
            await self._clean_up(piece, partial)

    # -- download -------------------------------------------------------------------------

    async def download(self, remote: str, local: Path) -> str:
        # -I: not the working directory's modules (a json.py the sandbox wrote) nor PYTHON* settings
        listing = json.loads(await self._exec('exec python3 -I -c "$1" "$2" "$3"', LIST_SCRIPT, remote,
                                              str(MAX_ENTRIES)))
        if listing.get("missing"):
            raise TransferError(f"{remote}: no such file or directory in the sandbox")
        if listing.get("too_many"):
            raise TransferError(f"{remote} holds more than {MAX_ENTRIES} files and directories: "
                                "pack it into an archive in the sandbox first")
        if "file" in listing:
            check_size(listing["file"], remote)
            self.tally.total, self.tally.count = listing["file"], 1
            if local.is_dir():  # as cp does: into the directory
                local = local / posixpath.basename(remote)
            await self._download_file(remote, listing["file"], local)
        else:
            entries = listing["dir"]
            for name, size in entries:
                check_size(size, posixpath.join(remote, name))
            self.tally.total = sum(size for _, size in entries if size > 0)
            self.tally.count = sum(1 for _, size in entries if size >= 0)
            local.mkdir(parents=True, exist_ok=True)
            root = local.resolve()
            for name, size in entries:
                target = inside(root, name)
                if size < 0:
                    target.mkdir(parents=True, exist_ok=True)
                else:
                    target.parent.mkdir(parents=True, exist_ok=True)
                    await self._download_file(posixpath.join(remote, name), size, target)
        return f"Downloaded {self.tally.summary()} to {local}"

    async def _download_file(self, remote: str, size: int, local: Path) -> None:
        partial = local.with_name(f".{local.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            with partial.open("wb") as sink:
                if size <= CHUNK:
                    data = await self.client.download_file(self.sandbox_id, remote)
                    check_size(len(data), remote)
                    sink.write(data)
                    self.tally.done += len(data)
                else:
                    await self._download_in_pieces(remote, size, sink)
            partial.replace(local)
        finally:
            partial.unlink(missing_ok=True)
        self.tally.files += 1
        self._progress()

    async def _download_in_pieces(self, remote: str, size: int, sink: BinaryIO) -> None:
        piece = f"{STAGING}/{uuid.uuid4().hex}"
        await self._exec(f"mkdir -p {STAGING}")
        try:
            for index in range((size + CHUNK - 1) // CHUNK):
                await self._exec(f'dd if="$1" of="$2" bs={CHUNK} skip={index} count=1 status=none',
                                 remote, piece)
                data = await self.client.download_file(self.sandbox_id, piece)
                sink.write(data)
                self.tally.done += len(data)
                self._progress()
        finally:
            await self._clean_up(piece)


def check_size(size: int, name: str) -> None:
    if size > MAX_FILE:
        raise TransferError(f"{name} is {describe_size(size)}: files over {describe_size(MAX_FILE)} "
                            "are not transferred (split it, or fetch it from inside the sandbox)")


def inside(root: Path, name: str) -> Path:
    """root/name, refusing names that would leave root (the sandbox chose them)."""
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts:
        raise TransferError(f"the sandbox listed a path outside the directory: {name!r}")
    target = root.joinpath(*parts)
    if not target.parent.resolve().is_relative_to(root):
        raise TransferError(f"{target.parent} leads outside {root} (a symlink?)")
    return target
