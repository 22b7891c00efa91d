"""The host's pip and CA settings, carried into a new sandbox: a user behind a corporate
proxy has pip set up on the host (an index, trusted hosts, a CA bundle), and `%pip install`
in the sandbox needs the same.

Read on the host when a sandbox is created: the environment variables PIP_INDEX_URL,
PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST, PIP_CERT, REQUESTS_CA_BUNDLE and SSL_CERT_FILE, and,
where a variable is not set, index-url, extra-index-url, trusted-host and cert of pip's
configuration files (as pip reads them: global, user, site, then PIP_CONFIG_FILE; [install]
over [global]). They are set in the sandbox at create (its envs, which every command and
the runner inherit). A CA bundle is a host file the sandbox cannot see: its bytes are
uploaded to a file named SANDBOX_CA_PREFIX + its hash, and the variable names the copy.

What is never passed (the sandbox runs code the user did not write: a credential there is
a credential leaked): an index URL carrying a user, password or query (`user:token@host`),
a file holding a private key, pip's client-cert. Each is one line of `withheld`, which the
kernel logs once, at its first sandbox's creation. On the local engine an index on the host's loopback
is reached as HOST_ALIAS (the sandbox's own 127.0.0.1 is its own), through an egress rule
like any other destination, and trusted as the host trusts its loopback; a CA bundle (or SSL_CERT_DIR) the local
engine's sandboxes see at the same path (the system's, under /etc/ssl) is named, not copied.
An index in a host directory (file://) is not passed: the sandbox cannot see it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from sandbox_kernel.api.local_engine import HOST_ALIAS, HOST_ETC
from sandbox_kernel.config import Settings

if TYPE_CHECKING:
    from sandbox_kernel.api import SandboxClient

log = logging.getLogger("sandbox_kernel.host_pip_settings")

# In /tmp, which every sandbox has: an upload's parent directory must exist, and making one
# was a round trip of its own (an exec) in every new sandbox's start.
SANDBOX_CA_PREFIX = "/tmp/sandbox-kernel-host-ca-"
CA_BUNDLE_LIMIT = 4 * 1024 * 1024  # a CA bundle is ~200 KiB; anything far larger is no bundle
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
# The withheld lines this process logged: each is said once, at its first sandbox, not at
# every fork or warm pool member.
_said: set[str] = set()

# Variable -> pip configuration key that stands in for it when it is not set.
INDEX_SETTINGS = {"PIP_INDEX_URL": "index-url", "PIP_EXTRA_INDEX_URL": "extra-index-url"}
CA_SETTINGS = {"PIP_CERT": "cert", "REQUESTS_CA_BUNDLE": None, "SSL_CERT_FILE": None}


@dataclass
class HostPipSettings:
    """What to give a new sandbox: `envs` at create, then `files` (sandbox path -> bytes)."""

    envs: dict[str, str] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)
    withheld: list[str] = field(default_factory=list)  # one line each: what was not passed, and why


def for_sandbox(settings: Settings) -> HostPipSettings:
    """This host's settings for a sandbox of `settings`' provider, each withheld one logged."""
    alias, shared = None, ()
    if settings.provider == "local":
        # What the local engine's sandboxes see of the host, read-only at the same path.
        alias, shared = HOST_ALIAS, ("/usr", *(f"/etc/{name}" for name in HOST_ETC))
    found = collect(os.environ, pip_config_files(os.environ), alias, shared)
    for line in found.withheld:
        if line not in _said:
            _said.add(line)
            log.info("%s", line)  # the kernel log at INFO: a kernel writes nothing to stderr unasked
    return found


async def upload(client: SandboxClient, sandbox_id: str, found: HostPipSettings) -> None:
    """Copy the CA bundles into the sandbox, where its envs say they are."""
    await asyncio.gather(*(client.upload_file(sandbox_id, path, data) for path, data in found.files.items()))


def collect(environ: Mapping[str, str], config_files: list[Path], loopback_alias: str | None,
            shared_dirs: tuple[str, ...] = ()) -> HostPipSettings:
    """The settings of `environ`, or else of pip's `config_files` (later ones win). A
    loopback index becomes `loopback_alias` (None: a provider that cannot reach the host).
    A CA bundle inside `shared_dirs` (host dirs the sandbox sees at the same path) is not
    copied: its variable names it where it is."""
    config = read_pip_config(config_files)
    found = HostPipSettings()
    trusted = (environ.get("PIP_TRUSTED_HOST") or config.get("trusted-host", "")).split()
    for variable, key in INDEX_SETTINGS.items():
        source = variable if environ.get(variable) else f"pip's {key}"
        urls = []
        for url in (environ.get(variable) or config.get(key, "")).split():
            passed = _sandbox_url(url, source, loopback_alias, found.withheld)
            if passed is not None:
                urls.append(passed)
                if loopback_alias and passed != url:  # trusted as the host trusts its loopback
                    trusted.append(loopback_alias)
        if urls:
            found.envs[variable] = " ".join(urls)
    if trusted:
        found.envs["PIP_TRUSTED_HOST"] = " ".join(dict.fromkeys(trusted))
    for variable, key in CA_SETTINGS.items():
        host_path = environ.get(variable) or (config.get(key) if key else None)
        if host_path:
            copied = _copy_of(Path(host_path).expanduser(), variable, found, shared_dirs)
            if copied:
                found.envs[variable] = copied
    if cert_dir := environ.get("SSL_CERT_DIR"):
        resolved = os.path.realpath(cert_dir)
        if _shared(resolved, shared_dirs):
            found.envs["SSL_CERT_DIR"] = resolved
        else:
            found.withheld.append(f"SSL_CERT_DIR: {cert_dir} is not passed to the sandbox (a directory is not "
                                  "copied; SSL_CERT_FILE with one bundle is)")
    if config.get("client-cert"):
        found.withheld.append("pip's client-cert is not passed to the sandbox: it holds a private key")
    return found


def _sandbox_url(url: str, source: str, loopback_alias: str | None, withheld: list[str]) -> str | None:
    """`url` as the sandbox must spell it, or None (and why, in withheld) if it is not passed."""
    try:
        parts = urlsplit(url)
        host = parts.hostname
        credentials = parts.username is not None or parts.password is not None
    except ValueError:
        withheld.append(f"{source}: an index URL that does not parse is not passed to the sandbox")
        return None
    if credentials or parts.query or parts.fragment:
        # Named by host only: the URL itself is the secret.
        withheld.append(f"{source}: the index on {host} is not passed to the sandbox: its URL carries "
                        "credentials, which code in the sandbox could read")
        return None
    if parts.scheme not in ("http", "https"):  # a directory of the host (file://) or a path
        withheld.append(f"{source}: the index {url} is not passed: the sandbox cannot see the host's files")
        return None
    if host not in LOOPBACK_HOSTS:
        return url
    if loopback_alias is None:
        withheld.append(f"{source}: the index on the host's loopback ({url}) is not passed: "
                        "the provider's sandboxes cannot reach this host")
        return None
    netloc = loopback_alias + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def _copy_of(host_path: Path, variable: str, found: HostPipSettings, shared_dirs: tuple[str, ...]) -> str | None:
    """The sandbox path of the host's CA bundle: where the sandbox sees it already, else of
    its copy (added to found.files); None if it is not passed."""
    try:
        with host_path.open("rb") as bundle:
            data = bundle.read(CA_BUNDLE_LIMIT + 1)
    except OSError as exc:
        found.withheld.append(f"{variable}: the host's CA bundle {host_path} is not passed to the sandbox: "
                              f"{exc.strerror or exc}")
        return None
    if len(data) > CA_BUNDLE_LIMIT:
        found.withheld.append(f"{variable}: {host_path} is not passed to the sandbox: over "
                              f"{CA_BUNDLE_LIMIT // 1024 // 1024} MiB, no CA bundle")
        return None
    if b"PRIVATE KEY" in data:
        found.withheld.append(f"{variable}: {host_path} is not passed to the sandbox: it holds a private key")
        return None
    resolved = os.path.realpath(host_path)
    if _shared(resolved, shared_dirs):
        return resolved  # e.g. the system's bundle: no upload at every sandbox's start
    # Named by content: the same bundle behind several variables is copied once.
    path = f"{SANDBOX_CA_PREFIX}{hashlib.sha256(data).hexdigest()[:16]}.pem"
    found.files[path] = data
    return path


def _shared(resolved: str, shared_dirs: tuple[str, ...]) -> bool:
    return any(resolved == directory or resolved.startswith(directory + "/") for directory in shared_dirs)


def pip_config_files(environ: Mapping[str, str]) -> list[Path]:
    """pip's configuration files, in the order pip loads them (a later one wins): global,
    user (not when PIP_CONFIG_FILE names a file), site, PIP_CONFIG_FILE."""
    config_file = environ.get("PIP_CONFIG_FILE")
    if config_file == os.devnull:  # pip's way to read none
        return []
    config_dirs = (environ.get("XDG_CONFIG_DIRS") or "/etc/xdg").split(os.pathsep)
    files = [Path(directory) / "pip" / "pip.conf" for directory in config_dirs]
    files.append(Path("/etc/pip.conf"))
    if not (config_file and os.path.exists(config_file)):
        home = Path(environ.get("HOME") or Path.home())
        files.append(home / ".pip" / "pip.conf")
        files.append(Path(environ.get("XDG_CONFIG_HOME") or home / ".config") / "pip" / "pip.conf")
    files.append(Path(sys.prefix) / "pip.conf")
    if config_file:
        files.append(Path(config_file))
    return files


def read_pip_config(files: list[Path]) -> dict[str, str]:
    """The keys this module passes, as pip's install command sees them in `files`."""
    import configparser  # read for a new sandbox only: a start on a pooled one does without

    found: dict[str, str] = {}
    for path in files:
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (configparser.Error, UnicodeDecodeError) as exc:
            log.warning("pip configuration %s is not read: %s", path, exc)
            continue
        for section in ("global", "install"):
            if parser.has_section(section):
                for key in ("index-url", "extra-index-url", "trusted-host", "cert", "client-cert"):
                    if parser.has_option(section, key):
                        found[key] = parser.get(section, key)
    return found
