"""The engine's log cannot be grown without bound from a sandbox (issue 30, item 5): 100k
refused CONNECTs in 30 s grew it by 60 MiB. Refusals are logged one by one up to a budget,
then summed up; the log file itself is rotated by size."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from attack_helpers import ONCE
from engine_helpers import running_engine
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.api.egress_rules import DENY_ALL
from sandbox_kernel.local.egress_proxy import RefusalLog
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, ONCE]

CONNECTS = 5000
# Run in the sandbox: CONNECTS refused CONNECTs through its proxy; how many were refused.
REFUSED_CONNECTS = r'''
import socket
refused = 0
for _ in range({count}):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
    s.sendall(b"CONNECT 192.0.2.1:9 HTTP/1.1\r\n\r\n")
    answer = b""
    while data := s.recv(4096):
        answer += data
    s.close()
    refused += answer.startswith(b"HTTP/1.1 403")
print(refused)
'''


@pytest.fixture(scope="module")
def own_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[EngineEndpoint, Path]]:
    """An engine of its own, started in the background as a kernel starts one (its output
    on engine.log), so that only this test writes its log."""
    state = Path(tmp_path_factory.mktemp("log-state"))
    with running_engine(state) as endpoint:
        yield endpoint, state / "engine.log"


def denial_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if "egress denied" in line]


async def test_refused_connects_leave_the_engine_log_bounded(own_engine) -> None:
    endpoint, log = own_engine
    async with SandboxClient(endpoint.url, endpoint.token) as client:
        sandbox = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
        try:
            await client.set_egress(sandbox, [DENY_ALL])
            size_before = log.stat().st_size
            result = (await client.exec(sandbox, "python3", ["-c", REFUSED_CONNECTS.format(count=CONNECTS)],
                                        timeout=600)).result
            assert result.exit_code == 0, result.stderr
            # The attack ran: every CONNECT was refused by the engine's proxy ...
            assert int(result.stdout) == CONNECTS
            # ... and each is counted for %egress ...
            assert (await client.get_egress(sandbox)).denied_count >= CONNECTS
        finally:
            await client.delete_sandbox(sandbox)
    # ... while the log took the first few one by one and then sums (one line a minute).
    lines = denial_lines(log)
    grown = log.stat().st_size - size_before
    print(f"{CONNECTS} refused CONNECTs: engine log +{grown} B, {len(lines)} lines about them")
    assert RefusalLog.FIRST_LINES <= len(lines) <= RefusalLog.FIRST_LINES + 1 + 12  # 12: minutes, loaded host
    assert any("further refusals are summed up" in line for line in lines)
    assert grown < 32 * 1024


ROTATING = """
import logging, sys
from pathlib import Path
from sandbox_kernel.local.engine_log import bound_if_redirected
logging.basicConfig(level=logging.INFO, format="%(message)s")
print(json.dumps(bound_if_redirected(Path(sys.argv[1]), max_bytes=64 * 1024)), flush=True)
for i in range(20000):
    logging.getLogger("flood").info("line %d %s", i, "x" * 100)
print("printed at the end", flush=True)
sys.stderr.write("written to stderr at the end\\n")
"""


def test_the_engine_log_is_rotated_by_size(tmp_path: Path) -> None:
    """2 MiB of log lines through a log capped at 64 KiB: the file is renamed .1 and
    started again, and what the process prints outside logging follows the new file."""
    log = tmp_path / "engine.log"
    with open(log, "ab") as output:
        subprocess.run([sys.executable, "-c", "import json\n" + ROTATING, str(log)], stdout=output,
                       stderr=output, check=True)
    rotated = tmp_path / "engine.log.1"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["engine.log", "engine.log.1"]
    assert log.stat().st_size + rotated.stat().st_size <= 2 * 64 * 1024 + 200
    text = log.read_text()
    assert "line 0 " not in rotated.read_text() + text  # gone: the oldest lines make room
    assert "line 19999 " in text
    assert text.endswith("printed at the end\nwritten to stderr at the end\n")


def test_a_terminal_engine_keeps_logging_to_stderr(tmp_path: Path) -> None:
    """An engine whose stderr is not its log file (run in a terminal) is left alone."""
    log = tmp_path / "engine.log"
    log.write_text("")
    run = subprocess.run([sys.executable, "-c", "import json\n" + ROTATING.replace("range(20000)", "range(3)"),
                          str(log)], capture_output=True, text=True, check=True)
    assert run.stdout.startswith("false\n")
    assert "line 2 " in run.stderr and log.read_text() == ""


def test_refusals_past_the_budget_are_summed_up(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="sandbox_kernel.local.egress_proxy")
    now = [0.0]
    refusals = RefusalLog(clock=lambda: now[0])
    for _ in range(RefusalLog.FIRST_LINES + 500):
        refusals.refused("192.0.2.1:9", "all egress is blocked (block-all)")
    now[0] = RefusalLog.SUMMARY_INTERVAL
    for _ in range(3):
        refusals.refused("192.0.2.1:9", "all egress is blocked (block-all)")
    lines = [record.getMessage() for record in caplog.records]
    assert lines[:RefusalLog.FIRST_LINES] == ["egress denied: 192.0.2.1:9: all egress is blocked (block-all)"] * 20
    assert lines[RefusalLog.FIRST_LINES:] == [
        "egress denied 20 connections of this sandbox: further refusals are summed up every 60 s",
        "egress denied 501 more connections of this sandbox (last: 192.0.2.1:9: all egress is blocked (block-all))"]
