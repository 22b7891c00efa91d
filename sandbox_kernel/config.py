"""Which sandbox provider a kernel uses, and how to reach it.

With CREATEOS_SANDBOX_API_KEY set, the kernel talks to CreateOS; otherwise to the local
engine, started on demand. Both are reached through the same SandboxClient: the only
difference is the base URL and the key.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from .api import SandboxClient
from .egress_rules import EgressRuleError, validate as validate_egress
from .paths import state_dir

DEFAULT_BASE_URL = "https://api.sb.createos.sh"
DEFAULT_SHAPE = "s-1vcpu-1gb"
# A sandbox the kernel creates pauses itself after this long with no exec: a crashed or
# forgotten kernel stops using (and on CreateOS, paying for) vCPU. The next cell resumes it.
DEFAULT_AUTO_PAUSE = 1800
# Output floods: a cell shows at most this much output (MiB), and past a short burst its
# writers are slowed to this rate (MiB/s); the runner in the sandbox enforces both.
DEFAULT_OUTPUT_LIMIT_MIB = 64
DEFAULT_OUTPUT_RATE_MIB = 8
MIB = 1024 * 1024
SHUTDOWN_POLICIES = ("destroy", "pause", "keep")
LOCAL_ENGINE_URL_FOR_UDS = "http://localhost"


class ConfigError(ValueError):
    """A configuration mistake the user can fix; the message is one line."""


@dataclass(frozen=True)
class Settings:
    provider: str  # "local" or "createos"
    shape: str = DEFAULT_SHAPE
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    engine_transport: str = "unix"  # how the kernel reaches the local engine: unix or tcp
    engine_idle_timeout: float = 600.0
    attach_to: str | None = None  # drive this existing sandbox instead of creating one
    on_shutdown: str | None = None  # destroy | pause | keep; None: destroy ours, keep adopted
    egress: list[str] | None = None  # rules for a sandbox the kernel creates; None: allow all
    auto_pause: int | None = DEFAULT_AUTO_PAUSE  # seconds; None: never
    output_limit: int = DEFAULT_OUTPUT_LIMIT_MIB * MIB  # bytes of output a cell may show
    output_rate: int = DEFAULT_OUTPUT_RATE_MIB * MIB  # bytes per second after a burst; 0: no limit

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        api_key = env.get("CREATEOS_SANDBOX_API_KEY") or None
        provider = env.get("SANDBOX_KERNEL_PROVIDER") or ("createos" if api_key else "local")
        if provider not in ("local", "createos"):
            raise ConfigError(f"SANDBOX_KERNEL_PROVIDER must be 'local' or 'createos', not {provider!r}")
        if provider == "createos" and not api_key:
            raise ConfigError("no CreateOS API key: set CREATEOS_SANDBOX_API_KEY "
                              "(or unset SANDBOX_KERNEL_PROVIDER to use the local engine)")
        transport = env.get("SANDBOX_KERNEL_ENGINE_TRANSPORT", "unix")
        if transport not in ("unix", "tcp"):
            raise ConfigError(f"SANDBOX_KERNEL_ENGINE_TRANSPORT must be 'unix' or 'tcp', not {transport!r}")
        return cls(provider=provider, auto_pause=auto_pause_from(env.get("SANDBOX_KERNEL_AUTO_PAUSE")),
                   shape=env.get("SANDBOX_KERNEL_SHAPE") or DEFAULT_SHAPE,
                   base_url=env.get("CREATEOS_SANDBOX_BASE_URL") or DEFAULT_BASE_URL,
                   api_key=api_key, engine_transport=transport,
                   output_limit=mebibytes_from(env, "SANDBOX_KERNEL_OUTPUT_LIMIT", DEFAULT_OUTPUT_LIMIT_MIB, 1),
                   output_rate=mebibytes_from(env, "SANDBOX_KERNEL_OUTPUT_RATE", DEFAULT_OUTPUT_RATE_MIB, 0),
                   ).with_overrides(attach_to=env.get("SANDBOX_KERNEL_SANDBOX_ID") or None,
                                    on_shutdown=env.get("SANDBOX_KERNEL_ON_SHUTDOWN") or None,
                                    egress=env.get("SANDBOX_KERNEL_EGRESS") or None)

    def with_overrides(self, attach_to: str | None, on_shutdown: str | None,
                       egress: str | None = None) -> Settings:
        """These settings with the attach target, shutdown policy and egress rules
        (comma- or space-separated) replaced where given."""
        if on_shutdown is not None and on_shutdown not in SHUTDOWN_POLICIES:
            raise ConfigError(f"the shutdown policy must be destroy, pause or keep, not {on_shutdown!r}")
        rules = self.egress
        if egress is not None:
            try:
                rules = validate_egress(egress.replace(",", " ").split())
            except EgressRuleError as exc:
                raise ConfigError(str(exc)) from None
        return replace(self, attach_to=attach_to or self.attach_to,
                       on_shutdown=on_shutdown or self.on_shutdown, egress=rules)

    @property
    def description(self) -> str:
        return "CreateOS" if self.provider == "createos" else "the local engine"


def auto_pause_from(text: str | None) -> int | None:
    """SANDBOX_KERNEL_AUTO_PAUSE: seconds (60-86400, as CreateOS allows), or 0/off for never."""
    if text is None or not text.strip():
        return DEFAULT_AUTO_PAUSE
    if text.strip().lower() in ("0", "off", "never"):
        return None
    try:
        seconds = int(text)
    except ValueError:
        seconds = -1
    if not 60 <= seconds <= 86400:
        raise ConfigError(f"SANDBOX_KERNEL_AUTO_PAUSE must be 60-86400 seconds or off, not {text!r}")
    return seconds


def mebibytes_from(env: Mapping[str, str], name: str, default: float, least: int) -> int:
    """A size in MiB (fractions allowed) from the environment, as bytes; at least `least` bytes."""
    text = env.get(name, "").strip()
    if not text:
        return int(default * MIB)
    try:
        size = int(float(text) * MIB)
    except (ValueError, OverflowError):  # not a number, or inf
        size = -1
    if size < least:
        raise ConfigError(f"{name} must be a number of MiB{' above 0' if least else ''}, not {text!r}")
    return size


async def open_client(settings: Settings, state: Path | None = None) -> SandboxClient:
    """A client for the configured provider; for the local engine, start it if needed."""
    if settings.provider == "createos":
        return SandboxClient(settings.base_url, settings.api_key)
    from .local.service import ensure_engine

    endpoint = await asyncio.to_thread(ensure_engine, state or state_dir(),
                                       settings.engine_idle_timeout)
    if settings.engine_transport == "unix" and endpoint.socket:
        return SandboxClient(LOCAL_ENGINE_URL_FOR_UDS, endpoint.token, uds=endpoint.socket)
    return SandboxClient(endpoint.url, endpoint.token)
