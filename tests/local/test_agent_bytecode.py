"""The agent's optimization level (local/bwrap.py `agent_optimization`): -OO where the
sandbox's Python has its standard library compiled at that level, with the agent's own
bytecode bound at the same level, in a sandbox and in a fork's child alike."""

from __future__ import annotations

import importlib
import py_compile
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from createos import Client, SandboxInstance
from createos.models import CreateSandboxRequest, RunCommandRequest

from sandbox_kernel.guest import bundle as guest_bundle
from sandbox_kernel.local import bwrap


@pytest.fixture
def fresh_choice() -> Iterator[None]:
    bwrap.agent_optimization.cache_clear()
    yield
    bwrap.agent_optimization.cache_clear()


def test_without_the_stdlibs_bytecode_at_that_level_the_agent_runs_unoptimized(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fresh_choice: None) -> None:
    """A distribution's Python often has only plain bytecode: at -OO the agent would compile
    its read-only stdlib again at every start."""
    module = tmp_path / "stdlib_stand_in.py"
    module.write_text('"""A docstring."""\n')
    py_compile.compile(str(module), optimize=0)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setattr(bwrap, "AGENT_STDLIB", ("stdlib_stand_in",))
    assert bwrap.agent_optimization() == ()
    py_compile.compile(str(module), optimize=2)
    assert Path(bwrap.cached_bytecode_path(str(module), optimized=True)).exists()
    bwrap.agent_optimization.cache_clear()
    assert bwrap.agent_optimization() == ("-OO",)


# Run in the sandbox: its agent's command line (readable there, as on the host, though the
# agent is undumpable; its environment is not, on the host, to an engine's unprivileged user).
AGENT_COMMAND_LINE = """
import os
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        words = open('/proc/%s/cmdline' % pid, 'rb').read().decode().split('\\0')
    except OSError:
        continue
    # bwrap's processes, above the agent, name it in theirs too
    if os.path.basename(words[0]) != 'bwrap' and any(word.endswith('/run_agent.py') for word in words):
        print(' '.join(words))
"""


def agent_command_lines(sandbox: SandboxInstance) -> list[list[str]]:
    """The command lines of the agents the sandbox sees: its own, and a fork's or its
    source's (they share a pid namespace on the local engine)."""
    result = sandbox.run_command(RunCommandRequest(
        command=sys.executable, arguments=["-I", "-S", "-c", AGENT_COMMAND_LINE])).result
    lines = [line.split() for line in result.standard_output.splitlines()]
    assert lines, result.standard_error
    return lines


def test_agents_run_at_the_level_of_the_bytecode_bound_beside_their_modules(vendor: Client) -> None:
    level = bwrap.agent_optimization()
    agent_dir = f"{bwrap.AGENT_MOUNT}/{guest_bundle.PACKAGE}/agent"
    # The sandbox's Python at the agent's level imports the agent's module from the bound
    # bytecode (`-v` names where each module's code object came from).
    probe = ("import sys; sys.path.insert(0, %r); import %s.agent.processes"
             % (bwrap.AGENT_MOUNT, guest_bundle.PACKAGE))
    box = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    try:
        box.pause()
        box.wait_until_paused()
        child = box.fork()
        try:
            child.wait_until_running()
            box.resume()
            box.wait_until_running()
            for sandbox in (box, child):
                for words in agent_command_lines(sandbox):
                    assert [word for word in words if word.startswith("-O")] == list(level), words
                result = sandbox.run_command(RunCommandRequest(
                    command=sys.executable, arguments=["-I", "-S", *level, "-v", "-c", probe])).result
                assert result.exit_code == 0, result.standard_error
                cached = bwrap.cached_bytecode_path(f"{agent_dir}/processes.py", optimized=bool(level))
                assert f"code object from '{cached}'" in result.standard_error, result.standard_error[-2000:]
        finally:
            child.destroy()
    finally:
        box.destroy()
