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
from quick_set import QUICK
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
    with running_jupyterlab(tmp_path_factory.mktemp("jupyterlab")) as lab:
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
