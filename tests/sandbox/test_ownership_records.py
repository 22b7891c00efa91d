"""Fast checks of the ownership records (what gc calls an orphan) and of sandbox names
(how a fork carries one through the CreateOS API). The kernel-level behaviour is in
test_ownership.py."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandbox_kernel.api import names
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.api import SandboxStatus, SandboxView


@pytest.fixture(autouse=True)
def own_state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_STATE_DIR", str(tmp_path))


@pytest.fixture
def live_kernel() -> Iterator[int]:
    """A process that looks like a live sandbox kernel (its command line says so)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)",
                                ownership.KERNEL_MARKER.decode()])
    # Popen returns once the child's exec has closed its close-on-exec pipe, which Linux does
    # before it sets up the new command line: read at once, /proc shows an empty one (this
    # test failed so, once, in a CI run under load).
    deadline = time.monotonic() + 30
    while not ownership.kernel_alive(process.pid):
        assert process.poll() is None and time.monotonic() < deadline, "the stand-in kernel did not start"
        time.sleep(0.01)
    yield process.pid
    process.kill()
    process.wait()


def view(sandbox_id: str, name: str | None = None, envs: list[str] | None = None,
         status: SandboxStatus = SandboxStatus.RUNNING) -> SandboxView:
    return SandboxView(id=sandbox_id, name=name, envs=envs, status=status, vcpu=1, mem_mib=256,
                       disk_mib=1024, created_at="2026-12-02T10:00:00Z", ingress_enabled=False)


def test_a_sandbox_whose_owner_is_gone_is_an_orphan_unless_kept_or_driven(live_kernel: int) -> None:
    # This test process is no sandbox kernel: what it owns counts as its dead kernel's.
    for sandbox_id in ("sb-owned", "sb-kept", "sb-driven", "sb-restarting"):
        ownership.own(sandbox_id)
    ownership.keep("sb-kept")
    ownership.hand_over("sb-driven", live_kernel)
    ownership.await_successor(["sb-restarting"], 60)
    live = {sandbox_id: None for sandbox_id in ("sb-owned", "sb-kept", "sb-driven", "sb-restarting",
                                                "sb-never-recorded")}
    assert ownership.orphaned(live) == ["sb-owned"]
    assert ownership.describe_owner("sb-driven", None) == f"kernel {live_kernel}"
    assert ownership.describe_owner("sb-kept", None) == "kept"
    assert ownership.describe_owner("sb-never-recorded", None) == "-"


def test_a_create_that_never_returned_is_found_by_its_name() -> None:
    ownership.creating("notebook-1234")
    assert ownership.creating_here() == ["notebook-1234"]
    assert ownership.orphaned({"sb-made": "notebook-1234", "sb-other": "brave-otter"}) == ["sb-made"]
    ownership.created("notebook-1234", "sb-made")  # it came back after all: owned, no trace left
    assert ownership.creating_here() == [] and ownership.owned_here() == ["sb-made"]


def test_gone_sandboxes_lose_their_records() -> None:
    ownership.own("sb-gone")
    ownership.own("sb-here")
    ownership.tidy({"sb-here": None})
    assert ownership.owned_here() == ["sb-here"]


def test_a_fork_name_travels_as_an_env_name() -> None:
    source = view("sb-source", name="brave-otter")
    envs = names.fork_envs(source, "try-b")
    assert envs == {"SANDBOX_KERNEL_NAME_try_b": "try-b"}
    child = view("sb-child", name="wise-lynx", envs=sorted(envs))
    assert names.names_of(child) == ["try-b", "wise-lynx"] and names.display_name(child) == "try-b"
    # An unnamed fork of a named fork does not inherit the name; nor does a renamed one.
    assert names.fork_envs(child, None) == {}
    assert names.fork_envs(child, "try-c") == {"SANDBOX_KERNEL_NAME_try_c": "try-c"}
    assert names.fork_envs(source, None) is None  # nothing to drop: inherit as CreateOS does


def test_a_sandbox_with_env_vars_of_its_own_cannot_name_a_fork() -> None:
    with pytest.raises(names.SandboxNameError, match=r"cannot name a fork of sb-s: .*\(TOKEN\)"):
        names.fork_envs(view("sb-s", envs=["TOKEN"]), "try-b")
    assert names.fork_envs(view("sb-s", envs=["TOKEN"]), None) is None


@pytest.mark.parametrize("bad", ["Try", "-x", "a_b", "", "x" * 64, "a b"])
def test_bad_names_are_refused_in_one_line(bad: str) -> None:
    with pytest.raises(names.SandboxNameError, match="use 1-63 lowercase letters"):
        names.checked(bad)


def test_resolve_by_id_or_name_and_say_why_not() -> None:
    views = [view("sb-1", name="alpha"), view("sb-2", name="beta", envs=["SANDBOX_KERNEL_NAME_try_b"]),
             view("sb-3", name="gamma", envs=["SANDBOX_KERNEL_NAME_twin"]),
             view("sb-4", name="delta", envs=["SANDBOX_KERNEL_NAME_twin"]),
             view("sb-5", name="try-gone", envs=["SANDBOX_KERNEL_NAME_old"], status=SandboxStatus.DESTROYED)]
    assert names.resolve(views, "sb-1", "here").id == "sb-1"
    assert names.resolve(views, "try-b", "here").id == "sb-2"
    assert names.resolve(views, "beta", "here").id == "sb-2"
    with pytest.raises(names.SandboxNameError, match="several sandboxes are called 'twin' on here: sb-3, sb-4"):
        names.resolve(views, "twin", "here")
    with pytest.raises(names.SandboxNameError, match="no sandbox with id or name 'old' on here"):
        names.resolve(views, "old", "here")
    assert names.taken_by(views, "alpha").id == "sb-1" and names.taken_by(views, "old") is None
