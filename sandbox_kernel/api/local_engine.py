"""What a client may rely on about the local engine's sandboxes beyond the CreateOS API: how a
sandbox names the host, and which of the host's files it sees where the host has them. The
engine (local/) is built on these, and the kernel's side uses them (host_pip_settings)."""

# The name by which a sandbox asks the proxy for the host's loopback (127.0.0.1 inside a
# sandbox is its own loopback, as on CreateOS). Like any non-public destination it needs
# a rule: the name itself, or 127.0.0.1 with the port.
HOST_ALIAS = "host.sandbox.internal"

# Host /etc entries a Python sandbox reasonably needs, bound read-only at the same path
# (as is /usr); nothing with secrets in it.
HOST_ETC = ("ssl", "ca-certificates", "alternatives", "ld.so.cache", "localtime",
            "mime.types", "fonts", "os-release", "debian_version")
