"""The client imports httpcore and anyio with the garbage collector held off
(sandbox_kernel/api/client.py `_import_httpcore`).

anyio compiles its own source to an AST when first imported, and httpcore's first request
imports anyio.abc. On CPython before 3.11.8 an AST built during that compile, by a
finalizer the collector runs, fails it with "SystemError: AST constructor recursion depth
mismatch" (CI's bench failed so). The attack: cycles of objects whose finalizer parses
Python, left for the collector, which is set to run a given number of allocations into the
import; swept over those numbers, first against a plain import, which must fail at some
(else this Python has no such flaw, and the test is skipped), then against the client's.
A fresh interpreter does it, since the import is undone and redone at each step.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

ATTACK = """
import ast, gc, json, sys
from sandbox_kernel.api.client import _import_httpcore

class ParsesWhenCollected:
    def __del__(self):
        ast.parse("x = [(1 + (2 * (3 - 4)))]")

def survives(importer, allocations_until_collected):
    for name in [n for n in sys.modules if n == "anyio" or n.startswith("anyio.")]:
        del sys.modules[name]
    gc.collect()
    gc.disable()
    for _ in range(200):
        cycle = ParsesWhenCollected()
        cycle.me = cycle
    del cycle
    gc.set_threshold(gc.get_count()[0] + allocations_until_collected)
    gc.enable()
    try:
        importer()
        return True
    except SystemError:
        return False
    finally:
        gc.set_threshold(700)

def plain_import():
    import anyio.abc

steps = range(0, 4000, 50)
print(json.dumps([[n for n in steps if not survives(plain_import, n)],
                  [n for n in steps if not survives(_import_httpcore, n)]]))
"""


def test_a_collection_during_anyios_first_import_fails_no_request() -> None:
    done = subprocess.run([sys.executable, "-c", ATTACK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    plain_failed_at, client_failed_at = json.loads(done.stdout)
    if not plain_failed_at:
        pytest.skip(f"Python {sys.version.split()[0]} builds ASTs re-entrantly without failing: nothing to hold off")
    assert client_failed_at == [], f"the client's import failed with the collector due after {client_failed_at} allocations"
