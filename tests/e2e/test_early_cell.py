"""A cell is sent to the sandbox as its execute_request arrives, ahead of ipykernel's dispatch
(kernel/early_cell.py). It runs once, on the count its execute_input showed, and the frontend
sees its output after that execute_input, as for any cell. The kernel's debug log says which
requests went ahead, so each test first shows that the way it tests was taken."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import TIMEOUT, execute, is_status_line, running_kernel

pytestmark = pytest.mark.slow

Logged = tuple[BlockingKernelClient, Path]


@pytest.fixture(scope="module")
def logged(kernelspec: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Logged]:
    log_path = tmp_path_factory.mktemp("early-cell") / "kernel.log"
    with log_path.open("w") as log, running_kernel(kernelspec, stdout=log, stderr=log,
                                                   extra_arguments=["--IPKernelApp.log_level=DEBUG"]) as (_, kc):
        yield kc, log_path


def went_ahead(log_path: Path, msg_id: str) -> bool:
    return f"request {msg_id}: its cell was sent ahead of its dispatch" in log_path.read_text()


def test_a_cell_sent_ahead_runs_once_on_its_count_after_its_execute_input(logged: Logged) -> None:
    kc, log_path = logged
    execute(kc, "runs = 0")
    for expected in range(1, 6):
        result = execute(kc, "runs += 1\nprint(runs)\nruns")
        assert went_ahead(log_path, result.reply["parent_header"]["msg_id"])
        assert [m["msg_type"] for m in result.messages] == \
            ["status", "execute_input", "stream", "execute_result", "status"]
        assert result.text() == f"{expected}\n"
        count = result.reply["content"]["execution_count"]
        assert [m["content"]["execution_count"] for m in result.messages
                if m["msg_type"] in ("execute_input", "execute_result")] == [count, count]
        # The runner kept the result under that count too (IPython's Out).
        shown = execute(kc, f"Out[{count}]").of_type("execute_result")
        assert shown[0]["data"]["text/plain"] == str(expected)


def test_only_a_cell_that_would_run_at_once_goes_ahead(logged: Logged) -> None:
    kc, log_path = logged
    # A magic line runs on the host first; user_expressions are evaluated after the code.
    magic = execute(kc, "%sandbox status\nafter_magic = 1")
    expressions = execute(kc, "z = 2", user_expressions={"z": "z"})
    assert expressions.reply["content"]["user_expressions"]["z"]["data"]["text/plain"] == "2"
    for result in (magic, expressions):
        assert result.reply["content"]["status"] == "ok"
        assert not went_ahead(log_path, result.reply["parent_header"]["msg_id"])
    # Requests sent together: the first goes ahead, the others wait their turn as usual.
    msg_ids = [kc.execute(f"print({i})") for i in range(3)]
    replies = [kc.get_shell_msg(timeout=TIMEOUT) for _ in msg_ids]
    assert [reply["parent_header"]["msg_id"] for reply in replies] == msg_ids
    assert [went_ahead(log_path, msg_id) for msg_id in msg_ids] == [True, False, False]
    texts: dict[str, str] = {msg_id: "" for msg_id in msg_ids}
    idle: set[str] = set()
    while idle != set(msg_ids):
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        parent = msg["parent_header"].get("msg_id")
        if parent not in texts:
            continue
        if msg["msg_type"] == "stream":
            texts[parent] += msg["content"]["text"]
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle.add(parent)
    assert list(texts.values()) == ["0\n", "1\n", "2\n"]


def test_a_cell_sent_ahead_to_a_paused_sandbox_runs_once_after_the_resume(logged: Logged) -> None:
    kc, log_path = logged
    execute(kc, "resumed_runs = 0\n%sandbox pause")
    result = execute(kc, "resumed_runs += 1\nprint(resumed_runs)")
    msg_id = result.reply["parent_header"]["msg_id"]
    assert went_ahead(log_path, msg_id)
    assert f"request {msg_id}: the sandbox refused its cell sent ahead" in log_path.read_text()
    kinds = [m["msg_type"] for m in result.messages]
    assert kinds[:2] == ["status", "execute_input"] and kinds[-1] == "status"
    notes = [m["content"]["data"]["text/plain"] for m in result.messages if is_status_line(m)]
    assert "was paused: resuming…" in notes[0]
    assert result.text() == "1\n"
