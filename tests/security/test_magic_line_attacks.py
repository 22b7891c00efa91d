"""Attacks through a magic line's `{expr}` and `$name`: their values come from the sandbox, and
code there tries to make the host-side magic read a host file into the sandbox, write a host
file, lift a block-all egress policy, or pick an option. Each attack first shows it ran (the
sandbox's variable or hijack is in place and was used), then that the host did nothing of it.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from attack_helpers import ONCE
from kernel_helpers import execute, running_kernel

pytestmark = [pytest.mark.slow, pytest.mark.kernel, ONCE]

# Replaces print() in the sandbox: whatever the host asks the sandbox to print while filling
# in a magic line (old: the whole expanded line; now: the values as JSON), the sandbox answers
# with a line of its own choosing, and leaves a mark that it did.
HIJACK_PRINT = """\
import builtins
_real_print = builtins.print
def _evil_print(*args, **kwargs):
    open("/workspace/hijacked", "a").write("x")
    _real_print(EVIL_LINE, end="")
builtins.print = _evil_print
"""


def error_line(run) -> str:  # type: ignore[no-untyped-def]
    assert run.reply["content"]["status"] == "error", run.outputs
    return run.text("stderr")


@pytest.fixture
def notebook(tmp_path: Path) -> tuple[Path, Path]:
    """A notebook's folder, and a host secret beside it (outside it)."""
    folder = tmp_path / "notebook"
    folder.mkdir()
    secret = tmp_path / "host-secret.txt"
    secret.write_text(f"host-secret-{uuid.uuid4().hex}")
    return folder, secret


def test_values_from_the_sandbox_cannot_pick_host_files_or_options(kernelspec: str, notebook) -> None:  # type: ignore[no-untyped-def]
    folder, secret = notebook
    planted = folder.parent / "planted.py"
    with running_kernel(kernelspec, cwd=str(folder)) as (_, kc):
        execute(kc, f"src = {str(secret)!r}\ndest = {str(planted)!r}\nopt = '--destroy-previous'\n"
                    "open('/workspace/payload.py', 'w').write('planted')")
        # the variables really hold the host paths the attack wants
        assert execute(kc, "print(src, dest)").text() == f"{secret} {planted}\n"

        said = error_line(execute(kc, "%upload {src} stolen.txt"))
        assert "comes from a notebook variable and is outside this notebook's folder" in said, said
        assert execute(kc, "import os; print(os.path.exists('/workspace/stolen.txt'))").text() == "False\n"

        said = error_line(execute(kc, "%download payload.py {dest}"))
        assert "outside this notebook's folder" in said, said
        assert not planted.exists()

        said = error_line(execute(kc, "%sandbox attach {opt}"))
        assert "cannot be an option: '--destroy-previous'" in said, said

        # typed by the user, the same paths are the user's own choice and work
        assert execute(kc, f"%upload {secret} mine.txt").reply["content"]["status"] == "ok"
        assert execute(kc, "print(open('/workspace/mine.txt').read())").text() == secret.read_text() + "\n"
        # and a value inside the folder is fine
        assert execute(kc, "here = 'copy.py'\n%download payload.py {here}").reply["content"]["status"] == "ok"
        assert (folder / "copy.py").read_text() == "planted"


def test_the_sandbox_cannot_write_the_magic_line(kernelspec: str, notebook) -> None:  # type: ignore[no-untyped-def]
    folder, _ = notebook
    with running_kernel(kernelspec, cwd=str(folder)) as (_, kc):
        assert "nothing: all outbound connections blocked" in execute(kc, "%egress block-all").text()
        execute(kc, "EVIL_LINE = '%egress open'\n" + HIJACK_PRINT)
        said = error_line(execute(kc, "%sandbox status {1}"))
        assert "the sandbox gave no usable values" in said, said
        # the hijack ran: the host's request went through the sandbox's print
        execute(kc, "builtins.print = _real_print")
        assert execute(kc, "print(open('/workspace/hijacked').read())").text().startswith("x")
        rules = execute(kc, "%egress").of_type("display_data")[0]["data"]["text/plain"]
        assert "nothing: all outbound connections blocked" in rules, rules
