"""`%pip install` and `!pip install` in a sandbox, as a new user tries them first: the package
lands on the sandbox's own disk (the Python environment is read-only), imports at once,
still imports after a kernel restart, and pip goes through the egress rules like any client.
On the python-stdlib rootfs (no IPython, no pip) the runner's plain mode runs `%pip` and
`!command` lines itself, pip from the interpreter's bundled wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

from kernel_helpers import TIMEOUT, execute, running_kernel
from package_index import PACKAGE, serving_index
from sandbox_kernel.api.local_engine import HOST_ALIAS

pytestmark = pytest.mark.slow

PIP = f"--no-cache-dir --disable-pip-version-check --trusted-host {HOST_ALIAS} --index-url"


def port_of(url: str) -> str:
    return url.split(":")[2].split("/")[0]


@pytest.mark.parametrize("rootfs", ["host-python", "python-stdlib"])
def test_pip_install_from_an_allowed_index_imports_and_survives_a_restart(
        kernelspec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rootfs: str) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_ROOTFS", rootfs)
    with serving_index(tmp_path / "allowed") as allowed, \
            serving_index(tmp_path / "other", "other-package") as other, \
            running_kernel(kernelspec) as (km, kc):
        lockdown = execute(kc, f"%egress only 127.0.0.1:{port_of(allowed)}")
        assert f"egress: only 127.0.0.1:{port_of(allowed)}" in lockdown.text()

        # the sandbox starts empty, and a failed import before the install is not remembered
        assert execute(kc, "import os; print(os.listdir('.'))").text() == "[]\n"
        missing = execute(kc, "import hello_sandbox")
        assert missing.of_type("error")[0]["ename"] == "ModuleNotFoundError"

        install = execute(kc, f"%pip install {PIP} {allowed} {PACKAGE}")
        assert install.reply["content"]["status"] == "ok", install.outputs
        assert "Successfully installed hello-sandbox-1.0" in install.text()
        imported = execute(kc, "import hello_sandbox\nprint(hello_sandbox.GREETING, hello_sandbox.__file__)")
        assert imported.text().startswith("installed from the host index /workspace/.local/lib/python3")
        # a subprocess sees it too (PYTHONPATH), and so does the shell's PATH for scripts
        assert execute(kc, "!python3 -c 'import hello_sandbox; print(42)'").text().strip() == "42"

        # pip itself only says 'no matching distribution': the kernel names the refusal
        refused = execute(kc, f"%pip install {PIP} {other} other-package")
        assert "No matching distribution found for other-package" in refused.text() + refused.text("stderr")
        assert (f"sandbox-kernel: egress refused {HOST_ALIAS}:{port_of(other)}: no rule allows"
                in refused.text("stderr")), refused.outputs

        km.restart_kernel()
        kc.wait_for_ready(timeout=TIMEOUT)
        after = execute(kc, "import hello_sandbox\nprint(hello_sandbox.GREETING)")
        assert after.text() == "installed from the host index\n", after.outputs
