"""%sandbox magics: parsing on the host, and pause/resume/attach from notebook cells."""

from __future__ import annotations

import asyncio
import re
from datetime import datetime, timezone

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from engine_helpers import sandbox_status
from kernel_helpers import VIA_CREATEOS, execute, is_status_line, running_kernel
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.api.models import parse_rfc3339 as parse_time
from sandbox_kernel.kernel.magics.parsing import PARSER, MagicError, split_cell
from sandbox_kernel.kernel.magics.tables import describe_age

# -- parsing (no kernel) ------------------------------------------------------------------


def test_split_cell_keeps_order_and_only_takes_top_level_magics() -> None:
    code = "x = 1\n%sandbox pause\nif x:\n    %sandbox status\n%sandboxes\n%sandbox\n"
    segments = [(s.magic, s.text) for s in split_cell(code)]
    assert segments == [(False, "x = 1\n"), (True, "%sandbox pause"),
                        (False, "if x:\n    %sandbox status\n%sandboxes\n"), (True, "%sandbox")]


@pytest.mark.parametrize(("line", "fragment"), [
    ("%sandbox pause now", "unrecognized arguments: now"),
    ("%sandbox frobnicate", "invalid choice: 'frobnicate'"),
    ("%sandbox on-shutdown sometimes", "invalid choice: 'sometimes'"),
    ("%sandbox attach", "the following arguments are required: ID|NAME"),
])
def test_bad_magic_lines_give_one_line(line: str, fragment: str) -> None:
    with pytest.raises(MagicError) as caught:
        PARSER.parse_args(line.split()[1:])
    message = str(caught.value)
    assert fragment in message and "\n" not in message and message.startswith("%sandbox")
    assert message.endswith("(see %sandbox help)")


def test_timestamps_from_createos_and_the_local_engine() -> None:
    assert parse_time("2026-12-02T10:07:40.525093Z") == datetime(2026, 12, 2, 10, 7, 40, 525093, timezone.utc)
    assert parse_time("2026-12-02T10:07:40.123456789Z") == datetime(2026, 12, 2, 10, 7, 40, 123456, timezone.utc)
    assert parse_time("2026-12-02T10:07:40+01:00") is not None
    assert parse_time("yesterday") is None
    now = datetime(2026, 12, 2, 12, 0, 0, tzinfo=timezone.utc)
    assert describe_age("2026-12-02T11:59:30Z", now) == "30 s"
    assert describe_age("2026-12-02T11:00:00Z", now) == "60 min"
    assert describe_age("2026-12-02T08:30:00Z", now) == "3 h 30 min"


# -- in a notebook ------------------------------------------------------------------------

pytest_slow = pytest.mark.slow


def destroy(engine: EngineEndpoint, sandbox_id: str) -> None:
    async def delete() -> None:
        async with SandboxClient(engine.url, engine.token) as client:
            await client.delete_sandbox(sandbox_id)

    asyncio.run(delete())


def create_and_destroy(engine: EngineEndpoint) -> str:
    async def make() -> str:
        async with SandboxClient(engine.url, engine.token) as client:
            created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-256mb"))
            await client.delete_sandbox(created.id)
            return created.id

    return asyncio.run(make())


