"""Moving files and directories between the notebook's machine and its sandbox (`%upload`,
`%download`), through the CreateOS files API.

That API moves one whole file per request, and CreateOS holds it in memory, so files larger
than CHUNK travel in pieces: an upload sends each piece to a temporary file in the sandbox
and appends it to the target with one exec; a download cuts a piece out with `dd` and fetches
it. A progress line counts the pieces. A file over MAX_FILE is refused before anything moves.

Paths: a relative host path is the notebook's directory (the kernel's working directory),
a relative sandbox path is under WORKSPACE.

Everything the sandbox says is untrusted, so a download:
- takes the listing's sizes as a claim only: bytes are counted as they arrive and written to
  disk as they arrive (never held whole), and a file that sends more (or fewer) bytes than it
  was listed with fails the download with one line;
- lands where the user's words say, decided before the sandbox is asked what REMOTE is, so
  the sandbox cannot turn a file download into a merge into an existing folder;
- writes nothing until everything arrived: a file goes to a temporary file beside its
  target and is renamed over it; a directory is built in a temporary directory beside its
  target and moved into it at the end, after checking that no name would pass through a
  symlink or land on something of another kind (host symlinks are never followed);
- is bounded: MAX_FILE a file, MAX_TOTAL and MAX_ENTRIES a directory.

An upload reads only what the user named: inside an uploaded directory, symlinks (and
anything else but regular files and directories) are skipped and counted, so a link in a
folder cannot send a file from elsewhere on this machine. A symlink named as LOCAL itself
is followed: the user chose it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import shutil
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from sandbox_kernel.api import BadRequestError, NotFoundError, SandboxAPIError, SandboxClient

WORKSPACE = "/workspace"
CHUNK = 8 * 2**20
MAX_FILE = 2 * 2**30
MAX_TOTAL = 4 * 2**30  # of one directory download
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
# One piece of a file, into $2; a file that became something else says so.
PIECE_SCRIPT = (f'test -f "$1" || {{ echo "$1: no longer a file" >&2; exit 1; }}; '
                f'exec dd if="$1" of="$2" bs={CHUNK} skip="$3" count=1 status=none')

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


def download_target(remote: str, local: Path | None) -> Path:
    """Where a download of `remote` lands, from the user's words and this machine alone (what
    the sandbox says REMOTE is must not choose it): LOCAL, or inside LOCAL as cp does when it
    is an existing directory; ./NAME when no LOCAL was given."""
    name = posixpath.basename(remote)
    if not name:
        raise TransferError(f"{remote}: name a file or directory below /")
    if local is None:
        return host_path(name)
    return local / name if local.is_dir() else local


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


@dataclass(frozen=True)
class Listing:
    """What the sandbox said REMOTE is, at one moment: a file of `size` bytes, or a directory
    of `entries` (name parts, and a size or -1 for a directory). A claim the fetch checks."""

    remote: str
    size: int | None = None
    entries: list[tuple[tuple[str, ...], int]] = field(default_factory=list)

    @property
    def is_file(self) -> bool:
        return self.size is not None


@dataclass
class HostTree:
    """The regular files and directories below an uploaded directory, and what was skipped."""

    dirs: list[Path] = field(default_factory=list)
    files: list[Path] = field(default_factory=list)
    skipped: int = 0  # symlinks, sockets, FIFOs, devices: never read


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
        skipped = 0
        if local.is_dir():
            tree = host_tree(local)
            dirs = [remote] + [posixpath.join(remote, p.relative_to(local).as_posix()) for p in tree.dirs]
            targets = [(p, posixpath.join(remote, p.relative_to(local).as_posix())) for p in tree.files]
            skipped = tree.skipped
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
            await self._upload_file(path, target, follow=path == local)
        links = f" ({skipped} skipped: symlinks and special files are not uploaded)" if skipped else ""
        return f"Uploaded {self.tally.summary()} to {remote}{links}"

    async def _upload_file(self, local: Path, remote: str, follow: bool) -> None:
        # Inside a directory a file is opened without following a symlink: what was checked
        # to be a regular file is what is read.
        flags = os.O_RDONLY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        with os.fdopen(os.open(local, flags), "rb") as source:
            size = os.fstat(source.fileno()).st_size
            check_size(size, str(local))
            if size <= CHUNK:
                data = source.read(CHUNK)  # bounded even if the file grew since
                await self.client.upload_file(self.sandbox_id, remote, data)
                self.tally.done += len(data)
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

    async def download(self, remote: str, local: Path | None) -> str:
        """REMOTE to LOCAL (None: ./NAME); the summary line."""
        target = download_target(remote, local)
        return await self.fetch(await self.list(remote), target)

    async def list(self, remote: str) -> Listing:
        """What the sandbox says REMOTE is, checked for shape and bounds."""
        # -I: not the working directory's modules (a json.py the sandbox wrote) nor PYTHON* settings
        output = await self._exec('exec python3 -I -c "$1" "$2" "$3"', LIST_SCRIPT, remote, str(MAX_ENTRIES))
        return parse_listing(remote, output)

    async def fetch(self, listing: Listing, target: Path) -> str:
        """The listed file or directory into `target`; nothing is written if any of it fails."""
        if listing.size is not None:
            self.tally.total, self.tally.count = listing.size, 1
            await self._fetch_file(listing.remote, listing.size, target)
        else:
            self.tally.total = sum(size for _, size in listing.entries if size > 0)
            self.tally.count = sum(1 for _, size in listing.entries if size >= 0)
            await self._fetch_directory(listing, target)
        return f"Downloaded {self.tally.summary()} to {target}"

    async def _fetch_file(self, remote: str, size: int, target: Path) -> None:
        """Into a new file beside `target`, renamed over it at the end: a symlink there is
        replaced, never written through."""
        if host_kind(target) == "dir":
            raise TransferError(f"{target} is a directory on this machine: nothing was written")
        partial = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
        try:
            await self._receive_file(remote, size, partial)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    async def _fetch_directory(self, listing: Listing, target: Path) -> None:
        if host_kind(target) not in (None, "dir"):
            raise TransferError(f"{target} exists on this machine and is not a directory: nothing was written")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.partial-{uuid.uuid4().hex[:8]}")
        staging.mkdir()  # ours alone, holding no symlink: what is built here follows none
        try:
            for parts, size in listing.entries:
                path = staging.joinpath(*parts)
                try:
                    if size < 0:
                        path.mkdir(parents=True, exist_ok=True)
                    else:
                        path.parent.mkdir(parents=True, exist_ok=True)
                        await self._receive_file(posixpath.join(listing.remote, *parts), size, path)
                except (FileExistsError, NotADirectoryError, IsADirectoryError):
                    raise TransferError(f"the sandbox listed {posixpath.join(*parts)} twice in "
                                        f"{listing.remote}: nothing was written") from None
            move_into(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    async def _receive_file(self, remote: str, size: int, path: Path) -> None:
        """`remote`'s bytes into the new file `path`, in pieces past CHUNK; it must send
        exactly the `size` it was listed with."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        with os.fdopen(fd, "wb") as sink:
            if size <= CHUNK:
                received = await self._receive(remote, remote, size, size, sink)
            else:
                received = await self._receive_in_pieces(remote, size, sink)
        if received != size:
            raise TransferError(changed(remote, size, f"{describe_size(received)} arrived"))
        self.tally.files += 1
        self._progress()

    async def _receive_in_pieces(self, remote: str, size: int, sink: BinaryIO) -> int:
        piece = f"{STAGING}/{uuid.uuid4().hex}"
        await self._exec(f"mkdir -p {STAGING}")
        received = 0
        try:
            for index in range((size + CHUNK - 1) // CHUNK):
                await self._exec(PIECE_SCRIPT, remote, piece, str(index))
                received += await self._receive(piece, remote, size, min(CHUNK, size - received), sink)
                self._progress()
        finally:
            await self._clean_up(piece)
        return received

    async def _receive(self, path: str, remote: str, listed: int, room: int, sink: BinaryIO) -> int:
        """One GET of `path` (a piece of `remote`, or itself) into `sink`, counted as it
        arrives: more than `room` bytes means `remote` (`listed` bytes) changed since it was listed."""
        received = 0
        try:
            async with self.client.download_stream(self.sandbox_id, path) as chunks:
                async for chunk in chunks:
                    received += len(chunk)
                    if received > room:
                        raise TransferError(changed(remote, listed, "more arrived"))
                    sink.write(chunk)
                    self.tally.done += len(chunk)
        except (NotFoundError, BadRequestError) as exc:  # it went away, or became a directory
            raise TransferError(f"{exc.message}: it changed in the sandbox during the download; "
                                "nothing was written") from None
        return received


def parse_listing(remote: str, output: str) -> Listing:
    """The listing script's answer, from the sandbox: its shape, names and sizes checked."""
    try:
        listing = json.loads(output)
    except ValueError:
        raise TransferError(f"the sandbox's listing of {remote} is not JSON") from None
    if not isinstance(listing, dict):
        raise TransferError(f"the sandbox's listing of {remote} is not an object")
    if listing.get("missing"):
        raise TransferError(f"{remote}: no such file or directory in the sandbox")
    if listing.get("too_many"):
        raise TransferError(too_many(remote))
    if "file" in listing:
        return Listing(remote, size=listed_size(listing["file"], remote))
    entries = listing.get("dir")
    if not isinstance(entries, list):
        raise TransferError(f"the sandbox's listing of {remote} is neither a file nor a directory")
    if len(entries) > MAX_ENTRIES:
        raise TransferError(too_many(remote))
    checked: list[tuple[tuple[str, ...], int]] = []
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
            raise TransferError(f"the sandbox's listing of {remote} holds a malformed entry")
        name, size = entry
        checked.append((relative_parts(name), -1 if size == -1 else listed_size(size, posixpath.join(remote, name))))
    total = sum(size for _, size in checked if size > 0)
    if total > MAX_TOTAL:
        raise TransferError(f"{remote} holds {describe_size(total)}: a download moves at most "
                            f"{describe_size(MAX_TOTAL)} (pack what you need into an archive in the sandbox)")
    return Listing(remote, entries=checked)


def listed_size(size: object, name: str) -> int:
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise TransferError(f"the sandbox listed {name} with no valid size")
    check_size(size, name)
    return size


def check_size(size: int, name: str) -> None:
    if size > MAX_FILE:
        raise TransferError(f"{name} is {describe_size(size)}: files over {describe_size(MAX_FILE)} "
                            "are not transferred (split it, or fetch it from inside the sandbox)")


def too_many(remote: str) -> str:
    return (f"{remote} holds more than {MAX_ENTRIES} files and directories: "
            "pack it into an archive in the sandbox first")


def changed(remote: str, size: int, what: str) -> str:
    return (f"{remote} changed in the sandbox during the download (listed as {describe_size(size)}, "
            f"{what}): nothing was written")


def relative_parts(name: str) -> tuple[str, ...]:
    """A name the sandbox listed, as path parts that stay below the target directory."""
    parts = tuple(name.split("/"))
    if not name or "\0" in name or any(part in ("", ".", "..") for part in parts):
        raise TransferError(f"the sandbox listed a path outside the directory: {name!r}")
    return parts


def host_kind(path: Path) -> str | None:
    """'dir', 'file' or 'other' (a symlink, a FIFO...) for `path` itself, None if absent."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    return "dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "other"


def move_into(staging: Path, target: Path) -> None:
    """The tree built in `staging` into `target`: renamed there when `target` is new, else
    merged into it, after checking every name first, so a conflict moves nothing. A name
    never passes through a symlink of this machine; a file replaces what was there (a
    symlink itself, not what it points at), a directory is only ever merged into a directory."""
    if host_kind(target) is None:
        os.rename(staging, target)
        return
    dirs, files = [], []
    for here, subdirs, names in os.walk(staging):
        rel = Path(here).relative_to(staging)
        dirs += [rel / name for name in subdirs]
        files += [rel / name for name in names]
    for rel in dirs:
        if host_kind(target / rel) not in (None, "dir"):
            raise TransferError(f"{target / rel} exists on this machine and is not a directory "
                                "(a symlink is not followed): nothing was written")
    for rel in files:
        if host_kind(target / rel) == "dir":
            raise TransferError(f"{target / rel} is a directory on this machine: nothing was written")
    for rel in dirs:  # parents first (os.walk goes top-down)
        (target / rel).mkdir(exist_ok=True)
    for rel in files:
        os.replace(staging / rel, target / rel)


def host_tree(root: Path) -> HostTree:
    """The regular files and directories below `root`, without following a symlink."""
    tree = HostTree()
    for here, subdirs, names in os.walk(root):  # followlinks=False: a linked dir is a name here
        for name in sorted(subdirs):
            path = Path(here, name)
            if path.is_symlink():
                tree.skipped += 1
            else:
                tree.dirs.append(path)
        for name in sorted(names):
            path = Path(here, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                tree.files.append(path)
            else:
                tree.skipped += 1
    return tree

