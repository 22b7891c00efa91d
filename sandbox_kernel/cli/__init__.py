"""The `sandbox-kernel` command: install, run, serve, ls, rm, gc, doctor."""
