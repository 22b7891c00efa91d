"""The wire models' own checks (api/wire.py), and the same models seen through pydantic, as
the local engine's server sees them (api/wire_pydantic.py)."""

from __future__ import annotations

import pydantic
import pytest

from sandbox_kernel.api import (
    CreateSandboxRequest,
    EgressUpdate,
    ForkSandboxRequest,
    ManagedProcess,
    ProcessFrame,
    SandboxStatus,
    SandboxView,
    Shape,
    WireError,
)

VIEW = {"id": "sb_1", "status": "running", "vcpu": 1, "mem_mib": 512, "disk_mib": 1024,
        "created_at": "2026-12-07T00:00:00Z", "ingress_enabled": False}


def test_values_are_checked_as_json_gives_them() -> None:
    view = SandboxView.from_wire({**VIEW, "vcpu": 0.5, "mem_mib": 512.0, "disk_mib": "1024", "spawn_ms": "7.5",
                                  "unknown": {"x": 1}, "self": 1})
    assert view.status is SandboxStatus.RUNNING and view.vcpu == 0.5
    assert view.mem_mib == 512 and isinstance(view.mem_mib, int)  # a whole float is the int
    assert view.disk_mib == 1024 and view.spawn_ms == 7.5  # as pydantic took numbers spelled as strings
    assert not hasattr(view, "unknown")
    assert Shape.from_wire({"id": "s", "vcpu": 2, "mem_mib": 1, "default_disk_mib": 1}).vcpu == 2  # int stays int
    for bad in ({"mem_mib": True}, {"mem_mib": 1.5}, {"mem_mib": "5 GiB"}, {"spawn_ms": "nan"}, {"status": "sleeping"},
                {"ingress_enabled": 1}, {"egress": "example.com"}, {"egress": [1]}):
        with pytest.raises(WireError):
            SandboxView.from_wire({**VIEW, **bad})
    with pytest.raises(WireError):
        SandboxView.from_wire(["not", "an", "object"])


def test_an_error_names_every_wrong_field_and_no_value() -> None:
    with pytest.raises(WireError) as caught:
        ManagedProcess.from_wire({"process_id": "p", "kind": "process", "pid": "secret-value", "state": "running",
                                  "output": {"oldest_seq": "also-secret"}, "args": ["ok", 7]})
    assert caught.value.errors == [(("pid",), "Input should be a valid integer"),
                                   (("args", 1), "Input should be a valid string"),
                                   (("output", "oldest_seq"), "Input should be a valid integer")]
    assert "secret" not in str(caught.value)
    with pytest.raises(WireError, match="created_at: Field required"):
        SandboxView.from_wire({key: value for key, value in VIEW.items() if key != "created_at"})


def test_bounds_defaults_and_serialisation() -> None:
    with pytest.raises(WireError, match="greater than or equal to 60"):
        CreateSandboxRequest(shape="s", auto_pause_after_seconds=59)
    first, second = ManagedProcess.from_wire({"process_id": "p", "kind": "pty", "pid": 1, "state": "exited"}), \
        ManagedProcess.from_wire({"process_id": "q", "kind": "pty", "pid": 2, "state": "exited"})
    first.args.append("x")
    assert second.args == [] and second.output.newest_seq == 0  # each its own default
    assert CreateSandboxRequest(shape="s", egress=[]).to_wire() == {"shape": "s", "egress": []}  # None omitted
    assert ForkSandboxRequest(egress=[], ingress_enabled=False, envs=None).to_wire() == {
        "egress": [], "ingress_enabled": False}  # what was given, but None
    assert ForkSandboxRequest().to_wire() == {} and EgressUpdate().to_wire() == {"egress": None}
    assert SandboxView.from_wire(VIEW).to_wire() == VIEW
    assert SandboxView.from_wire(VIEW) == SandboxView.from_wire(dict(VIEW))
    assert SandboxView.from_wire(VIEW) != SandboxView.from_wire({**VIEW, "name": "other"})


def test_a_frame_keeps_the_output_its_reader_decoded() -> None:
    frame = ProcessFrame.from_wire({"type": "data", "seq": 1, "stream": "stdout", "data_base64": "aGk="})
    assert frame.data == b"hi" and frame.with_data(b"decoded") is frame and frame.data == b"decoded"
    assert "_decoded" not in frame.to_wire()


def test_pydantic_validates_a_model_as_the_server_does_and_gives_the_model() -> None:
    fork = pydantic.TypeAdapter(ForkSandboxRequest).validate_python({"egress": [], "unknown": 1})
    assert isinstance(fork, ForkSandboxRequest) and fork.to_wire() == {"egress": []}
    request = pydantic.TypeAdapter(CreateSandboxRequest).validate_json(b'{"shape": "s", "networks": [{"id": "n"}]}')
    assert request.networks is not None and request.networks[0].id == "n"
    with pytest.raises(pydantic.ValidationError):
        pydantic.TypeAdapter(CreateSandboxRequest).validate_python({"shape": "s", "auto_pause_after_seconds": 1})
    schema = pydantic.TypeAdapter(CreateSandboxRequest).json_schema()
    assert schema["title"] == "CreateSandboxRequest" and "shape" in schema["required"]
