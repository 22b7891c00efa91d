"""metadata.sandbox (sealed.py): what it turns into for the kernel, one line for every rule
that cannot be applied, and a shared notebook never gets this project's own secrets."""

from __future__ import annotations

import pytest

from sandbox_kernel.api.egress_rules import DENY_ALL
from sandbox_kernel.config import Settings
from sandbox_kernel.sandbox.sealed import SealError, kernel_arguments, seal_metadata, sealed_options


def test_a_seal_becomes_kernel_arguments() -> None:
    seal = {"egress": ["host.sandbox.internal:8080", "*.example.com:443"], "shape": "s-2vcpu-4gb",
            "disk_mib": 4096, "env": ["DATA_URL"], "auto_pause": 600}
    assert kernel_arguments({"sandbox": seal}, {"DATA_URL"}, {"DATA_URL": "s3://x"}) == [
        "--SandboxKernel.egress=host.sandbox.internal:8080,*.example.com:443",
        "--SandboxKernel.shape=s-2vcpu-4gb", "--SandboxKernel.disk_mib=4096",
        "--SandboxKernel.env=DATA_URL", "--SandboxKernel.auto_pause=600"]
    assert kernel_arguments({}, (), {}) == []
    # No network at all, spelled as a reader expects ([]; CreateOS reads [] as allow all).
    assert sealed_options({"sandbox": {"egress": [], "auto_pause": "off"}}) == {"egress": DENY_ALL,
                                                                                 "auto_pause": "off"}


@pytest.mark.parametrize(("seal", "message"), [
    ({"egress": ["10.0.0.1/8"]}, "metadata.sandbox.egress: "),
    ({"egress": "host:80"}, "metadata.sandbox.egress must be a list of strings"),
    ({"shape": "huge"}, "metadata.sandbox.shape must be a shape id"),
    ({"shape": "s-64vcpu-1tb"}, "metadata.sandbox.shape: the local engine has no shape 's-64vcpu-1tb'"),
    ({"disk_mib": -1}, "metadata.sandbox.disk_mib must be a whole number of MiB above 0"),
    ({"auto_pause": 5}, "metadata.sandbox.auto_pause must be 60-86400 seconds or off"),
    ({"network": "none"}, "metadata.sandbox.network: unknown key"),
    ({"env": ["NOT_SET_HERE"]}, "metadata.sandbox.env: NOT_SET_HERE is not set in the environment"),
    ({"env": ["1BAD"]}, "metadata.sandbox.env: '1BAD' is not an environment variable name"),
])
def test_a_seal_that_cannot_be_applied_is_one_line_naming_its_key(seal: dict, message: str) -> None:
    allowed = set(seal.get("env", []))
    with pytest.raises(SealError) as raised:
        kernel_arguments({"sandbox": seal}, allowed, {})
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_shared_notebook_cannot_take_the_runners_key_or_its_variables() -> None:
    environ = {"CREATEOS_SANDBOX_API_KEY": "sk_live_secret", "GITHUB_TOKEN": "ghp_secret"}
    # The way in is real: a variable the runner allows reaches the sandbox's settings...
    assert Settings.from_env(environ, kernel_args={"env": "GITHUB_TOKEN"}).sandbox_env == {"GITHUB_TOKEN": "ghp_secret"}
    # ... but only with the runner's word ...
    with pytest.raises(SealError, match="asks for the host's GITHUB_TOKEN: pass --allow-env GITHUB_TOKEN"):
        kernel_arguments({"sandbox": {"env": ["GITHUB_TOKEN"]}}, (), environ)
    # ... and this project's key never, even allowed; the value is never in the message.
    with pytest.raises(SealError) as raised:
        kernel_arguments({"sandbox": {"env": ["CREATEOS_SANDBOX_API_KEY"]}}, {"CREATEOS_SANDBOX_API_KEY"}, environ)
    assert "never enters a sandbox" in str(raised.value) and "sk_live" not in str(raised.value)


def test_settings_seal_into_metadata_that_gives_them_back() -> None:
    environ = {"SANDBOX_KERNEL_EGRESS": "host.sandbox.internal:8080", "SANDBOX_KERNEL_SHAPE": "s-2vcpu-4gb",
               "SANDBOX_KERNEL_DISK_MIB": "2048", "SANDBOX_KERNEL_ENV": "DATA_URL", "DATA_URL": "secret-url",
               "SANDBOX_KERNEL_AUTO_PAUSE": "off"}
    settings = Settings.from_env(environ)
    seal = seal_metadata(settings)
    assert seal == {"shape": "s-2vcpu-4gb", "egress": ["host.sandbox.internal:8080"], "disk_mib": 2048,
                    "env": ["DATA_URL"], "auto_pause": "off"}
    assert "secret-url" not in repr(seal)  # names only, never values
    options = dict(arg.removeprefix("--SandboxKernel.").split("=", 1)
                   for arg in kernel_arguments({"sandbox": seal}, {"DATA_URL"}, {"DATA_URL": "v"}))
    again = Settings.from_env({"DATA_URL": "v"}, kernel_args=options)
    assert (again.egress, again.shape, again.disk_mib, again.auto_pause) == \
        (settings.egress, settings.shape, settings.disk_mib, settings.auto_pause)
    blocked = Settings.from_env({}, kernel_args={"egress": DENY_ALL})
    assert seal_metadata(blocked)["egress"] == [] and seal_metadata(Settings.from_env({})) == {"shape": "s-1vcpu-1gb"}
