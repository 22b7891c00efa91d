"""A dropped connection in the middle of a printing cell loses and repeats nothing: the
channel's output stream (managed processes), or a cell's exec stream (providers without)."""

from __future__ import annotations

import time

import pytest

from fault_proxy import SLOW_DOWN, http_reply, proxied_engine
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


def test_a_rate_limited_output_stream_is_connected_again_and_the_kernel_lives(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 429 on the channel's output stream (the client never retries a stream) says nothing
    of the Python in the sandbox: the channel waits as told and connects again. It was taken
    as the runner's death, and the kernel ended before its first cell."""
    with proxied_engine(engine, monkeypatch, connect_replies=[SLOW_DOWN, SLOW_DOWN]) as proxy, \
            running_kernel(kernelspec) as (_, kc):
        result = execute(kc, "print('still here')")
        assert result.reply["content"]["status"] == "ok"
        assert result.text() == "still here\n"
        assert proxy.refused_connects == 2


def test_a_refused_output_stream_fails_a_cell_with_its_reason_and_the_kernel_lives(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """The service refusing the output stream (the key, the account) says nothing of the
    Python in the sandbox either: the notebook hears the refusal, not that its Python died,
    and once the service lets it through the same Python goes on."""
    refused = http_reply("403 Forbidden", {"status": "fail", "data": "not allowed"})
    with proxied_engine(engine, monkeypatch) as proxy, running_kernel(kernelspec) as (_, kc):
        assert execute(kc, "x = 41").reply["content"]["status"] == "ok"
        proxy.connect_replies = [refused] * 100
        proxy.cut_after_bytes, proxy.max_cuts = 0, 1  # the stream's next heartbeat cuts it
        deadline = time.monotonic() + 60
        while proxy.refused_connects == 0:
            assert time.monotonic() < deadline, "the stream was never cut and refused"
            time.sleep(0.1)
        time.sleep(1)  # what the kernel makes of the refusal, between cells
        failed = execute(kc, "print(x)")
        assert failed.reply["content"]["status"] == "error"
        assert "CreateOS denied the request (403" in failed.reply["content"]["evalue"]
        assert "died" not in failed.reply["content"]["evalue"]
        proxy.connect_replies = []
        result = execute(kc, "print(x + 1)")
        assert result.reply["content"]["status"] == "ok" and result.text() == "42\n"


def test_a_paused_notebooks_dropped_stream_waits_for_its_next_cell_not_the_service(
        kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    """Paused, the channel's stream dropped (a gateway restart, a laptop waking up): the kernel's
    one attempt to follow it again is refused, and it waits for its next cell rather than
    asking the service every 8 s for as long as the pause lasts (15 requests a minute per
    paused notebook, once)."""
    with proxied_engine(engine, monkeypatch) as proxy, running_kernel(kernelspec) as (_, kc):
        assert execute(kc, "x = 41").reply["content"]["status"] == "ok"
        assert execute(kc, "%sandbox pause").reply["content"]["status"] == "ok"
        proxy.cut_after_bytes, proxy.max_cuts = 0, 1  # the stream's next heartbeat cuts it
        deadline = time.monotonic() + 60
        while proxy.cuts == 0:
            assert time.monotonic() < deadline, "the idle stream was never cut"
            time.sleep(0.1)
        cut_at = len(proxy.request_lines)
        time.sleep(25)  # three of the old 8 s rounds
        since = [line.decode() for line in proxy.request_lines[cut_at:]]
        # One attempt to reconnect (refused: paused, by far the likeliest for an idle notebook,
        # so not looked into until the next refusal in a row).
        assert len(since) == 1 and "/connect?" in since[0], "\n".join(since)
        result = execute(kc, "print(x + 1)")
        assert result.reply["content"]["status"] == "ok" and result.text() == "42\n"
