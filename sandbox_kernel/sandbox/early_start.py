"""Creating the sandbox while the kernel process is still importing ipykernel.

A kernel process spends about half a second importing ipykernel and its own modules and
setting up its sockets before SandboxKernel.start() runs; creating the sandbox and
starting its runner take as long again, waiting on the engine and the sandbox. Begun by
the kernel's __main__ (kernel/__main__.py) before it imports ipykernel, on a thread with
its own event loop and API client (a SandboxSession that opens no channel and tops no pool
up), the create and the runner's start overlap the kernel's own start-up. The kernel's
SandboxSession.start() then takes the sandbox over on the kernel's loop: its own client,
the channel to the runner and the warm pool's top-up (the steps tied to that loop).

Only the plain case starts early: a new sandbox or one of the warm pool, from the settings
of the config file and the environment. A kernel restart (its hand-off file is there),
kernel arguments on the command line or an attach start the usual way. The kernel compares
its own settings when it takes the sandbox over; if they differ (a kernel argument set in a
Jupyter config file), the early sandbox is destroyed and a new one made. Either way the
sandbox is recorded as this process's from its create (or claim) on (ownership.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from sandbox_kernel.api import SandboxAPIError
from sandbox_kernel.config import ConfigError, Settings, open_client
from sandbox_kernel.paths import connection_file_argument, handoff_path
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.sandbox.session import Prepared, SandboxSession

log = logging.getLogger("sandbox_kernel.sandbox.early_start")

KERNEL_ARGUMENT = "--SandboxKernel."
# The kernel's imports wait (at most this long) until the create is on its way: sharing the
# interpreter with them would only delay the create, which is the longer of the two.
SEND_WAIT = 2.0


class EarlyStart:
    """One sandbox being made on a thread of its own; `prepared()` awaits it on any loop.
    An EarlySandbox for SandboxSession.start (session.py)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.started = time.monotonic()
        self._result: concurrent.futures.Future[Prepared] = concurrent.futures.Future()
        # Running, so that a boot cancelled while it awaits this cannot cancel it (the
        # thread sets its result whatever happens).
        self._result.set_running_or_notify_cancel()
        self._sending = threading.Event()  # set when the create (or claim) is about to go, or never will
        # A daemon: a kernel that exits meanwhile leaves the create to its ownership trace.
        threading.Thread(target=self._run, name="sandbox-early-start", daemon=True).start()

    def wait_sending(self, timeout: float = SEND_WAIT) -> None:
        self._sending.wait(timeout)

    async def prepared(self) -> Prepared:
        """The sandbox made; raises what the start raised (a SessionError, as
        SandboxSession.start would)."""
        return await asyncio.wrap_future(self._result)

    async def prepared_for(self, settings: Settings) -> Prepared | None:
        """The sandbox made, if it was made for `settings` (the kernel's own); else None,
        and it is destroyed (settings from a Jupyter config file's kernel arguments)."""
        if settings == self.settings:
            return await self.prepared()
        try:
            await self.discard()
        except (SandboxAPIError, OSError, RuntimeError) as exc:  # still ours: the shutdown policy ends it
            log.warning("could not destroy the sandbox made before the kernel's settings were known: %s", exc)
        return None

    async def discard(self) -> None:
        """Destroy the sandbox made, for settings the kernel turned out not to have. One
        whose start failed half-way is left to the shutdown policy (it is ours all the same)."""
        try:
            prepared = await self.prepared()
        except Exception:
            return
        client = await open_client(self.settings)
        try:
            await client.delete_sandbox(prepared.sandbox_id)
        finally:
            await client.aclose()
        ownership.forget(prepared.sandbox_id)

    def _run(self) -> None:
        try:
            self._result.set_result(asyncio.run(self._prepare()))
        except BaseException as exc:  # the kernel's boot reports it, as its own start's
            self._result.set_exception(exc)
        finally:
            self._sending.set()

    async def _prepare(self) -> Prepared:
        client = await open_client(self.settings)
        # The channel and the warm pool's top-up live on the kernel's loop.
        session = SandboxSession(self.settings, client=client, open_channel=False, refill_pool=False)
        try:
            # What is left before the create is sent needs little of the interpreter:
            # the kernel's imports may go on.
            self._sending.set()
            await session.start()
        finally:
            await client.aclose()
        assert session.sandbox_id is not None
        return Prepared(session.sandbox_id, dict(session.runner_info))


_pending: EarlyStart | None = None


def begin(argv: list[str]) -> None:
    """Start making the sandbox now, unless this kernel is not a plain new one (see above).

    argv: the kernel's command line (after the module), as jupyter_client gives it.
    """
    global _pending
    if any(arg.startswith(KERNEL_ARGUMENT) for arg in argv):
        return
    connection_file = connection_file_argument(argv)
    try:
        if connection_file is None or handoff_path(connection_file).exists():  # a restart's successor
            return
        settings = Settings.from_env()
    except (ConfigError, OSError):  # the kernel's own start says it, in the first cell
        return
    if settings.attach_to:
        return
    _pending = EarlyStart(settings)
    _pending.wait_sending()


def take() -> EarlyStart | None:
    """The early start, once (a boot retried after a failure starts the usual way)."""
    global _pending
    early, _pending = _pending, None
    return early
