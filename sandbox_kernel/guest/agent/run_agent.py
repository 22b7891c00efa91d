"""What starts an agent: bwrap runs this file as a sandbox's main program, and a fork's
agent is exec'd from it too (agent.py). Python compiles a script from its source at
every start, while an imported module comes from the bytecode the engine binds beside
it (local/bwrap.py `bytecode`): so the script is this handful of lines, and the agent's
code, its protocol included, lives in agent.py. Stdlib only.

    python -I -S run_agent.py SOCKET WORKDIR LISTEN_FD
"""

import ctypes

# Before anything else, the imports included: an agent starts dumpable (exec makes it so)
# while it already holds its listening socket, and a dumpable process is open to the
# sandbox's code (see agent.set_dumpable). A fork's agent starts while that code runs.
if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
    raise SystemExit("agent: prctl(PR_SET_DUMPABLE) failed")

import os  # noqa: E402 - after the line above
import sys  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # -I leaves the script dir out

import agent  # noqa: E402 - needs the path above

sys.exit(agent.main(sys.argv))
