"""Downloads do not trust what the sandbox says (issue 30, item 4).

A `%download` asks the sandbox what REMOTE is (a listing), then fetches it. The sandbox can
change REMOTE in between: a small file for a huge one, a file for a directory, a directory
for a file. Each attack below first shows that the swap really happened after the kernel's
listing (the sandbox reports it), then that the kernel held a bounded amount of memory and
wrote nothing but the one path asked for.

To put the swap deterministically between the listing and the fetch, the API-level tests
drive the kernel's own transfer code (Transfer.list, then Transfer.fetch: what `%download`
runs) in this process against the real engine, and swap through an exec in between; its
memory is this process's. The last test runs `%download` in a real kernel after the
sandbox made a file a directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from attack_helpers import ONCE
from kernel_helpers import execute, running_kernel
from memory_probe import memory_growth
from sandbox_kernel.api import SandboxClient
from sandbox_kernel.sandbox.transfer import CHUNK, Listing, Transfer, TransferError

pytestmark = [pytest.mark.slow, ONCE]

HUGE = 768 * 2**20
# The kernel writes a download to disk as it arrives: it holds an HTTP read or so at a time.
MEMORY_BOUND_MIB = 64


async def in_sandbox(client: SandboxClient, sandbox_id: str, code: str) -> str:
    """Python run in the sandbox (the sandbox's side of an attack); its stdout."""
    result = (await client.exec(sandbox_id, "python3", ["-c", code])).result
    assert result.exit_code == 0, result.stderr
    return result.stdout.strip()


def host_files(folder: Path) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() if path.is_file() else b"<dir>"
            for path in sorted(folder.rglob("*"))}


# Replaces PATH by a sparse file of SIZE bytes (0 bytes on disk), by rename, and reports its size.
SWAP_FOR_SPARSE = """
import os
with open('{path}.swap', 'wb') as f:
    f.truncate({size})
os.replace('{path}.swap', '{path}')
print(os.path.getsize('{path}'))
"""
# Replaces PATH (a file) by a directory with files the host folder must not receive.
SWAP_FOR_DIRECTORY = """
import os
os.remove('{path}')
os.makedirs('{path}/sub')
open('{path}/keep.py', 'w').write('planted = True')
open('{path}/sub/planted.py', 'w').write('planted = True')
print('directory' if os.path.isdir('{path}') else 'file')
"""


@pytest.mark.parametrize("listed", [1024, 2 * CHUNK + 1], ids=["one-request", "in-pieces"])
async def test_a_file_swapped_for_a_huge_one_after_the_listing(sandbox, tmp_path: Path, listed: int) -> None:
    client, sandbox_id = sandbox
    await in_sandbox(client, sandbox_id, f"open('/workspace/data.bin', 'wb').write(b'd' * {listed})")
    transfer = Transfer(client, sandbox_id, lambda line: None)
    listing = await transfer.list("/workspace/data.bin")
    assert listing == Listing("/workspace/data.bin", size=listed)
    # The attack ran: after the listing, the file is 768 MiB.
    swapped = await in_sandbox(client, sandbox_id, SWAP_FOR_SPARSE.format(path="/workspace/data.bin", size=HUGE))
    assert int(swapped) == HUGE
    target = tmp_path / "data.bin"
    with memory_growth(os.getpid()) as growth:
        with pytest.raises(TransferError) as refused:
            await transfer.fetch(listing, target)
    print(f"{listed} B listed, 768 MiB sent: this process +{growth.mib:.0f} MiB, {transfer.tally.done} B taken")
    assert str(refused.value) == (f"/workspace/data.bin changed in the sandbox during the download (listed as "
                                  f"{'1.0 KiB' if listed == 1024 else '16.0 MiB'}, more arrived): nothing was written")
    # No more was taken than listed, nothing stayed on disk, memory stayed bounded.
    assert transfer.tally.done <= listed
    assert host_files(tmp_path) == {}
    assert growth.mib < MEMORY_BOUND_MIB


async def test_a_file_swapped_for_a_directory_after_the_listing(sandbox, tmp_path: Path) -> None:
    client, sandbox_id = sandbox
    await in_sandbox(client, sandbox_id, "open('/workspace/r.txt', 'w').write('result')")
    transfer = Transfer(client, sandbox_id, lambda line: None)
    listing = await transfer.list("/workspace/r.txt")
    assert listing.is_file
    assert await in_sandbox(client, sandbox_id, SWAP_FOR_DIRECTORY.format(path="/workspace/r.txt")) == "directory"
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.py").write_text("mine = True")
    before = host_files(out)
    with pytest.raises(TransferError, match="changed in the sandbox during the download; nothing was written"):
        await transfer.fetch(listing, out / "r.txt")
    assert host_files(out) == before


async def test_a_directory_swapped_for_a_file_after_the_listing(sandbox, tmp_path: Path) -> None:
    client, sandbox_id = sandbox
    await in_sandbox(client, sandbox_id, "import os\nos.makedirs('/workspace/results/sub')\n"
                                         "open('/workspace/results/a.txt', 'w').write('a')\n"
                                         "open('/workspace/results/sub/b.txt', 'w').write('b')")
    transfer = Transfer(client, sandbox_id, lambda line: None)
    listing = await transfer.list("/workspace/results")
    assert not listing.is_file and len(listing.entries) == 3
    swapped = await in_sandbox(client, sandbox_id, "import shutil\nshutil.rmtree('/workspace/results/sub')\n"
                                                   "open('/workspace/results/sub', 'w').write('now a file')\n"
                                                   "print(open('/workspace/results/sub').read())")
    assert swapped == "now a file"
    out = tmp_path / "out"
    out.mkdir()
    (out / "results").mkdir()
    (out / "results" / "a.txt").write_text("mine")
    before = host_files(out)
    with pytest.raises(TransferError, match="changed in the sandbox during the download; nothing was written"):
        await transfer.fetch(listing, out / "results")
    assert host_files(out) == before  # a.txt, which did arrive, was not moved in either


@pytest.mark.kernel
def test_a_file_download_into_a_folder_stays_one_path_when_the_sandbox_makes_it_a_directory(
        kernelspec: str, tmp_path: Path) -> None:
    """`%download r.txt out` into an existing folder: r.txt was made a directory holding a
    keep.py and a sub/planted.py. It once merged into `out` (overwriting out/keep.py,
    creating out/sub/planted.py); it lands at out/r.txt, the one path asked for."""
    notebook = tmp_path / "notebook"
    (notebook / "out").mkdir(parents=True)
    (notebook / "out" / "keep.py").write_text("mine = True")
    with running_kernel(kernelspec, cwd=str(notebook)) as (_, kc):
        made = execute(kc, "open('/workspace/r.txt', 'w').write('result')\n"
                           + SWAP_FOR_DIRECTORY.format(path="/workspace/r.txt"))
        assert made.text() == "directory\n"  # the attack ran
        down = execute(kc, "%download r.txt out")
        assert down.reply["content"]["status"] == "ok", down.outputs
        assert (notebook / "out" / "keep.py").read_text() == "mine = True"
        assert not (notebook / "out" / "sub").exists()
        assert host_files(notebook / "out") == {
            "keep.py": b"mine = True", "r.txt": b"<dir>", "r.txt/keep.py": b"planted = True",
            "r.txt/sub": b"<dir>", "r.txt/sub/planted.py": b"planted = True"}
        assert execute(kc, "print(6 * 7)").text() == "42\n"
