"""The panel's REST API, under the Jupyter server's own authentication (a request without
the server's token or session cookie is refused before any handler runs; the engine's
token or the CreateOS key stays on the host). Every error is JSON: {"message": one line}.

  GET    /sandbox-kernel/sandboxes                      every sandbox, with owners and costs
  POST   /sandbox-kernel/sandboxes/ID/pause|resume|keep
  POST   /sandbox-kernel/sandboxes/ID/fork              {"name": optional}
  POST   /sandbox-kernel/sandboxes/ID/open              {"kernel_name", "directory"}: a new notebook
  DELETE /sandbox-kernel/sandboxes/ID
  GET    /sandbox-kernel/sandboxes/ID/egress            rules and latest refusals
  PUT    /sandbox-kernel/sandboxes/ID/egress            {"rules": [...]} or {"block_all": true}
  POST   /sandbox-kernel/sandboxes/ID/egress/allow      {"target": "host:port"}
  GET    /sandbox-kernel/kernels/KERNEL_ID[?usage=1]    the sandbox a notebook's kernel drives
                                                        (with its CPU and memory now)
"""

from __future__ import annotations

import json
import logging
from typing import Any

from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from sandbox_kernel.api import SandboxAPIError, names
from sandbox_kernel.config import ConfigError
from sandbox_kernel.jupyter_panel.notebooks import Notebooks
from sandbox_kernel.jupyter_panel.sandboxes import PanelError, Sandboxes

log = logging.getLogger(__name__)
PREFIX = "sandbox-kernel"
SANDBOX_REF = r"(?P<ref>[A-Za-z0-9][A-Za-z0-9_.-]{0,127})"
KERNEL_ID = r"(?P<kernel_id>[A-Za-z0-9-]{1,64})"


class PanelHandler(APIHandler):
    def initialize(self, sandboxes: Sandboxes, notebooks: Notebooks) -> None:
        self.sandboxes = sandboxes
        self.notebooks = notebooks

    def body(self) -> dict[str, Any]:
        try:
            data = json.loads(self.request.body or b"{}")
        except ValueError:
            raise web.HTTPError(400, "the request body is not JSON") from None
        if not isinstance(data, dict):
            raise web.HTTPError(400, "the request body must be a JSON object")
        return data

    async def answer(self, work: Any) -> None:
        """Run `work` (a coroutine) and answer its result, or one line saying what went wrong."""
        try:
            result = await work
        except PanelError as exc:
            raise web.HTTPError(exc.status, str(exc)) from None
        except ConfigError as exc:
            raise web.HTTPError(500, str(exc)) from None
        except SandboxAPIError as exc:  # the provider's answer, in one line (no key: errors.py redacts)
            status = exc.status_code if exc.status_code and 400 <= exc.status_code < 500 else 502
            raise web.HTTPError(status, exc.user_message()) from None
        except (OSError, RuntimeError) as exc:  # the engine unreachable, a state dir unreadable
            log.warning("sandbox panel: %s", exc)
            raise web.HTTPError(502, f"the sandbox provider could not be reached: {exc}") from None
        self.finish(json.dumps(result))


class SandboxesHandler(PanelHandler):
    @web.authenticated
    async def get(self) -> None:
        await self.answer(self._list())

    async def _list(self) -> dict[str, Any]:
        return await self.sandboxes.listing(await self.notebooks.owners())


