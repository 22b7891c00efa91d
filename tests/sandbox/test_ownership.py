"""Ownership: a notebook cleans up every sandbox it made (forks included) unless the user
kept one, names work from every notebook, and `gc` finds what a dead kernel left.

Real kernels, the real engine, the real CLI. With SANDBOX_KERNEL_TEST_VIA_CREATEOS=1 the
same tests run through the CreateOS code path.
"""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from jupyter_client import BlockingKernelClient, KernelManager
from jupyter_client.manager import start_new_kernel

from engine_helpers import sandbox_status
from fault_proxy import proxied_engine
from kernel_helpers import PROVIDER, TIMEOUT, Execution, execute
from sandbox_kernel.api import SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox.session import FORK_AUTO_PAUSE
from cli_helpers import cli

pytestmark = pytest.mark.slow
GONE = (SandboxStatus.DESTROYED, None)  # None: the engine already forgot it


def ok(result: Execution) -> Execution:
    assert result.reply["content"]["status"] == "ok", result.of_type("error") or result.text("stderr")
    return result


def shown(result: Execution) -> str:
    """Everything the cell showed: streams and displayed text."""
    return result.text() + "\n".join(m["content"]["data"]["text/plain"] for m in result.messages
                                     if m["msg_type"] in ("display_data", "update_display_data"))


def sandbox_of(kc: BlockingKernelClient) -> str:
    return ok(execute(kc, "import os\nprint(os.environ['SANDBOX_ID'])")).text().strip()


def fork(kc: BlockingKernelClient, magic: str) -> str:
    """Run a fork magic; the fork's id."""
    return re.search(r"into (sb-\w+)", shown(ok(execute(kc, magic)))).group(1)


def error_of(result: Execution) -> str:
    """The one line a failed magic shows."""
    assert result.reply["content"]["status"] == "error"
    [line] = result.text("stderr").splitlines()
    return line


def kill(km: KernelManager) -> None:
    """A crash: no shutdown, no cleanup."""
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    km.provisioner.process.wait(10)
    km.cleanup_resources()


