"""Kernel subshells (JEP 91, as ipykernel 7 has them), across the sandbox boundary.

A subshell's cells run in a thread of their own in the runner, concurrently with the main
shell's and other subshells'. Concurrency is shown by outcomes and by the order of IOPub
messages (one socket, so its order is the kernel's), never by timings: cells meet at a
threading.Barrier or wait for an Event that another cell sets, with a timeout that turns a
cell that never ran alongside into an error. Every message is checked against the spec.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager

from fault_proxy import proxied_engine
from kernel_helpers import TIMEOUT, execute, running_kernel, wait_busy_then_idle
from message_spec import validate
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, pytest.mark.one_path]

WAIT = 60  # seconds a cell waits for its partner before it fails (only if concurrency is broken)


def control(kc: BlockingKernelClient, msg_type: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
    """A control request and its validated reply's content."""
    msg = kc.session.msg(msg_type, content or {})
    kc.control_channel.send(msg)
    while True:
        reply = kc.control_channel.get_msg(timeout=TIMEOUT)
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            validate(reply)
            return reply["content"]


def create(kc: BlockingKernelClient) -> str:
    reply = control(kc, "create_subshell_request")
    assert reply["status"] == "ok", reply
    return reply["subshell_id"]


def listed(kc: BlockingKernelClient) -> list[str]:
    return control(kc, "list_subshell_request")["subshell_id"]


def send(kc: BlockingKernelClient, code: str, subshell_id: str | None, **content: Any) -> str:
    """An execute_request to a subshell (None: the main shell); its msg_id."""
    msg = kc.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                             "allow_stdin": False, **content})
    msg["header"]["subshell_id"] = subshell_id
    kc.shell_channel.send(msg)
    return msg["header"]["msg_id"]


