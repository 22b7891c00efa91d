"""Wire-exact models of the CreateOS Sandbox REST API (see createos-api.md), on wire.py's base.

Shared by the client and by the local engine's server, so they describe the wire in both directions:

* field names are the snake_case wire keys;
* unknown keys are ignored, as the Go control plane and the SDKs do;
* optional fields default to None and are *omitted* when serialised ("omitempty", :meth:`WireModel.to_wire`).
  Two models differ: :class:`ForkSandboxRequest` sends every field that was explicitly set (an explicit ``False``,
  ``[]`` or ``{}`` is sent; unset or None is omitted) and :class:`EgressUpdate` always sends ``egress`` (null allowed);
* timestamps are kept as the RFC3339 strings the server sent, so they round-trip byte-exact;
* decoding is strict on enums: an unknown sandbox status fails validation (the client turns that into
  ``ProtocolError``, like the Python SDK).

No pydantic here (wire.py says why); the local engine's server validates with it all the same.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import Enum
from typing import Any, ClassVar, Dict, List, Optional, Union

import pybase64

from sandbox_kernel.api.wire import WireModel, wire_field

__all__ = [
    "WireModel",
    "SandboxStatus",
    "TRANSITIONAL",
    "TERMINAL",
    "Shape",
    "RootfsEntry",
    "RootfsCatalog",
    "Health",
    "Readiness",
    "NetworkRef",
    "DiskMount",
    "CreateSandboxRequest",
    "CreateSandboxResponse",
    "StatusAck",
    "SandboxView",
    "PatchSandboxRequest",
    "ForkSandboxRequest",
    "DestroyResponse",
    "EgressDenial",
    "EgressView",
    "EgressUpdate",
    "ExecRequest",
    "ExecResult",
    "ExecResponse",
    "ExecFrame",
    "ProcessKind",
    "ProcessState",
    "ProcessSignal",
    "ProcessOutputStream",
    "ProcessFrameType",
    "WaitScope",
    "PtySize",
    "CreateProcessRequest",
    "ProcessForeground",
    "OutputWindow",
    "ManagedProcess",
    "ProcessList",
    "ProcessInput",
    "ProcessInputAck",
    "ProcessSignalRequest",
    "ProcessAck",
    "ProcessFrame",
    "Pagination",
    "FileUploadResponse",
    "BandwidthView",
    "BandwidthRecharge",
    "HostPublic",
    "AUTO_PAUSE_MIN_SECONDS",
    "parse_rfc3339",
    "AUTO_PAUSE_MAX_SECONDS",
]

AUTO_PAUSE_MIN_SECONDS = 60
AUTO_PAUSE_MAX_SECONDS = 86400

# An integer that stays an integer on the wire, but tolerates a float (e.g. spawn_ms measured with a fraction).
Number = Union[int, float]


class SandboxStatus(str, Enum):
    """The 10 sandbox statuses (§4.1). A ``str`` subclass: ``status == "running"`` works."""

    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    FORKING = "forking"
    DESTROYING = "destroying"
    DESTROYED = "destroyed"
    ERROR = "error"
    FAILED = "failed"

    def __str__(self) -> str:  # "running", not "SandboxStatus.RUNNING"
        return self.value

    @property
    def is_transitional(self) -> bool:
        return self in TRANSITIONAL

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    @property
    def is_pause_like(self) -> bool:
        """Paused, or on its way there or back: a kernel waits for a resume, it does not give up."""
        return self in PAUSE_LIKE

    @property
    def is_gone(self) -> bool:
        """Being destroyed, destroyed or broken: no process will run in it again."""
        return self in GONE


#: statuses that change on their own (poll until they settle)
TRANSITIONAL: frozenset[SandboxStatus] = frozenset(
    {
        SandboxStatus.CREATING,
        SandboxStatus.PAUSING,
        SandboxStatus.RESUMING,
        SandboxStatus.FORKING,
        SandboxStatus.DESTROYING,
    }
)
#: statuses a sandbox never leaves (``error`` is not terminal: it may be recoverable and can be destroyed)
TERMINAL: frozenset[SandboxStatus] = frozenset({SandboxStatus.DESTROYED, SandboxStatus.FAILED})
#: statuses in which a sandbox's processes are frozen, or about to be or to stop being
PAUSE_LIKE: frozenset[SandboxStatus] = frozenset(
    {SandboxStatus.PAUSING, SandboxStatus.PAUSED, SandboxStatus.RESUMING, SandboxStatus.FORKING}
)
#: statuses in which a sandbox has no processes and never will again
GONE: frozenset[SandboxStatus] = frozenset(
    {SandboxStatus.DESTROYING, SandboxStatus.DESTROYED, SandboxStatus.ERROR, SandboxStatus.FAILED}
)


# --------------------------------------------------------------------------------------------------------------
# Catalog and health (§10)


class Shape(WireModel):
    id: str
    vcpu: Number
    mem_mib: int
    default_disk_mib: int
    cpu_quota_pct: Optional[Number] = None


class RootfsEntry(WireModel):
    name: str
    description: Optional[str] = None
    deprecated: Optional[bool] = None
    successor: Optional[str] = None


class RootfsCatalog(WireModel):
    rootfs: List[str]
    default: str
    entries: Optional[List[RootfsEntry]] = None


class Health(WireModel):
    up: bool


class Readiness(WireModel):
    ready: bool
    reason: Optional[str] = None
    scheduler_last_ok_ms_ago: Optional[Number] = None


# --------------------------------------------------------------------------------------------------------------
# Sandboxes (§3)


class NetworkRef(WireModel):
    id: str


class DiskMount(WireModel):
    disk_id: str
    mount_path: str
    sub_path: Optional[str] = None


class CreateSandboxRequest(WireModel):
    """Body of ``POST /v1/sandboxes``. Only ``shape`` is required; everything else is omitted when None.

    ``bandwidth_quota_bytes`` is here only so a server can see it and refuse a non-zero value (§3.1);
    clients never set it."""

    shape: str
    rootfs: Optional[str] = None
    name: Optional[str] = None
    networks: Optional[List[NetworkRef]] = None
    disk_mib: Optional[int] = wire_field(None, ge=0)
    egress: Optional[List[str]] = None
    envs: Optional[dict[str, str]] = None
    ssh_pubkeys: Optional[List[str]] = None
    host_id: Optional[str] = None
    node_selector: Optional[dict[str, str]] = None
    ingress_enabled: Optional[bool] = None
    disks: Optional[List[DiskMount]] = None
    region: Optional[str] = None
    auto_pause_after_seconds: Optional[int] = wire_field(None, ge=AUTO_PAUSE_MIN_SECONDS, le=AUTO_PAUSE_MAX_SECONDS)
    bandwidth_quota_bytes: Optional[int] = None


class CreateSandboxResponse(WireModel):
    """``data`` of ``POST /v1/sandboxes``. ``status`` defaults to ``running`` when absent (TS servers omit it;
    create returns only once the VM is up)."""

    id: str
    status: SandboxStatus = SandboxStatus.RUNNING
    name: Optional[str] = None
    ip: Optional[str] = None
    shape: Optional[str] = None
    rootfs: Optional[str] = None
    vcpu: Optional[Number] = None
    mem_mib: Optional[int] = None
    disk_mib: Optional[int] = None
    spawn_ms: Optional[Number] = None
    egress: Optional[List[str]] = None
    bandwidth_quota_bytes: Optional[int] = None
    ingress_url_template: Optional[str] = None
    ingress_enabled: Optional[bool] = None
    ssh_pubkeys: Optional[List[str]] = None
    created_at: Optional[str] = None


class StatusAck(WireModel):
    """``{id, status}``: what an early server answers to pause/resume. :class:`SandboxView` is a subclass, so
    ``isinstance(x, StatusAck)`` holds for both and ``x.id`` / ``x.status`` always work."""

    id: str
    status: SandboxStatus


class SandboxView(StatusAck):
    """``SandboxView`` (§3.2): GET one / list / patch / pause / resume / fork."""

    vcpu: Number
    mem_mib: int
    disk_mib: int
    created_at: str
    ingress_enabled: bool
    ip: Optional[str] = None
    name: Optional[str] = None
    ingress_url_template: Optional[str] = None
    running_at: Optional[str] = None
    destroyed_at: Optional[str] = None
    paused_at: Optional[str] = None
    last_resumed_at: Optional[str] = None
    spawn_ms: Optional[Number] = None
    shape: Optional[str] = None
    rootfs: Optional[str] = None
    region: Optional[str] = None
    egress: Optional[List[str]] = None
    envs: Optional[List[str]] = None  # names only, never values
    ssh_pubkeys: Optional[List[str]] = None
    created_by: Optional[str] = None
    bandwidth_ingress_bytes: Optional[int] = None
    bandwidth_quota_bytes: Optional[int] = None
    forked_from: Optional[str] = None
    auto_pause_after_seconds: Optional[int] = None
    # Local engine only (CreateOS does not send them): how many processes the memory limit
    # killed so far, and which of the shape's limits this host enforces, in words.
    oom_kills: Optional[int] = None
    limits: Optional[str] = None


class PatchSandboxRequest(WireModel):
    """Body of ``PATCH /v1/sandboxes/:id``; omitted = unchanged. ``disable_auto_pause=True`` clears the timeout."""

    ingress_enabled: Optional[bool] = None
    auto_pause_after_seconds: Optional[int] = wire_field(None, ge=AUTO_PAUSE_MIN_SECONDS, le=AUTO_PAUSE_MAX_SECONDS)
    disable_auto_pause: Optional[bool] = None


class ForkSandboxRequest(WireModel):
    """Body of ``POST /v1/sandboxes/:id/fork``; omitted fields inherit from the source.

    Serialisation sends every field that was explicitly set and not None, so an explicit ``False``, ``[]`` or ``{}``
    is sent (``ForkSandboxRequest(egress=[], ingress_enabled=False)`` -> ``{"egress": [], "ingress_enabled": false}``)
    and no overrides -> ``{}``."""

    start_paused: Optional[bool] = None
    ssh_pubkeys: Optional[List[str]] = None
    egress: Optional[List[str]] = None
    ingress_enabled: Optional[bool] = None
    envs: Optional[dict[str, str]] = None

    def to_wire(self) -> dict[str, Any]:
        return {name: value for name, value in super().to_wire().items() if name in self.fields_set()}


class DestroyResponse(StatusAck):
    """``data`` of ``DELETE /v1/sandboxes/:id``: ``{id, status: destroying|destroyed}``."""


class EgressDenial(WireModel):
    """One refused outbound connection (local engine extension; CreateOS does not report them)."""

    at: str
    host: str
    port: int
    reason: str


class EgressView(WireModel):
    id: str
    egress: Optional[List[str]] = None
    # Local engine extension, absent on CreateOS: how many connections the rules refused,
    # and the most recent ones.
    denied_count: Optional[int] = None
    denied: Optional[List[EgressDenial]] = None


class EgressDestination(WireModel):
    host: str  # as the sandbox asked for it: a name, or an IP literal where it gave one
    port: int
    allowed: int  # connections the rules allowed
    refused: int  # and refused


class EgressDestinations(WireModel):
    """Local engine extension, absent on CreateOS (`GET /v1/sandboxes/:id/egress/destinations`;
    DELETE clears it): every destination the sandbox asked to reach through the egress proxy
    since it started or was last cleared, at most `cap` distinct ones; `dropped` counts
    connections to destinations that found the table full."""

    id: str
    destinations: List[EgressDestination]
    cap: int
    dropped: int


class EgressUpdate(WireModel):
    """Body of ``PUT /v1/sandboxes/:id/egress``: replaces the whole list. ``[]`` or null = allow all."""

    egress: Optional[List[str]] = None

    def to_wire(self) -> dict[str, Any]:
        return {"egress": None if self.egress is None else list(self.egress)}  # always present (null is meaningful)


# --------------------------------------------------------------------------------------------------------------
# Bandwidth (§7) and hosts (§10)


class BandwidthView(WireModel):
    """``quota_bytes`` and ``remaining_bytes`` -1 = unmetered; ``used_bytes`` = egress, ``ingress_bytes`` observed."""

    id: str
    quota_bytes: int
    used_bytes: int
    ingress_bytes: int
    remaining_bytes: int
    capped: bool


class BandwidthRecharge(WireModel):
    add_bytes: int = wire_field(ge=0)


class HostPublic(WireModel):
    id: str
    status: str
    free_mib: int
    vm_count: int
    rootfses: Optional[List[str]] = None


# --------------------------------------------------------------------------------------------------------------
# Exec (§5)


class ExecRequest(WireModel):
    """``stdin`` is written to the command's standard input, then closed (§15.2); without it the command reads
    EOF. ``env`` is added to the sandbox's create-time ``envs`` for this command only (it wins on a clash)."""

    cmd: str
    args: List[str] = wire_field(default_factory=list)
    stdin: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    stream: Optional[bool] = None


