"""Escapes through the files API: `..` paths, absolute host paths and symlinks planted in
the workspace, for uploads and downloads. Every path is resolved by the sandbox's agent
inside the sandbox, so none of these reaches a host file.
"""

from __future__ import annotations

import hashlib
import uuid
from pathlib import Path

import pytest

from attack_helpers import ONCE
from sandbox_kernel.api import BadRequestError, NotFoundError, SandboxAPIError

pytestmark = [pytest.mark.slow, ONCE]

HOST_PASSWD = Path("/etc/passwd").read_bytes()


@pytest.fixture
def host_secret(tmp_path: Path) -> Path:
    path = tmp_path / "host-secret.txt"
    path.write_text(f"host-secret-{uuid.uuid4().hex}")
    path.chmod(0o666)
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


async def test_dot_dot_paths_stay_inside(sandbox, host_secret: Path) -> None:
    client, sandbox_id = sandbox
    # Resolved inside: this is the sandbox's own synthetic /etc/passwd, not the host's.
    passwd = await client.download_file(sandbox_id, "/workspace/../../../../etc/passwd")
    assert passwd != HOST_PASSWD and b"sandbox:x:1000" in passwd
    with pytest.raises(NotFoundError):
        await client.download_file(sandbox_id, f"/workspace/../../..{host_secret}")
    before = hashlib.sha256(HOST_PASSWD).hexdigest()
    with pytest.raises(BadRequestError, match="Read-only"):
        await client.upload_file(sandbox_id, "/workspace/../../etc/passwd", b"pwned::0:0::/:/bin/sh\n")
    assert digest(Path("/etc/passwd")) == before


async def test_absolute_host_paths_are_not_the_hosts(sandbox, host_secret: Path, state_dir: Path) -> None:
    client, sandbox_id = sandbox
    for path in (host_secret, state_dir / "token", Path("/etc/shadow"), Path.home() / ".bashrc"):
        with pytest.raises(NotFoundError):
            await client.download_file(sandbox_id, str(path))
    secret = digest(host_secret)
    with pytest.raises(NotFoundError):  # its directory does not exist in the sandbox
        await client.upload_file(sandbox_id, str(host_secret), b"overwritten")
    assert digest(host_secret) == secret
    # /tmp is the sandbox's own: a file uploaded there never shows on the host.
    sandbox_tmp_file = f"/tmp/upload-{uuid.uuid4().hex}"
    await client.upload_file(sandbox_id, sandbox_tmp_file, b"inside")
    assert await client.download_file(sandbox_id, sandbox_tmp_file) == b"inside"
    assert not Path(sandbox_tmp_file).exists()


async def test_symlinks_in_the_workspace_resolve_inside(sandbox, host_secret: Path) -> None:
    client, sandbox_id = sandbox
    links = {"shadow": "/etc/shadow", "secret": str(host_secret), "hostdir": str(host_secret.parent),
             "root": "/", "passwd": "/etc/passwd"}
    script = "; ".join(f"ln -s {target} /workspace/{name}" for name, target in links.items())
    result = (await client.exec(sandbox_id, "sh", ["-c", script])).result
    assert result.exit_code == 0, result.stderr
    for name in ("shadow", "secret"):
        with pytest.raises(NotFoundError):
            await client.download_file(sandbox_id, f"/workspace/{name}")
    assert await client.download_file(sandbox_id, "/workspace/root/etc/passwd") != HOST_PASSWD
    secret = digest(host_secret)
    for path in ("/workspace/secret", "/workspace/hostdir/new.txt"):
        with pytest.raises(NotFoundError):  # the link's target directory is not in the sandbox
            await client.upload_file(sandbox_id, path, b"through a symlink")
    with pytest.raises(BadRequestError, match="Read-only"):
        await client.upload_file(sandbox_id, "/workspace/passwd", b"through a symlink")
    assert digest(host_secret) == secret
    assert not (host_secret.parent / "new.txt").exists()
    assert Path("/etc/passwd").read_bytes() == HOST_PASSWD


async def test_relative_and_odd_paths_are_refused(sandbox) -> None:
    client, sandbox_id = sandbox
    for path in ("etc/passwd", "../etc/passwd", "", "/proc/self/fd/0", "/dev/zero"):
        with pytest.raises(SandboxAPIError) as caught:
            await client.download_file(sandbox_id, path)
        assert caught.value.status_code in (400, 404), (path, caught.value)
