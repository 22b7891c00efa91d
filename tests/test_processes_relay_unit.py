"""The engine's pass-through of a managed process's frames (local/processes.py `_relay`),
fed frames exactly as the agent writes them (guest/agent.py `frame`): no engine, no sandbox."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

from sandbox_kernel.local import processes

sys.path.insert(0, str(Path(processes.__file__).parent / "guest"))
from agent import frame  # noqa: E402 (the agent is a script beside its own modules)


class CountingSandbox:
    """Stands in for LocalSandbox where _relay needs it: it only counts activity."""

    def __init__(self) -> None:
        self.touches = 0

    def touch(self) -> None:
        self.touches += 1


async def relayed(frames: list[bytes]) -> tuple[list[dict], int]:
    async def agent() -> AsyncIterator[bytes]:
        for line in frames:
            yield line

    sandbox = CountingSandbox()
    lines = [json.loads(line) async for line in
             processes._relay(sandbox, agent(), contextlib.AsyncExitStack())]  # type: ignore[arg-type]
    return lines, sandbox.touches


async def test_data_frames_are_activity_and_pass_unchanged() -> None:
    data = [frame({"type": "data", "seq": n, "stream": "stdout", "data_base64": "eA=="}) for n in (1, 2)]
    lines, touches = await relayed([*data, frame({"type": "exit", "seq": 2, "exit_code": 0, "signal": None})])
    assert [line["type"] for line in lines] == ["data", "data", "exit"]
    assert touches == 2


async def test_a_stream_that_ends_without_exit_gets_an_error_frame() -> None:
    lines, touches = await relayed([frame({"type": "data", "seq": 1, "stream": "stderr", "data_base64": ""})])
    assert [line["type"] for line in lines] == ["data", "error"]
    assert touches == 1
