"""The Sandboxes panel's server extension (sandbox_kernel/jupyter_panel/): its REST handlers
in a real Jupyter server (the one `pip install` enabled it in), against the real engine.

Authentication is the server's own: a request without its token is refused before any
handler runs. Bad input is one JSON line the panel shows, never a traceback or a secret.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from browser_helpers import Lab, running_jupyterlab
from kernel_helpers import PROVIDER
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus
from sandbox_kernel.local.service import EngineEndpoint
from sandbox_kernel.sandbox import ownership

ROUTES = [("GET", "sandboxes"), ("POST", "sandboxes/SB/pause"), ("POST", "sandboxes/SB/resume"),
          ("POST", "sandboxes/SB/keep"), ("POST", "sandboxes/SB/fork"), ("POST", "sandboxes/SB/open"),
          ("DELETE", "sandboxes/SB"), ("GET", "sandboxes/SB/egress"), ("PUT", "sandboxes/SB/egress"),
          ("POST", "sandboxes/SB/egress/allow"), ("GET", "kernels/KERNEL")]


@pytest.fixture(scope="module")
def lab(kernelspec: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    with running_jupyterlab(tmp_path_factory.mktemp("panel-lab")) as running:
        yield running


@pytest.fixture
async def sandbox(engine: EngineEndpoint) -> AsyncIterator[str]:
    async with SandboxClient(engine.url, engine.token) as client:
        created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))
        try:
            yield created.id
        finally:
            await client.delete_sandbox(created.id)
            ownership.forget(created.id)


async def call(lab: Lab, method: str, path: str, token: str | None = "", **kwargs: object) -> httpx.Response:
    """A request to the panel's API; token "" means the server's own, None none at all."""
    headers = {} if token is None else {"Authorization": f"token {token or lab.token}"}
    async with httpx.AsyncClient(base_url=f"{lab.url}/sandbox-kernel/", timeout=60) as client:
        return await client.request(method, path, headers=headers, **kwargs)  # type: ignore[arg-type]


async def status_of(engine: EngineEndpoint, sandbox_id: str) -> SandboxStatus:
    async with SandboxClient(engine.url, engine.token) as client:
        return (await client.get_sandbox(sandbox_id)).status


@pytest.mark.parametrize("token", [None, "not-the-token"], ids=["no token", "a wrong token"])
async def test_every_route_refuses_a_request_without_the_servers_token(lab: Lab, sandbox: str,
                                                                      engine: EngineEndpoint, token: str | None) -> None:
    for method, path in ROUTES:
        response = await call(lab, method, path.replace("SB", sandbox).replace("KERNEL", "x"), token=token,
                              content=b"{}")
        assert response.status_code == 403, (method, path, response.status_code)
        # Forbidden, or (a POST without a token) its missing _xsrf argument: refused before the handler.
        message = response.json()["message"]
        assert message == "Forbidden" or message.startswith("'_xsrf' argument missing"), message
    # Nothing happened to the sandbox: pause and destroy were among them.
    assert await status_of(engine, sandbox) == SandboxStatus.RUNNING


async def test_the_listing_names_owner_state_and_cost_and_holds_no_secret(lab: Lab, sandbox: str,
                                                                          engine: EngineEndpoint) -> None:
    response = await call(lab, "GET", "sandboxes")
    assert response.status_code == 200
    assert engine.token not in response.text
    listing = response.json()
    assert listing["provider"] == PROVIDER  # the server's environment picks it, as the kernel's does
    row = next(row for row in listing["sandboxes"] if row["id"] == sandbox)
    assert row["status"] == "running" and row["mem_mib"] == 512
    assert row["owner"] == {"kind": "none", "label": "-"}  # made through the API: nobody's here
    assert row["cost_per_hour"] > 0 and row["cost_so_far"] >= 0 and row["driven_by"] == []


async def test_pause_resume_keep_and_destroy_change_the_sandbox(lab: Lab, engine: EngineEndpoint) -> None:
    async with SandboxClient(engine.url, engine.token) as client:
        sandbox = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
    assert (await call(lab, "POST", f"sandboxes/{sandbox}/pause", content=b"{}")).status_code == 200
    while (state := await status_of(engine, sandbox)) == SandboxStatus.PAUSING:
        await asyncio.sleep(0.05)
    assert state == SandboxStatus.PAUSED
    again = await call(lab, "POST", f"sandboxes/{sandbox}/pause", content=b"{}")
    assert again.status_code == 409
    assert again.json()["message"] == f"sandbox {sandbox} is paused: only a running one can be paused"
    assert (await call(lab, "POST", f"sandboxes/{sandbox}/resume", content=b"{}")).status_code == 200
    while (state := await status_of(engine, sandbox)) == SandboxStatus.RESUMING:
        await asyncio.sleep(0.05)
    assert state == SandboxStatus.RUNNING
    assert (await call(lab, "POST", f"sandboxes/{sandbox}/keep", content=b"{}")).json() == {"status": "kept"}
    assert ownership.is_kept(sandbox)
    gone = await call(lab, "DELETE", f"sandboxes/{sandbox}")
    assert gone.status_code == 200 and gone.json()["status"] in ("destroying", "destroyed")
    assert not ownership.is_kept(sandbox)  # the record went with it
    assert (await call(lab, "GET", f"sandboxes/{sandbox}/egress")).status_code == 404


BAD_INPUT = [
    ("POST", "fork", b'{"name": "Bad Name"}', 400, "bad sandbox name 'Bad Name'"),
    ("POST", "fork", b'{"name": 5}', 400, "name must be a string"),
    ("POST", "fork", b"not json", 400, "the request body is not JSON"),
    ("POST", "fork", b"[1]", 400, "the request body must be a JSON object"),
    ("PUT", "egress", b'{"rules": "example.com"}', 400, "rules must be a list of strings"),
    ("PUT", "egress", b'{"rules": [1]}', 400, "rules must be a list of strings"),
    ("PUT", "egress", b'{"rules": ["10.0.0.0/33"]}', 400, "invalid egress rule '10.0.0.0/33'"),
    ("PUT", "egress", b'{"rules": ["intranet"]}', 400, "'intranet' is not a rule: give a full host name"),
    ("POST", "egress/allow", b'{"target": ""}', 400, "target must be the refused host:port"),
    # Allow takes one destination the log refused, nothing else (the target came from the sandbox).
    ("POST", "egress/allow", b'{"target": "*.example.com:443"}', 400, "'*.example.com:443' is not one destination"),
    ("POST", "egress/allow", b'{"target": "10.0.0.0/8"}', 400, "'10.0.0.0/8' is not one destination"),
    ("POST", "egress/allow", b'{"target": "example.com:443"}', 409, "example.com:443 is not among the latest refusals"),
    ("POST", "open", b"{}", 400, "kernel_name (a sandbox kernel's name) and directory must be strings"),
    ("POST", "open", b'{"kernel_name": "no-such-kernel"}', 404, "no kernel 'no-such-kernel' is installed"),
    ("POST", "open", b'{"kernel_name": "python3"}', 400, "the kernel 'python3' is not a sandbox kernel"),
]


@pytest.mark.parametrize(("method", "action", "body", "status", "message"), BAD_INPUT,
                         ids=[f"{action} {body.decode()}" for _, action, body, _, _ in BAD_INPUT])
async def test_bad_input_is_one_json_line_and_changes_nothing(lab: Lab, sandbox: str, engine: EngineEndpoint,
                                                              method: str, action: str, body: bytes,
                                                              status: int, message: str) -> None:
    response = await call(lab, method, f"sandboxes/{sandbox}/{action}", content=body)
    assert response.status_code == status, response.text
    assert response.headers["Content-Type"].startswith("application/json")
    assert message in response.json()["message"] and "\n" not in response.json()["message"]
    assert "Traceback" not in response.text and engine.token not in response.text
    async with SandboxClient(engine.url, engine.token) as client:
        assert (await client.get_egress(sandbox)).egress in (None, [])
        assert not [view for view in await client.list_sandboxes() if view.forked_from == sandbox]
    assert not list(lab.root.glob("*.ipynb"))


async def test_unknown_sandboxes_kernels_and_folders_are_named(lab: Lab, sandbox: str, kernelspec: str) -> None:
    missing = await call(lab, "POST", "sandboxes/no-such-sandbox/pause", content=b"{}")
    assert missing.status_code == 404
    assert missing.json()["message"] == f"no sandbox with id or name 'no-such-sandbox' on {PROVIDER}"
    kernel = await call(lab, "GET", "kernels/0000-not-a-kernel")
    assert (kernel.status_code, kernel.json()["message"]) == (404, "no kernel '0000-not-a-kernel' on this server")
    body = {"kernel_name": kernelspec, "directory": "no/such/folder"}
    folder = await call(lab, "POST", f"sandboxes/{sandbox}/open", json=body)
    assert (folder.status_code, folder.json()["message"]) == (404, "no folder 'no/such/folder' on this server")
    # Out of the server's root: its contents manager refuses, and nothing is written there.
    outside = await call(lab, "POST", f"sandboxes/{sandbox}/open", json={**body, "directory": "../.."})
    assert outside.status_code == 404 and "\n" not in outside.json()["message"]
    assert not list(lab.root.parent.parent.glob("sandbox-*.ipynb"))