class Run:
    """The replies and IOPub messages of some requests, in the order IOPub carried them."""

    def __init__(self, kc: BlockingKernelClient, msg_ids: list[str]) -> None:
        self.replies: dict[str, dict[str, Any]] = {}
        self.iopub: list[dict[str, Any]] = []
        idle: set[str] = set()
        while idle != set(msg_ids):
            msg = kc.get_iopub_msg(timeout=TIMEOUT)
            validate(msg)
            parent = msg["parent_header"].get("msg_id")
            if parent in msg_ids:
                self.iopub.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle.add(parent)
        while set(self.replies) != set(msg_ids):
            reply = kc.get_shell_msg(timeout=TIMEOUT)
            validate(reply)
            if reply["parent_header"].get("msg_id") in msg_ids:
                self.replies[reply["parent_header"]["msg_id"]] = reply

    def status(self, msg_id: str) -> str:
        return str(self.replies[msg_id]["content"]["status"])

    def stdout(self, msg_id: str) -> str:
        return "".join(m["content"]["text"] for m in self.iopub
                       if m["parent_header"]["msg_id"] == msg_id and m["msg_type"] == "stream"
                       and m["content"]["name"] == "stdout")

    def index(self, msg_id: str, msg_type: str, text: str = "") -> int:
        """Where the first such message of msg_id's came on IOPub (text: in its stream)."""
        for i, m in enumerate(self.iopub):
            if m["parent_header"]["msg_id"] == msg_id and m["msg_type"] == msg_type and \
                    text in m["content"].get("text", ""):
                return i
        raise AssertionError(f"no {msg_type} {text!r} for {msg_id}")

    def idle(self, msg_id: str) -> int:
        return max(i for i, m in enumerate(self.iopub) if m["parent_header"]["msg_id"] == msg_id
                   and m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")


def run(kc: BlockingKernelClient, code: str, subshell_id: str | None = None) -> Run:
    return Run(kc, [send(kc, code, subshell_id)])


def ran(kc: BlockingKernelClient, code: str, subshell_id: str | None = None) -> tuple[str, str]:
    """One request's status and stdout."""
    result = Run(kc, [msg_id := send(kc, code, subshell_id)])
    return result.status(msg_id), result.stdout(msg_id)


@pytest.fixture
def subshells(kc: BlockingKernelClient) -> Iterator[list[str]]:
    """Two subshells, deleted after the test."""
    made = [create(kc), create(kc)]
    yield made
    for subshell in made:
        control(kc, "delete_subshell_request", {"subshell_id": subshell})


def thread_count(kc: BlockingKernelClient) -> int:
    return int(ran(kc, "import threading; print(threading.active_count())")[1])


def test_advertised_created_listed_deleted(kc: BlockingKernelClient) -> None:
    info = kc.kernel_info(reply=True, timeout=TIMEOUT)
    validate(info)
    assert "kernel subshells" in info["content"]["supported_features"]
    threads = thread_count(kc)
    assert listed(kc) == []
    first, second = create(kc), create(kc)
    assert listed(kc) == [first, second]
    assert thread_count(kc) == threads + 2  # each has its thread in the sandbox, from its creation
    assert control(kc, "delete_subshell_request", {"subshell_id": first})["status"] == "ok"
    assert listed(kc) == [second]
    assert thread_count(kc) == threads + 1
    unknown = control(kc, "delete_subshell_request", {"subshell_id": first})
    assert unknown["status"] == "error" and first in unknown["evalue"]
    control(kc, "delete_subshell_request", {"subshell_id": second})
    assert listed(kc) == [] and thread_count(kc) == threads
    # A request to a subshell that is gone is answered by ipykernel's shell channel thread
    # (its reply, which has no execution_count, is ipykernel's own: not validated here).
    gone = send(kc, "1", second)
    reply = kc.get_shell_msg(timeout=TIMEOUT)
    assert reply["parent_header"]["msg_id"] == gone
    assert reply["content"]["ename"] == "UnknownSubshellError"


def test_two_subshells_run_together_each_output_on_its_request(kc: BlockingKernelClient,
                                                               subshells: list[str]) -> None:
    run(kc, f"import threading; meet = threading.Barrier(2, timeout={WAIT})")
    # Each cell waits at the barrier for the other: they finish only if they run at once.
    ids = [send(kc, f"print('in {name}', flush=True); meet.wait(); print('{name} thread', "
                    f"threading.current_thread() is not threading.main_thread()); '{name}'", subshell)
           for name, subshell in zip("ab", subshells)]
    result = Run(kc, ids)
    for name, msg_id in zip("ab", ids):
        assert result.status(msg_id) == "ok"
        assert result.stdout(msg_id) == f"in {name}\n{name} thread True\n"
        results = [m["content"] for m in result.iopub if m["msg_type"] == "execute_result"
                   and m["parent_header"]["msg_id"] == msg_id]
        assert [r["data"]["text/plain"] for r in results] == [f"'{name}'"]
        # Busy and idle per request, with the request's subshell in their parent.
        statuses = [m for m in result.iopub if m["msg_type"] == "status" and m["parent_header"]["msg_id"] == msg_id]
        assert [m["content"]["execution_state"] for m in statuses] == ["busy", "idle"]
        assert {m["parent_header"]["subshell_id"] for m in statuses} == {subshells["ab".index(name)]}
    # Both had started before either ended.
    assert max(result.index(i, "stream", "in ") for i in ids) < min(result.idle(i) for i in ids)
    # Each its own number, the same in its execute_input, execute_result and execute_reply.
    counts = {i: {m["content"]["execution_count"] for m in result.iopub if m["parent_header"]["msg_id"] == i
                  and m["msg_type"] in ("execute_input", "execute_result")}
              | {result.replies[i]["content"]["execution_count"]} for i in ids}
    assert all(len(numbers) == 1 for numbers in counts.values()) and counts[ids[0]] != counts[ids[1]]


def test_the_main_shell_runs_while_a_subshell_waits(kc: BlockingKernelClient) -> None:
    subshell = create(kc)
    run(kc, "import threading; waiting, go = threading.Event(), threading.Event()")
    # The subshell's cell ends only once the main shell's has run, and that one runs only
    # once the subshell's waits: both succeed only if the main shell runs meanwhile.
    sub = send(kc, f"waiting.set(); assert go.wait({WAIT}); print('went')", subshell)
    main = send(kc, f"assert waiting.wait({WAIT}); go.set(); print('main ran')", None)
    result = Run(kc, [sub, main])
    assert result.status(sub) == result.status(main) == "ok"
    assert result.stdout(main) == "main ran\n" and result.stdout(sub) == "went\n"
    control(kc, "delete_subshell_request", {"subshell_id": subshell})


def test_an_error_aborts_only_its_own_subshells_queue(kc: BlockingKernelClient, subshells: list[str]) -> None:
    run(kc, f"import threading; meet = threading.Barrier(2, timeout={WAIT})")
    failing = [send(kc, "meet.wait(); raise ValueError('no')", subshells[0]),
               send(kc, "print('skipped')", subshells[0])]
    other = [send(kc, "meet.wait(); print('other')", subshells[1]), send(kc, "print('next')", subshells[1])]
    result = Run(kc, failing + other)
    assert [result.status(i) for i in failing] == ["error", "aborted"]
    assert [result.status(i) for i in other] == ["ok", "ok"]
    assert result.replies[failing[0]]["content"]["ename"] == "ValueError"
    assert result.stdout(other[1]) == "next\n" and result.stdout(failing[1]) == ""
    assert ran(kc, "print('again')", subshells[0]) == ("ok", "again\n")  # the abort is over


def test_an_interrupt_stops_the_main_shell_not_a_subshell(kc: BlockingKernelClient) -> None:
    """As under ipykernel, where SIGINT reaches only the main thread."""
    subshell = create(kc)
    run(kc, "import threading, time; go = threading.Event()")
    waiting = send(kc, f"print('sub waits', flush=True); assert go.wait({WAIT}); print('sub went')", subshell)
    sleeping = send(kc, "print('main sleeps', flush=True); time.sleep(600)", None)
    # Both are running once each has printed its line (a print may come in pieces: its text,
    # then its newline, when the runner's flusher runs in between, as under load).
    printed = {waiting: "", sleeping: ""}
    while printed != {waiting: "sub waits\n", sleeping: "main sleeps\n"}:
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(msg)
        if msg["msg_type"] == "stream":
            printed[msg["parent_header"]["msg_id"]] += msg["content"]["text"]
    assert control(kc, "interrupt_request")["status"] == "ok"
    interrupted = Run(kc, [sleeping])
    assert interrupted.replies[sleeping]["content"]["ename"] == "KeyboardInterrupt"
    release = send(kc, "go.set()", None)
    result = Run(kc, [waiting, release])
    assert result.status(waiting) == "ok" and result.stdout(waiting) == "sub went\n"
    control(kc, "delete_subshell_request", {"subshell_id": subshell})


def test_deleting_a_running_subshell_waits_for_its_cell(kc: BlockingKernelClient) -> None:
    """As ipykernel's delete, which joins the subshell's thread: the cell ends, and is answered."""
    subshell = create(kc)
    run(kc, "import threading; go = threading.Event()")
    waiting = send(kc, f"print('waits', flush=True); assert go.wait({WAIT}); print('went')", subshell)
    while True:  # the cell runs
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(msg)
        if msg["msg_type"] == "stream" and msg["parent_header"]["msg_id"] == waiting:
            break
    delete = kc.session.msg("delete_subshell_request", {"subshell_id": subshell})
    kc.control_channel.send(delete)
    release = send(kc, "go.set()", None)
    result = Run(kc, [waiting, release])
    assert result.status(waiting) == "ok" and result.stdout(waiting) == "went\n"
    reply = kc.control_channel.get_msg(timeout=TIMEOUT)
    validate(reply)
    assert reply["parent_header"]["msg_id"] == delete["header"]["msg_id"] and reply["content"]["status"] == "ok"
    # The kernel's own clock: the deletion was answered after the cell.
    assert reply["header"]["date"] >= result.replies[waiting]["header"]["date"]
    assert listed(kc) == []


def test_input_async_and_shell_commands_in_a_subshell(kc: BlockingKernelClient) -> None:
    subshell = create(kc)
    asked = send(kc, "print(input('name? '))", subshell, allow_stdin=True)
    request = kc.get_stdin_msg(timeout=TIMEOUT)
    validate(request)
    assert request["content"]["prompt"] == "name? "
    kc.input("Ada")
    awaited = send(kc, "import asyncio; await asyncio.sleep(0); print('awaited')", subshell)
    shell = send(kc, "!echo from a shell", subshell)
    result = Run(kc, [asked, awaited, shell])
    assert result.stdout(asked) == "Ada\n" and result.stdout(awaited) == "awaited\n"
    assert result.stdout(shell).strip() == "from a shell"
    control(kc, "delete_subshell_request", {"subshell_id": subshell})


def send_comm_msg(kc: BlockingKernelClient, comm_id: str, n: int, subshell_id: str | None) -> str:
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": {"n": n}})
    msg["header"]["subshell_id"] = subshell_id
    kc.shell_channel.send(msg)
    return msg["header"]["msg_id"]


def test_comm_messages_on_a_subshell_and_on_the_main_shell_all_reach_the_sandbox(kc: BlockingKernelClient) -> None:
    """JupyterLab sends a comm target's messages on a subshell of its own once the kernel has
    subshells (its commsOverSubshells setting), and on the main shell until that subshell is
    made: a widget's changes come on both, and are handled on both threads here while the
    earlier ones still run in the sandbox. Each reaches the sandbox's one comm manager, and
    each is busy then idle (ipywidgets' page sends the next change only then)."""
    run(kc, "import comm, time\nseen = []\nwidget = comm.create_comm(target_name='moved')\n"
            "def on_msg(msg):\n"
            "    if msg['content']['data']['n'] == 0:\n"
            "        time.sleep(1)  # the next messages arrive meanwhile (what they must survive)\n"
            "    seen.append(msg['content']['data']['n'])\n"
            "widget.on_msg(on_msg)")
    comm_id = next(iter(kc.comm_info("moved", reply=True, timeout=TIMEOUT)["content"]["comms"]))
    subshell = create(kc)
    sent = [send_comm_msg(kc, comm_id, 0, None), send_comm_msg(kc, comm_id, 1, None),
            send_comm_msg(kc, comm_id, 2, subshell), send_comm_msg(kc, comm_id, 3, subshell)]
    wait_busy_then_idle(kc, sent)
    seen = [int(n) for n in ran(kc, "print(*seen)")[1].split()]
    # Each shell's in the order sent (the main shell's and the subshell's may interleave).
    assert sorted(seen) == [0, 1, 2, 3] and seen.index(0) < seen.index(1) and seen.index(2) < seen.index(3), seen
    control(kc, "delete_subshell_request", {"subshell_id": subshell})


def test_restart_clears_subshells(kernel: tuple[KernelManager, BlockingKernelClient]) -> None:
    km, kc = kernel
    create(kc)
    assert len(listed(kc)) == 1
    km.restart_kernel()
    kc.wait_for_ready(timeout=TIMEOUT)
    assert listed(kc) == []
    subshell = create(kc)
    assert ran(kc, "print('fresh')", subshell) == ("ok", "fresh\n")  # the new runner has its thread
    control(kc, "delete_subshell_request", {"subshell_id": subshell})


def assert_refused(kc: BlockingKernelClient) -> None:
    """Not advertised; every subshell request answered with an error, not left to time out."""
    assert execute(kc, "print('runs')").text() == "runs\n"
    assert "kernel subshells" not in kc.kernel_info(reply=True, timeout=TIMEOUT)["content"]["supported_features"]
    for msg_type, content in (("create_subshell_request", {}), ("list_subshell_request", {}),
                              ("delete_subshell_request", {"subshell_id": "x"})):
        reply = control(kc, msg_type, content)
        assert reply["status"] == "error" and reply["ename"] == "NotImplementedError"


def test_no_subshells_without_ipython_in_the_sandbox(kernelspec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain runner (a rootfs with a bare Python) runs cells in its main thread only."""
    monkeypatch.setenv("SANDBOX_KERNEL_ROOTFS", "python-stdlib")
    with running_kernel(kernelspec) as (_, kc):
        assert_refused(kc)


def test_no_subshells_without_a_channel(kernelspec: str, engine: EngineEndpoint,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A provider without managed processes: one exec per cell, which carries one cell at a time."""
    with proxied_engine(engine, monkeypatch, refuse_processes=True), running_kernel(kernelspec) as (_, kc):
        assert_refused(kc)
