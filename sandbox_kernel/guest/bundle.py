"""What of the guest package each sandbox program needs, where it goes, how it starts, and
the runner bundle's content hash.

One definition for both sides. On the host the session uploads `runner_files()` under its
runner directory and starts the daemon with `runner_path()`; the local engine mounts
`agent_files()` read-only for its agent. In a sandbox the guest package is called PACKAGE
(its modules import each other relatively, so the name is free): user code that imports a
module named like one of ours (``protocol``, ``daemon``...) gets its own, never ours.

The warm pool keys its members by the runner bundle's hash (sandbox/pool.py); the runner,
started from its uploaded copy, hashes its own copy with the same function and reports
the hash in its info (runner/daemon.py). A runner whose hash is not the kernel's (or that
reports none: it predates this file) runs another bundle, i.e. another sandbox-kernel
version.

Part of the bundle (it hashes itself too): stdlib-only, Python 3.8+.
"""

import os

# The guest package's name in a sandbox.
PACKAGE = "sandbox_kernel_guest"
# The runner's info field that carries the hash.
INFO_FIELD = "bundle"
# The subpackages of the two programs; each also needs the package's top-level modules.
RUNNER = "runner"
AGENT = "agent"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))  # the package's on the host, its copy in a sandbox


def _modules(package_dir: str, part: str) -> list:
    """The paths, relative to package_dir, of the package's top-level modules and of every
    module of its subpackage `part`, sorted: the same list on the host and in a sandbox,
    where only these were uploaded."""
    found = [name for name in os.listdir(package_dir) if name.endswith(".py")]
    for directory, subdirectories, names in os.walk(os.path.join(package_dir, part)):
        subdirectories[:] = [name for name in subdirectories if name != "__pycache__"]
        relative = os.path.relpath(directory, package_dir)
        found += [os.path.join(relative, name) for name in names if name.endswith(".py")]
    return sorted(found)


def _files(part: str) -> dict:
    return {PACKAGE + "/" + relative: os.path.join(_PACKAGE_DIR, relative) for relative in _modules(_PACKAGE_DIR, part)}


def runner_files() -> dict:
    """The runner's bundle: {path under the sandbox's runner directory: the file on the host}."""
    return _files(RUNNER)


def agent_files() -> dict:
    """The local engine's agent: {path under its mount point: the file on the host}."""
    return _files(AGENT)


def prepare_command(root: str) -> str:
    """A shell command making `root` ready for runner_files(): the directories made, and a
    previous upload removed (a file an older version had and this one has not would stay
    in the hash). A running daemon has imported all its modules: it keeps working."""
    directories = sorted({os.path.dirname(path) for path in runner_files()})
    return "rm -rf %s/%s && mkdir -p %s" % (root, PACKAGE, " ".join("%s/%s" % (root, d) for d in directories))


def runner_path(root: str) -> str:
    """What the sandbox's Python runs to start the daemon (`PYTHON PATH serve DIR`): the
    runner package's directory, whose __main__.py imports the daemon as a package module."""
    return "%s/%s/%s" % (root, PACKAGE, RUNNER)


def client_path(root: str) -> str:
    """The runner's light client (`PYTHON -I -S PATH ...`), a script of built-in imports only."""
    return "%s/%s/%s/client.py" % (root, PACKAGE, RUNNER)


def agent_path(root: str) -> str:
    """What starts the agent (`PYTHON -I -S PATH ...`) under the agent files' mount point."""
    return "%s/%s/%s/run_agent.py" % (root, PACKAGE, AGENT)


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


def bundle_hash(package_dir: str) -> str:
    """The content hash of the runner bundle's files in `package_dir` (a copy of the guest
    package): it changes when any of them changes (their paths and lengths are hashed too,
    so content cannot shift between files)."""
    digest = _sha256()
    for relative in _modules(package_dir, RUNNER):
        with open(os.path.join(package_dir, relative), "rb") as file:
            content = file.read()
        digest.update(b"%s\0%d\0" % (relative.encode(), len(content)))
        digest.update(content)
    return digest.hexdigest()[:16]


_own_hash = ""


def own_hash() -> str:
    """The hash of the bundle this process was started from: the package this module is
    part of (on the host, or the runner's copy in a sandbox), read at the first call."""
    global _own_hash
    if not _own_hash:
        _own_hash = bundle_hash(_PACKAGE_DIR)
    return _own_hash


def runs_this_bundle(info: dict) -> bool:
    """Whether a runner's info (its INFO_FIELD may be missing: an older runner) says it runs
    the bundle this process was started from."""
    return isinstance(info, dict) and info.get(INFO_FIELD) == own_hash()
