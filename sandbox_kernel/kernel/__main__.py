"""`python -m sandbox_kernel.kernel -f CONNECTION_FILE`: what the kernelspec starts."""
import sys

if __name__ == "__main__":
    # First of all: a client connecting meanwhile waits in these ports' backlogs, not for
    # zmq's next retry (see early_listen).
    from sandbox_kernel.kernel import early_listen
    from sandbox_kernel.paths import connection_file_argument

    early_listen.listen(connection_file_argument(sys.argv[1:]))

    # httpx's __init__ imports its command-line client, which imports rich, click and
    # pygments when they are installed (Jupyter installs them): ~40 ms of the start's CPU
    # and 4 MiB of this process's PSS, for a `main` the kernel never calls. A None entry
    # makes that import fail as if they were missing; httpx then defines its own stub
    # `main` (its __init__'s `except ImportError`) and everything else is unchanged.
    sys.modules.setdefault("httpx._main", None)

    # Begin making the sandbox now, while ipykernel is imported (about as long); the
    # kernel takes it over at boot.
    from sandbox_kernel.sandbox import early_start

    early_start.begin(sys.argv[1:])

    from sandbox_kernel.kernel.app import main

    main()
