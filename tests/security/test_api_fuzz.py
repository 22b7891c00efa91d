"""Malformed requests to every route of the engine's API: schemathesis, from its own
OpenAPI schema, against a real engine. No request, however malformed, gets a 500,
and no route but the public ones answers without the token.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from engine_helpers import running_engine
from sandbox_kernel.local.server import PUBLIC_PATHS
from sandbox_kernel.local.service import EngineEndpoint

# Generation is random: a modest number per operation keeps the module well under a minute.
EXAMPLES_PER_OPERATION = 25


@pytest.fixture(scope="module")
def fuzzed_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    """An engine of its own: whatever the fuzzer creates dies with it."""
    with running_engine(Path(tmp_path_factory.mktemp("fuzz-state"))) as endpoint:
        yield endpoint


def test_no_request_makes_the_engine_fail(fuzzed_engine: EngineEndpoint) -> None:
    """Every operation, with data that fits the schema and data that does not, aimed at
    unknown sandboxes and at a real one (made afresh for each operation, as the
    fuzzer may destroy, pause or fork it)."""
    auth = {"X-Api-Key": fuzzed_engine.token}
    schema = schemathesis.openapi.from_url(f"{fuzzed_engine.url}/openapi.json", headers=auth)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 16, [op.label for op in operations]

    with httpx.Client(base_url=fuzzed_engine.url, headers=auth, timeout=60) as api:
        for operation in operations:
            sandbox_id = api.post("/v1/sandboxes", json={"shape": "s-1vcpu-1gb"}).json()["data"]["id"]

            @given(case=cases(operation, sandbox_id))
            @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            def no_server_error(case) -> None:  # type: ignore[no-untyped-def]
                case.call_and_validate(base_url=fuzzed_engine.url, headers=auth,
                                       checks=[not_a_server_error], timeout=60)

            try:
                no_server_error()
            finally:
                api.delete(f"/v1/sandboxes/{sandbox_id}")


def cases(operation, sandbox_id: str) -> st.SearchStrategy:  # type: ignore[no-untyped-def]
    modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
    strategies = [operation.as_strategy(mode) for mode in modes]
    if "{sandbox_id}" in operation.path:
        strategies += [operation.as_strategy(mode, path_parameters={"sandbox_id": sandbox_id})
                       for mode in modes]
    return st.one_of(strategies)


def test_every_private_route_wants_the_token(fuzzed_engine: EngineEndpoint) -> None:
    spec = httpx.get(f"{fuzzed_engine.url}/openapi.json", headers={"X-Api-Key": fuzzed_engine.token}).json()
    checked = 0
    for path, operations in spec["paths"].items():
        if path in PUBLIC_PATHS:
            continue
        concrete = re.sub(r"\{[^}]+\}", "sb-does-not-matter", path)
        for method in operations:
            for headers in ({}, {"X-Api-Key": "not-the-token"}):
                response = httpx.request(method.upper(), fuzzed_engine.url + concrete, headers=headers,
                                         params={"path": "/etc/passwd"})
                assert response.status_code == 401, (method, path, response.text)
                checked += 1
    assert checked >= 2 * 14, "every sandbox route was tried"
