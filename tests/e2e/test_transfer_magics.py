"""%upload and %download: a notebook's data into the sandbox and results out, through the
files API, files and directories, small and larger than one piece (with progress)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from kernel_helpers import execute, running_kernel
from sandbox_kernel.sandbox.transfer import (
    CHUNK,
    MAX_FILE,
    TransferError,
    move_into,
    parse_listing,
    relative_parts,
)

pytestmark = pytest.mark.slow

FAKE_JSON = "def dumps(*args, **kwargs):\n    return '{\"dir\": [[\"../escaped.txt\", 1]]}'\n"


def lines_of(result) -> list[str]:  # type: ignore[no-untyped-def]
    return [m["content"]["data"]["text/plain"] for m in result.messages
            if m["msg_type"] in ("display_data", "update_display_data")]


def test_upload_and_download_files_and_directories(kernelspec: str, tmp_path: Path) -> None:
    notebook_dir = tmp_path / "notebook"
    (notebook_dir / "data" / "nested").mkdir(parents=True)
    (notebook_dir / "data" / "a.csv").write_text("x,y\n1,2\n")
    (notebook_dir / "data" / "nested" / "b.txt").write_text("deep")
    (tmp_path / "host-secret.txt").write_text("not for the sandbox")
    (notebook_dir / "data" / "secret-link").symlink_to(tmp_path / "host-secret.txt")  # not followed
    big = os.urandom(2 * CHUNK + 12345)  # three pieces
    (notebook_dir / "big.bin").write_bytes(big)

    with running_kernel(kernelspec, cwd=str(notebook_dir)) as (_, kc):
        # relative on both sides: the notebook's directory, /workspace
        up = execute(kc, "%upload data")
        assert up.reply["content"]["status"] == "ok", up.outputs
        assert lines_of(up)[-1].startswith("Uploaded 2 files, 12 B in ")
        assert lines_of(up)[-1].endswith(" to /workspace/data (1 skipped: symlinks and special files are not uploaded)")
        seen = execute(kc, "import os\nprint(open('/workspace/data/a.csv').read(), open('data/nested/b.txt').read(),\n"
                           "      os.path.lexists('data/secret-link'))")
        assert seen.text() == "x,y\n1,2\n deep False\n"

        up_big = execute(kc, "%upload big.bin /workspace/in/big.bin")
        shown = lines_of(up_big)
        assert "Uploading big.bin… 8.0 MiB of 16.0 MiB" in shown, shown  # progress per piece
        assert shown[-1].startswith("Uploaded 1 file, 16.0 MiB in ")
        digest = execute(kc, "import hashlib; print(hashlib.sha256(open('in/big.bin', 'rb').read()).hexdigest())")
        assert digest.text().strip() == hashlib.sha256(big).hexdigest()

        execute(kc, "import os, shutil\nos.makedirs('results/plots')\nopen('results/r.txt', 'w').write('42')\n"
                    "open('results/plots/p.svg', 'w').write('<svg/>')\nshutil.copy('in/big.bin', 'results/big.bin')")
        # a json.py in the working directory that fakes a listing leaving the target: a plain
        # `python3 -c` there would use it (shown), the listing's isolated Python does not
        execute(kc, f"open('/workspace/json.py', 'w').write({FAKE_JSON!r})")
        assert "escaped" in execute(kc, "!python3 -c 'import json; print(json.dumps(1))'").text()
        down = execute(kc, "%download results out")
        assert down.reply["content"]["status"] == "ok", down.outputs
        assert lines_of(down)[-1].startswith("Downloaded 3 files, 16.0 MiB in ")
        assert (notebook_dir / "out" / "r.txt").read_text() == "42"
        assert (notebook_dir / "out" / "plots" / "p.svg").read_text() == "<svg/>"
        assert (notebook_dir / "out" / "big.bin").read_bytes() == big
        assert not (notebook_dir / "escaped.txt").exists()
        assert not list(notebook_dir.rglob(".*partial*"))  # no leftovers on either side
        assert execute(kc, "import glob; print(glob.glob('/tmp/.sandbox-kernel-transfer/*'))").text() == "[]\n"

        one = execute(kc, "%download results/r.txt")
        assert (notebook_dir / "r.txt").read_text() == "42", one.outputs
        into = execute(kc, "%download results/r.txt out/plots")  # an existing directory: into it
        assert (notebook_dir / "out" / "plots" / "r.txt").read_text() == "42", into.outputs

        # mistakes: one line, and the kernel carries on
        missing = execute(kc, "%download nothing-here.txt")
        assert missing.reply["content"]["status"] == "error"
        assert missing.text("stderr") == ("sandbox-kernel: %download: /workspace/nothing-here.txt: "
                                          "no such file or directory in the sandbox\n")
        absent = execute(kc, "%upload no-such-file")
        assert "no-such-file: no such file or directory on this machine" in absent.text("stderr")
        assert "%upload LOCAL [REMOTE]" in execute(kc, "%upload help").text()
        assert execute(kc, "print('still here')").text() == "still here\n"


def test_a_listed_name_never_leaves_the_target_directory() -> None:
    """The sandbox lists a directory for %download: its names are not trusted."""
    assert relative_parts("a/b.txt") == ("a", "b.txt")
    for name in ("../escape.txt", "/etc/passwd", "a/../../escape", "a/./b", "a//b", "", "a/\0"):
        with pytest.raises(TransferError):
            relative_parts(name)
    for output in ('{"dir": [["../x", 1]]}', '{"dir": [["x", -5]]}', '{"dir": [["x", true]]}', '{"file": "1"}',
                   '{"dir": {"x": 1}}', "[]", "not json", f'{{"dir": [["x", {MAX_FILE + 1}]]}}'):
        with pytest.raises(TransferError):
            parse_listing("/workspace/d", output)


def test_a_merge_never_passes_through_a_host_symlink(tmp_path: Path) -> None:
    """A directory download into an existing folder: a symlink of this machine on the way
    is refused before anything moves, and a file replaces a symlink rather than writing
    through it."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("mine")
    target = tmp_path / "target"
    target.mkdir()
    (target / "link").symlink_to(outside)
    (target / "file-link").symlink_to(outside / "victim.txt")
    staging = tmp_path / "staging"
    (staging / "link").mkdir(parents=True)
    (staging / "link" / "victim.txt").write_text("planted")
    (staging / "new.txt").write_text("new")
    with pytest.raises(TransferError, match="not a directory"):
        move_into(staging, target)
    assert (outside / "victim.txt").read_text() == "mine" and not (target / "new.txt").exists()
    (staging / "link" / "victim.txt").unlink()
    (staging / "link").rmdir()
    (staging / "file-link").write_text("replaced")
    move_into(staging, target)
    assert (outside / "victim.txt").read_text() == "mine"
    assert not (target / "file-link").is_symlink() and (target / "file-link").read_text() == "replaced"
    assert (target / "new.txt").read_text() == "new"
