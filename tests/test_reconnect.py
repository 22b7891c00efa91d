"""A dropped exec connection in the middle of a printing cell loses and repeats nothing."""

from __future__ import annotations

import pytest
from jupyter_client.manager import start_new_kernel

from fault_proxy import FaultProxy
from kernel_helpers import TIMEOUT, execute
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


def test_dropped_stream_resumes_without_loss_or_duplicates(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    engine_port = int(engine.url.rsplit(":", 1)[1])
    with FaultProxy(engine_port, cut_after_bytes=1500, max_cuts=3) as proxy:
        # The CreateOS code path, pointed at the local engine through the proxy.
        monkeypatch.setenv("CREATEOS_SANDBOX_BASE_URL", f"http://127.0.0.1:{proxy.port}")
        monkeypatch.setenv("CREATEOS_SANDBOX_API_KEY", engine.token)
        km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
        try:
            code = ("import time\n"
                    "for i in range(400):\n"
                    "    print(i, flush=True)\n"
                    "    time.sleep(0.005)")
            result = execute(kc, code)
            assert result.reply["content"]["status"] == "ok"
            assert result.text() == "".join(f"{i}\n" for i in range(400))
            assert proxy.cuts == 3, "the proxy cut the cell's stream three times"
        finally:
            kc.stop_channels()
            km.shutdown_kernel()
