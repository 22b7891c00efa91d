"""Inside a sandbox, as the vendor's examples use it: common HTTP clients work with the
proxy variables the sandbox gets, loopback stays the sandbox's own (CreateOS §6), and
the vendor SDK's in-sandbox self-signals (§9) pause or delete that sandbox only."""

from __future__ import annotations

import http.server
import json
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from createos import Client, CreateSandboxRequest, RunCommandRequest, SandboxInstance, WaitOptions

from sandbox_kernel.api.local_engine import HOST_ALIAS

pytestmark = pytest.mark.slow
SHAPE = "s-1vcpu-1gb"
INSIDE_PORT = 8765  # on the sandbox's own loopback: no host port is involved





PACKUMENT = json.dumps({"name": "hello-sandbox", "dist-tags": {"latest": "1.0.0"}, "versions": {
    "1.0.0": {"name": "hello-sandbox", "version": "1.0.0", "dist": {"tarball": "http://unused/x.tgz"}}}})


class Named(http.server.BaseHTTPRequestHandler):
    """Answers "host", or, as a package registry would, hello-sandbox's metadata."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = (PACKUMENT if self.path.startswith("/hello-sandbox") else "host").encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def host_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Named)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()


CLIENTS = r"""
import http.server, json, subprocess, sys, threading, urllib.request
import httpx, requests

class Inside(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "6"); self.end_headers()
        self.wfile.write(b"inside")
    def log_message(self, *args):
        pass

inner = http.server.ThreadingHTTPServer(("127.0.0.1", INSIDE_PORT), Inside)
threading.Thread(target=inner.serve_forever, daemon=True).start()

def attempt(fetch, url):
    try:
        return fetch(url)
    except Exception as exc:
        return type(exc).__name__

clients = {
    "urllib": lambda url: urllib.request.urlopen(url, timeout=10).read().decode(),
    "requests": lambda url: requests.get(url, timeout=10).text,
    "httpx": lambda url: httpx.Client(timeout=10).get(url).text,
    "curl": lambda url: subprocess.run(["curl", "-sS", "-m", "10", url], capture_output=True, text=True).stdout,
}
print(json.dumps({name: [attempt(fetch, url) for url in sys.argv[1:]] for name, fetch in clients.items()}))
""".replace("INSIDE_PORT", str(INSIDE_PORT))


def test_common_clients_reach_the_host_by_rule_and_loopback_stays_inside(
        vendor_sandbox: SandboxInstance, host_server: int) -> None:
    vendor_sandbox.set_egress([f"127.0.0.1:{host_server}"])
    urls = [f"http://{HOST_ALIAS}:{host_server}/", f"http://127.0.0.1:{INSIDE_PORT}/",
            f"http://localhost:{INSIDE_PORT}/", f"http://{HOST_ALIAS}:{host_server + 1}/"]
    done = vendor_sandbox.run_command(RunCommandRequest(command="python3", arguments=["-c", CLIENTS, *urls]))
    assert done.result.exit_code == 0, done.result.standard_error
    outcomes = json.loads(done.result.standard_output.strip().splitlines()[-1])
    assert sorted(outcomes) == ["curl", "httpx", "requests", "urllib"]
    for name, (host, inside, localhost, other_port) in outcomes.items():
        assert (host, inside, localhost) == ("host", "inside", "inside"), name
        # No rule for that port: the proxy's 403 with its reason (urllib raises on it).
        assert other_port == "HTTPError" if name == "urllib" else "egress denied" in other_port, name
    env = vendor_sandbox.shell("env | grep -i _proxy= | sort").result.standard_output
    assert "socks" not in env  # httpx would need its socks extra just to build a client
    assert re.search(r"^NO_PROXY=.*127\.0\.0\.1", env, re.M) and re.search(r"^no_proxy=.*::1", env, re.M)


@pytest.mark.skipif(not shutil.which("npm"), reason="npm is not installed on this host")
def test_npm_uses_the_proxy_variables(vendor_sandbox: SandboxInstance, host_server: int) -> None:
    vendor_sandbox.set_egress([f"127.0.0.1:{host_server}"])
    asked = vendor_sandbox.shell(f"npm view hello-sandbox version --registry http://{HOST_ALIAS}:{host_server}/")
    assert asked.result.standard_output.strip() == "1.0.0"


def signal_itself(sandbox: SandboxInstance, action: str, reason: str) -> None:
    """The vendor SDK's own helper, in a detached process as the vendor advises (the
    sandbox freezes or dies mid-call)."""
    helper = f"import createos; createos.self_{action}({reason!r}); print('accepted')"
    detach = ("import subprocess, sys\n"
              f"subprocess.Popen([sys.executable, '-c', {helper!r}], start_new_session=True,\n"
              "                 stdout=open('/tmp/signal.out', 'w'), stderr=subprocess.STDOUT)")
    done = sandbox.run_command(RunCommandRequest(command="python3", arguments=["-c", detach]))
    assert done.result.exit_code == 0, done.result.standard_error


def test_a_sandbox_pauses_and_deletes_itself_and_nothing_else(
        vendor: Client, vendor_sandbox: SandboxInstance, state_dir: Path) -> None:
    bystander = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    try:
        signal_itself(vendor_sandbox, "pause", "r" * 300)
        vendor_sandbox.wait_until_paused(WaitOptions(timeout=30))
        assert bystander.refresh().status == "running"
        vendor_sandbox.resume().wait_until_running()
        assert vendor_sandbox.shell("cat /tmp/signal.out").result.standard_output == "accepted\n"
        # CreateOS truncates the reason to 128 characters; the engine logs what it got.
        logged = re.findall(rf"sandbox {vendor_sandbox.id} asks to pause itself \(reason '(r*)'\)",
                            (state_dir / "engine.log").read_text())
        assert logged == ["r" * 128]
        wrong = vendor_sandbox.shell("curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:1029/self/pause;"
                              "curl -s -o /dev/null -w '%{http_code}' -X POST http://127.0.0.1:1029/self/reboot")
        assert wrong.result.standard_output == "405 404"
        signal_itself(vendor_sandbox, "delete", "done")
        vendor_sandbox.wait_until_destroyed(WaitOptions(timeout=30))
        assert bystander.refresh().status == "running"
    finally:
        bystander.destroy()


def test_a_fork_signals_only_itself(vendor_sandbox: SandboxInstance) -> None:
    """A fork shares its source's pid namespace, not its loopback or its agent: its
    self-pause pauses the fork alone."""
    vendor_sandbox.pause().wait_until_paused()
    child = vendor_sandbox.fork()
    try:
        child.wait_until_running(WaitOptions(timeout=60))
        vendor_sandbox.resume().wait_until_running()
        signal_itself(child, "pause", "fork")
        child.wait_until_paused(WaitOptions(timeout=30))
        assert vendor_sandbox.refresh().status == "running"
    finally:
        child.destroy()
