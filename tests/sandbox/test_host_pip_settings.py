"""What of the host's pip and CA settings a new sandbox gets (host_pip_settings.collect):
variables first, pip's configuration files where none is set, a CA bundle as a copy the
sandbox can read, a loopback index by the host alias, and never a credential."""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

from sandbox_kernel.sandbox.host_pip_settings import SANDBOX_CA_PREFIX, collect, pip_config_files

ALIAS = "host.sandbox.internal"
CERT = b"-----BEGIN CERTIFICATE-----\nMIIBcorporateCA\n-----END CERTIFICATE-----\n"


def copy_path(data: bytes) -> str:
    return f"{SANDBOX_CA_PREFIX}{hashlib.sha256(data).hexdigest()[:16]}.pem"


def test_variables_pass_a_loopback_index_by_the_alias_and_trusted(tmp_path: Path) -> None:
    found = collect({"PIP_INDEX_URL": "http://127.0.0.1:8000/simple",
                     "PIP_EXTRA_INDEX_URL": "https://mirror.corp.example/simple http://localhost/x",
                     "PIP_TRUSTED_HOST": "mirror.corp.example"}, [], ALIAS)
    assert found.envs == {"PIP_INDEX_URL": f"http://{ALIAS}:8000/simple",
                          "PIP_EXTRA_INDEX_URL": f"https://mirror.corp.example/simple http://{ALIAS}/x",
                          "PIP_TRUSTED_HOST": f"mirror.corp.example {ALIAS}"}
    assert found.files == {} and found.withheld == []


def test_a_url_with_credentials_is_withheld_and_named_by_its_host_only(tmp_path: Path) -> None:
    secret = "s3cret-token-1234"
    config = tmp_path / "pip.conf"
    config.write_text(f"[global]\nextra-index-url = https://__token__:{secret}@git.corp.example/simple\n")
    found = collect({"PIP_INDEX_URL": f"https://alice:{secret}@pkgs.corp.example/simple",
                     "PIP_CONFIG_FILE": str(config)}, [config], ALIAS)
    assert found.envs == {}
    assert found.withheld == [
        "PIP_INDEX_URL: the index on pkgs.corp.example is not passed to the sandbox: its URL carries "
        "credentials, which code in the sandbox could read",
        "pip's extra-index-url: the index on git.corp.example is not passed to the sandbox: its URL carries "
        "credentials, which code in the sandbox could read"]
    assert secret not in repr(found)
    # a token in the query is one too
    query = collect({"PIP_INDEX_URL": f"https://pkgs.corp.example/simple?token={secret}"}, [], ALIAS)
    assert query.envs == {} and secret not in repr(query)


def test_config_files_where_no_variable_is_set_later_and_install_win(tmp_path: Path) -> None:
    bundle = tmp_path / "corp-ca.pem"
    bundle.write_bytes(CERT)
    first, second = tmp_path / "global.conf", tmp_path / "user.conf"
    first.write_text("[global]\nindex-url = https://old.corp.example/simple\ntrusted-host = old.corp.example\n")
    second.write_text(f"[global]\nindex-url = https://global.corp.example/simple\ncert = {bundle}\n"
                      "[install]\nindex-url = https://install.corp.example/simple\n"
                      "extra-index-url =\n    https://a.corp.example/simple\n    https://b.corp.example/simple\n")
    found = collect({}, [first, second, tmp_path / "missing.conf"], ALIAS)
    assert found.envs == {"PIP_INDEX_URL": "https://install.corp.example/simple",
                          "PIP_EXTRA_INDEX_URL": "https://a.corp.example/simple https://b.corp.example/simple",
                          "PIP_TRUSTED_HOST": "old.corp.example", "PIP_CERT": copy_path(CERT)}
    assert found.files == {copy_path(CERT): CERT}
    # a variable wins over the files
    assert collect({"PIP_INDEX_URL": "https://env.corp.example/simple"}, [second], ALIAS).envs[
        "PIP_INDEX_URL"] == "https://env.corp.example/simple"


