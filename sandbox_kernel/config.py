"""Which sandbox provider a kernel uses, and how to reach it.

With CREATEOS_SANDBOX_API_KEY set, the kernel talks to CreateOS; otherwise to the local
engine, started on demand. Both are reached through the same SandboxClient: the only
difference is the base URL and the key. Options (shape, rootfs, egress, auto-pause...)
come from a TOML config file, the environment and kernel arguments, in rising priority.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandbox_kernel.api import names
from sandbox_kernel.api import SandboxClient
from sandbox_kernel.api.egress_rules import EgressRuleError, validate as validate_egress
from sandbox_kernel.paths import state_dir

DEFAULT_BASE_URL = "https://api.sb.createos.sh"
DEFAULT_SHAPE = "s-1vcpu-1gb"
# CreateOS shape ids: s-<vCPUs>vcpu-<memory>mb|gb|tb (which ones exist is the provider's answer).
SHAPE_ID = re.compile(r"s-\d+vcpu-\d+(mb|gb|tb)")
# A sandbox the kernel creates pauses itself after this long with no exec: a crashed or
# forgotten kernel stops using (and on CreateOS, paying for) vCPU. The next cell resumes it.
DEFAULT_AUTO_PAUSE = 1800
# Output floods: a cell shows at most this much output (MiB), and past a short burst its
# writers are slowed to this rate (MiB/s); the runner in the sandbox enforces both.
DEFAULT_OUTPUT_LIMIT_MIB = 64
DEFAULT_OUTPUT_RATE_MIB = 8
MIB = 1024 * 1024
SHUTDOWN_POLICIES = ("destroy", "pause", "keep")
MAX_WARM_POOL = 32  # more ready sandboxes than this is a typo, not a warm pool
MAX_DISK_MIB = 16 * 1024 * 1024  # 16 TiB: more is a typo (the provider refuses what it cannot give)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Host variables never handed to a sandbox: this project's key and settings (a shared
# notebook naming them must not carry the API key into its sandbox).
PRIVATE_ENV_PREFIXES = ("CREATEOS_", "SANDBOX_KERNEL_")
LOCAL_ENGINE_URL_FOR_UDS = "http://localhost"


class ConfigError(ValueError):
    """A configuration mistake the user can fix; the message is one line."""


@dataclass(frozen=True)
class Settings:
    provider: str  # "local" or "createos"
    shape: str = DEFAULT_SHAPE
    rootfs: str | None = None  # None: the provider's default rootfs
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = field(default=None, repr=False)
    engine_transport: str = "unix"  # how the kernel reaches the local engine: unix or tcp
    engine_idle_timeout: float = 600.0
    attach_to: str | None = None  # drive this existing sandbox instead of creating one
    name: str | None = None  # of the sandbox the kernel creates (unique); None: generated
    on_shutdown: str | None = None  # destroy | pause | keep; None: destroy ours, keep adopted
    egress: list[str] | None = None  # rules for a sandbox the kernel creates; None: allow all
    auto_pause: int | None = DEFAULT_AUTO_PAUSE  # seconds; None: never
    disk_mib: int | None = None  # disk of a sandbox the kernel creates; None: the shape's default
    # Host environment variables handed to a sandbox the kernel creates (name -> value, read
    # from the kernel's own environment; only their names are ever shown).
    sandbox_env: dict[str, str] | None = field(default=None, repr=False)
    output_limit: int = DEFAULT_OUTPUT_LIMIT_MIB * MIB  # bytes of output a cell may show
    output_rate: int = DEFAULT_OUTPUT_RATE_MIB * MIB  # bytes per second after a burst; 0: no limit
    warm_pool: int = 0  # ready sandboxes kept for starting kernels (pool.py); 0: no pool
    show_ready: bool = False  # the first cell shows where it runs (off: banner, log, %sandbox status)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None,
                 kernel_args: Mapping[str, str | None] | None = None,
                 argument_name: Callable[[str], str] = "--SandboxKernel.{}".format) -> Settings:
        """Settings from the config file, then the environment, then kernel arguments
        (each wins over the one before). The API key comes from the environment only.
        argument_name(option) is how errors name a kernel argument."""
        env = os.environ if env is None else env
        options = _Options(env, kernel_args or {}, argument_name)
        api_key = env.get("CREATEOS_SANDBOX_API_KEY") or None
        provider = options.choice("provider", ("local", "createos"), "createos" if api_key else "local")
        if provider == "createos" and not api_key:
            raise ConfigError("no CreateOS API key: set CREATEOS_SANDBOX_API_KEY "
                              "(or unset SANDBOX_KERNEL_PROVIDER to use the local engine)")
        on_shutdown = options.text("on_shutdown")
        if on_shutdown is not None and on_shutdown not in SHUTDOWN_POLICIES:
            raise ConfigError(f"{options.source('on_shutdown')}: the shutdown policy must be "
                              f"destroy, pause or keep, not {on_shutdown!r}")
        name = options.text("sandbox_name")
        try:
            name = name and names.checked(name)
        except names.SandboxNameError as exc:
            raise ConfigError(f"{options.source('sandbox_name')}: {exc}") from None
        return cls(provider=provider, api_key=api_key, name=name,
                   shape=options.shape(),
                   rootfs=options.text("rootfs"),
                   base_url=options.text("base_url") or DEFAULT_BASE_URL,
                   engine_transport=options.choice("engine_transport", ("unix", "tcp"), "unix"),
                   attach_to=options.text("sandbox_id"), on_shutdown=on_shutdown,
                   egress=options.egress(), auto_pause=options.auto_pause(),
                   disk_mib=options.count("disk_mib", MAX_DISK_MIB) or None,
                   sandbox_env=options.sandbox_env(env),
                   output_limit=options.mebibytes("output_limit", DEFAULT_OUTPUT_LIMIT_MIB, 1),
                   output_rate=options.mebibytes("output_rate", DEFAULT_OUTPUT_RATE_MIB, 0),
                   warm_pool=options.count("warm_pool", MAX_WARM_POOL),
                   show_ready=options.flag("show_ready"))

    @property
    def description(self) -> str:
        return "CreateOS" if self.provider == "createos" else "the local engine"

    @property
    def why(self) -> str:
        """Why this provider, when the user may not know (the first cell says it)."""
        return " (no CreateOS API key set)" if self.provider == "local" and not self.api_key else ""


# Every option and its environment variable. In the config file an option is a key of the
# same name (shape = "s-2vcpu-4gb"); as a kernel argument, --SandboxKernel.<option>=...
ENV_VARS = {
    "provider": "SANDBOX_KERNEL_PROVIDER",
    "base_url": "CREATEOS_SANDBOX_BASE_URL",
    "shape": "SANDBOX_KERNEL_SHAPE",
    "rootfs": "SANDBOX_KERNEL_ROOTFS",
    "auto_pause": "SANDBOX_KERNEL_AUTO_PAUSE",
    "disk_mib": "SANDBOX_KERNEL_DISK_MIB",
    "env": "SANDBOX_KERNEL_ENV",
    "egress": "SANDBOX_KERNEL_EGRESS",
    "on_shutdown": "SANDBOX_KERNEL_ON_SHUTDOWN",
    "sandbox_id": "SANDBOX_KERNEL_SANDBOX_ID",
    "sandbox_name": "SANDBOX_KERNEL_SANDBOX_NAME",
    "engine_transport": "SANDBOX_KERNEL_ENGINE_TRANSPORT",
    "output_limit": "SANDBOX_KERNEL_OUTPUT_LIMIT",
    "output_rate": "SANDBOX_KERNEL_OUTPUT_RATE",
    "warm_pool": "SANDBOX_KERNEL_WARM_POOL",
    "show_ready": "SANDBOX_KERNEL_SHOW_READY",
}


def config_file_path(env: Mapping[str, str]) -> Path | None:
    """$SANDBOX_KERNEL_CONFIG, else sandbox-kernel/config.toml in the XDG config dir."""
    if env.get("SANDBOX_KERNEL_CONFIG"):
        return Path(env["SANDBOX_KERNEL_CONFIG"]).expanduser()
    base = env.get("XDG_CONFIG_HOME") or (env.get("HOME") and str(Path(env["HOME"]) / ".config"))
    return Path(base) / "sandbox-kernel" / "config.toml" if base else None


def read_config_file(path: Path) -> dict[str, str]:
    """The options a TOML config file sets, as text; unknown options and API keys are refused."""
    import tomllib  # only where a config file exists: most kernels start without one

    try:
        table = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read the config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"the config file {path} is not valid TOML: {exc}") from None
    if "api_key" in table:
        raise ConfigError(f"{path}: keep the API key out of files; set CREATEOS_SANDBOX_API_KEY")
    unknown = sorted(set(table) - set(ENV_VARS))
    if unknown:
        raise ConfigError(f"{path}: unknown option {unknown[0]!r} (known: {', '.join(ENV_VARS)})")
    return {name: " ".join(map(str, value)) if isinstance(value, list) else str(value).lower()
            if isinstance(value, bool) else str(value) for name, value in table.items()}


class _Options:
    """Raw option values with where each came from, for one-line errors that name it."""

    def __init__(self, env: Mapping[str, str], kernel_args: Mapping[str, str | None],
                 argument_name: Callable[[str], str]) -> None:
        self.values: dict[str, tuple[str, str]] = {}
        path = config_file_path(env)
        if path is not None and (path.exists() or "SANDBOX_KERNEL_CONFIG" in env):
            for name, value in read_config_file(path).items():
                self.values[name] = (value, f"{name} in {path}")
        for name, variable in ENV_VARS.items():
            if env.get(variable, "").strip():
                self.values[name] = (env[variable], variable)
        for name, value in kernel_args.items():
            if value:
                self.values[name] = (value, argument_name(name))

    def text(self, name: str) -> str | None:
        return self.values[name][0].strip() if name in self.values else None

    def source(self, name: str) -> str:
        return self.values[name][1]

    def choice(self, name: str, allowed: tuple[str, ...], default: str) -> str:
        value = self.text(name) or default
        if value not in allowed:
            raise ConfigError(f"{self.source(name)} must be {' or '.join(map(repr, allowed))}, not {value!r}")
        return value

    def shape(self) -> str:
        value = self.text("shape") or DEFAULT_SHAPE
        if not SHAPE_ID.fullmatch(value):
            raise ConfigError(f"{self.source('shape')} must be a shape id like {DEFAULT_SHAPE} "
                              f"or s-2vcpu-4gb, not {value!r}")
        return value

    def egress(self) -> list[str] | None:
        """Rules, comma- or space-separated; None (allow all) when not set."""
        text = self.text("egress")
        if text is None:
            return None
        try:
            return validate_egress(text.replace(",", " ").split())
        except EgressRuleError as exc:
            raise ConfigError(f"{self.source('egress')}: {exc}") from None

    def auto_pause(self) -> int | None:
        """Seconds (60-86400, as CreateOS allows), or 0/off/never for never."""
        text = self.text("auto_pause")
        if text is None:
            return DEFAULT_AUTO_PAUSE
        if text.lower() in ("0", "off", "never", "false"):
            return None
        seconds = int(text) if text.isdigit() else -1
        if not 60 <= seconds <= 86400:
            raise ConfigError(f"{self.source('auto_pause')} must be 60-86400 seconds or off, not {text!r}")
        return seconds

    def sandbox_env(self, env: Mapping[str, str]) -> dict[str, str] | None:
        """The host variables named by the env option (comma- or space-separated), with
        their values from `env`; None when not set."""
        text = self.text("env")
        if not text:
            return None
        handed: dict[str, str] = {}
        for name in text.replace(",", " ").split():
            if not ENV_NAME.fullmatch(name):
                raise ConfigError(f"{self.source('env')}: {name!r} is not an environment variable name")
            if name.startswith(PRIVATE_ENV_PREFIXES):
                raise ConfigError(f"{self.source('env')}: {name} is sandbox-kernel's own and never "
                                  "enters a sandbox")
            if name not in env:
                raise ConfigError(f"{self.source('env')}: {name} is not set in the environment")
            handed[name] = env[name]
        return handed

    def flag(self, name: str) -> bool:
        """true/false (also 1/0, yes/no, on/off); false when not set."""
        text = (self.text(name) or "false").lower()
        if text not in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            raise ConfigError(f"{self.source(name)} must be true or false, not {text!r}")
        return text in ("true", "1", "yes", "on")

    def count(self, name: str, most: int) -> int:
        """A whole number from 0 to `most`; 0 when not set."""
        text = self.text(name)
        if text is None:
            return 0
        if not (text.isdigit() and int(text) <= most):
            raise ConfigError(f"{self.source(name)} must be a whole number from 0 to {most}, not {text!r}")
        return int(text)

    def mebibytes(self, name: str, default: float, least: int) -> int:
        """A size in MiB (fractions allowed), as bytes; at least `least` bytes."""
        text = self.text(name)
        if text is None:
            return int(default * MIB)
        try:
            size = int(float(text) * MIB)
        except (ValueError, OverflowError):  # not a number, or inf
            size = -1
        if size < least:
            raise ConfigError(f"{self.source(name)} must be a number of MiB{' above 0' if least else ''}, "
                              f"not {text!r}")
        return size


class EngineNotRunning(Exception):
    """open_client(start_engine=False) found no local engine serving the state dir."""


async def open_client(settings: Settings, state: Path | None = None, start_engine: bool = True) -> SandboxClient:
    """A client for the configured provider; for the local engine, start it if needed (or,
    with start_engine false, raise EngineNotRunning: a viewer need not keep one alive)."""
    if settings.provider == "createos":
        return SandboxClient(settings.base_url, settings.api_key)
    from sandbox_kernel.local.service import EngineRestarting, ensure_engine, read_endpoint

    state = state or state_dir()
    if start_engine:
        endpoint = await asyncio.to_thread(ensure_engine, state, settings.engine_idle_timeout)
    elif (running := await asyncio.to_thread(read_endpoint, state)) is None:
        raise EngineNotRunning(f"no local engine is running for {state}")
    else:
        endpoint = running
    if settings.engine_transport == "unix" and endpoint.socket:
        # The socket's path stays when the engine is restarted: a request that finds no
        # engine there starts one (which takes the sandboxes over) and goes again. One
        # transport carries every call, a process's input and output among them (over
        # kept_connections.py either way): one set of kept connections, one engine it knows.
        restarting = EngineRestarting(endpoint.socket, state, settings.engine_idle_timeout, endpoint.pid)
        return SandboxClient(LOCAL_ENGINE_URL_FOR_UDS, endpoint.token, uds=endpoint.socket,
                             transport=restarting, process_transport=restarting)
    return SandboxClient(endpoint.url, endpoint.token)
