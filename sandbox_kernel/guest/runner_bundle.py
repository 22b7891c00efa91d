"""The runner's bundle: the files uploaded into every sandbox, and their content hash.

One definition for both sides. The session uploads exactly FILES (sandbox_kernel/session.py)
and the warm pool keys its members by their hash (pool.py); the runner, started from its
uploaded copy of them, hashes its own directory with the same function and reports the hash
in its info (runner.py). A runner whose hash is not the kernel's (or that reports none: it
predates this file) runs another bundle, i.e. another sandbox-kernel version.

Uploaded next to runner.py, so, like it: stdlib-only, Python 3.8+, imported as a sibling
module in the sandbox.
"""

import os

# Every file the sandbox runs, in one directory (the package's on the host, the runner's
# directory in the sandbox). This module hashes itself too: it is part of the bundle.
FILES = ("runner.py", "runner_fork.py", "runner_debug.py", "runner_protocol.py", "runner_client.py",
         "runner_bundle.py")
# The runner's info field that carries the hash.
INFO_FIELD = "bundle"


def _sha256():
    """SHA-256, preferably the interpreter's built-in one: hashlib's import loads OpenSSL
    (3 ms), which the runner would pay at every start."""
    try:
        from _sha2 import sha256  # Python 3.12+
    except ImportError:
        try:
            from _sha256 import sha256  # Python 3.8 to 3.11
        except ImportError:
            from hashlib import sha256
    return sha256()


def bundle_hash(directory: str) -> str:
    """The content hash of the bundle's files in `directory`: it changes when any of them
    changes (their names and lengths are hashed too, so content cannot shift between files)."""
    digest = _sha256()
    for name in FILES:
        with open(os.path.join(directory, name), "rb") as file:
            content = file.read()
        digest.update(b"%s\0%d\0" % (name.encode(), len(content)))
        digest.update(content)
    return digest.hexdigest()[:16]


_own_hash = ""


def own_hash() -> str:
    """The hash of the bundle this process was started from: the files next to this module
    (the package on the host, the runner's directory in the sandbox), read at the first call."""
    global _own_hash
    if not _own_hash:
        _own_hash = bundle_hash(os.path.dirname(os.path.abspath(__file__)))
    return _own_hash


def runs_this_bundle(info: dict) -> bool:
    """Whether a runner's info (its INFO_FIELD may be missing: an older runner) says it runs
    the bundle this process was started from."""
    return isinstance(info, dict) and info.get(INFO_FIELD) == own_hash()
