"""A dropped connection in the middle of a printing cell loses and repeats nothing: the
channel's output stream (managed processes), or a cell's exec stream (providers without)."""

from __future__ import annotations

import pytest

from fault_proxy import proxied_engine
from kernel_helpers import execute, running_kernel
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("path", ["channel", "exec per cell"])
def test_dropped_stream_resumes_without_loss_or_duplicates(
        path: str, kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, cut_after_bytes=1500, max_cuts=3,
                        refuse_processes=path != "channel") as proxy, \
            running_kernel(kernelspec) as (_, kc):
        code = ("import time\n"
                "for i in range(400):\n"
                "    print(i, flush=True)\n"
                "    time.sleep(0.005)")
        result = execute(kc, code)
        assert result.reply["content"]["status"] == "ok"
        assert result.text() == "".join(f"{i}\n" for i in range(400))
        assert proxy.cuts == 3, "the proxy cut the cell's stream three times"
