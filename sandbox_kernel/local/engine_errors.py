"""The requests the local engine refuses, each with the HTTP status CreateOS would answer
(server.py turns them into JSend failures)."""

from __future__ import annotations


class EngineError(Exception):
    """A request the engine refuses; `status` is the HTTP status CreateOS would answer."""

    status = 400

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class SandboxStartFailed(EngineError):
    status = 500


class InvalidRequest(EngineError):
    status = 400


class NotFound(EngineError):
    status = 404


class TooLarge(EngineError):
    """An upload that does not fit the sandbox's disk (HTTP's 413 Content Too Large)."""

    status = 413


class Conflict(EngineError):
    status = 409


class ShuttingDown(EngineError):
    status = 503


class AgentLost(EngineError):
    status = 502


class EngineStopped(EngineError):
    status = 500
