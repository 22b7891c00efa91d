"""Attacks on the way the engine reaches a sandbox's agent (issue 30, item 3).

The engine runs as root (or as the host user) and talks to each sandbox's agent over a
unix socket: whoever answers there gets the owner's execs, uploads and egress streams.

- A fork's processes live in a user namespace its SOURCE sandbox owns, so code in the
  source can enter the fork's mount namespace and change what is at the fork's
  /run/sandbox-agent. The engine used to connect to the fork's agent through
  /proc/<agent>/root/run/sandbox-agent, following what it found there: a symlink to a
  host socket (a root-only one, or another sandbox's agent), or a socket planted there.
- The agent's listening socket could be copied (pidfd_getfd) out of a child it spawns,
  in the moment that child is dumpable and has not yet closed what it inherited.

Each test first shows that its attack step really ran (the sandbox says so, in detail),
then that the owner's requests still reached the right agent and nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from attack_helpers import ONCE
from engine_helpers import wait_status
from sandbox_kernel.api import CreateSandboxRequest, SandboxClient, SandboxStatus

pytestmark = [pytest.mark.slow, ONCE]

# Run in the SOURCE sandbox with the fork's agent pid: enter the fork's user, mount and
# network namespaces (the source owns the fork's user namespace) and replace the fork's
# /run/sandbox-agent. argv: pid, then "symlink TARGET" or "plant LOGFILE"; then connects
# to the fork's egress port. Prints one JSON line of what it did.
ENTER_FORK = r'''
import ctypes, json, os, socket, sys, threading, time
libc = ctypes.CDLL(None, use_errno=True)
pid, mode, arg = int(sys.argv[1]), sys.argv[2], sys.argv[3]
log = open(arg, "a", buffering=1) if mode == "plant" else None  # opened before leaving the source's files
done = {}
for name, flag in (("user", 0x10000000), ("mnt", 0x00020000), ("net", 0x40000000)):
    fd = os.open("/proc/%d/ns/%s" % (pid, name), os.O_RDONLY)
    if libc.setns(fd, flag) != 0:
        raise OSError(ctypes.get_errno(), "setns " + name)
    os.close(fd)
    done["setns " + name] = True
libc.umount2(b"/run/sandbox-agent", 2)
os.rename("/run/sandbox-agent", "/run/sandbox-agent.old")  # what the fork set up, moved aside
if mode == "symlink":
    os.symlink(arg, "/run/sandbox-agent")
    done["symlink"] = os.readlink("/run/sandbox-agent")
else:
    os.mkdir("/run/sandbox-agent")
    planted = socket.socket(socket.AF_UNIX)
    planted.bind("/run/sandbox-agent/agent.sock")
    planted.listen(16)
    done["planted"] = sorted(os.listdir("/run/sandbox-agent"))
    if os.fork() == 0:  # serves on, in the background, answering every op as the agent
        os.setsid()
        null = os.open("/dev/null", os.O_RDWR)
        for fd in (0, 1, 2):  # not the exec's pipes: its output would never end
            os.dup2(null, fd)
        while True:
            conn, _ = planted.accept()
            log.write(conn.recv(65536).decode(errors="replace").split("\n")[0] + "\n")
            conn.sendall(b'{"stdout":"planted\\n"}\n{"exit_code":0}\n{"ok":true,"bytes":0}\n')
            conn.close()
egress = socket.create_connection(("127.0.0.1", 3128), timeout=10)  # the fork's egress port
egress.sendall(b"CONNECT 127.0.0.1:9 HTTP/1.1\r\n\r\n")
egress.settimeout(5)
try:
    done["egress answer"] = egress.recv(100).decode(errors="replace").split("\r\n")[0]
except OSError as exc:
    done["egress answer"] = repr(exc)
print(json.dumps(done))
'''


@dataclass
class Decoy:
    """A unix socket on the host that the sandbox must never get the engine to reach: it
    answers any request as an agent would, and keeps the request lines it was sent."""

    directory: Path
    requests: list[str] = field(default_factory=list)

    def serve(self) -> None:
        self.directory.mkdir(mode=0o700)  # the engine's user's alone (root's, as root)
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(self.directory / "agent.sock"))
        server.listen(16)

        def answer() -> None:
            while True:
                try:
                    conn, _ = server.accept()
                except OSError:
                    return
                with conn:
                    self.requests.append(conn.recv(65536).decode(errors="replace").split("\n")[0])
                    conn.sendall(b'{"stdout":"decoy\\n"}\n{"exit_code":0}\n')

        threading.Thread(target=answer, daemon=True).start()


@pytest.fixture
def decoy(tmp_path: Path) -> Iterator[Decoy]:
    found = Decoy(tmp_path / "root-only")
    found.serve()
    yield found


@dataclass
class Family:
    source: str
    fork: str
    fork_agent: int  # its agent's pid in the family's pid namespace


async def run(client: SandboxClient, sandbox_id: str, *argv: str, env: dict[str, str] | None = None) -> str:
    result = (await client.exec(sandbox_id, argv[0], list(argv[1:]), env=env)).result
    assert result.exit_code == 0, result.stderr
    return result.stdout


@pytest.fixture
async def family(client: SandboxClient) -> AsyncIterator[Family]:
    """A running source and its running fork."""
    source = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
    fork = None
    try:
        await client.pause_sandbox(source)
        await wait_status(client, source, SandboxStatus.PAUSED)
        fork = (await client.fork_sandbox(source)).id
        await wait_status(client, fork, SandboxStatus.RUNNING, timeout=60)
        await client.resume_sandbox(source)
        await wait_status(client, source, SandboxStatus.RUNNING)
        # A command's parent is the agent that started it; the pid namespace is shared.
        agent = int(await run(client, fork, "python3", "-c", "import os; print(os.getppid())"))
        yield Family(source, fork, agent)
    finally:
        for sandbox_id in (fork, source):
            if sandbox_id:
                await client.delete_sandbox(sandbox_id)


async def enter_fork(client: SandboxClient, family: Family, mode: str, arg: str) -> dict:
    return json.loads(await run(client, family.source, "python3", "-c", ENTER_FORK,
                                str(family.fork_agent), mode, arg))


async def assert_fork_answers_itself(client: SandboxClient, family: Family) -> None:
    """The owner's exec and upload on the fork reach the fork's own agent."""
    marker = "owner-secret-" + os.urandom(4).hex()
    said = await run(client, family.fork, "sh", "-c", "echo $SANDBOX_ID $MARK", env={"MARK": marker})
    assert said == f"{family.fork} {marker}\n"
    await client.upload_file(family.fork, "/workspace/upload.txt", b"uploaded")
    assert await run(client, family.fork, "cat", "/workspace/upload.txt") == "uploaded"


async def test_a_symlink_to_a_root_only_host_socket_is_not_followed(
        client: SandboxClient, family: Family, decoy: Decoy) -> None:
    done = await enter_fork(client, family, "symlink", str(decoy.directory))
    assert done["setns mnt"] and done["symlink"] == str(decoy.directory)  # the attack step ran
    assert decoy.requests == []  # the fork's egress stream was not taken there...
    assert done["egress answer"].startswith("HTTP/1.1 403")  # ...but by its own agent, under its rules
    await assert_fork_answers_itself(client, family)
    assert decoy.requests == []


async def test_a_symlink_to_another_sandboxs_agent_is_not_followed(
        client: SandboxClient, family: Family, state_dir: Path) -> None:
    other = (await client.create_sandbox(CreateSandboxRequest(
        shape="s-1vcpu-256mb", envs={"OTHER_SECRET": "other-sandbox-secret"}))).id
    try:
        their_agent = state_dir / "sandboxes" / other / "agent"
        assert (their_agent / "agent.sock").exists()  # the path the sandbox names is real
        done = await enter_fork(client, family, "symlink", str(their_agent))
        assert done["symlink"] == str(their_agent)
        said = await run(client, family.fork, "sh", "-c", "echo $SANDBOX_ID ${OTHER_SECRET:-none}")
        assert said == f"{family.fork} none\n"
        await client.upload_file(family.fork, "/workspace/for-the-fork.txt", b"mine")
        assert await run(client, other, "ls", "/workspace") == ""  # nothing went to the other one
    finally:
        await client.delete_sandbox(other)


async def test_a_socket_planted_in_the_fork_does_not_answer_for_its_agent(
        client: SandboxClient, family: Family) -> None:
    log = "/workspace/planted.log"  # in the source: where the planted server says what it got
    done = await enter_fork(client, family, "plant", log)
    assert done["planted"] == ["agent.sock"]  # the attack step ran: a socket is there
    await assert_fork_answers_itself(client, family)
    assert done["egress answer"].startswith("HTTP/1.1 403")
    listed = await run(client, family.source, "sh", "-c", f"cat {log} 2>/dev/null; echo end")
    assert listed == "end\n"  # the planted socket was never connected to


# Run in a sandbox, beside the owner's execs: for every child the agent spawns, try to
# copy each of its descriptors 3..63 (pidfd_getfd) and keep any listening socket.
STEAL = r'''
import ctypes, errno, json, os, socket, stat, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
PIDFD_OPEN, PIDFD_GETFD = 434, 438
agent, seconds = os.getppid(), float(sys.argv[1])
open("/tmp/stealer.ready", "w").close()
children, attempts, refused, stolen = set(), 0, {}, 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline and not os.path.exists("/tmp/stealer.stop"):
    last = int(open("/proc/sys/kernel/ns_last_pid").read())
    for pid in (last, last + 1):
        pidfd = libc.syscall(PIDFD_OPEN, pid, 0)
        if pidfd < 0:
            continue
        try:
            if int(open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[1]) != agent:
                continue  # not one of the agent's children
            children.add(pid)
            for _ in range(20):
                for fd in range(3, 64):
                    attempts += 1
                    got = libc.syscall(PIDFD_GETFD, pidfd, fd, 0)
                    if got < 0:
                        name = errno.errorcode.get(ctypes.get_errno(), "?")
                        refused[name] = refused.get(name, 0) + 1
                        continue
                    if stat.S_ISSOCK(os.fstat(got).st_mode):
                        copy = socket.socket(fileno=got)
                        if copy.family == socket.AF_UNIX and copy.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                            stolen += 1
                        copy.close()
                    else:
                        os.close(got)  # (a pipe kept open would keep the command's output from ending)
        except (OSError, IndexError, ValueError):
            pass
        finally:
            os.close(pidfd)
print(json.dumps({"children": len(children), "attempts": attempts, "refused": refused, "stolen": stolen}))
'''


async def test_the_agents_listener_cannot_be_copied_from_a_child_it_spawns(client: SandboxClient) -> None:
    sandbox = (await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-512mb"))).id
    try:
        async with client.exec_stream(sandbox, "python3", ["-c", STEAL, "120"]) as frames:
            while (await client.exec(sandbox, "sh", ["-c", "ls /tmp/stealer.ready"])).result.exit_code:
                await asyncio.sleep(0.05)
            for number in range(150):  # each exec is a child of the agent
                assert await run(client, sandbox, "echo", str(number)) == f"{number}\n"
            await run(client, sandbox, "touch", "/tmp/stealer.stop")
            output = ""
            async for frame in frames:
                output += frame.stdout or ""
                if frame.exit_code is not None:
                    assert frame.exit_code == 0, output
        found = json.loads(output)
        # The attack ran: it caught the agent's children and tried to copy their descriptors.
        assert found["children"] >= 50 and found["attempts"] >= 50 * 61 * 20, found
        assert found["stolen"] == 0, found
    finally:
        await client.delete_sandbox(sandbox)
