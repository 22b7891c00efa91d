"""The vendor's Python SDK (`createos-sandbox`, unchanged) against the local engine.

Each test drives the engine only through the SDK's public methods, the way a user
copying the vendor's examples would, and checks what CreateOS answers (createos-api.md):
catalog names, fields and routes the engine cannot honour refused with a reason (never
a silent 200), coded errors, and the hosts and bandwidth views. Access tokens, faults,
the sandbox's network and its self-signals are in test_vendor_sdk_*.py.
"""

from __future__ import annotations

import http.server
import json
import subprocess
import threading
import sys
import time
from pathlib import Path

import httpx
import pytest
from createos import (
    APIError,
    AttachDiskOptions,
    Client,
    ComputerCreateScreenRequest,
    CreateSandboxRequest,
    DetachDiskOptions,
    DiskAttachment,
    DiskConfig,
    DiskCreateRequest,
    DiskCredentials,
    ListSandboxesOptions,
    ForkSandboxRequest,
    NetworkCreateRequest,
    NetworkEntry,
    RunCommandRequest,
    SandboxInstance,
    TemplateCreateRequest,
    WaitOptions,
)

from engine_helpers import stop_process
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local.service import EngineEndpoint, read_endpoint

pytestmark = pytest.mark.slow
SHAPE = "s-1vcpu-512mb"





def refused(call, status: int) -> APIError:  # type: ignore[no-untyped-def]
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status_code == status, caught.value
    return caught.value


def live_ids(vendor: Client) -> set[str]:
    return {sb.id for sb in vendor.list_sandboxes()}


# -- item 1: the vendor catalog's names ------------------------------------------------


def test_the_vendor_rootfs_name_runs_and_says_what_it_means_locally(
        vendor: Client, vendor_sandbox: SandboxInstance) -> None:
    catalog = vendor.list_root_file_systems()
    assert "devbox:1" in catalog.root_file_systems
    [entry] = [e for e in catalog.entries if e.name == "devbox:1"]
    assert "host-python" in (entry.description or "")
    assert vendor_sandbox.data.rootfs == "devbox:1" and vendor_sandbox.refresh().data.rootfs == "devbox:1"
    # What the vendor docs promise of devbox:1: bash, GNU timeout, python3, curl.
    done = vendor_sandbox.shell("timeout 5 python3 -c 'print(6 * 7)' && command -v curl >/dev/null && echo ok")
    assert done.result.standard_output == "42\nok\n"
    wrong = refused(lambda: vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE, rootfs="desktop:1")), 400)
    assert "rootfs_unsupported" in str(wrong) and "graphical session" in str(wrong)
    assert "unknown_rootfs" in str(refused(
        lambda: vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE, rootfs="nosuch:9")), 400))


# -- item 4: nothing silently dropped ----------------------------------------------------


@pytest.mark.parametrize("field, request_", [
    ("ingress_enabled", CreateSandboxRequest(shape=SHAPE, ingress_enabled=True)),
    ("ssh_pubkeys", CreateSandboxRequest(shape=SHAPE, ssh_public_keys=["ssh-ed25519 AAAA k"])),
    ("networks", CreateSandboxRequest(shape=SHAPE, networks=[NetworkEntry(id="net_1")])),
    ("disks", CreateSandboxRequest(shape=SHAPE, disks=[DiskAttachment("disk_1", "/mnt/d")])),
    ("host_id", CreateSandboxRequest(shape=SHAPE, host_id="host-7")),
    ("node_selector", CreateSandboxRequest(shape=SHAPE, node_selector={"zone": "a"})),
    ("region", CreateSandboxRequest(shape=SHAPE, region="eu-west")),
])
def test_create_refuses_a_field_it_cannot_honour(vendor: Client, field: str,
                                                 request_: CreateSandboxRequest) -> None:
    before = live_ids(vendor)
    error = refused(lambda: vendor.create_sandbox(request_), 400)
    code = "region_mismatch" if field == "region" else f"unsupported_{field}"
    assert json.loads(error.body)["data"]["code"] == code
    assert live_ids(vendor) == before, "nothing was created"


def test_create_refuses_a_bandwidth_quota_the_sdk_cannot_even_send(engine: EngineEndpoint) -> None:
    # The SDK never sends bandwidth_quota_bytes; a raw client can, and CreateOS says 400.
    response = httpx.post(f"{engine.url}/v1/sandboxes", headers={"X-Api-Key": engine.token},
                          json={"shape": SHAPE, "bandwidth_quota_bytes": 1 << 30})
    assert response.status_code == 400
    assert response.json()["data"]["code"] == "unsupported_bandwidth_quota_bytes"