class ActionHandler(PanelHandler):
    @web.authenticated
    async def post(self, ref: str, action: str) -> None:
        body = self.body()
        if action == "fork":
            name = body.get("name") or None
            if name is not None and not isinstance(name, str):
                raise web.HTTPError(400, "name must be a string")
            await self.answer(self.sandboxes.fork(ref, name))
        elif action == "open":
            await self.answer(self._open(ref, body))
        else:
            work = {"pause": self.sandboxes.pause, "resume": self.sandboxes.resume,
                    "keep": self.sandboxes.keep}[action]
            await self.answer(self._status(work(ref)))

    @staticmethod
    async def _status(work: Any) -> dict[str, str]:
        return {"status": await work}

    async def _open(self, ref: str, body: dict[str, Any]) -> dict[str, str]:
        kernel_name, directory = body.get("kernel_name"), body.get("directory", "")
        if not isinstance(kernel_name, str) or not kernel_name or not isinstance(directory, str):
            raise PanelError("kernel_name (a sandbox kernel's name) and directory must be strings")
        async with self.sandboxes.client() as client:
            view = await self.sandboxes.view(client, ref)
        if view.status.is_gone:
            raise PanelError(f"sandbox {view.id} is {view.status.value}", 409)
        label = names.display_name(view)
        return {"path": await self.notebooks.open_attached(view.id, label if label != "-" else view.id,
                                                           kernel_name, directory)}


class SandboxHandler(PanelHandler):
    @web.authenticated
    async def delete(self, ref: str) -> None:
        await self.answer(self._destroy(ref))

    async def _destroy(self, ref: str) -> dict[str, str]:
        return {"status": await self.sandboxes.destroy(ref)}


class EgressHandler(PanelHandler):
    @web.authenticated
    async def get(self, ref: str) -> None:
        await self.answer(self.sandboxes.egress(ref))

    @web.authenticated
    async def put(self, ref: str) -> None:
        body = self.body()
        if body.get("block_all") is True:
            await self.answer(self.sandboxes.block_all(ref))
            return
        rules = body.get("rules")
        if not isinstance(rules, list):
            raise web.HTTPError(400, "rules must be a list of strings ([] allows every public destination), "
                                "or block_all true")
        await self.answer(self.sandboxes.set_egress(ref, rules))


class AllowHandler(PanelHandler):
    @web.authenticated
    async def post(self, ref: str) -> None:
        target = self.body().get("target")
        if not isinstance(target, str) or not target:
            raise web.HTTPError(400, "target must be the refused host:port")
        await self.answer(self.sandboxes.allow(ref, target))


class KernelHandler(PanelHandler):
    @web.authenticated
    async def get(self, kernel_id: str) -> None:
        await self.answer(self._current(kernel_id))

    async def _current(self, kernel_id: str) -> dict[str, Any]:
        sandbox_id = self.notebooks.sandbox_of(kernel_id)
        if sandbox_id is None:
            return {"sandbox": None}
        listed = await self.sandboxes.listing(await self.notebooks.owners())
        row = next((row for row in listed["sandboxes"] if row["id"] == sandbox_id), None)
        # Only asked for (the panel asks for the notebook in focus while it shows) and only of a
        # running sandbox: the kernel asks its sandbox, which would wake a paused one.
        if row is not None and row["status"] == "running" and self.get_argument("usage", "") == "1":
            row["usage"] = await self.notebooks.usage(kernel_id)
        return {"sandbox": row, "provider": listed["provider"]}


def install(serverapp: Any) -> None:
    web_app = serverapp.web_app
    base = url_path_join(web_app.settings["base_url"], PREFIX)
    args = {"sandboxes": Sandboxes(), "notebooks": Notebooks(serverapp)}
    web_app.add_handlers(".*$", [
        (url_path_join(base, "sandboxes"), SandboxesHandler, args),
        (url_path_join(base, "sandboxes", SANDBOX_REF, "egress"), EgressHandler, args),
        (url_path_join(base, "sandboxes", SANDBOX_REF, "egress", "allow"), AllowHandler, args),
        (url_path_join(base, "sandboxes", SANDBOX_REF, r"(?P<action>pause|resume|keep|fork|open)"),
         ActionHandler, args),
        (url_path_join(base, "sandboxes", SANDBOX_REF), SandboxHandler, args),
        (url_path_join(base, "kernels", KERNEL_ID), KernelHandler, args),
    ])