class ExecResult(WireModel):
    stdout: str = ""
    stderr: str = ""
    exit_code: int
    error: Optional[str] = None


class ExecResponse(WireModel):
    result: ExecResult
    exec_ms: float


class ExecFrame(WireModel):
    """One NDJSON frame of a streaming exec. All keys optional; several may be present in one frame (consume them
    in the order hb -> stdout -> stderr -> error -> exit_code). ``{}`` and unknown keys carry nothing."""

    hb: Optional[bool] = None
    stdout: Optional[str] = None
    stderr: Optional[str] = None
    error: Optional[str] = None
    exit_code: Optional[int] = None

    @property
    def is_heartbeat(self) -> bool:
        return bool(self.hb)


# --------------------------------------------------------------------------------------------------------------
# Managed processes (§15.3)


class ProcessKind(str, Enum):
    PROCESS = "process"
    PTY = "pty"


class ProcessState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    TERMINATING = "terminating"
    EXITED = "exited"
    FAILED = "failed"


class ProcessSignal(str, Enum):
    """The signals ``POST .../processes/:pid/signal`` accepts (by name on the wire)."""

    SIGHUP = "SIGHUP"
    SIGINT = "SIGINT"
    SIGQUIT = "SIGQUIT"
    SIGKILL = "SIGKILL"
    SIGTERM = "SIGTERM"
    SIGUSR1 = "SIGUSR1"
    SIGUSR2 = "SIGUSR2"
    SIGWINCH = "SIGWINCH"


