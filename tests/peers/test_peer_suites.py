"""Other projects' kernel tests, run against plain ipykernel and against this kernel.

Three peer suites, each run twice with the kernel name as the only change (all six runs
queued at once, two at a time: see `suite_runs`), and one test per suite compares its runs:
- jupyter_kernel_test: a complete `KernelTests` subclass (kernel_tests_python.py);
- ipykernel's own protocol tests, those that talk to a kernel through jupyter_client;
- nbclient's tests that run its test notebooks and compare the outputs as nbclient does.
A test that passes on ipykernel must pass here, unless known_failures.toml lists it with the
reason. The counts are printed, and written to test-artifacts/peer-suites/<suite>.txt.

Listed tests whose reason is "open: …" run here too, and those that pass are named, so their
entries can go; SANDBOX_KERNEL_PEERS_ALL=1 runs the other listed ones as well.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import pytest

from engine_helpers import running_engine
from peer_runs import HERE, Comparison, PeerSuite, Run, install_kernelspec, known_failures, run_suite
from sandbox_kernel.local.service import EngineEndpoint
from sources import sdist_tree

RUN_LISTED = os.environ.get("SANDBOX_KERNEL_PEERS_ALL") == "1"
ARTIFACTS = HERE.parent.parent / "test-artifacts" / "peer-suites"

SUITES = {suite.name: suite for suite in (
    PeerSuite("jupyter_kernel_test", ("kernel_tests_python.py",), ("--timeout=60",)),
    # The files whose tests start kernels with jupyter_client and talk to them (the rest of
    # ipykernel's suite drives its classes in-process), under its own pytest config
    # (per-test timeout 30 s, warnings are errors).
    PeerSuite("ipykernel", ("tests/test_message_spec.py", "tests/test_kernel.py",
                            "tests/test_async.py", "tests/test_debugger.py", "tests/test_subshells.py")),
    # Under its own pytest config (warnings are errors). TestRunCell feeds canned messages to
    # a mock client: no kernel in it.
    PeerSuite("nbclient", ("tests/test_client.py",), ("-k", "not TestRunCell", "--timeout=120")),
)}


@pytest.fixture(scope="module")
def peer_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineEndpoint]:
    """The peer suites' own engine and state dir. Their tests kill kernels outright (a
    `shutdown_kernel(now=True)`, a cell that kills its process), which leaves sandboxes
    for gc; those must not land among the records the rest of our suite's gc tests read.
    The engine destroys whatever is left when the module ends."""
    state = tmp_path_factory.mktemp("peer-state")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SANDBOX_KERNEL_STATE_DIR", str(state))  # the suites' kernels inherit it
        patch.delenv("CREATEOS_SANDBOX_API_KEY", raising=False)
        with running_engine(state) as endpoint:
            yield endpoint


@pytest.fixture(scope="module")
def kernelspecs(peer_engine: EngineEndpoint, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """JUPYTER_PATH folders whose `python3` is plain ipykernel, or the sandbox kernel."""
    root = tmp_path_factory.mktemp("peer-kernelspecs")
    return {"ipykernel": install_kernelspec("ipykernel", root / "ipykernel"),
            "sandbox": install_kernelspec("sandbox_kernel", root / "sandbox")}


def suite_source(name: str, tmp: Path) -> Path:
    if name == "jupyter_kernel_test":
        # Our own subclass, alone in a folder: no conftest or config of this repo applies.
        tmp.mkdir()
        shutil.copy(HERE / "kernel_tests_python.py", tmp)
        return tmp
    return sdist_tree(name)


@dataclass(frozen=True)
class SuiteRuns:
    source: Path
    here: Future[Run]
    on_ipykernel: Future[Run]


@pytest.fixture(scope="module")
def suite_runs(request: pytest.FixtureRequest, kernelspecs: dict[str, Path],
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SuiteRuns]]:
    """The two runs of every selected suite, queued when the module's first test starts and run
    two at a time: both mostly wait on kernels, and the time budget is tight. A suite's run on
    this kernel, queued first, takes longer than the one on ipykernel (a kernel start here
    creates a sandbox): the next suite's runs start as soon as either ends, rather than one
    run going on alone for the last minute or so of each suite."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.originalname == "test_peer_suite"]
    pool = ThreadPoolExecutor(2)
    runs = {}
    for name in selected:
        suite, work = SUITES[name], tmp_path_factory.mktemp(f"peer-{name}")
        source = suite_source(name, work / "source")
        runs[name] = SuiteRuns(
            source,
            here=pool.submit(run_suite, suite, source, kernelspecs["sandbox"], work / "sandbox",
                             deselect=() if RUN_LISTED else known_failures(name).not_run_here()),
            on_ipykernel=pool.submit(run_suite, suite, source, kernelspecs["ipykernel"], work / "ipykernel"))
    try:
        yield runs
    finally:
        pool.shutdown(cancel_futures=True)  # after an interrupted test, start no further run


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("name", list(SUITES))
def test_peer_suite(name: str, suite_runs: dict[str, SuiteRuns], kernelspecs: dict[str, Path],
                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs = suite_runs[name]
    here, on_ipykernel = runs.here.result(), runs.on_ipykernel.result()
    comparison = Comparison(name, on_ipykernel.passed(), here, known_failures(name))
    if comparison.regressions:
        # Once more, alone (once the other suites' runs have ended): a timing-sensitive test
        # that lost a race under load is named, not failed; one that fails again fails this test.
        wait([future for other in suite_runs.values() for future in (other.here, other.on_ipykernel)])
        again = run_suite(SUITES[name], runs.source, kernelspecs["sandbox"], tmp_path / "sandbox-again",
                          only=comparison.regressions)
        comparison.second_try = again.passed()
    report = comparison.summary()
    with capsys.disabled():
        print("\n" + report)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / f"{name}.txt").write_text(report + "\n")
    if comparison.regressions:
        pytest.fail(f"{report}\n(pytest logs: {on_ipykernel.log}, {here.log})", pytrace=False)
