"""The Jupyter side of the panel: which notebook each kernel of this server is, which
sandbox a notebook's kernel drives, and a new notebook whose kernel attaches to a sandbox.

A kernel's sandbox is found through its process id: the server started the kernel
(`python -m sandbox_kernel.kernel`, no wrapper), and the kernel records the sandbox it
drives under its pid in the state dir (ownership.drive)."""

from __future__ import annotations

import asyncio
import os
import posixpath
import re
from typing import Any

import nbformat
from jupyter_core.utils import ensure_async

from sandbox_kernel.config import ENV_VARS
from sandbox_kernel.jupyter_panel.sandboxes import Owners, PanelError
from sandbox_kernel.sandbox import ownership

KERNEL_MODULE = "sandbox_kernel.kernel"
USAGE_WAIT = 6.0  # the kernel itself waits up to 5 s for its sandbox's answer (kernel/handlers.py)


class Notebooks:
    def __init__(self, serverapp: Any) -> None:
        self.kernels = serverapp.kernel_manager
        self.sessions = serverapp.session_manager
        self.contents = serverapp.contents_manager
        self.kernelspecs = serverapp.kernel_spec_manager

    def pid_of(self, kernel_id: str) -> int | None:
        if kernel_id not in self.kernels:
            return None
        provisioner = getattr(self.kernels.get_kernel(kernel_id), "provisioner", None)
        pid = getattr(provisioner, "pid", None)
        return pid if isinstance(pid, int) else None

    async def owners(self) -> Owners:
        notebook_of_pid: dict[int, str] = {}
        for session in await self.sessions.list_sessions():
            kernel = session.get("kernel") or {}
            pid = self.pid_of(kernel.get("id", ""))
            if pid is not None:
                notebook_of_pid[pid] = session.get("path") or session.get("name") or kernel.get("id", "")
        driving = {pid: sandbox_id for pid in notebook_of_pid
                   if (sandbox_id := ownership.driven_by(pid)) is not None}
        return Owners(notebook_of_pid, driving)

    def sandbox_of(self, kernel_id: str) -> str | None:
        """The sandbox the kernel `kernel_id` drives now (None: not a sandbox kernel, or not started)."""
        if kernel_id not in self.kernels:
            raise PanelError(f"no kernel {kernel_id!r} on this server", 404)
        pid = self.pid_of(kernel_id)
        return ownership.driven_by(pid) if pid is not None else None

    async def usage(self, kernel_id: str) -> dict[str, float | None] | None:
        """The CPU and memory of the sandbox the kernel drives, as the kernel reports them to
        JupyterLab's kernel usage panel (a usage_request on its control channel: the kernel
        asks its sandbox); None if it does not answer in time or has no sample."""
        client = self.kernels.get_kernel(kernel_id).client()
        client.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        try:
            request = client.session.msg("usage_request", {})
            client.control_channel.send(request)
            reply = await asyncio.wait_for(self._reply_to(client, request["header"]["msg_id"]), USAGE_WAIT)
        except asyncio.TimeoutError:
            return None
        finally:
            client.stop_channels()
        content = reply.get("content") or {}
        memory = content.get("host_virtual_memory") or {}
        if content.get("reason") or not isinstance(memory, dict):
            return None
        numbers = {"cpu_percent": content.get("host_cpu_percent"), "memory_used": memory.get("used"),
                   "memory_total": memory.get("total")}
        # From the sandbox, through the kernel: only numbers pass.
        return {key: float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
                for key, value in numbers.items()}

    @staticmethod
    async def _reply_to(client: Any, msg_id: str) -> dict[str, Any]:
        while True:
            message = await client.control_channel.get_msg()
            if message.get("parent_header", {}).get("msg_id") == msg_id:
                return message

    async def open_attached(self, sandbox_id: str, label: str, kernel_name: str, directory: str) -> str:
        """A new notebook in `directory` whose kernel drives `sandbox_id`; its path.

        The kernel gets SANDBOX_KERNEL_SANDBOX_ID in its environment when it is launched (the
        variable the kernel reads to attach, config.ENV_VARS), so it never creates a sandbox of
        its own; the session is made here so JupyterLab, opening the notebook, finds it and
        connects to that kernel. The sandbox's Python state is kept (a fork's included)."""
        spec = self._sandbox_kernelspec(kernel_name)
        directory = directory.strip("/")
        if directory and not await self._is_directory(directory):
            raise PanelError(f"no folder {directory!r} on this server", 404)
        # A name or an id in a file name and a cell: only the characters a sandbox name may have.
        label = re.sub(r"[^a-z0-9-]", "-", label.lower())[:63]
        shown_id = re.sub(r"[^A-Za-z0-9_-]", "", sandbox_id)
        path = await self._free_path(directory, f"sandbox-{label}")
        notebook = nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_markdown_cell(
                f"This notebook's kernel drives sandbox `{label}` (`{shown_id}`), opened from the "
                "Sandboxes panel: its variables and files are the sandbox's."),
                nbformat.v4.new_code_cell("")],
            metadata={"kernelspec": {"name": kernel_name, "display_name": spec.display_name,
                                     "language": spec.language}})
        await ensure_async(self.contents.save({"type": "notebook", "format": "json", "content": notebook}, path))
        env = {**os.environ, "JPY_SESSION_NAME": path, ENV_VARS["sandbox_id"]: sandbox_id}
        kernel_id = await self.kernels.start_kernel(kernel_name=kernel_name, path=directory, env=env)
        await self.sessions.create_session(path=path, name=posixpath.basename(path), type="notebook",
                                           kernel_name=kernel_name, kernel_id=kernel_id)
        return path

    def _sandbox_kernelspec(self, kernel_name: str) -> Any:
        try:
            spec = self.kernelspecs.get_kernel_spec(kernel_name)
        except Exception:  # jupyter_client raises NoSuchKernel, a KeyError, or others per manager
            raise PanelError(f"no kernel {kernel_name!r} is installed", 404) from None
        if KERNEL_MODULE not in spec.argv:
            raise PanelError(f"the kernel {kernel_name!r} is not a sandbox kernel")
        return spec

    async def _is_directory(self, path: str) -> bool:
        return bool(await ensure_async(self.contents.dir_exists(path)))

    async def _free_path(self, directory: str, stem: str) -> str:
        for number in range(1, 1000):
            name = f"{stem}.ipynb" if number == 1 else f"{stem}-{number}.ipynb"
            path = posixpath.join(directory, name) if directory else name
            if not await ensure_async(self.contents.file_exists(path)):
                return path
        raise PanelError(f"{directory or 'the root folder'} has {stem}.ipynb up to -999 already", 409)
