"""Programs that run inside local sandboxes (stdlib only); mounted read-only at /opt/sandbox-kernel."""
