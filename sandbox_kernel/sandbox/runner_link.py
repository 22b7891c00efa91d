"""Which transport reaches the runner, and getting it back when its connection drops.

The session's runner is reached by one RunnerTransport (transport.py): the channel over a
managed process (channel.py) where the provider has managed processes, else one exec per
request (exec_transport.py). Whether it has them is learnt once, at the first runner start,
and kept. A channel whose connection was lost for good is opened again before the next
request (the runner lives on, with its state); one whose runner died says so
(RunnerTransportError with runner_gone), for the session to report, and tells the session
at once (on_runner_gone), between cells too, unless the death is one the session asked for
(a runner being replaced, a shutdown).

A relay left in a paused sandbox cannot be ended there (a paused sandbox refuses the kill:
a fork switched to, another sandbox attached): it is ended once this kernel resumes that
sandbox, so that switching back and forth does not pile relays up to the pids limit.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from enum import Enum
from typing import Any

from sandbox_kernel.api import SandboxClient
from sandbox_kernel.guest import protocol
from sandbox_kernel.sandbox.channel import ChannelUnavailable, RunnerChannel, SandboxProcesses
from sandbox_kernel.sandbox.errors import SessionError
from sandbox_kernel.sandbox.exec_transport import ExecStreaming, ExecTransport
from sandbox_kernel.sandbox.runner_setup import RUNNER_DIR, SANDBOX_PYTHON, runner_client
from sandbox_kernel.sandbox.transport import EventHandler, RunnerTransport, RunnerTransportError

log = logging.getLogger("sandbox_kernel.sandbox.runner_link")

# Where requests go: the session's client and its current sandbox (SessionError: none yet).
Where = Callable[[], tuple[SandboxClient, str]]
# Told that the runner died (or its sandbox went) without a request in hand to say it.
RunnerGone = Callable[[RunnerTransportError], None]


def channel_to(client: SandboxClient, sandbox_id: str, line_limit: int, on_background: EventHandler,
               background_seq: int = 0) -> RunnerChannel:
    """A channel (not yet open) to the runner serving in `sandbox_id`."""
    return RunnerChannel(SandboxProcesses(client, sandbox_id, SANDBOX_PYTHON),
                         lambda after: runner_client("channel", RUNNER_DIR, *([str(after)] if after else [])),
                         line_limit, on_background, background_seq=background_seq)


def execs_to(client: SandboxClient, sandbox_id: str, line_limit: int, streaming: ExecStreaming) -> ExecTransport:
    """The exec transport to the runner serving in `sandbox_id`."""
    return ExecTransport(client, sandbox_id, SANDBOX_PYTHON,
                         lambda command, arg: runner_client(command, RUNNER_DIR, arg), line_limit, streaming)


def is_runner_info(info: dict[str, Any]) -> bool:
    """Is this answer to an info request a runner's info? Anything else (the sandbox's code
    can replace the runner's client) is no runner this kernel can drive."""
    return "python_version" in info


class ManagedProcesses(Enum):
    """Whether the provider has managed processes (the channel's ground)."""

    UNKNOWN = "unknown"  # no runner started yet
    AVAILABLE = "available"
    MISSING = "missing"  # one exec per request, for good


