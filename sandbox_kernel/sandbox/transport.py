"""The one seam between a session and its runner: RunnerTransport, and its one error.

Two transports reach the runner daemon in the sandbox: the duplex channel over a managed
process (channel.py), and, on providers without managed processes, one exec of the
runner's light client per request (exec_transport.py). Both offer the same calls and say
that a request could not be carried through the same way (RunnerTransportError), so the session never
asks which one it has; runner_link.py chooses one and recovers it.

What passes through untouched: the sandbox service's own answers about the sandbox
(SandboxAPIError, e.g. ConflictError for an exec or input on a sandbox that is not
running), which the session reads as "wake it first".
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from sandbox_kernel.api import APITransportError, ProtocolError, RateLimitError, ServerError

EventHandler = Callable[[dict[str, Any]], Awaitable[None]]

# Waits before each new try at a connection to the runner that dropped (a channel's stream,
# an exec's); past the last one the transport gives up on it.
RECONNECT_DELAYS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0)
# Failures of one connection that a new try can repair. A 429 too: the client never
# retries a stream (createos-api.md), and a refused stream says nothing of the runner.
RECOVERABLE = (APITransportError, ProtocolError, RateLimitError, ServerError)


def reconnect_delay(failures: int, dropped_by: Exception | None) -> float:
    """How long to wait before the next try at a dropped connection: the next of
    RECONNECT_DELAYS, or longer if a 429 said when to come back."""
    delay = RECONNECT_DELAYS[failures]
    if isinstance(dropped_by, RateLimitError) and dropped_by.retry_after is not None:
        delay = max(delay, dropped_by.retry_after)
    return delay


class RunnerTransportError(Exception):
    """A request could not be carried through to the runner and back: the connection was
    lost for good, or the runner refused or never saw it; the message is for the notebook
    user. `runner_gone`: the runner daemon died (or its sandbox went), so no new connection
    will reach it."""

    def __init__(self, message: str, runner_gone: bool = False) -> None:
        super().__init__(message)
        self.runner_gone = runner_gone


class RunnerTransport(Protocol):
    """How a session reaches the runner daemon of one sandbox.

    A call that cannot be carried through raises RunnerTransportError, and no other error
    of the transport's own (see the module docstring for the service's answers).
    """

    @property
    def failure(self) -> RunnerTransportError | None:
        """Why the transport ended for good (its next calls raise it), or None."""

    async def run_cell(self, cell_id: str, request: dict[str, Any], on_event: EventHandler,
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        """Run one cell (a run request), delivering its events in order; return its done event.
        on_sent() is called once the sandbox has taken the request, where that is known before
        the cell's events."""

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        """A one-shot request with an answer (complete, inspect, info): the runner's answer,
        which may be its refusal ({"error": ...})."""

    async def send(self, message: dict[str, Any]) -> None:
        """A request without an answer (interrupt, an input answer)."""

    async def close(self, kill: bool = True) -> bool:
        """Stop using the transport, ending what it runs in the sandbox if `kill`; False if
        that must wait until the sandbox runs again (a paused one refuses it)."""
