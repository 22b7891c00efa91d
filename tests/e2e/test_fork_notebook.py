"""Fork from a notebook: the child carries the live Python state, then both diverge.

Notebook 1 builds state and forks; notebook 2 opens the fork. Each changes x and a file
without the other seeing it; destroying the parent leaves the fork running cells.
"""

from __future__ import annotations

import re

import pytest
from jupyter_client.manager import start_new_kernel

from engine_helpers import sandbox_status
from test_channel import RELAYS
from kernel_helpers import TIMEOUT, execute
from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow


def value(kc, code: str) -> str:  # type: ignore[no-untyped-def]
    result = execute(kc, code)
    assert result.reply["content"]["status"] == "ok", result.of_type("error") or result.text("stderr")
    return result.text()


def test_fork_in_a_notebook(kernelspec: str, engine: EngineEndpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    km1, kc1 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    km2 = kc2 = None
    try:
        parent = value(kc1, "import os, json\nprint(os.environ['SANDBOX_ID'])").strip()
        value(kc1, "x = list(range(1_000_000))\nstate = {'who': 'parent'}\n"
                   "open('f.txt', 'w').write('parent')\nlog = open('log.txt', 'a')")
        forked = execute(kc1, "%sandbox fork --name kid")
        assert forked.reply["content"]["status"] == "ok", forked.text("stderr")
        lines = [m["content"]["data"]["text/plain"] for m in forked.messages if m["msg_type"] in
                 ("display_data", "update_display_data")]
        assert any(f"Pausing sandbox {parent} first" in line for line in lines)
        child = re.search(rf"Forked {parent} into (sb-\w+) \(kid\)", "\n".join(lines)).group(1)
        assert "%sandbox attach kid" in forked.text()  # a name works from every notebook
        assert sandbox_status(engine, parent).value == "paused"

        monkeypatch.setenv("SANDBOX_KERNEL_SANDBOX_ID", "kid")
        km2, kc2 = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
        monkeypatch.delenv("SANDBOX_KERNEL_SANDBOX_ID")
        # The live interpreter state came along: variables, modules, an open file.
        assert value(kc2, "print(len(x), x[-1], state, json.__name__, open('f.txt').read(), "
                          "os.environ['SANDBOX_ID'])") == f"1000000 999999 {{'who': 'parent'}} json parent {child}\n"
        value(kc2, "x.append('child'); state['who'] = 'child'\nopen('f.txt', 'w').write('child')\n"
                   "log.write('from the child\\n'); log.flush()")
        status = execute(kc2, "%sandbox status").of_type("display_data")[0]["data"]["text/plain"]
        assert f"forked from  {parent}" in status

        # The parent (resumed by its next cell) never saw any of that, and vice versa.
        assert value(kc1, "print(x[-1], state['who'], open('f.txt').read(), os.path.getsize('log.txt'))") == \
            "999999 parent parent 0\n"
        value(kc1, "x.append('parent-only')")
        assert value(kc2, "print(x[-1], open('log.txt').read(), end='')") == "child from the child\n"

        # Destroy the parent (notebook 1 owns the fork too, but notebook 2 drives it, so
        # it passes to notebook 2): the fork runs on.
        kc1.stop_channels()
        km1.shutdown_kernel()
        km1 = None
        assert sandbox_status(engine, parent).value == "destroyed"
        assert value(kc2, "print(sum(v for v in x if isinstance(v, int)))") == f"{sum(range(1_000_000))}\n"
    finally:
        for km, kc in ((km1, kc1), (km2, kc2)):
            if km is not None:
                kc.stop_channels()
                km.shutdown_kernel()


def test_fork_and_switch(kernelspec: str, engine: EngineEndpoint) -> None:
    km, kc = start_new_kernel(kernel_name=kernelspec, startup_timeout=TIMEOUT)
    try:
        parent = value(kc, "import os\nmark = 'shared'\nprint(os.environ['SANDBOX_ID'])").strip()
        switched = execute(kc, "%sandbox fork --switch")
        assert switched.reply["content"]["status"] == "ok", switched.text("stderr")
        assert "This notebook now drives the fork" in switched.text()
        now = value(kc, "print(os.environ['SANDBOX_ID'], mark)").split()
        assert now[0] != parent and now[1] == "shared"
        # The forked runner joined the fork's namespaces but holds no capability there:
        # its cells cannot remount the fork's read-only agent directory.
        remount = value(kc, "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                            "MS_REMOUNT, MS_BIND = 32, 4096\n"
                            "print(libc.mount(None, b'/run/sandbox-agent', None, MS_REMOUNT | MS_BIND, None),"
                            " ctypes.get_errno())")
        assert remount.split() == ["-1", "1"], remount  # EPERM
        capabilities = value(kc, "print(open('/proc/self/status').read())")
        assert "CapEff:\t0000000000000000" in capabilities, capabilities
        assert sandbox_status(engine, parent).value == "paused"
        value(kc, f"%sandbox attach {parent} --destroy-previous")
        assert value(kc, "print(os.environ['SANDBOX_ID'])").strip() == parent
        # The relay the kernel left in the parent when it switched (a paused sandbox
        # refuses the kill) was ended on resume: one relay, not one per switch.
        relays = value(kc, RELAYS + "print(len(relays()))")
        assert relays.strip() == "1", relays
        assert sandbox_status(engine, now[0]).value == "destroyed"
    finally:
        kc.stop_channels()
        km.shutdown_kernel()
