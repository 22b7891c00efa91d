"""On a provider without managed processes (the kernel then runs one exec per cell), when
the service cannot stream exec output (some CreateOS versions answer 404, or send
an `error` frame; a gateway answers a held exec with 502), cells are followed by polling
the runner with short buffered execs: slower, but nothing is lost or repeated,
even when some of those execs fail with a 502 themselves."""

from __future__ import annotations

import pytest

from fault_proxy import BAD_GATEWAY, NOT_FOUND, proxied_engine
from kernel_helpers import Execution, execute, running_kernel
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow

REPLIES = {
    "404": NOT_FOUND,
    "error frame": (b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n"
                    b'{"error": "agent error: sandbox not found"}\n{"exit_code": -1}\n'),
    "502": BAD_GATEWAY,
}
COUNTING_CELL = "import time\nfor i in range(30):\n    print(i, flush=True)\n    time.sleep(0.05)\n'finished'"
COUNTED = "".join(f"{i}\n" for i in range(30))


def assert_counted_once(result: Execution) -> None:
    """COUNTING_CELL's output came whole: every line once, in order, then its result."""
    assert result.reply["content"]["status"] == "ok", result.text("stderr") or result.of_type("error")
    assert result.text() == COUNTED
    assert result.of_type("execute_result")[0]["data"]["text/plain"] == "'finished'"


@pytest.mark.parametrize("failure", list(REPLIES))
def test_cells_run_by_polling_when_streaming_is_unavailable(
        failure: str, kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, refuse_processes=True, stream_reply=REPLIES[failure]) as proxy:
        with running_kernel(kernelspec) as (_, kc):
            result = execute(kc, COUNTING_CELL)
            assert_counted_once(result)
            # Followed while it ran (about 1.5 s, polled every second), not only at the end.
            assert len([m for m in result.outputs if m["msg_type"] == "stream"]) >= 2
            error = execute(kc, "1 / 0").of_type("error")
            assert error[0]["ename"] == "ZeroDivisionError"
        assert proxy.refused_streams == 1, "after the first refusal the session stops asking"
        assert proxy.refused_processes == 1, "whether there are managed processes is asked once"


def test_buffered_execs_failing_with_502_lose_and_repeat_nothing(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, refuse_processes=True, stream_reply=REPLIES["404"]) as proxy:
        with running_kernel(kernelspec) as (_, kc):
            assert execute(kc, "'polling now'").reply["content"]["status"] == "ok"
            # The cell's first exec never reaches the sandbox; the next two run there, but
            # their answers (events the runner sent) are lost on the way back.
            proxy.fail_buffered_execs({1: "before", 2: "after", 3: "after"})
            result = execute(kc, COUNTING_CELL)
            assert proxy.bad_gateways == 3
            assert_counted_once(result)
            assert execute(kc, "i").of_type("execute_result")[0]["data"]["text/plain"] == "29"


def test_streams_dropping_before_any_output_give_way_to_polling(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, refuse_processes=True, cut_after_bytes=0, max_cuts=10) as proxy:
        with running_kernel(kernelspec) as (_, kc):
            assert_counted_once(execute(kc, COUNTING_CELL))
            assert proxy.cuts == 2, "two streams cut with nothing delivered, then polling"
            assert execute(kc, "i").of_type("execute_result")[0]["data"]["text/plain"] == "29"
            assert proxy.cuts == 2, "later cells poll from the start"
