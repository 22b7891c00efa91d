"""An engine serves one Python environment (service.engine_dir): the first environment to
use a state dir owns its engine, every other one gets an engine dir of its own, for good;
two environments asking at once get one answer; an engine of an earlier version (no record)
keeps the dir for the environment it runs in; `serve --state-dir` of a dir another
environment owns is refused in one line. Real engines where an engine is involved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from engine_helpers import running_engine
from sandbox_kernel.local.service import (ENGINES_DIR, ENVIRONMENT_FILE, PythonEnvironment, engine_dir,
                                          environment_of)

OTHER = PythonEnvironment(prefix="/opt/other-env", python="/opt/other-env/bin/python")


def test_the_first_environment_owns_the_dir_and_the_others_get_one_each(tmp_path: Path) -> None:
    me = PythonEnvironment.current()
    assert engine_dir(tmp_path) == tmp_path
    other = engine_dir(tmp_path, OTHER)
    assert other.parent == tmp_path / ENGINES_DIR and other.name.startswith("other-env-")
    assert environment_of(other) == OTHER.prefix and environment_of(tmp_path) == me.prefix
    # for good: asked again, in any order, each environment finds the same dir
    assert (engine_dir(tmp_path, OTHER), engine_dir(tmp_path)) == (other, tmp_path)
    assert (tmp_path / ENVIRONMENT_FILE).stat().st_mode & 0o777 == 0o600


def test_two_environments_asking_at_once_get_one_owner(tmp_path: Path) -> None:
    for attempt in range(20):
        state = tmp_path / str(attempt)
        with ThreadPoolExecutor(2) as pool:
            dirs = list(pool.map(lambda env: engine_dir(state, env), [PythonEnvironment.current(), OTHER]))
        assert sorted(d == state for d in dirs) == [False, True], dirs
        assert not [name for name in os.listdir(state) if name.endswith(".tmp")]


def test_an_unrecorded_engine_keeps_the_dir_for_its_environment(tmp_path: Path) -> None:
    with running_engine(tmp_path):
        (tmp_path / ENVIRONMENT_FILE).unlink()  # as an engine of an earlier version leaves it
        # another environment asks first: the running engine's own environment owns the dir
        assert engine_dir(tmp_path, OTHER) != tmp_path
        assert environment_of(tmp_path) == PythonEnvironment.current().prefix
        assert engine_dir(tmp_path) == tmp_path


def test_serve_refuses_the_dir_of_another_environment(tmp_path: Path) -> None:
    environment_of(tmp_path, claim=OTHER)
    done = subprocess.run([sys.executable, "-m", "sandbox_kernel", "serve", "--state-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == (f"sandbox-kernel: {tmp_path} holds the engine of the Python environment "
                           f"{OTHER.prefix}, not of this one ({os.path.realpath(sys.prefix)}), whose packages its "
                           "sandboxes would not see; serve another --state-dir, or none (each environment then "
                           "gets an engine of its own)\n")
    assert not (tmp_path / "engine.json").exists() and json.loads((tmp_path / ENVIRONMENT_FILE).read_text())[
        "prefix"] == OTHER.prefix
