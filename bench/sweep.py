"""`sandbox-kernel sweep` against papermill runs side by side, on the local engine.

    python bench/sweep.py [--quick]

A notebook with a 20 s setup (a sleep standing for I/O, plus state built with ~2 s of CPU),
a parameters cell and a short cell using both; 8 values of its parameter. Once as one sweep
(the setup runs once, the rest in 8 forks), once as 8 papermill runs at the same time (each
runs the setup). Reported: wall time, and CPU time of everything the run used on this
machine: its processes (sweep or papermill, the kernels) and the engine with the sandboxes it
reaped (the sandboxes' processes are the engine's children). The engine is private to the
bench and idle between runs. --quick: a 2 s setup and 2 values (a smoke run, not a measure).
Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat

from common import SANDBOX, bench_env

SETUP = """\
import hashlib, time
time.sleep({sleep})
started = time.process_time()
state = {{}}
while time.process_time() - started < {cpu}:
    state[len(state)] = hashlib.sha256(str(len(state)).encode()).hexdigest()
"""
BRANCH = "score = len(state) * alpha\nprint(alpha, score)"


def notebook(path: Path, sleep: float, cpu: float) -> Path:
    parameters = nbformat.v4.new_code_cell("alpha = 1")
    parameters.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(SETUP.format(sleep=sleep, cpu=cpu)),
                                         parameters, nbformat.v4.new_code_cell(BRANCH)],
                                  metadata={"kernelspec": {"name": SANDBOX, "display_name": SANDBOX,
                                                           "language": "python"}})
    nbformat.write(nb, path)
    return path


def process_cpu(pid: int) -> float:
    """CPU seconds of a process and of its children it has reaped (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15]) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def measured(engine_pid: int) -> Iterator[dict[str, float]]:
    """Wall and CPU seconds of the block: our reaped children (the runs, their kernels) and
    the engine (the sandboxes)."""
    result: dict[str, float] = {}
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    engine = process_cpu(engine_pid)
    started = time.monotonic()
    yield result
    result["wall"] = time.monotonic() - started
    time.sleep(1.0)  # destroyed sandboxes reaped by the engine
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result["cpu"] = (after.ru_utime + after.ru_stime - children.ru_utime - children.ru_stime
                     + process_cpu(engine_pid) - engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    sleep, cpu, values = (1.5, 0.5, ["1", "2"]) if args.quick else (18.0, 2.0, [str(v) for v in range(1, 9)])
    with bench_env() as env, tempfile.TemporaryDirectory() as work:
        assert env.engine is not None
        source = notebook(Path(work) / "setup.ipynb", sleep, cpu)
        with measured(env.engine.pid) as swept:
            subprocess.run([sys.executable, "-m", "sandbox_kernel", "sweep", str(source), "-p", "alpha", *values,
                            "--kernel", SANDBOX, "--output-dir", str(Path(work) / "sweep"),
                            "--jobs", str(len(values))], check=True, capture_output=True)
        with measured(env.engine.pid) as papermill:
            runs = [subprocess.Popen([sys.executable, "-m", "papermill", "-k", SANDBOX, str(source),
                                      str(Path(work) / f"papermill-{value}.ipynb"), "-p", "alpha", value,
                                      "--no-progress-bar"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                    for value in values]
            for run in runs:
                _, error = run.communicate()
                if run.returncode:
                    raise SystemExit(f"papermill failed: {error.decode()[-500:]}")
    print(f"{len(values)} values, setup {sleep + cpu:.0f} s ({cpu:.0f} s of it CPU), {os.cpu_count()} cores\n")
    print("| run | wall s | CPU s |\n|---|---|---|")
    print(f"| sandbox-kernel sweep (setup once, {len(values)} forks) | {swept['wall']:.1f} | {swept['cpu']:.1f} |")
    print(f"| {len(values)} papermill runs side by side | {papermill['wall']:.1f} | {papermill['cpu']:.1f} |")


if __name__ == "__main__":
    main()