@pytest.fixture(scope="module")
def sandbox_id(kc: BlockingKernelClient) -> str:
    return execute(kc, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()


def one_error_line(kc: BlockingKernelClient, code: str) -> str:
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "error"
    lines = result.text("stderr").splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest_slow
def test_help(kc: BlockingKernelClient, sandbox_id: str) -> None:
    for line in ("%sandbox", "%sandbox help", "%sandbox --help"):
        text = execute(kc, line).text()
        assert text.startswith("%sandbox — manage this notebook's sandbox")
        assert "%sandbox pause" in text and "%sandbox attach ID|NAME" in text


@pytest_slow
def test_misuse_is_one_line_and_the_kernel_lives(kc: BlockingKernelClient, sandbox_id: str,
                                                 engine: EngineEndpoint) -> None:
    assert "invalid choice: 'frobnicate'" in one_error_line(kc, "%sandbox frobnicate")
    assert "no sandbox with id or name 'sb-no-such-sandbox'" in one_error_line(kc, "%sandbox attach sb-no-such-sandbox")
    assert one_error_line(kc, "%sandbox resume").startswith("sandbox-kernel: ")  # it is running
    gone = create_and_destroy(engine)
    assert f"sandbox {gone} is destroyed: it cannot run cells" in one_error_line(kc, f"%sandbox attach {gone}")
    # A failed attach leaves the notebook on its own sandbox.
    assert execute(kc, "import os\nprint(os.environ['SANDBOX_ID'])").text() == f"{sandbox_id}\n"


@pytest_slow
def test_status_is_a_table(kc: BlockingKernelClient, sandbox_id: str) -> None:
    [shown] = execute(kc, "%sandbox status").of_type("display_data")
    text, page = shown["data"]["text/plain"], shown["data"]["text/html"]
    assert text.splitlines()[0].split() == ["id", sandbox_id]
    assert "state        running" in text and "s-1vcpu-1gb (1 vCPU, 1024 MiB)" in text
    assert "forked from  —" in text and "on shutdown  destroy" in text
    assert re.search(r"cost so far  \$0\.\d{4} \(running \d+ s, paused \d+ s\)", text)
    assert page.startswith('<div class="tex2jax_ignore mathjax_ignore"><table>') and f"<td>{sandbox_id}</td>" in page


@pytest_slow
def test_pause_resume_keeps_state(kc: BlockingKernelClient, sandbox_id: str, engine: EngineEndpoint) -> None:
    execute(kc, "state = {i: str(i) for i in range(200_000)}")
    paused = execute(kc, "%sandbox pause")
    assert paused.reply["content"]["status"] == "ok"
    lines = [m["content"]["data"]["text/plain"] for m in paused.messages if is_status_line(m)]
    assert lines[0] == f"Pausing sandbox {sandbox_id}…"
    assert lines[-1].startswith(f"Sandbox {sandbox_id} paused (")
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.PAUSED
    assert "state        paused" in execute(kc, "%sandbox status").of_type("display_data")[0]["data"]["text/plain"]
    assert one_error_line(kc, "%sandbox pause").startswith("sandbox-kernel: ")  # already paused

    resumed = execute(kc, "%sandbox resume")
    assert [m for m in resumed.messages if is_status_line(m)][-1]["content"]["data"]["text/plain"].startswith(
        f"Sandbox {sandbox_id} running again (")
    assert execute(kc, "len(state), state[199_999]").of_type("execute_result")[0]["data"]["text/plain"] == \
        "(200000, '199999')"


@pytest_slow
def test_a_cell_resumes_a_paused_sandbox_and_says_so(kc: BlockingKernelClient, sandbox_id: str,
                                                    engine: EngineEndpoint) -> None:
    execute(kc, "kept = 'before the pause'\n%sandbox pause")
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.PAUSED
    result = execute(kc, "print(kept)")
    notes = [m["content"]["data"]["text/plain"] for m in result.messages if is_status_line(m)]
    assert notes[0] == f"Sandbox {sandbox_id} was paused: resuming…"
    assert "resumed in" in notes[-1]
    assert result.text() == "before the pause\n"
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING


@pytest_slow
def test_list_marks_this_notebook(kc: BlockingKernelClient, sandbox_id: str) -> None:
    [shown] = execute(kc, "%sandbox list").of_type("display_data")
    assert f"{sandbox_id} (this notebook)" in shown["data"]["text/plain"]


@pytest_slow
def test_attach_drives_another_sandbox_with_its_state(kernelspec: str, kc: BlockingKernelClient,
                                                     sandbox_id: str, engine: EngineEndpoint) -> None:
    execute(kc, "shared_secret = 'from the first notebook'")
    with running_kernel(kernelspec) as (_, kc2):
        own_id = execute(kc2, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()
        attached = execute(kc2, f"%sandbox attach {sandbox_id} --destroy-previous")
        assert attached.reply["content"]["status"] == "ok"
        assert f"Destroyed the previous sandbox {own_id}" in attached.text()
        assert sandbox_status(engine, own_id) == SandboxStatus.DESTROYED
        assert execute(kc2, "print(shared_secret)").text() == "from the first notebook\n"
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING


@pytest_slow
def test_start_attached_and_shutdown_policies(kernelspec: str, kc: BlockingKernelClient, sandbox_id: str,
                                              engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    execute(kc, "marker = 42")
    monkeypatch.setenv("SANDBOX_KERNEL_SANDBOX_ID", sandbox_id)
    with running_kernel(kernelspec) as (_, kc2):
        monkeypatch.delenv("SANDBOX_KERNEL_SANDBOX_ID")
        assert execute(kc2, "print(marker)").text() == "42\n"
        status = execute(kc2, "%sandbox status").of_type("display_data")[0]["data"]["text/plain"]
        assert "on shutdown  keep" in status
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING  # adopted, so kept

    with running_kernel(kernelspec) as (_, kc3):
        third_id = execute(kc3, "import os\nprint(os.environ['SANDBOX_ID'])").text().strip()
        assert execute(kc3, "%sandbox on-shutdown pause").text() == \
            f"When this notebook shuts down, sandbox {third_id} will be paused\n"
    assert sandbox_status(engine, third_id) in (SandboxStatus.PAUSING, SandboxStatus.PAUSED)
    destroy(engine, third_id)


@pytest_slow
def test_start_attached_by_kernel_argument(kernelspec: str, kc: BlockingKernelClient, sandbox_id: str,
                                           engine: EngineEndpoint) -> None:
    execute(kc, "argument_marker = 'seen'")
    with running_kernel(kernelspec, extra_arguments=[f"--SandboxKernel.sandbox_id={sandbox_id}"]) as (_, kc2):
        assert execute(kc2, "print(argument_marker)").text() == "seen\n"
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING


@pytest_slow
def test_cost_covers_this_notebooks_sandboxes(kc: BlockingKernelClient, sandbox_id: str) -> None:
    [shown] = execute(kc, "%sandbox cost").of_type("display_data")
    text = shown["data"]["text/plain"]
    assert re.search(rf"{sandbox_id} \(this notebook\)\s+\$0\.\d{{4}} \(running", text)
    assert re.search(r"total\s+\$0\.\d{4}", text)
    assert "CreateOS, 2026-10-17: $0.03616363/vCPU-h running" in text
    assert ("local sandboxes are free: this is what they would cost on CreateOS" in text) != VIA_CREATEOS
