"""A cell, `%sandbox attach` or `%upload` sent while the sandbox is pausing, resuming or
being forked waits for the transition to settle, then wakes the sandbox and does its work.

On CreateOS a pause of a large VM takes seconds (an auto-pause firing as the user comes
back), and the service answers 409 to a resume, an exec or an upload until the sandbox is
settled (createos-api.md §4.2). A proxy in front of the real engine shows that: the
sandbox's views say "pausing" (or "resuming", "forking") and every change asked of it is
refused with 409, until the test releases it once the kernel has looked at it a few
times (it is waiting, not failing). The pause or resume itself is made by the real
engine, behind the kernel's back, as an auto-pause or another notebook makes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient

from engine_helpers import sandbox_status, wait_status
from fault_proxy import PROCESS_CREATE, FaultProxy, proxied_engine
from kernel_helpers import RELAYS, Execution, execute, is_status_line, running_kernel
from sandbox_kernel.api import SandboxClient, SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow

LOOKS = 3  # views of the held transition the kernel takes before the test ends it
KILL_RELAYS_SOON = RELAYS + """
import threading
def kill_relays_soon():
    time.sleep(1.0)
    for pid in relays():
        os.kill(pid, signal.SIGKILL)
threading.Thread(target=kill_relays_soon, daemon=True).start()
"""


@pytest.fixture
def notebook(kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
             ) -> Iterator[tuple[FaultProxy, BlockingKernelClient, str]]:
    """A kernel behind the proxy, with some state in its sandbox; (proxy, client, sandbox id)."""
    with proxied_engine(engine, monkeypatch) as proxy:
        with running_kernel(kernelspec, cwd=str(tmp_path)) as (_, kc):
            sandbox_id = ok(execute(kc, "import os\nstate = 'kept'\nprint(os.environ['SANDBOX_ID'])")).text().strip()
            yield proxy, kc, sandbox_id
            proxy.release()  # whatever happened, the kernel's shutdown destroys its sandboxes


def ok(result: Execution) -> Execution:
    assert result.reply["content"]["status"] == "ok", result.text("stderr") or result.of_type("error")
    return result


def behind_the_kernel(engine: EngineEndpoint, action: str, sandbox_id: str, settled: SandboxStatus) -> None:
    """Pause or resume the sandbox on the engine itself (an auto-pause, another notebook)."""
    async def act() -> None:
        async with SandboxClient(engine.url, engine.token) as client:
            await getattr(client, f"{action}_sandbox")(sandbox_id)
            await wait_status(client, sandbox_id, settled)

    asyncio.run(act())


@contextlib.contextmanager
def released_once_waited_for(proxy: FaultProxy) -> Iterator[None]:
    """End the held transition once the kernel has looked at it LOOKS times; the test then
    asserts it did (a kernel that fails at once never looks that often)."""
    done = threading.Event()

    def release() -> None:
        while proxy.held_views < LOOKS and not done.wait(0.02):
            pass
        proxy.release()

    releaser = threading.Thread(target=release)
    releaser.start()
    try:
        yield
    finally:
        done.set()
        releaser.join()


def notes(result: Execution) -> list[str]:
    """The kernel's own progress lines in the cell."""
    return [m["content"]["data"]["text/plain"] for m in result.messages if is_status_line(m)]


def test_a_cell_sent_while_the_sandbox_pauses_runs_once_it_can(
        notebook: tuple[FaultProxy, BlockingKernelClient, str], engine: EngineEndpoint) -> None:
    proxy, kc, sandbox_id = notebook
    proxy.hold_transition(sandbox_id, "pausing")
    behind_the_kernel(engine, "pause", sandbox_id, SandboxStatus.PAUSED)
    with released_once_waited_for(proxy):
        result = execute(kc, "print(state)")
    assert ok(result).text() == "kept\n"
    assert proxy.refused_in_transition >= 1, "the cell was never refused: the race did not happen"
    assert proxy.held_views >= LOOKS
    assert notes(result)[0] == f"Sandbox {sandbox_id} was paused: resuming…"
    assert "resumed in" in notes(result)[-1]
    assert sandbox_status(engine, sandbox_id) == SandboxStatus.RUNNING


