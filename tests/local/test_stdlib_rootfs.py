"""A rootfs with Python and nothing installed (as a bare CreateOS rootfs may be): the runner
is uploaded, starts in its plain mode, and cells behave as a notebook user expects."""

from __future__ import annotations

import pytest

from kernel_helpers import execute, plain_traceback, running_kernel

pytestmark = pytest.mark.slow


def test_cells_run_on_a_rootfs_without_ipython(kernelspec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SANDBOX_KERNEL_ROOTFS", "python-stdlib")
    with running_kernel(kernelspec) as (_, kc):
        missing = execute(kc, "import IPython")
        assert missing.of_type("error")[0]["ename"] == "ModuleNotFoundError"
        assert execute(kc, "import sys; print(sys.version_info[0])").text() == "3\n"
        [info] = execute(kc, "%sandbox status").of_type("display_data")
        assert "python-stdlib" in info["data"]["text/plain"]
        execute(kc, "x = 21\ndef double(n):\n    return 2 * n")
        assert execute(kc, "double(x)").of_type("execute_result")[0]["data"]["text/plain"] == "42"
        error = execute(kc, "double(None) + 1").of_type("error")[0]
        assert error["ename"] == "TypeError" and "double" in plain_traceback(error["traceback"])
        reply = kc.complete("doub", 4, reply=True)["content"]
        assert "double" in reply["matches"]
