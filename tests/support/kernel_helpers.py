"""Driving the installed sandbox kernel through jupyter_client, as a frontend would."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.manager import KernelManager, start_new_kernel

from message_spec import validate
from sandbox_kernel.cli.headless import ANSI

TIMEOUT = 120
# SANDBOX_KERNEL_TEST_VIA_CREATEOS=1 runs the kernel tests through the CreateOS code path
# (base URL + key pointed at the local engine): the kernel must have no local-only shortcut.
VIA_CREATEOS = os.environ.get("SANDBOX_KERNEL_TEST_VIA_CREATEOS") == "1"
PROVIDER = "CreateOS" if VIA_CREATEOS else "the local engine"

# Cell code defining relays(): the pids of the kernel's relays alive in its sandbox.
RELAYS = """
import os, signal, time
def relays():
    \"\"\"Pids of the channel's relays alive in this sandbox: a relay (runner/client.py
    channel) is `python3 -I -S -c CODE channel DIR` until the daemon has its pipes, then a
    cat of its connection to the daemon (the cell that asks may run in between).\"\"\"
    found = []
    for pid in filter(str.isdigit, os.listdir('/proc')):
        try:
            argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
            stdin = os.readlink(f'/proc/{pid}/fd/0')
            state = open(f'/proc/{pid}/stat', 'rb').read().rsplit(b')', 1)[1].split()[0]
        except OSError:
            continue
        handed_over = argv[0] == b'cat' and stdin.startswith('socket:')
        starting = b'-c' in argv and argv[argv.index(b'-c') + 2:][:1] == [b'channel']
        if (handed_over or starting) and state != b'Z':
            found.append(int(pid))
    return found
"""


def plain_traceback(lines: list[str]) -> str:
    """A traceback as text, without IPython's colours."""
    return ANSI.sub("", "\n".join(lines))


def is_status_line(msg: dict[str, Any]) -> bool:
    """The kernel's own 'sandbox ready' line, which the first cell shows."""
    return bool(msg["content"].get("metadata", {}).get("sandbox_kernel", {}).get("status"))


@dataclass
class Execution:
    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """iopub messages a notebook would show, without the status line."""
        kinds = ("stream", "display_data", "update_display_data", "clear_output",
                 "execute_result", "error")
        return [m for m in self.messages if m["msg_type"] in kinds and not is_status_line(m)]

    def text(self, name: str = "stdout") -> str:
        return "".join(m["content"]["text"] for m in self.outputs
                       if m["msg_type"] == "stream" and m["content"]["name"] == name)

    def of_type(self, msg_type: str) -> list[dict[str, Any]]:
        return [m["content"] for m in self.outputs if m["msg_type"] == msg_type]


def execute(kc: BlockingKernelClient, code: str, *, allow_stdin: bool = False,
            stdin_hook: Callable[[dict[str, Any]], None] | None = None,
            timeout: float = TIMEOUT, **request: Any) -> Execution:
    """Run code as a frontend would; request: more execute_request fields (user_expressions...)."""
    messages: list[dict[str, Any]] = []
    reply = kc.execute_interactive(code, allow_stdin=allow_stdin, stdin_hook=stdin_hook,
                                   output_hook=messages.append, timeout=timeout, **request)
    return Execution(reply=reply, messages=messages)


def wait_busy_then_idle(kc: BlockingKernelClient, msg_ids: list[str]) -> None:
    """Until each request has had its busy and then its idle status, and no more."""
    statuses: dict[str, list[str]] = {msg_id: [] for msg_id in msg_ids}
    while any(states != ["busy", "idle"] for states in statuses.values()):
        msg = kc.get_iopub_msg(timeout=TIMEOUT)
        validate(msg)
        if msg["msg_type"] == "status" and msg["parent_header"].get("msg_id") in statuses:
            statuses[msg["parent_header"]["msg_id"]].append(msg["content"]["execution_state"])
            assert len(statuses[msg["parent_header"]["msg_id"]]) <= 2, statuses


@contextlib.contextmanager
def running_kernel(kernel_name: str, **kwargs: Any) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A kernel from the installed kernelspec, ready, shut down (and its sandbox with it) after."""
    km, kc = start_new_kernel(kernel_name=kernel_name, startup_timeout=TIMEOUT, **kwargs)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
