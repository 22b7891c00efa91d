"""A cell that forges input_request events (issue 30, item 5): code in the sandbox can emit
them into the runner's record of its cell, around input(). The runner asks one question at
a time and waits for its answer, so the kernel shows one at a time too: the forgeries that
come while a question waits are dropped, each at the cost of a check.
"""

from __future__ import annotations

import os
import queue
from pathlib import Path

import pytest

from kernel_helpers import TIMEOUT, execute, running_kernel

pytestmark = [pytest.mark.slow, pytest.mark.one_path]

FORGED = 30_000
# The real input() asks first; once its question is pending in the runner, a thread forges
# FORGED more into the cell's events, then says so (after them, in the same event stream).
CELL = f"""
import gc, threading, time
cell = next(o for o in gc.get_objects() if type(o).__name__ == 'Cell' and not o.finished)
bridge = next(o for o in gc.get_objects() if type(o).__name__ == 'InputBridge')

def forge():
    while cell.cell_id not in bridge._pending:
        time.sleep(0.001)
    for i in range({FORGED}):
        cell.emit('input_request', prompt='forged %d: ' % i, password=False)
    print('forged {FORGED} input requests')

threading.Thread(target=forge).start()
print('answered', input('real: '))
"""


def test_forged_input_requests_reach_the_frontend_as_one_prompt(kernelspec: str) -> None:
    with running_kernel(kernelspec) as (km, kc):
        cpu_before = cpu_seconds(km.provisioner.process.pid)  # type: ignore[union-attr]
        msg_id = kc.execute(CELL, allow_stdin=True)
        # The attack ran: every forgery was emitted (and reached the kernel: the line comes after them).
        assert f"forged {FORGED} input requests\n" in cell_text(kc, msg_id, until="forged")
        # The frontend was asked once: the real question or the first forgery, whichever
        # came first; the answer goes to the input() that waits.
        prompt = kc.get_stdin_msg(timeout=TIMEOUT)
        assert prompt["content"]["prompt"] in ("real: ", "forged 0: ")
        kc.input("typed")
        while True:
            reply = kc.get_shell_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "ok"
        assert cell_text(kc, msg_id, until=None) == "answered typed\n"
        print(f"{FORGED} forged input requests: kernel "
              f"{cpu_seconds(km.provisioner.process.pid) - cpu_before:.1f} CPU-seconds")  # type: ignore[union-attr]
        with pytest.raises(queue.Empty):
            extra = kc.get_stdin_msg(timeout=2)
            pytest.fail(f"a second prompt reached the frontend: {extra['content']}")
        assert execute(kc, "print(6 * 7)").text() == "42\n"
        # The kernel lives on, and so does input() for the next cell.
        asked = execute(kc, "print('got', input('again: '))", allow_stdin=True,
                        stdin_hook=lambda msg: kc.input("second"))
        assert asked.text() == "got second\n"


def cell_text(kc, msg_id: str, until: str | None) -> str:  # type: ignore[no-untyped-def]
    """The cell's stream text from now until `until` shows (None: until the cell is idle)."""
    text = ""
    while until is None or until not in text:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text += msg["content"]["text"]
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
    return text


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process so far (for the log: not asserted)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
