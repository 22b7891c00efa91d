"""What a notebook shows when CreateOS refuses to create its sandbox, and which refusals
the client retries (POST only on 429/503, honouring Retry-After). The faults come from a
proxy in front of the real local engine, reached through the CreateOS code path."""

from __future__ import annotations

import json

import pytest

from fault_proxy import SLOW_DOWN, http_reply, proxied_engine
from kernel_helpers import execute, running_kernel
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


UNAUTHORIZED = http_reply("401 Unauthorized", {"status": "fail", "data": "invalid api key"})
NO_CREDIT = http_reply("402 Payment Required", {"status": "fail", "data": {"code": "no_credit"}})
NO_CAPACITY = http_reply("503 Service Unavailable", {"status": "error", "message": "no host with capacity",
                                                     "code": 503})


# The kernel starts creating its sandbox at start-up, and a cell after a failed start tries
# once more: the proxy refuses both, so the first cell shows the refusal.
@pytest.mark.parametrize(("replies", "line", "creates"), [
    ([UNAUTHORIZED] * 2, "CreateOS rejected the API key (401): check CREATEOS_SANDBOX_API_KEY", 2),
    ([NO_CREDIT] * 2, "CreateOS account is out of credit (402)", 2),
    ([NO_CAPACITY] * 6, "CreateOS is temporarily unavailable (503)", 6),  # each try: 3 POSTs, then said
])
def test_refused_create_is_one_line_and_the_kernel_lives(
        replies: list[bytes], line: str, creates: int, kernelspec: str, engine: EngineEndpoint,
        monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, create_replies=replies) as proxy:
        with running_kernel(kernelspec) as (km, kc):
            result = execute(kc, "print('never')")
            assert result.reply["content"]["status"] == "error"
            [shown] = result.text("stderr").splitlines()
            assert shown.startswith("sandbox-kernel: could not start a sandbox on CreateOS: ") and line in shown
            assert engine.token not in json.dumps(result.messages, default=str)
            assert proxy.creates_seen == creates
            # The refusals are used up: the next cell tries again and runs.
            assert execute(kc, "print('second try')").text() == "second try\n"
            assert km.is_alive()


def test_rate_limited_create_waits_and_succeeds(kernelspec: str, engine: EngineEndpoint,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    with proxied_engine(engine, monkeypatch, create_replies=[SLOW_DOWN]) as proxy:
        with running_kernel(kernelspec) as (_, kc):
            assert execute(kc, "print('after the wait')").text() == "after the wait\n"
            assert proxy.creates_seen == 2  # the 429, then the retry after Retry-After
