"""Shared fixtures: one real local engine per test run, the installed kernelspec, and one
JupyterLab server for the browser tests.

Everything runs for real: the engine is `sandbox-kernel serve` in a subprocess with its
own state dir, kernels are started by jupyter_client from the installed kernelspec, and
sandboxes are bwrap sandboxes. Nothing of our own is mocked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from createos import APIError, Client, CreateSandboxRequest, SandboxInstance
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from browser_helpers import Lab, chromium_path, running_jupyterlab
from engine_helpers import running_engine
from kernel_helpers import VIA_CREATEOS, running_kernel
from sandbox_kernel.api import SandboxClient
from sandbox_kernel.local.service import EngineEndpoint

KERNEL_NAME = "sandbox-test"


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private state dir for this run; kernels started by tests inherit it."""
    path = Path(tmp_path_factory.mktemp("state"))
    os.environ["SANDBOX_KERNEL_STATE_DIR"] = str(path)
    os.environ.pop("CREATEOS_SANDBOX_API_KEY", None)
    return path


@pytest.fixture(scope="session")
def engine(state_dir: Path) -> Iterator[EngineEndpoint]:
    """A local engine serving both loopback TCP and a unix socket."""
    with running_engine(state_dir) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def kernelspec(engine: EngineEndpoint, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Install the kernelspec with the real CLI into a private prefix on JUPYTER_PATH."""
    prefix = Path(tmp_path_factory.mktemp("jupyter-prefix"))
    subprocess.run([sys.executable, "-m", "sandbox_kernel", "install", "--prefix", str(prefix),
                    "--name", KERNEL_NAME], check=True, capture_output=True)
    data_dir = prefix / "share" / "jupyter"
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        p for p in (str(data_dir), os.environ.get("JUPYTER_PATH")) if p)
    spec = json.loads((data_dir / "kernels" / KERNEL_NAME / "kernel.json").read_text())
    assert spec["display_name"] == "Python (sandbox)"
    if VIA_CREATEOS:
        os.environ["CREATEOS_SANDBOX_BASE_URL"] = engine.url
        os.environ["CREATEOS_SANDBOX_API_KEY"] = engine.token
    return KERNEL_NAME


@pytest.fixture(scope="session")
def jupyterlab(kernelspec: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    """JupyterLab for the browser tests, which share it (tests/browser_helpers.py says how)."""
    chromium_path()  # skip, not start a server, where no browser could use it
    settings = Path(tmp_path_factory.mktemp("jupyterlab"))
    root = settings / "notebooks"
    root.mkdir()
    with running_jupyterlab(root, settings) as lab:
        yield lab


@pytest.fixture
async def client(engine: EngineEndpoint) -> AsyncIterator[SandboxClient]:
    """An API client of the engine (a module may override `engine`, or `client` itself)."""
    async with SandboxClient(engine.url, engine.token) as api:
        yield api


@pytest.fixture(scope="module")
def kernel(kernelspec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """One kernel for a test module (a module may override it with arguments of its own)."""
    with running_kernel(kernelspec) as pair:
        yield pair


@pytest.fixture(scope="module")
def kc(kernel: tuple[KernelManager, BlockingKernelClient]) -> BlockingKernelClient:
    return kernel[1]


@pytest.fixture(scope="session")
def vendor(engine: EngineEndpoint) -> Iterator[Client]:
    """The vendor's Python SDK (createos-sandbox, unchanged), pointed at the engine."""
    with Client(api_key=engine.token, base_url=engine.url) as sdk:
        yield sdk


@pytest.fixture
def vendor_sandbox(vendor: Client) -> Iterator[SandboxInstance]:
    """A sandbox made through the vendor SDK as its examples do (rootfs devbox:1)."""
    created = vendor.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb", rootfs="devbox:1"))
    yield created
    try:
        created.destroy()
    except APIError:
        pass  # the test destroyed it already


# The README's first test command runs the unit tests and these end-to-end tests: every area
# at least once (kernel messages, widgets, magics, fork, egress, files, restart, the channel's
# recovery, the engine, isolation attacks, limits, the vendor SDK, subshells, the debugger, the
# pool, ownership, early start, papermill, a terminal and a browser frontend, what reaches the
# page, a fork's agent, transitions and shutdown), so that one
# change can be checked in minutes. The second command runs every other end-to-end test.
QUICK = frozenset({
    "tests/test_kernel_messages.py::test_state_persists_and_execute_result_counts",
    "tests/test_kernel_messages.py::test_interrupt_stops_a_busy_loop",
    "tests/test_kernel_messages.py::test_input_and_getpass_use_the_stdin_channel",
    "tests/test_kernel_messages.py::test_matplotlib_figure_is_an_inline_png",
    "tests/test_protocol_fidelity.py::test_a_slider_moved_in_the_frontend_reaches_its_observer",
    "tests/test_magics.py::test_pause_resume_keeps_state",
    "tests/test_magics.py::test_misuse_is_one_line_and_the_kernel_lives",
    "tests/test_fork_notebook.py::test_fork_in_a_notebook",
    "tests/test_fork.py::test_fork_copies_then_diverges_and_outlives_its_parent",
    "tests/test_egress.py::test_rules_let_through_only_what_they_name",
    "tests/test_transfer_magics.py::test_upload_and_download_files_and_directories",
    "tests/test_kernel_lifecycle.py::test_restart_is_a_fresh_runner_in_the_same_sandbox",
    "tests/test_channel.py::test_a_relay_killed_from_a_cell_is_replaced_and_the_runner_kept",
    "tests/test_reconnect.py::test_dropped_stream_resumes_without_loss_or_duplicates[channel]",
    "tests/test_engine_restart.py::test_a_killed_engine_takes_nothing_from_the_notebook[local engine]",
    "tests/test_engine_lifecycle.py::test_pause_resume_keeps_state",
    "tests/security/test_attacks.py::test_host_secrets_are_unreadable",
    "tests/security/test_attacks.py::test_host_loopback_and_engine_api_are_unreachable",
    "tests/security/test_magic_line_attacks.py::test_the_sandbox_cannot_write_the_magic_line",
    "tests/security/test_files_escape.py::test_symlinks_in_the_workspace_resolve_inside",
    "tests/security/test_output_floods.py::test_output_forged_past_the_runner_is_capped_by_the_kernel",
    "tests/test_limits.py::test_seccomp_blocks_dangerous_calls_with_eperm",
    "tests/test_vendor_sdk.py::test_the_everyday_methods_work",
    "tests/test_subshells.py::test_two_subshells_run_together_each_output_on_its_request",
    "tests/test_debugger.py::test_a_breakpoint_in_a_cell_stops_it_with_its_locals",
    "tests/test_pool.py::test_kernels_start_on_pooled_sandboxes_never_the_same_one_and_the_pool_refills",
    "tests/test_ownership.py::test_the_tour_leaves_no_sandbox_behind",
    "tests/test_early_start.py::test_the_session_drives_the_sandbox_made_early",
    "tests/test_papermill.py::test_papermill_injects_parameters",
    "tests/test_console.py::test_jupyter_console_runs_cells",
    "tests/test_browser.py::test_jupyterlab_runs_a_cell_that_prints_and_plots",
    "tests/security/test_output_attacks.py::test_output_that_would_run_in_the_page_is_withheld_or_isolated",
    "tests/security/test_agent_socket_attacks.py::test_a_socket_planted_in_the_fork_does_not_answer_for_its_agent",
    "tests/test_transition_races.py::test_a_cell_sent_while_the_sandbox_pauses_runs_once_it_can",
    "tests/test_shutdown_replies.py::test_a_cell_sent_while_the_kernel_shuts_down_is_answered",
})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that starts kernels `kernel` (the CreateOS-path run selects them),
    except those marked `one_path`: they test what lies past the sandbox API (the Jupyter
    protocol, subshells, frontends, output floods, the kernel's own memory), the same code on
    both paths. Mark the quick end-to-end set (QUICK) `quick`."""
    for item in items:
        if "kernelspec" in getattr(item, "fixturenames", ()) and item.get_closest_marker("one_path") is None:
            item.add_marker(pytest.mark.kernel)
        if item.nodeid in QUICK:
            item.add_marker(pytest.mark.quick)
