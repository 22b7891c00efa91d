"""What starts an agent: bwrap runs this file as a sandbox's main program, and a fork's
agent is exec'd from it too (agent.py). Python compiles a script from its source at
every start, while an imported module comes from the bytecode the engine binds beside
it (local/bwrap.py `bytecode`): so the script is this handful of lines, and the agent's
code, its protocol included, lives in agent.py. Stdlib only.

    python -I -S <mount>/<package>/agent/run_agent.py SOCKET WORKDIR LISTEN_FD
"""

import ctypes

if __name__ == "__main__":
    # Before anything else, the imports included: an agent starts dumpable (exec makes it
    # so) while it already holds its listening socket, and a dumpable process is open to the
    # sandbox's code (see agent.set_dumpable). A fork's agent starts while that code runs.
    if ctypes.CDLL(None).prctl(4, 0, 0, 0, 0) != 0:  # PR_SET_DUMPABLE
        raise SystemExit("agent: prctl(PR_SET_DUMPABLE) failed")

    import importlib
    import os
    import sys

    # The agent is a module of the guest package mounted in the sandbox
    # (<mount>/<package>/agent/): the mount point goes on sys.path (-I leaves even the
    # script's directory out).
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, os.path.dirname(package_dir))
    # asyncio imports ssl where it can, and with it OpenSSL's state: ~2 MiB PSS in every
    # sandbox's agent, which speaks no TLS (egress is spliced as raw bytes). Blocked here,
    # in the agent's own interpreter only: what it starts is a new process.
    sys.modules["ssl"] = None
    agent = importlib.import_module(os.path.basename(package_dir) + ".agent.agent")
    sys.exit(agent.main(sys.argv))
