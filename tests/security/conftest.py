"""Fixtures the attack tests share (a module may define its own `sandbox` instead)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandbox_kernel.api import CreateSandboxRequest, SandboxClient
from sandbox_kernel.local.service import EngineEndpoint


@pytest.fixture
async def sandbox(engine: EngineEndpoint) -> AsyncIterator[tuple[SandboxClient, str]]:
    """A sandbox of its own for one test, and a client of the engine that made it."""
    async with SandboxClient(engine.url, engine.token) as client:
        created = await client.create_sandbox(CreateSandboxRequest(shape="s-1vcpu-1gb"))
        try:
            yield client, created.id
        finally:
            await client.delete_sandbox(created.id)