def test_a_cell_sent_while_the_sandbox_resumes_runs_once_it_is_running(
        notebook: tuple[FaultProxy, BlockingKernelClient, str], engine: EngineEndpoint) -> None:
    proxy, kc, sandbox_id = notebook
    behind_the_kernel(engine, "pause", sandbox_id, SandboxStatus.PAUSED)
    proxy.hold_transition(sandbox_id, "resuming")
    behind_the_kernel(engine, "resume", sandbox_id, SandboxStatus.RUNNING)
    with released_once_waited_for(proxy):
        result = execute(kc, "print(state)")
    assert ok(result).text() == "kept\n"
    assert proxy.refused_in_transition >= 1, "the cell was never refused: the race did not happen"
    assert proxy.held_views >= LOOKS


def test_an_upload_sent_while_the_sandbox_pauses_lands_once_it_can(
        notebook: tuple[FaultProxy, BlockingKernelClient, str], engine: EngineEndpoint, tmp_path: Path) -> None:
    proxy, kc, sandbox_id = notebook
    (tmp_path / "data.csv").write_text("x,y\n1,2\n")
    proxy.hold_transition(sandbox_id, "pausing")
    behind_the_kernel(engine, "pause", sandbox_id, SandboxStatus.PAUSED)
    with released_once_waited_for(proxy):
        uploaded = execute(kc, "%upload data.csv")
    ok(uploaded)
    assert proxy.held_views >= LOOKS
    assert ok(execute(kc, "print(open('/workspace/data.csv').read(), state)")).text() == "x,y\n1,2\n kept\n"


@pytest.mark.parametrize("transition", ["forking", "pausing"])
def test_attach_to_a_sandbox_in_transition_waits_and_keeps_its_python(
        notebook: tuple[FaultProxy, BlockingKernelClient, str], engine: EngineEndpoint, transition: str) -> None:
    """Another notebook's fork, still being made (or pausing), is attached to once it settles."""
    proxy, kc, sandbox_id = notebook
    forked = ok(execute(kc, "%sandbox fork"))
    child = re.search(r"into (sb-\w+)", notes(forked)[-1]).group(1)
    proxy.hold_transition(child, transition)
    if transition == "pausing":
        behind_the_kernel(engine, "pause", child, SandboxStatus.PAUSED)
    with released_once_waited_for(proxy):
        attached = execute(kc, f"%sandbox attach {child}")
    assert f"This notebook now drives sandbox {child} (its Python state kept)" in notes(ok(attached))
    assert proxy.held_views >= LOOKS
    assert ok(execute(kc, "print(os.environ['SANDBOX_ID'], state)")).text() == f"{child} kept\n"


def test_a_relay_killed_as_the_sandbox_pauses_is_replaced_once_it_runs_and_keeps_its_python(
        notebook: tuple[FaultProxy, BlockingKernelClient, str], engine: EngineEndpoint) -> None:
    """The kernel's relay dies just as the sandbox starts pausing (an auto-pause): a new
    relay is refused (409) while the sandbox pauses and while it is paused, but the runner
    lives on. The kernel waits; the next cell resumes the sandbox and runs in the same
    Python (the refusal was taken for the runner's death, and the notebook's variables lost)."""
    proxy, kc, sandbox_id = notebook
    ok(execute(kc, KILL_RELAYS_SOON))
    proxy.hold_transition(sandbox_id, "pausing")
    first_held = len(proxy.request_lines)

    def relay_asked_for() -> bool:
        return any(PROCESS_CREATE.match(line) for line in proxy.request_lines[first_held:])

    deadline = time.monotonic() + 60
    while not (relay_asked_for() and proxy.refused_in_transition and proxy.held_views) \
            and time.monotonic() < deadline:
        time.sleep(0.05)
    assert relay_asked_for() and proxy.refused_in_transition, \
        "no new relay was asked for (and refused) while the sandbox paused: the race did not happen"
    assert proxy.held_views, "the kernel did not look at the sandbox after the refusal"
    behind_the_kernel(engine, "pause", sandbox_id, SandboxStatus.PAUSED)
    proxy.release()
    result = execute(kc, "print(state, len(relays()))")
    assert ok(result).text() == "kept 1\n", "the same Python, reached through one new relay"
    assert notes(result)[0] == f"Sandbox {sandbox_id} was paused: resuming…"
