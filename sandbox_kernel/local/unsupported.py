"""CreateOS routes the local engine does not implement, answered as such.

A plain 404 would read as "no such sandbox". Each of these answers 501 with a JSend error
naming the feature and why the local engine lacks it (after a 404 if the sandbox itself
does not exist), so a client can tell "not here" from "not supported here". They are left
out of the OpenAPI schema, which describes what the engine does.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from sandbox_kernel.api import envelope
from sandbox_kernel.local.engine import Engine

NOT_IMPLEMENTED = 501
ALL = ["GET", "POST", "PUT", "PATCH", "DELETE"]

# (path, methods, what is missing and why)
SANDBOX_ROUTES = [
    ("/resize", ["POST"], "growing a sandbox's disk: its size is fixed at create (disk_mib)"),
    ("/ssh-pubkeys", ["POST"], "SSH access: there is no SSH gateway"),
    ("/networks", ALL, "overlay networks: a local sandbox's network is its own loopback"),
    ("/networks/{network_id}", ALL, "overlay networks: a local sandbox's network is its own loopback"),
    ("/disks", ALL, "persistent disks: there is no S3 disk service"),
    ("/disks/{disk_id}", ALL, "persistent disks: there is no S3 disk service"),
    ("/computer/{rest:path}", ALL, "computer use: a local sandbox has no graphical session"),
    ("/tunnel/{port}", ALL, "port tunnels: a local sandbox has no network device to tunnel to"),
    ("/shell", ALL, "interactive shells over HTTP upgrade"),
    ("/shell-ws", ALL, "interactive shells over WebSocket"),
    ("/metrics", ALL, "sandbox metrics"),
]
ACCOUNT_ROUTES = [
    ("/v1/sandboxes/by-ip/{ip}", ["GET"], "lookup by IP: local sandboxes have no IP address"),
    ("/v1/networks", ALL, "overlay networks: a local sandbox's network is its own loopback"),
    ("/v1/networks/{network_id}", ALL, "overlay networks: a local sandbox's network is its own loopback"),
    ("/v1/disks", ALL, "persistent disks: there is no S3 disk service"),
    ("/v1/disks/{disk_id}", ALL, "persistent disks: there is no S3 disk service"),
    ("/v1/templates", ALL, "templates: rootfs images cannot be built locally (see GET /v1/rootfs)"),
    ("/v1/templates/{rest:path}", ALL, "templates: rootfs images cannot be built locally (see GET /v1/rootfs)"),
    ("/v1/metrics", ALL, "account metrics"),
    ("/v1/metrics/timeseries", ALL, "account metrics"),
]


def refusal(what: str) -> JSONResponse:
    message = f"not supported by the local engine: {what}"
    return JSONResponse(envelope.error(message, NOT_IMPLEMENTED), status_code=NOT_IMPLEMENTED)


def add_unsupported_routes(app: FastAPI, engine: Engine) -> None:
    for suffix, methods, what in SANDBOX_ROUTES:
        app.add_api_route("/v1/sandboxes/{sandbox_id}" + suffix, sandbox_refusal(engine, what),
                          methods=methods, include_in_schema=False)
    for path, methods, what in ACCOUNT_ROUTES:
        app.add_api_route(path, account_refusal(what), methods=methods, include_in_schema=False)


def sandbox_refusal(engine: Engine, what: str) -> Callable[[str], JSONResponse]:
    def route(sandbox_id: str) -> JSONResponse:
        engine.get(sandbox_id)  # 404 first for a sandbox that does not exist
        return refusal(what)
    return route


def account_refusal(what: str) -> Callable[[], JSONResponse]:
    def route() -> JSONResponse:
        return refusal(what)
    return route
