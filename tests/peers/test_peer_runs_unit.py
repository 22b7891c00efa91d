"""The peer-suite comparison's rules, on made-up outcomes (no kernel): what fails the harness,
what a listed test or a listed failure message excuses, and the list file itself."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from peer_runs import Comparison, Listed, Run, known_failures
from sources import extract_plainly

LISTED = Listed(
    tests={"t::cannot": "cannot apply: reads ipykernel's objects",
           "t::open": "open: a gap", "t::built": "not built: the debugger"},
    failing_with={r"AssertionError: bad version: \S+ < 2\.1": "cannot apply: IPython's version"})


def here(**outcomes: tuple[str, str]) -> Run:
    return Run({item: outcome for item, (outcome, _) in outcomes.items()},
               {item: crash for item, (_, crash) in outcomes.items()}, Path("pytest.log"))


def test_a_test_passing_on_ipykernel_must_pass_here() -> None:
    run = here(a=("passed", ""), b=("failed", "AssertionError: assert 1 == 2"))
    comparison = Comparison("s", {"a", "b"}, run, LISTED)
    assert comparison.regressions == ["b"]
    assert "FAILS HERE, passes on ipykernel: b (AssertionError: assert 1 == 2)" in comparison.summary()


def test_listed_tests_and_listed_failure_messages_are_excused() -> None:
    run = here(**{"t::open": ("failed", "x"), "a": ("error", "AssertionError: bad version: 0.1.0 < 2.1"),
                  "b": ("failed", "AssertionError: bad version: 0.1.0 < 2.1 and more")})
    comparison = Comparison("s", {"t::open", "t::cannot", "a", "b"}, run, LISTED)
    assert comparison.regressions == ["b"]  # the message must match in full
    assert comparison.failed_for_listed_cause() == {"a": "cannot apply: IPython's version"}


def test_a_second_try_that_passes_counts_and_is_named() -> None:
    comparison = Comparison("s", {"a"}, here(a=("failed", "Timeout")), LISTED)
    comparison.second_try = {"a"}
    assert comparison.regressions == []
    assert "passed here only on a second try: a" in comparison.summary()


def test_open_entries_run_here_and_are_named_once_they_pass() -> None:
    assert sorted(LISTED.not_run_here()) == ["t::built", "t::cannot"]
    comparison = Comparison("s", {"t::open"}, here(**{"t::open": ("passed", "")}), LISTED)
    assert "listed but passing here now (remove from the list): t::open" in comparison.summary()


def test_the_list_file_gives_every_entry_a_known_kind_of_reason() -> None:
    for suite in ("jupyter_kernel_test", "ipykernel", "nbclient"):
        listed = known_failures(suite)
        for reason in [*listed.tests.values(), *listed.failing_with.values()]:
            assert reason.startswith(("cannot apply: ", "not built: ", "open: ")), reason


def test_an_sdist_is_extracted_plainly_with_or_without_tarfiles_filter(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def archive_of(name: str, link: bool) -> Path:
        path = tmp_path / f"{name}.tar.gz"
        with tarfile.open(path, "w:gz") as archive:
            data = tmp_path / "data.txt"
            data.write_text("x")
            archive.add(data, "pkg/tests/data.txt")
            if link:
                entry = tarfile.TarInfo("pkg/escape")
                entry.type, entry.linkname = tarfile.SYMTYPE, "/etc/passwd"
                archive.addfile(entry)
        return path

    for has_filter in (True, False):
        if not has_filter:
            monkeypatch.delattr(tarfile, "data_filter", raising=False)
        into = tmp_path / f"plain-{has_filter}"
        with tarfile.open(archive_of(f"plain-{has_filter}", link=False)) as archive:
            extract_plainly(archive, into)
        assert (into / "pkg" / "tests" / "data.txt").read_text() == "x"
        with tarfile.open(archive_of(f"link-{has_filter}", link=True)) as archive, \
                pytest.raises((RuntimeError, tarfile.TarError)):
            extract_plainly(archive, tmp_path / f"link-{has_filter}")
