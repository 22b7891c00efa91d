"""What a frontend asks about code: completion and inspection, answered by the runner in the
sandbox (best effort: an empty answer beats an error popup), and whether an input is
complete, answered here (which also tells terminal frontends from notebooks)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sandbox_kernel.guest import protocol

if TYPE_CHECKING:
    from sandbox_kernel.kernel.handlers import SandboxKernel

log = logging.getLogger("sandbox_kernel.kernel.queries")


class CodeQueries:
    def __init__(self, kernel: SandboxKernel) -> None:
        self.kernel = kernel
        # Client sessions that asked is_complete: terminals (see updates_in_place).
        self.terminal_sessions: set[str] = set()

    async def ask_runner(self, message: dict[str, Any]) -> dict[str, Any]:
        """The runner's answer to a one-shot request; {} if the sandbox is not up or failed."""
        kernel = self.kernel
        if not kernel.boot.ready():
            return {}
        assert kernel.sandbox is not None
        try:
            return await kernel.on_main_loop(kernel.sandbox.runner_request(message))
        except Exception as exc:
            log.warning("%s failed: %s", message[protocol.OP], exc)
            return {}

    async def complete(self, code: str, cursor_pos: int) -> dict[str, Any]:
        reply = await self.ask_runner({protocol.OP: protocol.COMPLETE, "code": code, "cursor_pos": cursor_pos})
        return {"status": "ok", "matches": reply.get("matches", []),
                "cursor_start": reply.get("cursor_start", cursor_pos),
                "cursor_end": reply.get("cursor_end", cursor_pos),
                "metadata": reply.get("metadata", {})}

    async def inspect(self, code: str, cursor_pos: int, detail_level: int) -> dict[str, Any]:
        reply = await self.ask_runner({protocol.OP: protocol.INSPECT, "code": code, "cursor_pos": cursor_pos,
                                       "detail_level": detail_level})
        data, metadata = self.kernel.output_filter.bundle(reply.get("data", {}), reply.get("metadata", {}))
        return {"status": "ok", "found": reply.get("found", False), "data": data, "metadata": metadata}

    def is_complete(self, code: str) -> dict[str, Any]:
        self.terminal_sessions.add(self._client_session())
        from IPython.core.inputtransformer2 import TransformerManager

        status, indent = TransformerManager().check_complete(code)
        reply: dict[str, Any] = {"status": status}
        if status == "incomplete":
            reply["indent"] = " " * (indent or 0)
        return reply

    def updates_in_place(self) -> bool:
        """Notebooks (JupyterLab, VS Code, nbclient) update a display in place; terminal
        frontends (`jupyter console`) ignore update_display_data. A terminal asks whether each
        input is complete before running it, which notebooks never do: that tells them apart."""
        return self._client_session() not in self.terminal_sessions

    def _client_session(self) -> str:
        return self.kernel.get_parent().get("header", {}).get("session", "")
