"""The isolation attacks, each run from a notebook cell of a real kernel on the local
engine, each asserted to fail in the expected way: host secrets, host files, host
processes, host network and the engine, privileged system calls.
"""

from __future__ import annotations

import hashlib
import socket
import subprocess
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from attack_helpers import ONCE, attempt
from kernel_helpers import running_kernel
from sandbox_kernel.guest import bundle as guest_bundle
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.local import bwrap
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = [pytest.mark.slow, ONCE]


@pytest.fixture(scope="module")
def kc(kernelspec: str) -> Iterator[BlockingKernelClient]:
    with running_kernel(kernelspec) as (_, client):
        yield client


@pytest.fixture
def planted(tmp_path: Path, state_dir: Path) -> Iterator[dict[str, str]]:
    """A unique secret on the host: in a temp dir, in the host user's home and in the
    engine's state dir (next to its token). Maps path -> content."""
    secret = f"host-secret-{uuid.uuid4().hex}"
    paths = [tmp_path / "secret.txt", Path.home() / f".sandbox-kernel-{secret}",
             state_dir / f"secret-{secret}"]
    for path in paths:
        path.write_text(secret)
        path.chmod(0o644)  # readable by anyone on the host: only the sandbox boundary stops it
    yield {str(path): secret for path in paths}
    for path in paths[1:]:
        path.unlink()


def test_host_secrets_are_unreadable(kc, planted, state_dir: Path) -> None:
    targets = [*planted, "/etc/shadow", str(state_dir / "token"), str(state_dir), str(Path.home())]
    found = attempt(kc, f"""
        result = {{path: outcome(lambda: open(path, 'rb').read().decode('latin-1'))
                  if not os.path.isdir(path) else outcome(lambda: sorted(os.listdir(path)))
                  for path in {targets!r}}}
        """)
    for path in planted:
        assert found[path] == "ENOENT", path
    assert found["/etc/shadow"] in ("ENOENT", "EACCES")  # never its contents
    assert found[str(state_dir / "token")] == "ENOENT"
    assert found[str(state_dir)] == "ENOENT"
    # The sandbox's home is /workspace. The host user's home shows only if the Python
    # installation lives in it (bound read-only at its path), and then nothing else of it.
    home = found[str(Path.home())]
    assert home == "ENOENT" or (".bashrc" not in home and not any(name in home for name in
                                                                  (Path(p).name for p in planted)))


def test_the_engine_token_is_nowhere_in_the_sandbox(kc, engine: EngineEndpoint) -> None:
    """Not in the environment, the command lines or the environments of any process the
    sandbox can see, nor in its /etc."""
    token_hash = hashlib.sha256(engine.token.encode()).hexdigest()
    found = attempt(kc, """
        import hashlib, glob
        blobs = []
        for pattern in ('/proc/*/environ', '/proc/*/cmdline', '/etc/*', '/run/*/*'):
            for path in glob.glob(pattern):
                try:
                    blobs.append(open(path, 'rb').read())
                except OSError:
                    pass
        words = set()
        for blob in blobs:
            for word in blob.replace(b'\\0', b' ').replace(b'=', b' ').split():
                words.add(hashlib.sha256(word).hexdigest())
        result = {'hashes': sorted(words), 'files': len(blobs)}
        """)
    assert found["files"] > 10
    assert token_hash not in found["hashes"]


def test_writes_outside_the_workspace_never_reach_the_host(kc, tmp_path: Path) -> None:
    host_file = tmp_path / "host-file.txt"
    host_file.write_text("original")
    host_file.chmod(0o666)
    # The agent's code: its start script, its modules and the bytecode the engine binds beside them.
    agent_dir = f"/opt/sandbox-kernel/{guest_bundle.PACKAGE}/agent"
    agent_code = [f"{agent_dir}/agent.py", f"{agent_dir}/run_agent.py",
                  bwrap.cached_bytecode_path(f"{agent_dir}/agent.py", optimized=bool(bwrap.agent_optimization())),
                  f"{agent_dir}/__pycache__/intruder.pyc"]
    protected = ["/usr/sandbox-was-here", "/etc/passwd", *agent_code, "/run/sandbox-agent/intruder"]
    found = attempt(kc, f"""
        import socket, sys
        targets = {protected!r} + [sys.prefix + '/sandbox-was-here', sys.prefix + '/pyvenv.cfg', os.__file__]
        result = {{t: outcome(lambda: open(t, 'ab').write(b'x')) for t in targets}}
        # Posing as the sandbox's agent would need its socket replaced.
        result['unlink agent.sock'] = outcome(lambda: os.unlink('/run/sandbox-agent/agent.sock'))
        result['bind next to agent.sock'] = outcome(
            lambda: socket.socket(socket.AF_UNIX).bind('/run/sandbox-agent/fake.sock'))
        # The host file's path inside the sandbox is the sandbox's own /tmp: writing there works,
        # and must not touch the host's file.
        host_path = {str(host_file)!r}
        os.makedirs(os.path.dirname(host_path), exist_ok=True)
        result['host_path'] = outcome(lambda: open(host_path, 'w').write('overwritten'))
        """)
    assert found.pop("host_path") == 11  # characters written, inside the sandbox
    for target, what in found.items():
        assert what in ("EROFS", "EACCES", "ENOENT", "EPERM"), (target, what)
    assert host_file.read_text() == "original"
    assert not Path("/usr/sandbox-was-here").exists()


