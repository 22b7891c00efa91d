"""A pytest plugin for the peer suites' runs: one JSON line per test outcome.

Loaded with `-p outcomes_plugin` into a peer suite's pytest process; it writes to the file
named by PEER_OUTCOMES. A test counts as passed only if its setup, call and teardown all
passed, and (pytest marks it so) all its subtests passed.
"""

from __future__ import annotations

import json
import os
from typing import IO

import pytest

_out: IO[str] | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _out
    _out = open(os.environ["PEER_OUTCOMES"], "a", encoding="utf-8")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _out is not None:
        _out.close()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    assert _out is not None
    if hasattr(report, "context"):
        return  # a subtest's report (pytest's SubtestReport); its test fails with it
    outcome = report.outcome
    if report.when != "call" and outcome == "passed":
        return  # a passing setup or teardown says nothing; the call phase does
    if report.when != "call" and outcome == "failed":
        outcome = "error"
    crash = getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
    json.dump({"item": report.nodeid, "when": report.when, "outcome": outcome,
               "crash": crash if report.failed else ""}, _out)
    _out.write("\n")
    _out.flush()
