"""What a sandbox session tells the kernel went wrong: one line each, for the notebook user."""

from __future__ import annotations


class SessionError(Exception):
    """Something the notebook user should read as one line."""


class RunnerDied(SessionError):
    """The runner (the notebook's Python) died: the kernel says why and restarts, keeping
    the sandbox, as a frontend expects when a kernel's Python dies."""
