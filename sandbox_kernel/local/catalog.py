"""The local engine's root filesystems, under their own names and CreateOS's.

Vendor examples all ask for CreateOS's catalog names (`devbox:1`); the engine accepts
them, runs the closest local rootfs, and says in `/v1/rootfs` what each name means here.
A name whose point the engine cannot honour (`desktop:1` needs a graphical session) is
refused with the reason, never quietly swapped for something else.
"""

from __future__ import annotations

from sandbox_kernel.api.models import RootfsCatalog, RootfsEntry

HOST_PYTHON = "host-python"
# Python with its standard library only, as on a bare CreateOS rootfs (devbox:1 has
# python3, maybe no IPython): the runner's plain mode, and a smaller surface.
PYTHON_STDLIB = "python-stdlib"

LOCAL = {
    HOST_PYTHON: "the host's /usr and the engine's Python environment, read-only",
    PYTHON_STDLIB: "the same without any installed package: Python's standard library only",
}
# CreateOS catalog name -> the local rootfs that runs it.
ALIASES = {
    "devbox:1": HOST_PYTHON,  # bash, GNU timeout, python3, curl: the host's /usr has them
}
# CreateOS catalog names the engine refuses, and why.
UNSUPPORTED = {
    "desktop:1": "the local engine has no graphical session (computer use is not supported)",
}


class UnknownRootfs(ValueError):
    """A rootfs the engine does not run; `code` is the JSend machine code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


def local_rootfs(name: str) -> str:
    """The local rootfs that runs `name` (a local name or a CreateOS catalog alias)."""
    if name in LOCAL:
        return name
    if name in ALIASES:
        return ALIASES[name]
    if name in UNSUPPORTED:
        raise UnknownRootfs(f"rootfs {name!r} is not supported: {UNSUPPORTED[name]}",
                            "rootfs_unsupported")
    raise UnknownRootfs(f"unknown rootfs {name!r}: see GET /v1/rootfs", "unknown_rootfs")


CATALOG = RootfsCatalog(
    rootfs=[*LOCAL, *ALIASES], default=HOST_PYTHON,
    entries=[*(RootfsEntry(name=name, description=text) for name, text in LOCAL.items()),
             *(RootfsEntry(name=alias, description=f"runs as {target} on the local engine: {LOCAL[target]}")
               for alias, target in ALIASES.items())])
