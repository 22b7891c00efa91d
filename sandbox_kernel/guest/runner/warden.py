"""The end of the runner daemon's warden: it records how the daemon ended and the most memory
it ever held, which its parent alone can learn.

The kernel starts the daemon under a shell that waits for it (sandbox/runner_setup.py:
watched), and that becomes this script once the daemon has ended:

    sh -c 'trap "" INT; python3 RUNNER serve DIR; exec python3 -I -S warden.py RECORD $?'

A waiting shell costs a sandbox about 0.15 MiB (PSS), where a Python waiting in wait4 cost
3.6 MiB. The peak is what the process learns with getrusage(RUSAGE_CHILDREN): the largest
resident size among the children it has waited for, their own waited-for children included,
kept across exec. The shell waited for the daemon and has no other child.

RECORD gets one line, "STATUS PEAK_KIB": STATUS is the shell's $?, the exit code, or 128+N if
signal N killed the daemon. The kernel reads it when the daemon died (runner_setup.py:
how_runner_ended) to say why the notebook's Python died. Stdlib only, Python 3.8+, started
with -I -S: it costs a bare interpreter's start, once per runner, after its end.
"""

import os
import resource
import sys

USAGE = "usage: warden.py RECORD STATUS   (STATUS: the daemon's, as the shell's $? says it)\n"


def main(argv: list) -> int:
    if len(argv) != 3 or not argv[2].isdigit():
        sys.stderr.write(USAGE)
        return 2
    record, status = argv[1], int(argv[2])
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    # Whole or not at all: the kernel may read the record as soon as it exists.
    partial = record + ".partial"
    with open(partial, "w") as out:
        out.write("%d %d\n" % (status, peak_kib))
    os.replace(partial, record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
