"""The kernel's handler table (kernel/handlers.py): which message types SandboxKernel handles
itself, which it leaves to ipykernel (whose handler then calls one of its do_* hooks), and
what kernel_info advertises. A real SandboxKernel is built (no sandbox is started: that
happens in start())."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from ipykernel.kernelbase import Kernel

from sandbox_kernel.guest import protocol
from sandbox_kernel.kernel.handlers import CONTROL_HANDLERS, FEATURE_MESSAGES, SHELL_HANDLERS, SandboxKernel

# The message types ipykernel's own handler answers for this kernel, and the hook of ours it
# calls (None: nothing of the sandbox's is needed, e.g. connect_request's ports).
IPYKERNEL_HANDLES = {
    "complete_request": "do_complete", "inspect_request": "do_inspect", "history_request": "do_history",
    "is_complete_request": "do_is_complete", "shutdown_request": "do_shutdown",
    "debug_request": "do_debug_request", "connect_request": None,
}


@pytest.fixture
def kernel(state_dir: Path) -> SandboxKernel:
    return SandboxKernel()


def test_every_message_type_of_ipykernel_is_ours_or_calls_a_hook_of_ours() -> None:
    """A message type ipykernel starts handling (a newer version's) must be decided here: left
    to ipykernel, it would answer for this process, not for the sandbox."""
    for msg_type in {*Kernel.msg_types, *Kernel.control_msg_types}:
        assert msg_type in SHELL_HANDLERS or msg_type in CONTROL_HANDLERS or msg_type in IPYKERNEL_HANDLES, msg_type
    for msg_type, hook in IPYKERNEL_HANDLES.items():
        assert msg_type not in SHELL_HANDLERS and msg_type not in CONTROL_HANDLERS
        if hook is not None:
            assert getattr(SandboxKernel, hook) is not getattr(Kernel, hook), f"{hook} is ipykernel's own"


def test_the_tables_name_only_messages_ipykernel_dispatches_on_their_channel() -> None:
    assert set(SHELL_HANDLERS) <= {*Kernel.msg_types, *protocol.COMM_MESSAGES}
    assert set(CONTROL_HANDLERS) <= set(Kernel.control_msg_types)
    # A shell message of ours is ours on the control channel too, as ipykernel's are; comm
    # messages come on the shell channel only.
    assert {msg_type: SHELL_HANDLERS[msg_type] for msg_type in SHELL_HANDLERS
            if msg_type not in protocol.COMM_MESSAGES}.items() <= CONTROL_HANDLERS.items()


def test_the_kernel_dispatches_each_message_of_the_table_to_its_module(kernel: SandboxKernel) -> None:
    for table, installed in ((SHELL_HANDLERS, kernel.shell_handlers), (CONTROL_HANDLERS, kernel.control_handlers)):
        for msg_type, path in table.items():
            owner, _, name = path.rpartition(".")
            expected = getattr(getattr(kernel, owner) if owner else kernel, name)
            assert installed[msg_type] == expected, msg_type
            assert inspect.iscoroutinefunction(installed[msg_type]), msg_type
            # Each handler is a module's own, not ipykernel's default for that message.
            assert getattr(installed[msg_type], "__func__", None) is not getattr(Kernel, msg_type, None), msg_type
    for msg_type in protocol.COMM_MESSAGES:
        assert kernel.shell_handlers[msg_type] == kernel.comms.from_frontend
        assert msg_type not in kernel.control_handlers
    # What the table leaves to ipykernel stays ipykernel's.
    for msg_type in IPYKERNEL_HANDLES:
        assert kernel.control_handlers[msg_type].__func__ is getattr(Kernel, msg_type)


def test_every_feature_kernel_info_may_advertise_is_handled_here() -> None:
    """"kernel subshells" and "debugger" each need their messages answered by the sandbox:
    ipykernel's subshell handlers would make no thread in the runner, its debugger none at all."""
    for feature, messages in FEATURE_MESSAGES.items():
        for msg_type in messages:
            if msg_type in IPYKERNEL_HANDLES:
                hook = IPYKERNEL_HANDLES[msg_type]
                assert hook is not None and getattr(SandboxKernel, hook) is not getattr(Kernel, hook), feature
            else:
                assert msg_type in CONTROL_HANDLERS, (feature, msg_type)


def test_kernel_info_advertises_what_the_sandbox_has_and_nothing_without_one(kernel: SandboxKernel) -> None:
    info = kernel.kernel_info
    assert info["supported_features"] == [] and info["debugger"] is False  # no sandbox is up
    assert set(kernel.supported_features()) <= set(FEATURE_MESSAGES)
    assert info["implementation"] == "sandbox-kernel" and info["banner"] == SandboxKernel.base_banner
