"""Running a peer suite with pytest against one kernel, and comparing two such runs.

A peer suite starts the kernel named `python3` (jupyter_client maps `python` to it too). Each
run gets a JUPYTER_PATH whose first folder holds a kernelspec of that name pointing at the
kernel under test: that is the only change the suites see.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

HERE = Path(__file__).resolve().parent
KNOWN_FAILURES = HERE / "known_failures.toml"


@dataclass(frozen=True)
class PeerSuite:
    name: str
    paths: tuple[str, ...]  # test files, relative to the source folder
    options: tuple[str, ...] = ()  # extra pytest options for this suite


@dataclass
class Run:
    """What one pytest run of a suite reported: test id -> passed, failed, error or skipped,
    and for a failure the exception's one-line message."""
    outcomes: dict[str, str]
    crashes: dict[str, str]
    log: Path

    def passed(self) -> set[str]:
        return {item for item, outcome in self.outcomes.items() if outcome == "passed"}


def install_kernelspec(module: str, prefix: Path) -> Path:
    """Install `module`'s kernelspec as `python3` under prefix with its own CLI; return the
    folder to put first on JUPYTER_PATH."""
    subprocess.run([sys.executable, "-m", module, "install", "--prefix", str(prefix),
                    "--name", "python3"], check=True, capture_output=True)
    return prefix / "share" / "jupyter"


def run_suite(suite: PeerSuite, source: Path, jupyter_path: Path, work: Path,
              deselect: Iterable[str] = (), only: Iterable[str] = ()) -> Run:
    """Run the suite (or `only` these test ids of it) in a pytest subprocess whose `python3`
    kernel is the one at jupyter_path."""
    targets = tuple(only) or suite.paths
    work.mkdir(parents=True, exist_ok=True)
    outcomes_file, log = work / "outcomes.jsonl", work / "pytest.log"
    outcomes_file.unlink(missing_ok=True)
    env = {**os.environ,
           "JUPYTER_PATH": str(jupyter_path),
           "PEER_OUTCOMES": str(outcomes_file),
           "PYTHONPATH": os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)}
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "outcomes_plugin",
               "--color=no", "--durations=10",
               # Newer pytest-asyncio warns without it, and the suites make warnings errors.
               "-o", "asyncio_default_fixture_loop_scope=function",
               *suite.options, *targets]
    for item in deselect:
        command += ["--deselect", item]
    with open(log, "wb") as out:
        # pytest's exit status is 1 when tests fail: the outcomes file says which.
        subprocess.run(command, cwd=source, env=env, stdout=out, stderr=subprocess.STDOUT,
                       timeout=900)
    outcomes: dict[str, str] = {}
    crashes: dict[str, str] = {}
    if outcomes_file.exists():
        for line in outcomes_file.read_text().splitlines():
            record = json.loads(line)
            # The first bad phase decides: a test whose teardown errs did not pass.
            if outcomes.get(record["item"], "passed") == "passed":
                outcomes[record["item"]] = record["outcome"]
                crashes[record["item"]] = record["crash"]
    if not outcomes:
        raise RuntimeError(f"{suite.name}: pytest reported no test; see {log}:\n"
                           + log.read_text()[-3000:])
    return Run(outcomes, crashes, log)


@dataclass
class Listed:
    """One suite's entries of known_failures.toml."""
    tests: dict[str, str]  # test id -> reason
    # A failure whose message matches one of these (Python regexes) fails for that reason,
    # whichever test it hits: for a cause that lands on whichever test comes first.
    failing_with: dict[str, str]

    def not_run_here(self) -> list[str]:
        """Listed tests that cannot pass here: "cannot apply" and "not built" ones. They are
        left out of the sandbox run (some wait for replies that never come, some leave threads
        behind that fail the next test). "open" ones run, so a fix shows as soon as it lands,
        and so a cause that hits whichever test runs first hits the same test as on ipykernel."""
        return [item for item, reason in self.tests.items() if not reason.startswith("open:")]

    def cause(self, crash: str) -> str | None:
        for pattern, reason in self.failing_with.items():
            if re.fullmatch(pattern, crash):
                return reason
        return None


def known_failures(suite: str) -> Listed:
    table = dict(tomllib.loads(KNOWN_FAILURES.read_text()).get(suite, {}))
    listed = Listed(failing_with=table.pop("failing_with", {}), tests=table)
    reasons = {**listed.tests, **listed.failing_with}
    empty = [key for key, reason in reasons.items() if not reason.strip()]
    if empty:
        raise ValueError(f"{KNOWN_FAILURES.name}: no reason given for {empty}")
    return listed


@dataclass
class Comparison:
    suite: str
    on_ipykernel: set[str]  # passed on plain ipykernel
    here: Run  # the sandbox kernel's run
    listed: Listed
    # Failed here at first, passed when run again alone: counted as passed, and named.
    second_try: set[str] = field(default_factory=set)

    def passed_here(self) -> set[str]:
        return self.here.passed() | self.second_try

    def failed_for_listed_cause(self) -> dict[str, str]:
        failed = self.on_ipykernel - self.passed_here() - self.listed.tests.keys()
        causes = {item: self.listed.cause(self.here.crashes.get(item, "")) for item in failed}
        return {item: reason for item, reason in causes.items() if reason}

    @property
    def regressions(self) -> list[str]:
        return sorted(self.on_ipykernel - self.passed_here() - self.listed.tests.keys()
                      - self.failed_for_listed_cause().keys())

    def summary(self) -> str:
        by_cause = self.failed_for_listed_cause()
        lines = [f"{self.suite}: passed on ipykernel {len(self.on_ipykernel)}, "
                 f"passed here {len(self.passed_here())}, listed {len(self.listed.tests)}"
                 + (f", failed for a listed cause {len(by_cause)}" if by_cause else "")]
        lines += [f"  passed here only on a second try: {item}" for item in sorted(self.second_try)]
        lines += [f"  failed for a listed cause: {item} ({reason})"
                  for item, reason in sorted(by_cause.items())]
        lines += [f"  listed but passing here now (remove from the list): {item}"
                  for item in sorted(self.listed.tests.keys() & self.passed_here())]
        lines += [f"  listed but not passing on ipykernel (stale entry?): {item}"
                  for item in sorted(self.listed.tests.keys() - self.on_ipykernel)]
        lines += [f"  FAILS HERE, passes on ipykernel: {item} ({self.here.crashes.get(item, '')})"
                  for item in self.regressions]
        return "\n".join(lines)