class ProcessOutputStream(str, Enum):
    STDOUT = "stdout"
    STDERR = "stderr"
    PTY = "pty"  # a PTY's one merged stream


class ProcessFrameType(str, Enum):
    DATA = "data"
    EXIT = "exit"
    HEARTBEAT = "heartbeat"
    ERROR = "error"


class WaitScope(str, Enum):
    LEADER = "leader"  # the process started
    TREE = "tree"  # it and every process of its session


class PtySize(WireModel):
    rows: Optional[int] = wire_field(None, ge=1, le=1000)
    cols: Optional[int] = wire_field(None, ge=1, le=1000)


class CreateProcessRequest(WireModel):
    """``POST .../processes``. With ``pty`` the process gets a terminal (``cmd`` may then be omitted: a shell);
    without it, pipes (``cmd`` required)."""

    cmd: Optional[str] = None
    args: Optional[List[str]] = None
    cwd: Optional[str] = None
    env: Optional[Dict[str, str]] = None
    pty: Optional[PtySize] = None


class ProcessForeground(WireModel):
    """A PTY's foreground command (the job the terminal's keystrokes go to)."""

    pid: int
    cmd: str = ""
    args: List[str] = wire_field(default_factory=list)


class OutputWindow(WireModel):
    """The retained output: frames ``oldest_seq..newest_seq`` (both 0 before any output), ``bytes`` of data."""

    oldest_seq: int = 0
    newest_seq: int = 0
    bytes: int = 0