def test_this_region_is_honoured_and_patch_and_fork_refuse_ingress_and_ssh(
        vendor: Client, vendor_sandbox: SandboxInstance) -> None:
    local = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE, region="local"))
    try:
        assert local.refresh().data.region == "local"
    finally:
        local.destroy()
    assert "ingress" in str(refused(lambda: vendor_sandbox.set_ingress(True), 400))
    vendor_sandbox.set_ingress(False)  # asks for nothing: fine
    vendor_sandbox.pause().wait_until_paused()
    for fork in (ForkSandboxRequest(ingress_enabled=True), ForkSandboxRequest(ssh_public_keys=["k"])):
        refused(lambda: vendor_sandbox.fork(fork), 400)
    child = vendor_sandbox.fork(ForkSandboxRequest(ingress_enabled=False, ssh_public_keys=[]))
    child.wait_until_running(WaitOptions(timeout=60))
    child.destroy()


# -- item 5: routes the engine does not implement -----------------------------------------


def test_every_unsupported_method_says_so_in_jsend(vendor: Client, vendor_sandbox: SandboxInstance) -> None:
    unsupported = {
        "resize": lambda: vendor_sandbox.resize(20480),
        "add_ssh_public_keys": lambda: vendor_sandbox.add_ssh_public_keys(["ssh-ed25519 AAAA k"]),
        "get_sandbox_by_ip": lambda: vendor.get_sandbox_by_ip("10.0.0.7"),
        "attach_network": lambda: vendor_sandbox.attach_network("net_1"),
        "detach_network": lambda: vendor_sandbox.detach_network("net_1"),
        "list_disks": lambda: vendor_sandbox.list_disks(),
        "attach_disk": lambda: vendor_sandbox.attach_disk(AttachDiskOptions("disk_1", "/mnt/d")),
        "detach_disk": lambda: vendor_sandbox.detach_disk(DetachDiskOptions("disk_1", "/mnt/d")),
        "networks.list": lambda: vendor.networks.list(),
        "networks.create": lambda: vendor.networks.create(NetworkCreateRequest(name="n")),
        "networks.get": lambda: vendor.networks.get("net_1"),
        "networks.delete": lambda: vendor.networks.delete("net_1"),
        "disks.list": lambda: vendor.disks.list(),
        "disks.create": lambda: vendor.disks.create(DiskCreateRequest(
            name="d", config=DiskConfig(bucket="b", endpoint="http://s3.invalid"),
            credentials=DiskCredentials("a", "s"))),
        "disks.get": lambda: vendor.disks.get("d"),
        "disks.delete": lambda: vendor.disks.delete("d"),
        "disks.rotate_credentials": lambda: vendor.disks.rotate_credentials("d", DiskCredentials("a", "s")),
        "templates.list": lambda: vendor.templates.list(),
        "templates.create": lambda: vendor.templates.create(TemplateCreateRequest(name="t", dockerfile="FROM x")),
        "templates.get": lambda: vendor.templates.get("tpl_1"),
        "templates.logs": lambda: vendor.templates.logs("tpl_1"),
        "templates.delete": lambda: vendor.templates.delete("tpl_1"),
        "computer.screen": lambda: vendor_sandbox.computer.screen(),
        "computer.screenshot": lambda: vendor_sandbox.computer.screenshot(),
        "computer.screens.create": lambda: vendor_sandbox.computer.screens.create(ComputerCreateScreenRequest()),
        "computer.keyboard.type": lambda: vendor_sandbox.computer.keyboard.type("hi"),
    }
    for name, call in unsupported.items():
        error = refused(call, 501)
        assert error.code == 501, name  # JSend error: {"status": "error", "message", "code"}
        assert "not supported by the local engine" in str(error), name
    # Not the same answer as a sandbox that does not exist, nor as a route that does not.
    gone = refused(lambda: vendor.get_sandbox("sb-does-not-exist"), 404)
    assert "sandbox_not_found" in str(gone)
    assert json.loads(gone.body)["data"]["code"] == "sandbox_not_found"
    auth = {"X-Api-Key": vendor._transport.api_key}
    missing = httpx.post(f"{vendor.base_url}/v1/sandboxes/sb-does-not-exist/resize", headers=auth,
                         json={"disk_mib": 20480})
    assert missing.status_code == 404 and missing.json()["data"]["code"] == "sandbox_not_found"
    no_route = httpx.get(f"{vendor.base_url}/v1/no-such-route", headers=auth)
    assert no_route.status_code == 404 and no_route.json()["data"]["code"] == "route_not_found"


BODY_IN, BODY_OUT = 300_000, 200_000


class Sized(http.server.BaseHTTPRequestHandler):
    """Reads the request body, answers BODY_OUT bytes."""

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(BODY_OUT))
        self.end_headers()
        self.wfile.write(b"o" * BODY_OUT)

    def log_message(self, *args: object) -> None:
        pass