class RunnerLink:
    """The session's way to its runner; see the module docstring."""

    def __init__(self, where: Where, line_limit: int, on_background: EventHandler, *,
                 opens_channels: bool = True, on_runner_gone: RunnerGone | None = None) -> None:
        self._where = where
        self._line_limit = line_limit  # of one event line from the sandbox
        self._on_background = on_background
        self._on_runner_gone = on_runner_gone
        # False for a session that only prepares a sandbox for another to drive: that one
        # opens the channel, on its own event loop.
        self._opens_channels = opens_channels
        self._processes = ManagedProcesses.UNKNOWN
        self._streaming = ExecStreaming()
        self._channel: RunnerChannel | None = None
        self._channel_sandbox = ""  # the sandbox the channel's relay runs in
        self._paused_relays: dict[str, list[RunnerChannel]] = {}
        # Set once shutdown or a restart hand-off begins: a cell still running then must not
        # open a channel the closing session would leave reading on a closed client.
        self._closing = False
        # Set while the session starts a new runner in place of the one the channel reaches
        # (`%sandbox attach --restart-runner`): the old one's end is no death.
        self._replacing_runner = False

    @property
    def opens_channels(self) -> bool:
        return self._opens_channels

    @property
    def has_channel(self) -> bool:
        """Does a channel carry the runner's events (the exec fallback carries no debugger's)?"""
        return self._channel is not None

    def by_exec(self) -> ExecTransport:
        """The exec transport to the current sandbox (needs no channel, nor a managed process)."""
        client, sandbox_id = self._where()
        return execs_to(client, sandbox_id, self._line_limit, self._streaming)

    def _transport(self) -> RunnerTransport:
        return self._channel if self._channel is not None else self.by_exec()

    async def connect(self, background_seq: int = 0) -> None:
        """Reach the runner now serving in the current sandbox: open a channel to it,
        replacing any other (a background_seq: the same runner, whose between-cell output we
        saw up to it), unless the provider has no managed processes."""
        if not self._opens_channels or self._processes is ManagedProcesses.MISSING:
            return
        opened = await self._open_channel(background_seq)
        if opened is not None:
            await self._use(*opened)

    async def serving_runner_info(self) -> dict[str, Any] | None:
        """The info of a runner already serving in the current sandbox, now reached as by
        connect; None if nothing there answers as one (no runner, or the sandbox's code put
        something else in its client's place): no channel of ours is left then, and its
        relay's end is no runner death for on_runner_gone.

        Asked over the channel it will go on using: one Python started in the sandbox, where
        an exec asking first and then the channel started two (a fork's attach waits for
        them). By exec where no channel can open."""
        if self._opens_channels and self._processes is not ManagedProcesses.MISSING:
            opened = await self._open_channel()
            if opened is not None:
                return await self._info_over(*opened)
        try:
            info = await self.by_exec().request({protocol.OP: protocol.INFO})
        except RunnerTransportError:  # no answer, or one that is not JSON
            return None
        return info if is_runner_info(info) else None

    async def _info_over(self, channel: RunnerChannel, sandbox_id: str) -> dict[str, Any] | None:
        """serving_runner_info over a channel just opened, which becomes the link's if a
        runner answers. No runner is a relay's verdict (the daemon is unreachable), or a
        relay that ended without a word, or an answer that is no runner's; a connection to
        the sandbox lost for good is no verdict: the attach fails, as an exec's would."""
        try:
            info = await channel.request({protocol.OP: protocol.INFO})
        except RunnerTransportError as exc:
            failure = channel.failure
            if failure is not None and not failure.runner_gone:
                await channel.close()
                raise SessionError(f"could not reach the runner in sandbox {sandbox_id}: {exc}") from None
            info = {}
        except BaseException:
            await channel.close()
            raise
        if not is_runner_info(info):
            await channel.close()  # not the link's channel: its end is told to nobody
            return None
        await self._use(channel, sandbox_id)
        info.pop(protocol.REPLY, None)  # the channel's numbering, not the runner's word
        return info

    async def _open_channel(self, background_seq: int = 0) -> tuple[RunnerChannel, str] | None:
        """A channel opened to the current sandbox (not yet the link's), with that sandbox's
        id; None if the provider turns out to have no managed processes."""
        client, sandbox_id = self._where()
        channel = channel_to(client, sandbox_id, self._line_limit, self._on_background, background_seq)
        channel.on_runner_gone = lambda failure: self._runner_gone(channel, failure)  # knows its channel
        try:
            await channel.open()
        except ChannelUnavailable as exc:
            if self._processes is ManagedProcesses.AVAILABLE:
                raise RuntimeError(f"the runner's channel could not start: {exc}") from None
            log.warning("no managed processes (%s): one exec per cell", exc)
            self._processes = ManagedProcesses.MISSING
            return None
        self._processes = ManagedProcesses.AVAILABLE
        return channel, sandbox_id

    async def _use(self, channel: RunnerChannel, sandbox_id: str) -> None:
        """From now on requests go over `channel`, to the runner in `sandbox_id`; the channel
        it replaces is closed (or left to close once its paused sandbox runs again)."""
        if self._closing:
            await channel.close()
            raise SessionError("the kernel is shutting down")
        old, old_sandbox = self._channel, self._channel_sandbox
        self._channel, self._channel_sandbox = channel, sandbox_id
        if old is not None and not await old.close():
            self._paused_relays.setdefault(old_sandbox, []).append(old)

    @contextlib.contextmanager
    def replacing_runner(self) -> Iterator[None]:
        """While a new runner is started in place of the one the channel reaches."""
        self._replacing_runner = True
        try:
            yield
        finally:
            self._replacing_runner = False

    def _runner_gone(self, channel: RunnerChannel, failure: RunnerTransportError) -> None:
        """A channel's runner died: news for the session if it is the runner it drives and
        nobody asked for its end."""
        if (channel is self._channel and not self._closing and not self._replacing_runner
                and self._on_runner_gone is not None):
            self._on_runner_gone(failure)

    async def ensure_up(self) -> None:
        """Before a request: a channel that lost its connection is opened again; one whose
        runner died raises why (RunnerTransportError, runner_gone)."""
        channel = self._channel
        if channel is None or channel.alive or self._closing:
            return
        if channel.failure is not None and channel.failure.runner_gone:
            raise channel.failure
        await self.connect(channel.background_seq)  # only the connection was lost

    async def run_cell(self, cell_id: str, request: dict[str, Any], on_event: EventHandler,
                       on_sent: Callable[[], None] | None = None) -> dict[str, Any]:
        return await self._transport().run_cell(cell_id, request, on_event, on_sent)

    async def request(self, message: dict[str, Any]) -> dict[str, Any]:
        return await self._transport().request(message)

    async def send(self, message: dict[str, Any]) -> None:
        """A request without an answer: by exec while the channel is down (it needs no stream)."""
        transport = self._transport()
        await (transport if transport.failure is None else self.by_exec()).send(message)

    async def sandbox_resumed(self, sandbox_id: str) -> None:
        """`sandbox_id` runs again: the relays of ours left in it while it was paused end now,
        and the channel's reader, if it waits out that pause, goes on."""
        if self._channel is not None and self._channel_sandbox == sandbox_id:
            self._channel.sandbox_running()
        for relay in self._paused_relays.pop(sandbox_id, []):
            await relay.close()

    def egress_refusals(self, sandbox_id: str) -> int | None:
        """The engine's count of egress refusals in `sandbox_id`, as the channel's stream last
        said (None: no channel there). Only a cue to ask the engine (channel.py)."""
        if self._channel is None or self._channel_sandbox != sandbox_id:
            return None
        return self._channel.egress_refusals

    def begin_closing(self) -> None:
        """No channel opens from now on (the session is shutting down or handing over)."""
        self._closing = True

    async def close(self, kill: bool) -> None:
        """Stop following the runner, and end its relay if `kill` (else it ends with the
        runner or the sandbox)."""
        if self._channel is not None:
            await self._channel.close(kill=kill)
            self._channel = None
