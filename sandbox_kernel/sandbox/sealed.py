"""Notebooks sealed by their metadata: `metadata.sandbox` says what network, resources and
host environment variables the notebook's sandbox gets, so that a headless run of a shared
notebook (`sandbox-kernel run`, `sandbox-kernel sweep`, papermill with `--engine sandbox`)
gets exactly what its author sealed:

    "metadata": {"sandbox": {
        "egress": ["host.sandbox.internal:8080", "*.example.com:443"],  # [] = no network, ["*"] = all public
        "shape": "s-2vcpu-4gb",
        "disk_mib": 20480,
        "env": ["DATA_URL"],        # NAMES only: the values come from the host running it
        "auto_pause": 600           # seconds, or "off"
    }}

Each key is optional (absent: the runner's own configuration). The seal reaches the kernel as
kernel arguments, which win over the config file, the environment and a kernelspec's env.
A run refuses to start, with one line naming the key, when a rule cannot be applied. A host
variable enters the sandbox only when the person running the notebook allows it
(`--allow-env NAME`, or SANDBOX_KERNEL_ALLOW_ENV): a shared notebook must not be able to take
the runner's secrets by naming them.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from typing import Any

from sandbox_kernel.api.egress_rules import DENY_ALL
from sandbox_kernel.config import DEFAULT_AUTO_PAUSE, ConfigError, Settings

METADATA_KEY = "sandbox"
ALLOW_ENV_VAR = "SANDBOX_KERNEL_ALLOW_ENV"
# metadata key -> the kernel option (config.ENV_VARS) it sets
OPTIONS = {"egress": "egress", "shape": "shape", "disk_mib": "disk_mib", "env": "env", "auto_pause": "auto_pause"}
KERNEL_ARGUMENT = "--SandboxKernel.{}={}"


class SealError(ConfigError):
    """The notebook's seal cannot be applied; the message is one line naming the key."""


def _where(key: str) -> str:
    return f"metadata.{METADATA_KEY}.{key}"


def _text(key: str, value: Any) -> str:
    """One metadata value as the kernel option's text."""
    if key in ("egress", "env"):
        if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
            raise SealError(f"{_where(key)} must be a list of strings, not {value!r}")
        if key == "egress" and not value:  # sealed "no network": CreateOS reads [] as allow all
            return DENY_ALL
        if any("," in item or not item.strip() for item in value):
            raise SealError(f"{_where(key)}: {value!r} has an empty entry or a comma")
        return ",".join(value)
    if key == "disk_mib":
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise SealError(f"{_where(key)} must be a whole number of MiB above 0, not {value!r}")
        return str(value)
    if key == "auto_pause" and value in (False, None):
        return "off"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise SealError(f"{_where(key)} must be a string or a number, not {value!r}")
    return str(value)


def sealed_options(notebook_metadata: Mapping[str, Any]) -> dict[str, str]:
    """The kernel options (name -> text) a notebook's metadata seals; {} for none."""
    seal = notebook_metadata.get(METADATA_KEY)
    if seal is None:
        return {}
    if not isinstance(seal, Mapping):
        raise SealError(f"metadata.{METADATA_KEY} must be a mapping of {', '.join(OPTIONS)}")
    unknown = sorted(set(seal) - set(OPTIONS))
    if unknown:
        raise SealError(f"{_where(unknown[0])}: unknown key (known: {', '.join(OPTIONS)})")
    return {OPTIONS[key]: _text(key, value) for key, value in seal.items()}


def allowed_env(given: Collection[str] = (), environ: Mapping[str, str] | None = None) -> set[str]:
    """Host variables the person running the notebook lets into its sandbox: `given`
    (--allow-env) and those listed in SANDBOX_KERNEL_ALLOW_ENV."""
    environ = os.environ if environ is None else environ
    return set(given) | set(environ.get(ALLOW_ENV_VAR, "").replace(",", " ").split())


def kernel_arguments(notebook_metadata: Mapping[str, Any], allowed: Collection[str] = (),
                     environ: Mapping[str, str] | None = None) -> list[str]:
    """The kernel arguments that apply the notebook's seal, checked as the kernel will check
    them (raises SealError, one line, when a rule cannot be applied); [] for no seal."""
    environ = os.environ if environ is None else environ
    options = sealed_options(notebook_metadata)
    for name in options.get("env", "").split(","):
        if name and name not in allowed:
            raise SealError(f"{_where('env')} asks for the host's {name}: pass --allow-env {name} "
                            f"(or list it in {ALLOW_ENV_VAR}) to hand it to the sandbox")
    metadata_key = {option: key for key, option in OPTIONS.items()}
    try:
        settings = Settings.from_env(environ, kernel_args=options, argument_name=lambda name: _where(metadata_key[name]))
    except SealError:
        raise
    except ConfigError as exc:
        raise SealError(str(exc)) from None
    if "shape" in options and settings.provider == "local":  # CreateOS may know shapes we do not
        from sandbox_kernel.api.shapes import SHAPES

        if settings.shape not in (known := [shape.id for shape in SHAPES]):
            raise SealError(f"{_where('shape')}: the local engine has no shape {settings.shape!r} "
                            f"(known: {', '.join(known)})")
    return [KERNEL_ARGUMENT.format(name, value) for name, value in options.items()]


def seal_metadata(settings: Settings) -> dict[str, Any]:
    """`metadata.sandbox` for a notebook run with `settings` (what `%sandbox seal` writes):
    the network, shape, disk, variable names and auto-pause, never a variable's value."""
    seal: dict[str, Any] = {"shape": settings.shape}
    if settings.egress is not None:
        seal["egress"] = [] if settings.egress == [DENY_ALL] else (settings.egress or ["*"])
    if settings.disk_mib:
        seal["disk_mib"] = settings.disk_mib
    if settings.sandbox_env:
        seal["env"] = sorted(settings.sandbox_env)
    if settings.auto_pause != DEFAULT_AUTO_PAUSE:
        seal["auto_pause"] = settings.auto_pause or "off"
    return seal