def test_ca_bundles_are_copied_once_and_keys_never(tmp_path: Path) -> None:
    bundle, other, key = tmp_path / "ca.pem", tmp_path / "other.pem", tmp_path / "client.pem"
    bundle.write_bytes(CERT)
    other.write_bytes(CERT + CERT)
    key.write_bytes(CERT + b"-----BEGIN PRIVATE KEY-----\nMIIEsecret\n-----END PRIVATE KEY-----\n")
    found = collect({"PIP_CERT": str(bundle), "REQUESTS_CA_BUNDLE": str(bundle), "SSL_CERT_FILE": str(other)},
                    [], ALIAS)
    assert found.envs == {"PIP_CERT": copy_path(CERT), "REQUESTS_CA_BUNDLE": copy_path(CERT),
                          "SSL_CERT_FILE": copy_path(CERT + CERT)}
    assert found.files == {copy_path(CERT): CERT, copy_path(CERT + CERT): CERT + CERT}
    refused = collect({"PIP_CERT": str(key), "SSL_CERT_FILE": str(tmp_path / "gone.pem")}, [], ALIAS)
    assert refused.envs == {} and refused.files == {}
    assert refused.withheld == [
        f"PIP_CERT: {key} is not passed to the sandbox: it holds a private key",
        f"SSL_CERT_FILE: the host's CA bundle {tmp_path / 'gone.pem'} is not passed to the sandbox: "
        "No such file or directory"]
    assert b"MIIEsecret" not in repr(refused).encode()


def test_a_bundle_the_sandbox_sees_already_is_named_where_it_is(tmp_path: Path) -> None:
    shared = tmp_path / "etc-ssl"
    shared.mkdir()
    (shared / "bundle.crt").write_bytes(CERT)
    (tmp_path / "link.pem").symlink_to(shared / "bundle.crt")
    found = collect({"PIP_CERT": str(tmp_path / "link.pem"), "SSL_CERT_FILE": str(tmp_path / "link.pem")},
                    [], ALIAS, shared_dirs=(str(shared),))
    assert found.envs == {"PIP_CERT": str(shared / "bundle.crt"), "SSL_CERT_FILE": str(shared / "bundle.crt")}
    assert found.files == {}
    # a directory of certificates: named where the sandbox sees it, else not passed
    assert collect({"SSL_CERT_DIR": str(shared)}, [], ALIAS, shared_dirs=(str(shared),)).envs == {
        "SSL_CERT_DIR": str(shared)}
    elsewhere = collect({"SSL_CERT_DIR": str(tmp_path)}, [], ALIAS, shared_dirs=(str(shared),))
    assert elsewhere.envs == {} and elsewhere.withheld == [
        f"SSL_CERT_DIR: {tmp_path} is not passed to the sandbox (a directory is not copied; "
        "SSL_CERT_FILE with one bundle is)"]


def test_an_index_in_a_host_directory_is_not_passed() -> None:
    found = collect({"PIP_EXTRA_INDEX_URL": "file:///opt/wheels/simple https://mirror.corp.example/simple"},
                    [], ALIAS)
    assert found.envs == {"PIP_EXTRA_INDEX_URL": "https://mirror.corp.example/simple"}
    assert found.withheld == ["PIP_EXTRA_INDEX_URL: the index file:///opt/wheels/simple is not passed: "
                              "the sandbox cannot see the host's files"]


def test_a_provider_that_cannot_reach_the_host_gets_no_loopback_index() -> None:
    found = collect({"PIP_INDEX_URL": "http://127.0.0.1:8000/simple"}, [], None)
    assert found.envs == {}
    assert found.withheld == ["PIP_INDEX_URL: the index on the host's loopback (http://127.0.0.1:8000/simple) "
                              "is not passed: the provider's sandboxes cannot reach this host"]


def test_pip_config_files_in_pips_order(tmp_path: Path) -> None:
    environ = {"HOME": str(tmp_path), "XDG_CONFIG_DIRS": "/etc/xdg-a:/etc/xdg-b"}
    assert pip_config_files(environ) == [
        Path("/etc/xdg-a/pip/pip.conf"), Path("/etc/xdg-b/pip/pip.conf"), Path("/etc/pip.conf"),
        tmp_path / ".pip" / "pip.conf", tmp_path / ".config" / "pip" / "pip.conf", Path(sys.prefix) / "pip.conf"]
    # PIP_CONFIG_FILE comes last, and, when it exists, pip reads no user file
    explicit = tmp_path / "explicit.conf"
    explicit.touch()
    assert pip_config_files({**environ, "PIP_CONFIG_FILE": str(explicit)}) == [
        Path("/etc/xdg-a/pip/pip.conf"), Path("/etc/xdg-b/pip/pip.conf"), Path("/etc/pip.conf"),
        Path(sys.prefix) / "pip.conf", explicit]
    assert pip_config_files({**environ, "PIP_CONFIG_FILE": os.devnull}) == []