class ManagedProcess(WireModel):
    process_id: str
    kind: ProcessKind
    pid: int
    state: ProcessState
    leader_exited: bool = False
    tree_exited: bool = False
    created_at: Optional[str] = None
    finished_at: Optional[str] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None  # the signal's name (e.g. "SIGKILL") when the leader was killed by one
    cmd: str = ""
    args: List[str] = wire_field(default_factory=list)
    cwd: str = ""
    foreground: Optional[ProcessForeground] = None
    output: OutputWindow = wire_field(default_factory=OutputWindow)


class ProcessList(WireModel):
    processes: List[ManagedProcess] = wire_field(default_factory=list)


class ProcessInput(WireModel):
    data_base64: str


class ProcessInputAck(WireModel):
    input_seq: int


class ProcessSignalRequest(WireModel):
    signal: ProcessSignal


class ProcessAck(WireModel):
    ok: bool = True


class ProcessFrame(WireModel):
    """One NDJSON frame of ``GET .../processes/:pid/connect``.

    ``data`` frames carry output (``data_base64``, ``seq`` counting from 1, ``stream``); the one ``exit`` frame
    ends a process's output (``exit_code``, ``signal``; ``seq`` = the last data frame's); ``error`` frames carry
    ``error``; ``heartbeat`` frames keep an idle stream alive. ``oldest_available_seq`` is set on the first frame
    after a gap: the frames between the requested ``after`` and it are no longer retained."""

    type: ProcessFrameType
    seq: Optional[int] = None
    stream: Optional[ProcessOutputStream] = None
    data_base64: Optional[str] = None
    exit_code: Optional[int] = None
    signal: Optional[str] = None
    error: Optional[str] = None
    oldest_available_seq: Optional[int] = None
    # Local engine extension, on heartbeats: connections the egress rules refused so far.
    egress_denied_count: Optional[int] = None
    _decoded: ClassVar[Optional[bytes]] = None  # never from the wire: set by with_data

    def with_data(self, data: bytes) -> ProcessFrame:
        """This frame, its output decoded already (by a reader that checked it so)."""
        self._decoded = data
        return self

    @property
    def data(self) -> bytes:
        if self._decoded is not None:
            return self._decoded
        # pybase64: the standard library's decoder took a sixth of the kernel's time in a long print.
        return pybase64.b64decode(self.data_base64, validate=True) if self.data_base64 else b""


# --------------------------------------------------------------------------------------------------------------
# Pagination (§1.3)


class Pagination(WireModel):
    total: Optional[int] = None
    limit: Optional[int] = None
    offset: Optional[int] = None
    count: Optional[int] = None


# --------------------------------------------------------------------------------------------------------------
# Files (§8)


class FileUploadResponse(WireModel):
    bytes: Optional[int] = None
    path: Optional[str] = None


def parse_rfc3339(stamp: str | None) -> datetime | None:
    """RFC3339 as CreateOS (Go, up to nanoseconds) or the local engine writes it."""
    if not stamp:
        return None
    match = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)?$", stamp)
    if not match:
        return None
    base, fraction, zone = match.groups()
    fraction = (fraction or ".0")[:7]
    zone = "+00:00" if zone in (None, "Z") else zone
    return datetime.fromisoformat(base + fraction + zone)
