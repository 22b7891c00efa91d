"""Configuration from a config file, the environment and kernel arguments (each wins over
the one before): one clear line, naming where the bad value came from, for every mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandbox_kernel.config import DEFAULT_AUTO_PAUSE, ConfigError, Settings, config_file_path


def test_defaults_use_the_local_engine_and_say_why() -> None:
    settings = Settings.from_env({})
    assert (settings.provider, settings.shape, settings.auto_pause, settings.egress) == \
        ("local", "s-1vcpu-1gb", DEFAULT_AUTO_PAUSE, None)
    assert (settings.description, settings.why) == ("the local engine", " (no CreateOS API key set)")
    pinned = Settings.from_env({"SANDBOX_KERNEL_PROVIDER": "local", "CREATEOS_SANDBOX_API_KEY": "sk_x"})
    assert (pinned.description, pinned.why) == ("the local engine", "")
    assert "sk_secret" not in repr(Settings.from_env({"CREATEOS_SANDBOX_API_KEY": "sk_secret"}))


def test_a_key_selects_createos() -> None:
    settings = Settings.from_env({"CREATEOS_SANDBOX_API_KEY": "sk_x", "CREATEOS_SANDBOX_BASE_URL": "https://h"})
    assert (settings.provider, settings.base_url, settings.description) == ("createos", "https://h", "CreateOS")


@pytest.mark.parametrize(("env", "message"), [
    ({"SANDBOX_KERNEL_PROVIDER": "createos"}, "no CreateOS API key: set CREATEOS_SANDBOX_API_KEY"),
    ({"SANDBOX_KERNEL_PROVIDER": "cloud"}, "SANDBOX_KERNEL_PROVIDER must be 'local' or 'createos'"),
    ({"SANDBOX_KERNEL_ON_SHUTDOWN": "explode"},
     "SANDBOX_KERNEL_ON_SHUTDOWN: the shutdown policy must be destroy, pause or keep"),
    ({"SANDBOX_KERNEL_AUTO_PAUSE": "5"}, "SANDBOX_KERNEL_AUTO_PAUSE must be 60-86400 seconds or off"),
    ({"SANDBOX_KERNEL_EGRESS": "ok.example.com, 10.0.0.0/33"},
     "SANDBOX_KERNEL_EGRESS: invalid egress rule '10.0.0.0/33'"),
    ({"SANDBOX_KERNEL_ENGINE_TRANSPORT": "pigeon"}, "SANDBOX_KERNEL_ENGINE_TRANSPORT must be 'unix' or 'tcp'"),
    ({"SANDBOX_KERNEL_SANDBOX_NAME": "My Notebook"},
     "SANDBOX_KERNEL_SANDBOX_NAME: bad sandbox name 'My Notebook': use 1-63 lowercase letters"),
])
def test_mistakes_are_one_line(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Settings.from_env(env)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_auto_pause_and_egress_forms() -> None:
    assert Settings.from_env({"SANDBOX_KERNEL_AUTO_PAUSE": "off"}).auto_pause is None
    assert Settings.from_env({"SANDBOX_KERNEL_AUTO_PAUSE": "600"}).auto_pause == 600
    assert Settings.from_env({"SANDBOX_KERNEL_EGRESS": "Index.Example.com, files.example.com:443"}).egress == \
        ["index.example.com", "files.example.com:443"]


def write_config(tmp_path: Path, text: str) -> dict[str, str]:
    """An environment whose config file (found the XDG way) holds `text`."""
    path = tmp_path / "sandbox-kernel" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    env = {"XDG_CONFIG_HOME": str(tmp_path)}
    assert config_file_path(env) == path
    return env


def test_config_file_then_environment_then_kernel_arguments(tmp_path: Path) -> None:
    env = write_config(tmp_path, '''
shape = "s-2vcpu-4gb"
rootfs = "devbox:1"
auto_pause = 600
egress = ["Index.Example.com", "files.example.com:443"]
on_shutdown = "pause"
''')
    from_file = Settings.from_env(env)
    assert (from_file.shape, from_file.rootfs, from_file.auto_pause, from_file.on_shutdown) == \
        ("s-2vcpu-4gb", "devbox:1", 600, "pause")
    assert from_file.egress == ["index.example.com", "files.example.com:443"]
    overridden = Settings.from_env({**env, "SANDBOX_KERNEL_SHAPE": "s-1vcpu-256mb",
                                    "SANDBOX_KERNEL_AUTO_PAUSE": "off"},
                                   kernel_args={"shape": "s-4vcpu-8gb", "rootfs": ""})
    assert (overridden.shape, overridden.rootfs, overridden.auto_pause) == ("s-4vcpu-8gb", "devbox:1", None)


def test_no_config_file_is_fine_and_a_named_missing_one_is_not(tmp_path: Path) -> None:
    assert Settings.from_env({"HOME": str(tmp_path)}).shape == "s-1vcpu-1gb"
    with pytest.raises(ConfigError, match="cannot read the config file"):
        Settings.from_env({"SANDBOX_KERNEL_CONFIG": str(tmp_path / "missing.toml")})


@pytest.mark.parametrize(("text", "message"), [
    ("shape = ", "is not valid TOML"),
    ("colour = 'blue'", "unknown option 'colour'"),
    ("api_key = 'sk_secret'", "keep the API key out of files; set CREATEOS_SANDBOX_API_KEY"),
    ("auto_pause = 5", "auto_pause in "),
    ("egress = ['10.0.0.0/33']", "invalid egress rule '10.0.0.0/33'"),
])
def test_config_file_mistakes_are_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    env = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        Settings.from_env(env)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    assert "sk_secret" not in str(caught.value)
