"""The runner daemon's parent in the sandbox: it starts the daemon, waits for it, and records
how it ended and the most memory it ever held, which its parent alone can learn (wait4's
ru_maxrss: the daemon's peak resident size, its waited-for children's included).

    python3 -I -S warden.py RECORD SCRIPT [ARG...]

runs SCRIPT with the warden's own interpreter (sys.executable: `python3` resolved once, which
costs dearly where it is a shim), without -I -S.

RECORD gets one line, "STATUS PEAK_KIB": STATUS is the exit code, or 128+N if signal N
killed the daemon (as a shell says it). The kernel reads it when the daemon died
(sandbox/runner_setup.py: how_runner_ended) to say why the notebook's Python died. Stdlib
only, started with -I -S: it costs a bare interpreter's start, once per runner.
"""

from __future__ import annotations

import os
import signal
import sys


def main(argv: list[str]) -> int:
    record, script = argv[1], argv[2:]
    pid = os.fork()
    if pid == 0:
        try:
            os.execv(sys.executable, [sys.executable, *script])
        except OSError as exc:
            print(f"warden: {sys.executable}: {exc}", file=sys.stderr, flush=True)
        os._exit(127)  # as a shell says "command not found"
    # A signal meant for the cell's processes (a cell's os.killpg(0, SIGINT)) must not end the
    # warden before the daemon: it would leave no record.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _, status, usage = os.wait4(pid, 0)
    # (os.waitstatus_to_exitcode is Python 3.9+; a sandbox's Python may be 3.8)
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    with open(record, "w") as out:
        out.write(f"{code} {usage.ru_maxrss}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
