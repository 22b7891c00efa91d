"""The host's pip and CA settings reach `%pip install` in the sandbox (issue 36, item 3), as
a user behind a corporate proxy has them: the host's PIP_INDEX_URL (a local index on the
host's loopback here) installs on the first try once egress allows it; the host's CA bundle
files are readable in the sandbox, byte for byte, where its PIP_CERT, REQUESTS_CA_BUNDLE and
SSL_CERT_FILE say; an index URL with credentials never reaches it; a named fork keeps them."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from kernel_helpers import execute, running_kernel
from package_index import PACKAGE, serving_index
from sandbox_kernel.api.local_engine import HOST_ALIAS
from sandbox_kernel.sandbox.host_pip_settings import SANDBOX_CA_PREFIX

# The loopback index is reached by the local engine's host alias: nothing to check on the
# CreateOS code path, whose sandboxes cannot reach this host.
pytestmark = [pytest.mark.slow, pytest.mark.one_path]

CA_VARIABLES = ("PIP_CERT", "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE")
SHOW = ("import os, json, hashlib\n"
        "seen = {name: os.environ.get(name) for name in "
        "('PIP_INDEX_URL', 'PIP_EXTRA_INDEX_URL', 'PIP_TRUSTED_HOST', 'PIP_CERT', 'REQUESTS_CA_BUNDLE', 'SSL_CERT_FILE')}\n"
        "seen['hashes'] = {name: hashlib.sha256(open(os.environ[name], 'rb').read()).hexdigest() "
        "for name in ('PIP_CERT', 'REQUESTS_CA_BUNDLE', 'SSL_CERT_FILE')}\n"
        "seen['host paths'] = [os.path.exists(path) for path in HOST_PATHS]\n"
        "seen['environ'] = repr(dict(os.environ))\n"
        "print(json.dumps(seen))")


def self_signed_ca(directory: Path, name: str) -> Path:
    """A corporate-style CA certificate (its key stays beside it, set nowhere)."""
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", f"/CN={name}", "-keyout", str(directory / f"{name}.key"),
                    "-out", str(directory / f"{name}.pem")], check=True, capture_output=True, timeout=60)
    return directory / f"{name}.pem"


def test_the_hosts_index_and_ca_bundles_reach_pip_in_the_sandbox(
        kernelspec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pip_ca, ssl_ca = self_signed_ca(tmp_path, "corp-proxy-ca"), self_signed_ca(tmp_path, "corp-root-ca")
    secret = "s3cret-" + hashlib.sha256(os.urandom(8)).hexdigest()[:12]
    with serving_index(tmp_path / "index") as alias_url:
        host_url = alias_url.replace(HOST_ALIAS, "127.0.0.1")  # as the host's pip knows it
        port = host_url.split(":")[2].split("/")[0]
        monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's own pip files stay out of it
        monkeypatch.setenv("PIP_INDEX_URL", host_url)
        monkeypatch.setenv("PIP_EXTRA_INDEX_URL", f"https://alice:{secret}@127.0.0.1:9/simple")
        monkeypatch.setenv("PIP_CERT", str(pip_ca))
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(pip_ca))
        monkeypatch.setenv("SSL_CERT_FILE", str(ssl_ca))
        show = SHOW.replace("HOST_PATHS", repr([str(pip_ca), str(ssl_ca)]))
        hashes = {name: hashlib.sha256(Path(os.environ[name]).read_bytes()).hexdigest() for name in CA_VARIABLES}
        with running_kernel(kernelspec) as (_, kc):
            allowed = execute(kc, f"%egress allow 127.0.0.1:{port}")
            assert allowed.reply["content"]["status"] == "ok", allowed.outputs
            # no --index-url, no --trusted-host: the host's settings, on the first try
            install = execute(kc, f"%pip install --no-cache-dir --disable-pip-version-check {PACKAGE}")
            assert install.reply["content"]["status"] == "ok", install.outputs
            assert "Successfully installed hello-sandbox-1.0" in install.text(), install.outputs
            assert execute(kc, "import hello_sandbox; print(hello_sandbox.GREETING)").text() == \
                "installed from the host index\n"

            seen = json.loads(execute(kc, show).text())
            assert seen["PIP_INDEX_URL"] == alias_url and seen["PIP_TRUSTED_HOST"] == HOST_ALIAS
            # the CA bundles: copies the sandbox can read (the host's paths are not there), same bytes
            assert seen["host paths"] == [False, False]
            assert all(seen[name].startswith(SANDBOX_CA_PREFIX) for name in CA_VARIABLES)
            assert seen["hashes"] == hashes
            # the index with credentials: not passed, nor anything of it
            assert seen["PIP_EXTRA_INDEX_URL"] is None and secret not in seen["environ"]
            assert secret not in install.text() + install.text("stderr")

            forked = execute(kc, "%sandbox fork --name pip-fork")
            assert forked.reply["content"]["status"] == "ok", forked.text("stderr")
            attached = execute(kc, "%sandbox attach pip-fork")
            assert attached.reply["content"]["status"] == "ok", attached.text("stderr")
            in_fork = json.loads(execute(kc, show).text())
            assert {name: in_fork[name] for name in ("PIP_INDEX_URL", "PIP_TRUSTED_HOST", *CA_VARIABLES)} == \
                {name: seen[name] for name in ("PIP_INDEX_URL", "PIP_TRUSTED_HOST", *CA_VARIABLES)}
            assert in_fork["hashes"] == hashes and secret not in in_fork["environ"]
