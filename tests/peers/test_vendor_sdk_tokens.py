"""Per-sandbox access tokens (createos-api.md §15.4) through the vendor's Python SDK:
a token reaches its own sandbox and nothing else, and is dead once rotated or disabled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from createos import (
    APIError,
    Client,
    CreateSandboxRequest,
    ExecOptions,
    RequestOptions,
    RunCommandRequest,
    SandboxInstance,
)

from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow
SHAPE = "s-1vcpu-512mb"



@pytest.fixture
def pair(vendor: Client) -> Iterator[tuple[SandboxInstance, SandboxInstance]]:
    mine = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    other = vendor.create_sandbox(CreateSandboxRequest(shape=SHAPE))
    yield mine, other
    for sandbox in (mine, other):
        try:
            sandbox.destroy()
        except APIError:
            pass


def status_of(call) -> int:  # type: ignore[no-untyped-def]
    try:
        call()
    except APIError as error:
        return error.status_code
    return 200


def test_a_token_operates_its_own_sandbox_and_nothing_else(
        vendor: Client, engine: EngineEndpoint, state_dir: Path,
        pair: tuple[SandboxInstance, SandboxInstance]) -> None:
    mine, other = pair
    assert mine.get_access_token().enabled is False
    created = mine.create_access_token()
    assert created.enabled and created.token and created.rotated_at is None
    assert status_of(mine.create_access_token) == 409  # one enabled token per sandbox
    shown = mine.get_access_token()
    assert shown.enabled and shown.token_hint and created.token.endswith(shown.token_hint[-4:])
    assert created.token not in repr(shown)

    delegated = mine.with_access_token(created.token)
    # Its sandbox: view, exec, files, egress, pause/resume.
    assert delegated.refresh().id == mine.id
    assert delegated.shell("echo via the token").result.standard_output == "via the token\n"
    delegated.files.upload("/workspace/t.txt", b"written with a token")
    with delegated.files.download("/workspace/t.txt") as stream:
        assert stream.read() == b"written with a token"
    assert delegated.egress().id == mine.id
    delegated.pause().wait_until_paused()
    delegated.resume().wait_until_running()

    # Nothing else: another sandbox, the account, token management.
    stranger = other.with_access_token(created.token)
    assert status_of(stranger.refresh) == 404
    assert status_of(lambda: stranger.shell("echo no")) == 404
    as_account = Client(api_key=created.token, base_url=engine.url)
    assert status_of(as_account.list_sandboxes) == 403
    assert status_of(lambda: as_account.create_sandbox(CreateSandboxRequest(shape=SHAPE))) == 403
    assert status_of(as_account.who_am_i) == 403
    for manage in (delegated.get_access_token, delegated.create_access_token,
                   delegated.rotate_access_token, delegated.disable_access_token, delegated.fork):
        assert status_of(manage) == 403
    assert other.refresh().status == "running"

    # Rotate: the old token dies, the new one works; disable: dead, idempotent.
    rotated = mine.rotate_access_token()
    assert rotated.token != created.token and rotated.rotated_at is not None
    assert rotated.created_at == created.created_at
    assert status_of(delegated.refresh) == 401
    renewed = mine.with_access_token(rotated.token)
    assert renewed.refresh().id == mine.id
    assert mine.disable_access_token().enabled is False
    assert mine.disable_access_token().enabled is False
    assert status_of(renewed.refresh) == 401
    assert status_of(mine.rotate_access_token) == 404  # nothing to rotate
    again = mine.create_access_token()  # a new one may be made after disabling
    assert mine.with_access_token(again.token).refresh().id == mine.id

    # A token is a secret: never in the engine's log, never in the sandbox.
    log = (state_dir / "engine.log").read_text(errors="replace")
    for token in (created.token, rotated.token, again.token):
        assert token not in log
        found = mine.shell(f"grep -rs -- '{token}' /proc/self/environ /workspace /tmp /etc; true")
        assert token not in found.result.standard_output


def test_a_token_of_a_destroyed_sandbox_reaches_nothing(vendor: Client,
                                                        pair: tuple[SandboxInstance, SandboxInstance]) -> None:
    mine, other = pair
    token = mine.create_access_token().token
    delegated = mine.with_access_token(token)
    mine.destroy()
    assert delegated.refresh().status == "destroyed"  # its own view, as wait_until_destroyed needs
    assert status_of(lambda: delegated.shell("echo")) == 409
    assert status_of(other.with_access_token(token).refresh) == 404


def test_a_stale_x_access_token_shadows_the_key_as_on_createos(vendor: Client, engine: EngineEndpoint,
                                                                vendor_sandbox: SandboxInstance) -> None:
    """The SDK lets X-Access-Token through (§15.1) and CreateOS reads it before X-Api-Key."""
    stale = RequestOptions(headers={"X-Access-Token": "sbt_stale"})
    with Client(api_key=engine.token, base_url=engine.url) as client:
        assert status_of(lambda: client.create_sandbox(CreateSandboxRequest(shape=SHAPE), stale)) == 401
    token = vendor_sandbox.create_access_token().token
    right = ExecOptions(headers={"X-Access-Token": token})
    done = vendor_sandbox.run_command(RunCommandRequest(command="echo", arguments=["ok"]), right)
    assert done.result.standard_output == "ok\n"
