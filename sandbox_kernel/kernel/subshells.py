"""Kernel subshells: ipykernel's threads here (its subshell manager), and one thread each in
the runner, made and ended together. Advertised only where the runner can run a subshell's
cells in a thread of its own and a channel carries several cells at once."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.subshells")


class Subshells:
    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # Each subshell's execute_requests being handled (see delete_request); they are
        # handled in the subshells' threads, the deletion in the control thread.
        self.requests: dict[str, set[concurrent.futures.Future[None]]] = {}
        self.requests_lock = threading.Lock()

    def available(self) -> bool:
        """The runner can run a subshell's cells in a thread of its own (it has IPython), and a
        channel carries several cells at once (the exec-per-cell fallback does not)."""
        return self.kernel._supports_kernel_subshells and self.kernel.runner_offers("subshells")

    def exist(self) -> bool:
        """A subshell was made (its cells take execution counts, on a thread of its own)."""
        thread = self.kernel.shell_channel_thread
        return thread is not None and bool(thread.manager.list_subshell())

    @contextlib.contextmanager
    def tracked(self, parent: dict[str, Any]) -> Iterator[None]:
        """A subshell's execute_request, tracked until answered (see delete_request)."""
        subshell_id = parent["header"].get("subshell_id")
        if not isinstance(subshell_id, str):
            yield
            return
        answered: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self.requests_lock:
            self.requests.setdefault(subshell_id, set()).add(answered)
        try:
            yield
        finally:
            answered.set_result(None)
            with self.requests_lock:
                requests = self.requests.get(subshell_id, set())
                requests.discard(answered)
                if not requests:
                    self.requests.pop(subshell_id, None)

    async def _ready(self) -> bool:
        await self.kernel.boot.wait_briefly()
        return self.available()

    def _manager_call(self, request: dict[str, Any]) -> dict[str, Any]:
        """A request to ipykernel's subshell manager, which runs in the shell channel thread
        (what ipykernel's own handlers send it), and its answer (at once: it only starts or
        stops a thread)."""
        manager_socket = self.kernel.shell_channel_thread.manager.control_to_shell_channel.from_socket
        manager_socket.send_json(request)
        return manager_socket.recv_json()  # type: ignore[no-any-return]

    async def _in_runner(self, action: str, subshell_id: str) -> None:
        kernel = self.kernel
        assert kernel.sandbox is not None
        await kernel.on_main_loop(kernel.sandbox.runner_request(
            {protocol.OP: protocol.SUBSHELL, "action": action, protocol.SUBSHELL_ID: subshell_id}))

    async def create_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        """ipykernel's subshell (a thread here that handles its shell messages), and its
        thread in the runner, made before the reply (a cell may count the threads next)."""
        if not await self._ready():
            return self._refuse(socket, "create_subshell_reply", parent, ident)
        reply = self._manager_call({"type": "create"})
        if reply.get("status") == "ok":
            try:
                await self._in_runner("create", reply["subshell_id"])
            except Exception as exc:  # the runner died or refused: no subshell then
                self._manager_call({"type": "delete", "subshell_id": reply["subshell_id"]})
                reply = {"status": "error", "evalue": f"the sandbox could not start a subshell: {exc}"}
        self.kernel.session.send(socket, "create_subshell_reply", reply, parent, ident=ident)

    async def delete_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        """As ipykernel's delete, which joins the subshell's thread: a cell it is running
        finishes first (and is answered), then the subshell ends, here and in the runner."""
        if not await self._ready():
            return self._refuse(socket, "delete_subshell_reply", parent, ident)
        subshell_id = parent["content"].get("subshell_id")
        with self.requests_lock:
            running = list(self.requests.get(subshell_id, ()))
        if running:
            await asyncio.wait([asyncio.wrap_future(request) for request in running])
        reply = self._manager_call({"type": "delete", "subshell_id": subshell_id})
        if reply.get("status") == "ok":
            try:
                await self._in_runner("delete", subshell_id)
            except Exception as exc:  # a runner that died took its threads along
                log.warning("subshell %s: %s", subshell_id, exc)
        self.kernel.session.send(socket, "delete_subshell_reply", reply, parent, ident=ident)

    async def list_request(self, socket, ident, parent):  # type: ignore[no-untyped-def]
        if not await self._ready():
            return self._refuse(socket, "list_subshell_reply", parent, ident)
        reply = self._manager_call({"type": "list"})
        self.kernel.session.send(socket, "list_subshell_reply", reply, parent, ident=ident)

    def _refuse(self, socket: Any, reply_type: str, parent: dict[str, Any], ident: Any) -> None:
        """No subshells here (yet): refused, not left unanswered."""
        why = ("the sandbox is not up: a cell shows why" if not self.kernel.boot.ready() else
               "they need IPython in the sandbox and a provider with managed processes")
        self.kernel.session.send(socket, reply_type, {
            "status": "error", "ename": "NotImplementedError", "traceback": [],
            "evalue": f"sandbox-kernel has no kernel subshells now: {why}"}, parent, ident=ident)