def test_the_tour_leaves_no_sandbox_behind(kernelspec: str, engine: EngineEndpoint,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_AUTO_PAUSE", "off")  # forks pause when forgotten all the same
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    monkeypatch.delenv("SANDBOX_KERNEL_AUTO_PAUSE")
    parent = sandbox_of(kc)
    ok(execute(kc, "x = 41"))
    named = fork(kc, "%sandbox fork --name tour-b")
    ok(execute(kc, "%sandbox attach tour-b"))
    assert ok(execute(kc, "print(x + 1)")).text() == "42\n"
    switched = fork(kc, "%sandbox fork --switch")
    assert sandbox_of(kc) == switched
    status = shown(ok(execute(kc, "%sandbox status")))
    assert "on shutdown  destroy" in status  # --switch no longer marks the fork `keep`
    assert f"auto-pause   after {FORK_AUTO_PAUSE // 60} min idle" in status
    kc.stop_channels()
    km.shutdown_kernel()
    for sandbox_id in (parent, named, switched):
        assert sandbox_status(engine, sandbox_id) in GONE, sandbox_id
    assert not any(sandbox_id in cli("gc", "--dry-run").stdout for sandbox_id in (parent, named, switched))


def test_a_named_fork_is_attached_by_name_from_another_notebook(kernelspec: str, engine: EngineEndpoint) -> None:
    km1, kc1 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    km2, kc2 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        ok(execute(kc1, "who = 'the first notebook'"))
        child = fork(kc1, "%sandbox fork --name shared-b")
        taken = error_of(execute(kc1, "%sandbox fork --name shared-b"))
        assert taken == f"sandbox-kernel: the name 'shared-b' is taken by sandbox {child} on {PROVIDER}: choose another"
        listed = [line for line in cli("ls").stdout.splitlines() if line.startswith(child)]
        assert len(listed) == 1 and "shared-b" in listed[0] and f"owner: kernel {km1.provisioner.process.pid}" \
            in listed[0], listed

        own = sandbox_of(kc2)
        ok(execute(kc2, "%sandbox attach shared-b --destroy-previous"))
        assert sandbox_status(engine, own) in GONE
        assert ok(execute(kc2, "print(who)")).text() == "the first notebook\n"
        assert "shared-b" in shown(ok(execute(kc2, "%sandbox list")))

        # The owner goes while another notebook drives its fork: that notebook takes it over.
        kc1.stop_channels()
        km1.shutdown_kernel()
        km1 = None
        assert sandbox_status(engine, child) == SandboxStatus.RUNNING
        assert ok(execute(kc2, "print(who)")).text() == "the first notebook\n"
        kc2.stop_channels()
        km2.shutdown_kernel()
        km2 = None
        assert sandbox_status(engine, child) in GONE
    finally:
        for km, kc in ((km1, kc1), (km2, kc2)):
            if km is not None:
                kc.stop_channels()
                km.shutdown_kernel()


def test_a_killed_kernels_sandboxes_and_forks_are_found_by_gc(kernelspec: str, engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    parent = sandbox_of(kc)
    child = fork(kc, "%sandbox fork --name killed-b")
    ok(execute(kc, "%sandbox attach killed-b"))  # the kernel's own sandbox is left by attach-away
    kc.stop_channels()
    kill(km)
    dry = cli("gc", "--dry-run").stdout
    for sandbox_id in (parent, child):
        assert f"{sandbox_id}: orphaned (its kernel is gone); would destroy" in dry
        assert sandbox_status(engine, sandbox_id) in (SandboxStatus.RUNNING, SandboxStatus.PAUSED)
    collected = cli("gc").stdout
    for sandbox_id in (parent, child):
        assert f"{sandbox_id}: orphaned, destroyed" in collected
        assert sandbox_status(engine, sandbox_id) in GONE


def test_kept_sandboxes_outlive_the_notebook_and_are_listed_at_shutdown(kernelspec: str,
                                                                        engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    parent = sandbox_of(kc)
    child = fork(kc, "%sandbox fork --name kept-b")
    assert ok(execute(kc, "%sandbox keep kept-b")).text().startswith(f"Sandbox {child} (kept-b) is kept")
    assert ok(execute(kc, "%sandbox on-shutdown pause")).text() == \
        f"When this notebook shuts down, sandbox {parent} will be paused\n"
    # What outlives the notebook is marked where the user looks (JupyterLab shows nothing at shutdown).
    [shown] = ok(execute(kc, "%sandbox list")).of_type("display_data")
    listed = {line.split()[0]: line for line in shown["data"]["text/plain"].splitlines()}
    assert listed[child].endswith(f"; KEPT: outlives its notebook (sandbox-kernel rm {child} destroys it)")
    assert listed[parent].endswith("; outlives this notebook (on shutdown: pause)")
    kc.shutdown()
    last_words = ""
    deadline = time.monotonic() + TIMEOUT
    while "Kept after this notebook" not in last_words or parent not in last_words:
        assert time.monotonic() < deadline, last_words
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["msg_type"] == "stream":
            last_words += msg["content"]["text"]
    kc.stop_channels()
    km.shutdown_kernel()
    assert re.search(rf"{child} \(kept-b\), running, \$0\.\d{{4}}/hour on CreateOS", last_words), last_words
    assert re.search(rf"{parent} \(notebook-\w+\), paused, \$0\.\d{{4}}/hour on CreateOS", last_words), last_words
    assert sandbox_status(engine, parent) in (SandboxStatus.PAUSING, SandboxStatus.PAUSED)
    assert sandbox_status(engine, child) == SandboxStatus.RUNNING
    listed = cli("ls").stdout
    assert not any(sandbox_id in cli("gc", "--dry-run").stdout for sandbox_id in (parent, child))
    for sandbox_id in (parent, child):
        assert re.search(rf"{sandbox_id} .* owner: kept", listed), listed
    # Destroying a kept sandbox is an explicit act, by id or by name.
    assert cli("rm", "kept-b").stdout == f"{child}: destroyed\n"
    assert cli("rm", parent).stdout == f"{parent}: destroyed\n"


def test_shutdown_while_the_sandbox_starts_destroys_it(kernelspec: str, engine: EngineEndpoint,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # The create reaches the engine, but its answer never reaches the kernel (a CreateOS
    # create taking minutes): the kernel has no id when it is told to shut down.
    with proxied_engine(engine, monkeypatch, hold_creates=True) as proxy:
        km = KernelManager(kernel_name=kernelspec)
        km.start_kernel()
        try:
            deadline = time.monotonic() + TIMEOUT
            while not proxy.held_creates:
                assert time.monotonic() < deadline, "the kernel never created its sandbox"
                time.sleep(0.05)
        finally:
            km.shutdown_kernel()
        [held] = proxy.held_creates
        assert sandbox_status(engine, held) in GONE


def test_a_kernel_killed_while_its_sandbox_starts_leaves_it_to_gc(kernelspec: str, engine: EngineEndpoint,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, hold_creates=True) as proxy:
        km = KernelManager(kernel_name=kernelspec)
        km.start_kernel()
        deadline = time.monotonic() + TIMEOUT
        while not proxy.held_creates:
            assert time.monotonic() < deadline, "the kernel never created its sandbox"
            time.sleep(0.05)
        kill(km)
        [held] = proxy.held_creates
        assert sandbox_status(engine, held) == SandboxStatus.RUNNING
        assert f"{held}: orphaned, destroyed" in cli("gc").stdout
        assert sandbox_status(engine, held) in GONE


def test_a_kernel_creates_its_sandbox_under_the_name_asked_for_once(kernelspec: str, engine: EngineEndpoint,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_SANDBOX_NAME", "named-nb")
    km1, kc1 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    km2, kc2 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        assert "name         named-nb" in shown(ok(execute(kc1, "%sandbox status")))
        refused = execute(kc2, "1")
        assert refused.reply["content"]["status"] == "error"
        assert refused.text("stderr") == \
            f"sandbox-kernel: the name 'named-nb' is taken on {PROVIDER}: choose another (SANDBOX_KERNEL_SANDBOX_NAME)\n"
        assert [line for line in cli("ls").stdout.splitlines() if "named-nb" in line][0].startswith(sandbox_of(kc1))
    finally:
        for km, kc in ((km1, kc1), (km2, kc2)):
            kc.stop_channels()
            km.shutdown_kernel()
    assert "named-nb" not in cli("ls").stdout
