"""Output floods from notebook cells: endless prints, huge lines, binary garbage.

A cell's output is capped and paced by the runner (SANDBOX_KERNEL_OUTPUT_LIMIT and
SANDBOX_KERNEL_OUTPUT_RATE); whatever a cell writes, the NDJSON framing between the
runner, the engine and the kernel holds, the kernel answers an interrupt, and the next
cell runs normally.
"""

from __future__ import annotations

import os
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from kernel_helpers import TIMEOUT, execute, running_kernel

pytestmark = [pytest.mark.slow, pytest.mark.one_path]

NOTICE = "[sandbox-kernel] output limit reached: 2 MiB shown, further output of this cell discarded\n"
SMALL_LIMIT = 2 * 1024 * 1024


@pytest.fixture(scope="module")
def capped(kernelspec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A kernel whose cells may show 2 MiB of output."""
    env = {**os.environ, "SANDBOX_KERNEL_OUTPUT_LIMIT": "2"}
    with running_kernel(kernelspec, env=env) as (km, kc):
        yield km, kc


@pytest.fixture(scope="module")
def default_kernel(kernelspec: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A kernel with the default limits (64 MiB per cell, 8 MiB/s after a 32 MiB burst)."""
    with running_kernel(kernelspec) as (km, kc):
        yield km, kc


def outputs_until(kc: BlockingKernelClient, msg_id: str, stop: Any, timeout: float = TIMEOUT) -> list[dict]:
    """iopub messages of one request until stop(messages) is true or the cell went idle."""
    messages: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        messages.append(msg)
        if stop(messages):
            return messages
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
    pytest.fail(f"no end of output within {timeout} s ({len(messages)} messages)")


def shell_reply(kc: BlockingKernelClient, msg_id: str) -> dict:
    while True:
        reply = kc.get_shell_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply


def stream_text(messages: list[dict], name: str | None = None) -> str:
    return "".join(m["content"]["text"] for m in messages
                   if m["msg_type"] == "stream" and (name is None or m["content"]["name"] == name))


def assert_next_cell_works(kc: BlockingKernelClient) -> None:
    result = execute(kc, "print(6 * 7)")
    assert result.reply["content"]["status"] == "ok"
    assert result.text() == "42\n"


def test_endless_print_is_capped_with_one_notice_and_interruptible(capped) -> None:
    km, kc = capped
    msg_id = kc.execute("n = 0\nwhile True:\n    n += 1\n    print('x' * 100)")
    shown = outputs_until(kc, msg_id, lambda ms: NOTICE in stream_text(ms[-1:]))
    # The cell keeps running after the notice (the counter grows), and an interrupt stops it.
    time.sleep(1)
    km.interrupt_kernel()
    shown += outputs_until(kc, msg_id, lambda ms: False)
    reply = shell_reply(kc, msg_id)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    stdout = stream_text(shown, "stdout")
    assert set(stdout) == {"x", "\n"} and len(stdout) <= SMALL_LIMIT
    assert len(stdout) > SMALL_LIMIT - 200, "everything up to the limit is shown"
    assert stream_text(shown, "stderr").count(NOTICE) == 1
    lines_printed = int(execute(kc, "print(n)").text())
    assert lines_printed * 101 > SMALL_LIMIT, "the cell ran on after its output was cut"
    assert_next_cell_works(kc)


def test_a_paced_flood_is_slowed_down_and_interruptible(kernelspec: str) -> None:
    """At 0.5 MiB/s (a burst of 2 MiB), an endless print is held back rather than cut,
    and an interrupt still stops it."""
    rate = 512 * 1024
    env = {**os.environ, "SANDBOX_KERNEL_OUTPUT_RATE": "0.5"}
    with running_kernel(kernelspec, env=env) as (km, kc):
        msg_id = kc.execute("while True:\n    print('p' * 1000)")
        started = time.monotonic()
        shown = outputs_until(kc, msg_id, lambda ms: len(stream_text(ms)) > 3 * rate)
        km.interrupt_kernel()
        shown += outputs_until(kc, msg_id, lambda ms: False)
        elapsed = time.monotonic() - started
        assert shell_reply(kc, msg_id)["content"]["ename"] == "KeyboardInterrupt"
        # However slow this host: no more than the burst (4 s worth), one event (1 MiB, the
        # runner waits after sending it) and the rate for the time the cell ran.
        assert len(stream_text(shown)) <= 4 * rate + 2 * rate + rate * elapsed
        assert NOTICE not in stream_text(shown), "paced, not cut"
        assert_next_cell_works(kc)


def test_each_cell_has_its_own_budget(capped) -> None:
    _, kc = capped
    for _ in range(2):
        result = execute(kc, "print('y' * (1024 * 1024))")
        assert result.text() == "y" * 1024 * 1024 + "\n"
        assert NOTICE not in result.text("stderr")


def test_output_forged_past_the_runner_is_capped_by_the_kernel(capped) -> None:
    """Code in the cell finds the runner's record of the cell and emits events into it
    directly, around the runner's count: the kernel's own count stops them."""
    _, kc = capped
    result = execute(kc, "import gc\n"
                         "cell = next(o for o in gc.get_objects()\n"
                         "            if type(o).__name__ == 'Cell' and not o.finished)\n"
                         "for _ in range(100):\n"
                         "    cell.emit('stream', name='stdout', text='f' * 65536)")
    assert result.reply["content"]["status"] == "ok"
    shown = result.text()
    assert set(shown) == {"f"} and SMALL_LIMIT <= len(shown) <= SMALL_LIMIT + 128 * 1024
    assert result.text("stderr") == NOTICE
    assert_next_cell_works(kc)


@pytest.mark.parametrize("kind", ["execute_result", "error"])
def test_forged_results_and_errors_count_toward_the_cap(capped, kind: str) -> None:
    """Every event kind counts in the kernel: results and errors forged into the runner's
    record of the cell stop at the cap like stream text."""
    _, kc = capped
    fields = ("data={'text/plain': 'r' * 65536}, metadata={}" if kind == "execute_result" else
              "ename='Forged', evalue='e' * 65536, traceback=[]")
    result = execute(kc, "import gc\n"
                         "cell = next(o for o in gc.get_objects()\n"
                         "            if type(o).__name__ == 'Cell' and not o.finished)\n"
                         f"for _ in range(100):\n    cell.emit({kind!r}, {fields})")
    shown = result.of_type(kind)
    assert 0 < len(shown) <= (SMALL_LIMIT + 128 * 1024) // 65536
    assert result.text("stderr") == NOTICE
    assert_next_cell_works(kc)


def test_endless_displays_are_capped_too(capped) -> None:
    _, kc = capped
    result = execute(kc, "from IPython.display import display, HTML\n"
                         "for i in range(3000):\n    display(HTML('<b>%d</b>' % i + ' ' * 2000))\n"
                         "print('finished')")
    assert result.reply["content"]["status"] == "ok"
    displays = result.of_type("display_data")
    assert 500 < len(displays) < 1100
    assert result.text("stderr").count(NOTICE) == 1
    assert result.text() == "", "stream output past the limit is dropped as well"
    assert_next_cell_works(kc)


def test_huge_single_line_arrives_whole(default_kernel) -> None:
    _, kc = default_kernel
    size = 50_000_000
    result = execute(kc, f"import sys\nsys.stdout.write('y' * {size})")
    assert result.reply["content"]["status"] == "ok"
    text = result.text()
    assert len(text) == size and set(text) == {"y"}
    # Each message is a bounded slice, not one 50 MB line.
    assert max(len(m["text"]) for m in result.of_type("stream")) <= 2 * 1024 * 1024
    assert_next_cell_works(kc)


def test_huge_line_from_a_file_descriptor(default_kernel) -> None:
    _, kc = default_kernel
    size = 20_000_000
    result = execute(kc, f"import os\ndata = b'z' * {size}\nwritten = 0\n"
                         "while written < len(data):\n    written += os.write(1, data[written:])")
    assert result.reply["content"]["status"] == "ok"
    assert result.text() == "z" * size
    assert_next_cell_works(kc)


def test_a_huge_display_arrives_whole(default_kernel) -> None:
    """One 20 MB event: a single NDJSON line spread over hundreds of exec frames."""
    _, kc = default_kernel
    size = 20_000_000
    result = execute(kc, f"from IPython.display import display\ndisplay({{'text/plain': 'd' * {size}}}, raw=True)")
    assert result.reply["content"]["status"] == "ok"
    assert [m["data"]["text/plain"] for m in result.of_type("display_data")] == ["d" * size]
    assert_next_cell_works(kc)


def test_binary_garbage_keeps_the_framing(default_kernel) -> None:
    _, kc = default_kernel
    code = ("import os, random, sys\n"
            "rng = random.Random(7)\n"
            "os.write(1, bytes(rng.getrandbits(8) for _ in range(1_000_000)))\n"
            "os.write(1, b'\\x00' * 10000 + b'\\r' * 100000 + b'\\xff\\xfe\\xc3(\\n')\n"
            "os.write(2, b'\\x80\\x81{\"seq\": 999999, \"type\": \"done\"}\\n\\x00')\n"
            "sys.stdout.buffer.write(b'\\xe2\\x82')\nsys.stdout.buffer.write(b'\\xac\\n')\n"
            "print('\\u2603 after the garbage')")
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok"
    stdout, stderr = result.text(), result.text("stderr")
    assert "\x00" * 10000 + "\r" * 100000 in stdout
    assert stdout.endswith("\u20ac\n\u2603 after the garbage\n"), "a character split across writes stays whole"
    assert '{"seq": 999999, "type": "done"}' in stderr, "output that looks like an event is just text"
    assert_next_cell_works(kc)
