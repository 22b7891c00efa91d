"""The engine's pass-through of a managed process's frames (local/processes.py `_relay`),
fed frames exactly as the agent writes them (guest/agent/processes.py `data_frame`, guest/agent/agent.py
`frame`): no engine, no sandbox. And the window sizes the kernel's relay relies on."""

from __future__ import annotations

import base64
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sandbox_kernel.guest import agent as agent_package
from sandbox_kernel.guest.agent.agent import frame
from sandbox_kernel.guest.agent.processes import CHUNK_OVERHEAD, READ_CHUNK, WINDOW_BYTES, data_frame
from sandbox_kernel.guest.protocol import CHANNEL_WINDOW
from sandbox_kernel.local import processes


class CountingSandbox:
    """Stands in for LocalSandbox where _relay needs it: it only counts activity."""

    def __init__(self) -> None:
        self.touches = 0
        self.gate = None  # no egress proxy: no refusals to report

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
    data = [data_frame(n, "stdout", b"x", None) for n in (1, 2)]
    lines, touches = await relayed([*data, frame({"type": "exit", "seq": 2, "exit_code": 0, "signal": None})])
    assert [line["type"] for line in lines] == ["data", "data", "exit"]
    assert touches == 2


async def test_a_stream_that_ends_without_exit_gets_an_error_frame() -> None:
    lines, touches = await relayed([data_frame(1, "stderr", b"", None)])
    assert [line["type"] for line in lines] == ["data", "error"]
    assert touches == 1


@pytest.mark.parametrize("data", [b"", b"x", "é\n€".encode(), bytes(range(256)) * 1024])
@pytest.mark.parametrize("oldest", [None, 7])
def test_data_frames_are_the_compact_json_of_their_fields(data: bytes, oldest: int | None) -> None:
    """The agent spells data frames out by hand: they must be what its JSON encoder writes."""
    fields = {"type": "data", "seq": 9, "stream": "stdout", "data_base64": base64.b64encode(data).decode()}
    if oldest is not None:
        fields["oldest_available_seq"] = oldest
    assert data_frame(9, "stdout", data, oldest) == frame(fields)
    assert data_frame(9, "stdout", data, oldest).startswith(processes.DATA_FRAME)


def test_the_agent_encodes_output_with_pybase64_as_binascii_would() -> None:
    """The agent runs as `python -I -S` (no site): it still finds pybase64 in its own
    environment (which has it here, as the engine's has), leaves its import path as it was,
    and its encoder writes what binascii's does."""
    import subprocess

    # As agent.py started by path: the guest package's parent directory on sys.path.
    package_parent = Path(agent_package.__file__).parents[3]
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); before = list(sys.path); "
             "from sandbox_kernel.guest.agent import processes; "
             "encode = processes._output_encoder(); print(encode.__module__, sys.path == before)")
    found = subprocess.run([sys.executable, "-I", "-S", "-c", probe, str(package_parent)], capture_output=True, text=True,
                           check=True).stdout.split()
    assert found == ["pybase64._pybase64", "True"]
    guest_processes = sys.modules[data_frame.__module__]
    for data in (b"", b"x", bytes(range(256)) * 1025, b"\xff" * 100_001):
        assert guest_processes._output_encoder()(data) == guest_processes._stdlib_base64(data)


def test_the_relays_window_fits_in_what_the_agent_retains() -> None:
    """What the kernel has not acknowledged is still retained by the agent, so a reconnect
    replays it: the relay's window plus one whole chunk (the agent drops whole chunks) and
    the chunks' charge, for chunks no smaller than 4 KiB."""
    assert CHANNEL_WINDOW + READ_CHUNK + (CHANNEL_WINDOW // 4096 + 1) * CHUNK_OVERHEAD <= WINDOW_BYTES
