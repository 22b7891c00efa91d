"""The runner: the in-sandbox half of sandbox-kernel, a daemon that owns the user's Python.

The kernel uploads the runner's bundle (bundle.py) into the sandbox and starts the daemon,
``python3 BUNDLE/<package>/runner serve DIR`` (__main__.py), which runs cells one at a
time in its main thread (with IPython when importable, ipython.py; with a small ast-based
engine otherwise, plain.py), those of each kernel subshell in a thread of that subshell
(loop.py), and keeps every output event of a cell in memory (cells.py), so a client can
read them again from any seq. Its clients talk to it over ``DIR/runner.sock``: the
kernel's relay (``client.py channel DIR``, which hands the daemon its stdin and stdout:
the channel for the kernel's lifetime, many requests and tagged events, channel.py) or short-lived ``client.py
run|request DIR B64`` execs (one request, NDJSON answer, connection closed).

The modules: daemon.py (the daemon and its table of request handlers), wire.py (the lines
it writes), cells.py (a cell's events, the between-cell log, output budgets), output.py
(where output goes), bridges.py (input() and comms), loop.py (event loops, subshells),
plain.py and ipython.py (the two engines), environment.py (the sandbox's Python
environment), channel.py (the kernel's channel, on a relay's pipes), usage.py (CPU and memory), fork.py (the
fork op), debug.py (debugpy), client.py (the light client and relay). The words of the
protocol: ../protocol.py. Standard library only (IPython, debugpy and comm are used where
the sandbox has them), Python 3.8+.
"""
import os


def _own_directory() -> str:
    # As the runner's frames name their files (code objects), to tell them from the user's.
    return os.path.dirname(_own_directory.__code__.co_filename) + os.sep


# Frames of files under here are the runner's: dropped from the user's tracebacks.
OWN_FILES = _own_directory()
