"""Configuration from the environment: one clear line for every mistake."""

from __future__ import annotations

import pytest

from sandbox_kernel.config import DEFAULT_AUTO_PAUSE, ConfigError, Settings


def test_defaults_use_the_local_engine() -> None:
    settings = Settings.from_env({})
    assert (settings.provider, settings.shape, settings.auto_pause, settings.egress) == \
        ("local", "s-1vcpu-1gb", DEFAULT_AUTO_PAUSE, None)
    assert "sk_secret" not in repr(Settings.from_env({"CREATEOS_SANDBOX_API_KEY": "sk_secret"}))


def test_a_key_selects_createos() -> None:
    settings = Settings.from_env({"CREATEOS_SANDBOX_API_KEY": "sk_x", "CREATEOS_SANDBOX_BASE_URL": "https://h"})
    assert (settings.provider, settings.base_url, settings.description) == ("createos", "https://h", "CreateOS")


@pytest.mark.parametrize(("env", "message"), [
    ({"SANDBOX_KERNEL_PROVIDER": "createos"}, "no CreateOS API key: set CREATEOS_SANDBOX_API_KEY"),
    ({"SANDBOX_KERNEL_PROVIDER": "cloud"}, "SANDBOX_KERNEL_PROVIDER must be 'local' or 'createos'"),
    ({"SANDBOX_KERNEL_ON_SHUTDOWN": "explode"}, "the shutdown policy must be destroy, pause or keep"),
    ({"SANDBOX_KERNEL_AUTO_PAUSE": "5"}, "SANDBOX_KERNEL_AUTO_PAUSE must be 60-86400 seconds or off"),
    ({"SANDBOX_KERNEL_EGRESS": "ok.example.com, 10.0.0.0/33"}, "invalid egress rule '10.0.0.0/33'"),
])
def test_mistakes_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env(env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_auto_pause_and_egress_forms() -> None:
    assert Settings.from_env({"SANDBOX_KERNEL_AUTO_PAUSE": "off"}).auto_pause is None
    assert Settings.from_env({"SANDBOX_KERNEL_AUTO_PAUSE": "600"}).auto_pause == 600
    assert Settings.from_env({"SANDBOX_KERNEL_EGRESS": "PyPI.org, files.pythonhosted.org:443"}).egress == \
        ["pypi.org", "files.pythonhosted.org:443"]
