"""What the attack tests share: one kernel per module, and cells that report as JSON."""

from __future__ import annotations

import json
import textwrap
from typing import Any

import pytest
from jupyter_client.blocking.client import BlockingKernelClient

from kernel_helpers import VIA_CREATEOS, execute

# The attacks target the sandbox, which is the same whichever way the kernel reaches the
# engine, so they run once: not again in the CreateOS-path pass of the kernel tests.
ONCE = pytest.mark.skipif(VIA_CREATEOS, reason="sandbox isolation does not depend on the "
                                               "kernel's route to the engine; checked in the main run")


def attempt(kc: BlockingKernelClient, code: str, timeout: float = 120) -> Any:
    """Run an attack in a notebook cell; its code leaves its findings in `result`, which
    comes back through JSON. The cell itself must not fail: the attack code catches what
    the sandbox refuses and reports it, e.g. with outcome() (see OUTCOME)."""
    cell = OUTCOME + textwrap.dedent(code) + "\nimport json as _json\nprint(_json.dumps(result))"
    run = execute(kc, cell, timeout=timeout)
    assert run.reply["content"]["status"] == "ok", run.of_type("error") or run.text("stderr")
    return json.loads(run.text().strip().splitlines()[-1])


# At the top of every attack cell: outcome(action) is the errno name of the OSError
# the action raised, or "DONE" (or what it returned) when it worked.
OUTCOME = '''
import errno, os
def outcome(action):
    try:
        value = action()
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno)) if exc.errno else type(exc).__name__
    return "DONE" if value is None else value
'''