def test_hosts_and_bandwidth_have_their_local_meaning(vendor: Client, vendor_sandbox: SandboxInstance) -> None:
    [host] = vendor.list_hosts()
    assert host.id == "local" and host.sandbox_count >= 1 and "devbox:1" in host.root_file_systems
    view = vendor_sandbox.bandwidth()
    assert (view.id, view.quota_bytes, view.remaining_bytes, view.capped) == (vendor_sandbox.id, -1, -1, False)
    assert (view.used_bytes, view.ingress_bytes) == (0, 0)
    assert vendor_sandbox.recharge_bandwidth(1024).quota_bytes == -1  # a no-op when unmetered (§7)
    # Counted at the egress proxy: what the sandbox sends is used_bytes, what it gets ingress.
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        vendor_sandbox.set_egress([f"127.0.0.1:{port}"])
        vendor_sandbox.shell(f"head -c {BODY_IN} /dev/zero | curl -sf --data-binary @- "
                      f"http://{HOST_ALIAS}:{port}/ -o /dev/null")
    finally:
        server.shutdown()
    view = vendor_sandbox.bandwidth()
    assert BODY_IN <= view.used_bytes < BODY_IN + 4096
    assert BODY_OUT <= view.ingress_bytes < BODY_OUT + 4096


# -- item 7: the errors a user meets first ---------------------------------------------


def test_serve_makes_a_state_dir_that_does_not_exist_yet(tmp_path: Path) -> None:
    state = tmp_path / "not" / "yet"
    process = subprocess.Popen([sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(state)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        endpoint = None
        while endpoint is None and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
            endpoint = read_endpoint(state) if state.exists() else None
        assert endpoint is not None, process.stdout.read().decode() if process.poll() is not None else "no engine"
        assert state.stat().st_mode & 0o777 == 0o700
        with Client(api_key=endpoint.token, base_url=endpoint.url) as client:
            assert client.who_am_i().user_id == "local"
    finally:
        stop_process(process, 15)


def test_a_directory_download_and_bad_json_are_400s_naming_the_problem(
        engine: EngineEndpoint, vendor_sandbox: SandboxInstance) -> None:
    def download() -> None:
        with vendor_sandbox.files.download("/workspace") as stream:
            stream.read()

    error = refused(download, 400)
    assert "/workspace: a directory" in str(error)
    vendor_sandbox.files.upload("/workspace/after.txt", b"the agent is still there")
    with vendor_sandbox.files.download("/workspace/after.txt") as stream:
        assert stream.read() == b"the agent is still there"
    response = httpx.post(f"{engine.url}/v1/sandboxes", headers={"X-Api-Key": engine.token,
                                                                 "Content-Type": "application/json"},
                          content=b'{"shape": ')
    assert response.status_code == 400
    assert response.json() == {"status": "fail", "data": {"message": "request body is not valid JSON",
                                                          "code": "invalid_json"}}


def test_the_everyday_methods_work(vendor: Client, vendor_sandbox: SandboxInstance) -> None:
    """The rest of the compatibility table (docs/createos.md) marked "works", each called once."""
    assert vendor.health().up and vendor.readiness().ready
    assert vendor.who_am_i().stats.running >= 1
    assert SHAPE in {shape.id for shape in vendor.list_shapes()}
    assert vendor_sandbox.id in {sb.id for sb in vendor.list_sandboxes(ListSandboxesOptions(status="running"))}
    assert vendor.get_sandbox(vendor_sandbox.id).name == vendor_sandbox.name
    assert vendor_sandbox.set_auto_pause(600).data.auto_pause_after_seconds == 600
    assert vendor_sandbox.set_auto_pause(None).data.auto_pause_after_seconds is None
    vendor_sandbox.set_egress(["example.com:443"])
    assert vendor_sandbox.egress().egress_rules == ["example.com:443"]
    vendor_sandbox.run_command(RunCommandRequest(command="bash", arguments=[
        "-c", "nohup setsid python3 -m http.server 8123 </dev/null >/dev/null 2>&1 &"]))
    vendor_sandbox.wait_for_port(8123, timeout=20)
    events = []
    with vendor_sandbox.stream_command(RunCommandRequest(command="bash", arguments=["-c", "echo out; exit 4"])) as stream:
        events = [(str(e.type), e.data or e.exit_code) for e in stream if e.type != "heartbeat"]
    assert events == [("stdout", "out\n"), ("exit", 4)]
    with pytest.raises(ValueError, match="ingress is not enabled"):
        vendor_sandbox.preview_url(8123)  # client-side; ingress is refused locally (set_ingress: 400)
