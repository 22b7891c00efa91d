"""Fork on the real local engine: CreateOS semantics, and a real copy that diverges.

A fork copies the paused source's files and its fork-aware processes (the runner; see
test_fork_notebook.py for live Python state) into a sandbox with its own mount, network,
uts and ipc namespaces. Destroying either side leaves the other working.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine_helpers import running_engine, sandbox_pids, wait_status
from sandbox_kernel.api import (
    ConflictError,
    CreateSandboxRequest,
    ForkSandboxRequest,
    NotFoundError,
    SandboxClient,
    SandboxStatus,
)

pytestmark = pytest.mark.slow


async def sh(client: SandboxClient, sandbox_id: str, script: str) -> str:
    result = (await client.exec(sandbox_id, "sh", ["-c", script])).result
    assert result.exit_code == 0, result.stderr
    return result.stdout


async def paused_sandbox(client: SandboxClient, **create: object) -> str:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb", **create))
    await sh(client, created.id, "echo original > /workspace/note.txt; echo scratch > /tmp/scratch.txt")
    await client.pause_sandbox(created.id)
    await wait_status(client, created.id, SandboxStatus.PAUSED)
    return created.id


async def fork(client: SandboxClient, source: str, request: ForkSandboxRequest | None = None,
               want: SandboxStatus = SandboxStatus.RUNNING) -> str:
    child = await client.fork_sandbox(source, request)
    assert child.forked_from == source and child.id != source
    seen, _ = await wait_status(client, child.id, want, timeout=30)
    assert seen[0] in (SandboxStatus.FORKING, want)
    return child.id


async def test_fork_needs_a_paused_source_and_a_known_id(client: SandboxClient) -> None:
    created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
    try:
        with pytest.raises(ConflictError) as caught:
            await client.fork_sandbox(created.id)
        assert "only a paused sandbox can be forked" in caught.value.user_message()
        with pytest.raises(NotFoundError):
            await client.fork_sandbox("sb-no-such-sandbox")
    finally:
        await client.delete_sandbox(created.id)


async def test_fork_copies_then_diverges_and_outlives_its_parent(client: SandboxClient) -> None:
    parent = await paused_sandbox(client, envs={"COLOUR": "blue"})
    child = await fork(client, parent)
    assert (await client.get_sandbox(parent)).status == SandboxStatus.PAUSED  # the parent stays paused
    view = await client.get_sandbox(child)
    assert view.forked_from == parent and view.envs == ["COLOUR"]

    assert await sh(client, child, "cat /workspace/note.txt /tmp/scratch.txt; echo $SANDBOX_ID $COLOUR") == \
        f"original\nscratch\n{child} blue\n"
    await sh(client, child, "echo child > /workspace/note.txt; echo only-child > /workspace/new.txt")
    await client.resume_sandbox(parent)
    await wait_status(client, parent, SandboxStatus.RUNNING)
    assert await sh(client, parent, "cat /workspace/note.txt; ls /workspace; echo $SANDBOX_ID") == \
        f"original\nnote.txt\n{parent}\n"
    await sh(client, parent, "echo parent > /workspace/note.txt")
    assert await sh(client, child, "cat /workspace/note.txt") == "child\n"

    # Their own network, hostname and IPC: nothing of the other's is reachable.
    await sh(client, parent, "nohup python3 -m http.server 8765 >/dev/null 2>&1 & sleep 0.5")
    probe = ("import socket\ntry:\n    socket.create_connection(('127.0.0.1', 8765), 2).close(); print('REACHED')\n"
             "except OSError as exc:\n    print(type(exc).__name__)")
    assert await sh(client, child, f"python3 -c \"{probe}\"") == "ConnectionRefusedError\n"

    await client.delete_sandbox(parent)
    assert await sh(client, child, "cat /workspace/note.txt") == "child\n"
    assert not sandbox_pids(parent, b"http.server"), "the parent's processes are gone"
    await client.delete_sandbox(child)
    assert not sandbox_pids(child) and not sandbox_pids(parent)


async def test_destroying_the_fork_leaves_the_parent(client: SandboxClient) -> None:
    parent = await paused_sandbox(client)
    child = await fork(client, parent)
    await client.delete_sandbox(child)
    assert not sandbox_pids(child)
    await client.resume_sandbox(parent)
    await wait_status(client, parent, SandboxStatus.RUNNING)
    assert await sh(client, parent, "cat /workspace/note.txt") == "original\n"
    await client.delete_sandbox(parent)


async def test_overrides_start_paused_and_forks_of_forks(client: SandboxClient) -> None:
    parent = await paused_sandbox(client, envs={"COLOUR": "blue"})
    child = await fork(client, parent, ForkSandboxRequest(start_paused=True, envs={"COLOUR": "green"},
                                                          egress=["127.0.0.1:9"]),
                       want=SandboxStatus.PAUSED)
    view = await client.get_sandbox(child)
    assert view.egress == ["127.0.0.1:9"] and view.paused_at
    with pytest.raises(ConflictError):
        await client.exec(child, "true")
    grandchild = await fork(client, child)
    assert await sh(client, grandchild, "cat /workspace/note.txt; echo $COLOUR") == "original\ngreen\n"
    await client.resume_sandbox(child)
    await wait_status(client, child, SandboxStatus.RUNNING)
    assert await sh(client, child, "echo $COLOUR") == "green\n"
    for sandbox_id in (parent, child, grandchild):
        await client.delete_sandbox(sandbox_id)


async def test_pausing_one_side_does_not_freeze_the_other(client: SandboxClient) -> None:
    parent = await paused_sandbox(client)
    child = await fork(client, parent)
    # The parent is paused (frozen) and the child still answers at once.
    assert await sh(client, child, "echo awake") == "awake\n"
    await client.pause_sandbox(child)
    await wait_status(client, child, SandboxStatus.PAUSED)
    await client.resume_sandbox(parent)
    await wait_status(client, parent, SandboxStatus.RUNNING)
    assert await sh(client, parent, "echo awake") == "awake\n"
    for sandbox_id in (parent, child):
        await client.delete_sandbox(sandbox_id)


async def test_fork_with_the_signal_freezer(tmp_path: Path) -> None:
    """Hosts without a usable cgroup pause by signals; forks must still be independent."""
    state = tmp_path / "state"
    state.mkdir()
    with running_engine(state, SANDBOX_KERNEL_FREEZER="signal",
                        SANDBOX_KERNEL_STATE_DIR=str(state)) as endpoint:
        async with SandboxClient(endpoint.url, endpoint.token) as api:
            parent = await paused_sandbox(api)
            child = await fork(api, parent)
            assert await sh(api, child, "echo awake; cat /workspace/note.txt") == "awake\noriginal\n"
            await api.delete_sandbox(parent)
            assert await sh(api, child, "echo still") == "still\n"
            await api.delete_sandbox(child)
            assert not sandbox_pids(child)