@pytest.fixture
def host_process() -> Iterator[subprocess.Popen]:
    process = subprocess.Popen(["sleep", "600"])
    yield process
    process.kill()
    process.wait()


def test_host_processes_cannot_be_seen_signalled_or_traced(kc, host_process) -> None:
    pid = host_process.pid
    found = attempt(kc, f"""
        import ctypes, signal
        libc = ctypes.CDLL(None, use_errno=True)
        def ptrace_attach(pid):
            if libc.ptrace(16, pid, None, None) != 0:  # PTRACE_ATTACH
                raise OSError(ctypes.get_errno(), 'ptrace')
        visible = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
        result = {{
            'visible': visible,
            'host_pid_shown': os.path.exists('/proc/{pid}') and b'sleep' in open('/proc/{pid}/cmdline', 'rb').read(),
            'kill': outcome(lambda: os.kill({pid}, signal.SIGKILL)) if {pid} not in visible else 'collides',
            'ptrace': outcome(lambda: ptrace_attach({pid})) if {pid} not in visible else 'collides',
        }}
        """)
    assert found["host_pid_shown"] is False
    assert len(found["visible"]) < 20, "only the sandbox's own few processes"
    if found["kill"] != "collides":  # a sandbox process may happen to have the same number
        assert found["kill"] == "ESRCH" and found["ptrace"] in ("ESRCH", "EPERM")
    assert host_process.poll() is None, "the host process is alive"


class RecordingServer:
    """A TCP service on the host's loopback that notes every connection it gets."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            conn.close()


def test_host_loopback_and_engine_api_are_unreachable(kc, engine: EngineEndpoint) -> None:
    server = RecordingServer()
    engine_port = int(engine.url.rsplit(":", 1)[1])
    try:
        found = attempt(kc, f"""
            import socket, urllib.request
            def connect(port):
                socket.create_connection(('127.0.0.1', port), timeout=3).close()
            def via_proxy(port):
                # The sandbox's only way out: the engine's egress proxy (http_proxy is set),
                # where the host's loopback is {HOST_ALIAS}.
                urllib.request.urlopen('http://{HOST_ALIAS}:%d/v1/whoami' % port, timeout=10)
            def unix(path):
                with socket.socket(socket.AF_UNIX) as s:
                    s.connect(path)
            result = {{
                'service': outcome(lambda: connect({server.port})),
                'engine': outcome(lambda: connect({engine_port})),
                'service_via_proxy': outcome(lambda: via_proxy({server.port})),
                'engine_via_proxy': outcome(lambda: via_proxy({engine_port})),
                'engine_socket': outcome(lambda: unix({str(engine.socket)!r})),
                'interfaces': sorted(n for _, n in socket.if_nameindex()),
            }}
            """)
    finally:
        server.listener.close()
    assert found["service"] == found["engine"] == "ECONNREFUSED"  # the sandbox's own loopback
    assert found["engine_socket"] == "ENOENT"
    # The proxy answers 403 (HTTPError); urllib reports it as an exception, not an OSError errno.
    assert found["service_via_proxy"] == found["engine_via_proxy"] == "HTTPError"
    assert found["interfaces"] == ["lo"]
    assert server.connections == 0


def test_privileged_system_calls_fail(kc) -> None:
    before = socket.gethostname()
    found = attempt(kc, """
        import ctypes, socket, tempfile
        libc = ctypes.CDLL(None, use_errno=True)
        def call(result):
            if result != 0:
                raise OSError(ctypes.get_errno(), 'syscall')
        module = tempfile.NamedTemporaryFile(suffix='.ko')
        result = {
            'mount_tmpfs': outcome(lambda: call(libc.mount(b'none', b'/workspace', b'tmpfs', 0, None))),
            'remount_usr_rw': outcome(lambda: call(libc.mount(None, b'/usr', None, 32 | 4096, None))),  # MS_REMOUNT|MS_BIND
            'umount_usr': outcome(lambda: call(libc.umount2(b'/usr', 2))),  # MNT_DETACH
            'finit_module': outcome(lambda: call(libc.syscall(313, module.fileno(), b'', 0))),
            'init_module': outcome(lambda: call(libc.syscall(175, None, 0, b''))),
            'sethostname': outcome(lambda: call(libc.sethostname(b'pwned', 5))),
            'reboot': outcome(lambda: call(libc.reboot(0x4321FEDC))),  # RB_POWER_OFF
            'hostname': socket.gethostname(),
        }
        """)
    assert found.pop("hostname") == "sandbox"
    for call, what in found.items():
        assert what in ("EPERM", "EACCES", "ENOSYS"), (call, what)
    assert socket.gethostname() == before
