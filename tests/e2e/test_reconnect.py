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
    # Each cut stream must carry a whole event before its cut: on the exec path, two streams
    # in a row that bring no new event switch the notebook to polling (no more streams to
    # cut). Under load the runner batches more lines per event, so the cut comes late enough
    # (4000 bytes) for any batch of a few hundred milliseconds, and the lines are long
    # enough for three such cuts to come well before the cell ends.
    with proxied_engine(engine, monkeypatch, cut_after_bytes=4000, max_cuts=3,
                        refuse_processes=path != "channel") as proxy, \
            running_kernel(kernelspec) as (_, kc):
        code = ("import time\n"
                "for i in range(400):\n"
                "    print(i, '-' * 60, flush=True)\n"
                "    time.sleep(0.005)")
        result = execute(kc, code)
        assert result.reply["content"]["status"] == "ok"
        assert result.text() == "".join(f"{i} {'-' * 60}\n" for i in range(400))
        assert proxy.cuts == 3, "the proxy cut the cell's stream three times"
