"""Isolation smoke tests, run from notebook cells as a user (or an attacker) would.

The full attack suite lives with the hardening work; these prove the basics every
sandbox must give: no host files, no host processes, no host network, no neighbours.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from kernel_helpers import TIMEOUT, execute
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_kernels(kernelspec: str) -> Iterator[tuple[BlockingKernelClient, BlockingKernelClient]]:
    started: list[tuple[KernelManager, BlockingKernelClient]] = [
        start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT) for _ in range(2)]
    yield started[0][1], started[1][1]
    for km, kc in started:
        kc.stop_channels()
        km.shutdown_kernel()


def value(kc: BlockingKernelClient, code: str) -> str:
    """Run code whose last line prints one value; fail loudly if the cell errors."""
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok", result.of_type("error")
    return result.text().strip()


def test_host_home_and_host_files_are_invisible(two_kernels, tmp_path: Path) -> None:
    kc = two_kernels[0]
    marker = Path.home() / f".sandbox-kernel-marker-{uuid.uuid4().hex}"
    outside = tmp_path / "host-secret.txt"
    marker.write_text("host home")
    outside.write_text("outside the workspace")
    try:
        code = (f"import os\nprint(os.path.exists({str(marker)!r}), os.path.exists({str(outside)!r}), "
                f"os.path.exists({str(tmp_path)!r}))")
        assert value(kc, code) == "False False False"
    finally:
        marker.unlink()


def test_cannot_write_outside_the_workspace(two_kernels) -> None:
    kc = two_kernels[0]
    code = ("import sys, os\n"
            "results = []\n"
            "for target in ('/usr/sandbox-was-here', sys.prefix + '/sandbox-was-here', '/etc/passwd'):\n"
            "    try:\n"
            "        open(target, 'a').write('x')\n"
            "        results.append('WROTE ' + target)\n"
            "    except OSError as exc:\n"
            "        results.append(type(exc).__name__)\n"
            "print(results)")
    assert "WROTE" not in value(kc, code)
    assert not Path("/usr/sandbox-was-here").exists()


def test_host_processes_are_invisible(two_kernels) -> None:
    kc = two_kernels[0]
    code = ("import os\n"
            "pids = [p for p in os.listdir('/proc') if p.isdigit()]\n"
            "cmdlines = [open(f'/proc/{p}/cmdline', 'rb').read() for p in pids]\n"
            "print(len(pids), any(b'pytest' in c or b'jupyter' in c or b'sandbox_kernel.kernel' in c for c in cmdlines))")
    count, host_seen = value(kc, code).split()
    assert host_seen == "False"
    assert int(count) < 20, "only the sandbox's own few processes are visible"
    # Our own pid, from inside, is a different process (or none at all).
    own = value(kc, f"import os\nprint(open('/proc/{os.getpid()}/cmdline','rb').read() if os.path.exists('/proc/{os.getpid()}') else b'')")
    assert "pytest" not in own


def test_host_network_and_engine_are_unreachable(two_kernels, engine: EngineEndpoint) -> None:
    kc = two_kernels[0]
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        host_port = listener.getsockname()[1]
        engine_port = int(engine.url.rsplit(":", 1)[1])
        code = ("import socket, os\n"
                "def reach(port):\n"
                "    try:\n"
                "        socket.create_connection(('127.0.0.1', port), timeout=2).close()\n"
                "        return 'REACHED'\n"
                "    except OSError as exc:\n"
                "        return type(exc).__name__\n"
                f"print(reach({host_port}), reach({engine_port}), os.path.exists({str(engine.socket)!r}), "
                "sorted(n for _, n in socket.if_nameindex()))")
        assert value(kc, code) == "ConnectionRefusedError ConnectionRefusedError False ['lo']"


def test_two_notebooks_do_not_see_each_other(two_kernels) -> None:
    first, second = two_kernels
    secret = uuid.uuid4().hex
    first_id = value(first, f"import os\nopen('mine.txt','w').write({secret!r})\n"
                            f"open('/tmp/mine-tmp.txt','w').write({secret!r})\nprint(os.environ['SANDBOX_ID'])")
    second_id = value(second, "import os\nprint(os.environ['SANDBOX_ID'])")
    assert first_id != second_id
    seen = value(second, "import os, subprocess\n"
                         "found = subprocess.run(['find', '/workspace', '/tmp', '/run', '-name', 'mine*.txt'],"
                         " capture_output=True, text=True).stdout\n"
                         "print(os.path.exists('mine.txt'), os.path.exists('/tmp/mine-tmp.txt'), bool(found.strip()))")
    assert seen == "False False False"
