"""How a command ends when its sandbox or the engine goes away, through the vendor's
Python SDK: as CreateOS ends it, a JSend error for a buffered exec, an `error` frame then
`exit_code` for a stream; never a 200 with nothing said, a bare EOF or a torn body."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest
from createos import APIError, Client, CreateSandboxRequest, RunCommandRequest, SandboxInstance

from engine_helpers import running_engine

pytestmark = pytest.mark.slow
SHAPE = "s-1vcpu-512mb"
STARTED = "started\n"
# Prints, then waits for ever: only the fault under test ends it.
LONG = RunCommandRequest(command="bash", arguments=["-c", f"printf '{STARTED}'; exec sleep 600"])



def wait_for_command(sandbox: SandboxInstance) -> None:
    """Until the long command runs (its sleep is a process of the sandbox)."""
    sandbox.shell("until grep -qsx sleep /proc/[0-9]*/comm; do sleep 0.05; done")


def buffered_outcome(sandbox: SandboxInstance, found: dict) -> threading.Thread:
    def run() -> None:
        try:
            found["result"] = sandbox.run_command(LONG)
        except APIError as error:
            found["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def stream_events(sandbox: SandboxInstance, on_start) -> list[tuple[str, object]]:  # type: ignore[no-untyped-def]
    events = []
    with sandbox.stream_command(LONG) as stream:
        for event in stream:
            if event.type == "heartbeat":
                continue
            events.append((str(event.type), event.data or event.error_message or event.exit_code))
            if event.data == STARTED:
                on_start()
    return events


def test_destroy_during_a_buffered_exec_is_a_jsend_error(vendor: Client) -> None:
    sandbox = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    found: dict = {}
    thread = buffered_outcome(sandbox, found)
    wait_for_command(sandbox)
    sandbox.destroy()
    thread.join(60)
    error = found.get("error")
    assert error is not None, found
    assert error.status_code == 409
    assert json.loads(error.body) == {"status": "fail", "data": {
        "message": "the sandbox was destroyed while the command ran", "code": "sandbox_destroyed"}}


def test_destroy_during_a_stream_ends_with_an_error_frame_then_the_exit(vendor: Client) -> None:
    sandbox = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    events = stream_events(sandbox, sandbox.destroy)
    assert events == [("stdout", STARTED), ("error", "the sandbox was destroyed while the command ran"),
                      ("exit", -1)]


def test_sigterm_ends_running_commands_cleanly(tmp_path: Path) -> None:
    with running_engine(tmp_path) as endpoint, Client(api_key=endpoint.token, base_url=endpoint.url) as client:
        buffered = client.create_sandbox(CreateSandboxRequest(shape=SHAPE))
        streaming = client.create_sandbox(CreateSandboxRequest(shape=SHAPE))
        found: dict = {}
        thread = buffered_outcome(buffered, found)
        wait_for_command(buffered)
        events = stream_events(streaming, lambda: os.kill(endpoint.pid, signal.SIGTERM))
        thread.join(60)
    assert events == [("stdout", STARTED), ("error", "the local engine shut down while the command ran"),
                      ("exit", -1)]
    error = found.get("error")
    assert error is not None, found
    assert error.status_code == 500 and error.headers["content-type"] == "application/json"
    assert json.loads(error.body) == {"status": "error", "code": 500,
                                      "message": "the local engine shut down while the command ran"}
