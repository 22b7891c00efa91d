"""Typed errors of the CreateOS REST API client.

Every error carries what a caller needs to react (HTTP status, method, path, the server's text, a machine code,
the request id) and ``user_message()``: one clear line for a notebook user.

Security: no error ever holds request headers. Server text is passed through ``redact()`` by the client, so an API
key echoed back by a server does not reach a message, a repr or a traceback either.
"""

from __future__ import annotations

import email.utils
import time
from typing import Any, Iterable

__all__ = [
    "SandboxAPIError",
    "BadRequestError",
    "AuthenticationError",
    "PaymentRequiredError",
    "PermissionDeniedError",
    "NotFoundError",
    "ConflictError",
    "RateLimitError",
    "ServerError",
    "ServiceUnavailableError",
    "ProtocolError",
    "APITransportError",
    "APITimeoutError",
    "error_class_for_status",
    "parse_retry_after",
    "redact",
]

_MAX_TEXT = 300
_REDACTED = "***"


def redact(text: str, secrets: Iterable[str | None] = ()) -> str:
    """Replace every occurrence of each (non-trivial) secret in ``text``."""
    for secret in secrets:
        if secret and len(secret) >= 4 and secret in text:
            text = text.replace(secret, _REDACTED)
    return text


def _one_line(text: str, limit: int = _MAX_TEXT) -> str:
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 1] + "…"
    return text


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Parse a ``Retry-After`` header: delta-seconds or an HTTP-date. Returns seconds (>= 0) or None."""
    if value is None:
        return None
    value = value.strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        pass
    else:
        if seconds != seconds or seconds in (float("inf"), float("-inf")):  # NaN / inf
            return None
        return max(0.0, seconds)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    if when.tzinfo is None:  # an HTTP-date is always GMT
        import datetime as _dt

        when = when.replace(tzinfo=_dt.timezone.utc)
    current = time.time() if now is None else now
    return max(0.0, when.timestamp() - current)


class SandboxAPIError(Exception):
    """Base class of every error raised by :class:`sandbox_kernel.api.SandboxClient`.

    Attributes:
        status_code: HTTP status (None when no response was received).
        method, path: the request's method and URL path (no host, no query, never headers).
        message: the server's text (JSend ``message``, string ``data``, or ``data`` rendered ``k: v; ...``), or the
            HTTP reason phrase when the body had none.
        code: a machine code when the server sent one: JSend ``fail`` ``data.code`` (string) or JSend ``error``
            ``code`` (usually a number); None otherwise.
        request_id: ``X-Request-Id`` (fallback ``X-Fc-Request-Id``) of the response.
    """

    default_status: int | None = None

    def __init__(
        self,
        message: str = "request failed",
        *,
        status_code: int | None = None,
        method: str | None = None,
        path: str | None = None,
        code: str | int | None = None,
        request_id: str | None = None,
        data: Any = None,
    ) -> None:
        self.message = _one_line(message or "request failed", 2000)
        self.status_code = status_code if status_code is not None else self.default_status
        self.method = method
        self.path = path
        self.code = code
        self.request_id = request_id
        #: the JSend ``data`` of an error response (server text, already redacted by the client); may be None
        self.data = data
        super().__init__(self._format())

    def _format(self) -> str:
        where = " ".join(p for p in (self.method, self.path) if p)
        parts = []
        if where:
            parts.append(where)
        if self.status_code is not None:
            parts.append(f"HTTP {self.status_code}")
        parts.append(self.message)
        text = ": ".join(parts)
        if self.request_id:
            text += f" (request id {self.request_id})"
        return text

    def __str__(self) -> str:
        return self._format()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status_code={self.status_code!r}, method={self.method!r}, "
            f"path={self.path!r}, message={self.message!r}, code={self.code!r}, request_id={self.request_id!r})"
        )

    def __reduce__(self):  # keep pickling (e.g. across processes) working with keyword-only init
        return (
            _rebuild,
            (type(self), self.message, self.status_code, self.method, self.path, self.code, self.request_id),
            {"data": self.data, **{k: v for k, v in self.__dict__.items() if k == "retry_after"}},
        )

    def _suffix(self) -> str:
        return f": {_one_line(self.message)}" if self.message else ""

    def user_message(self) -> str:
        """One clear line for a notebook user (no traceback, no secrets)."""
        status = self.status_code if self.status_code is not None else "?"
        return _one_line(f"sandbox request failed ({status}){self._suffix()}")


def _rebuild(cls, message, status_code, method, path, code, request_id):
    return cls(message, status_code=status_code, method=method, path=path, code=code, request_id=request_id)


def _sandbox_id_from_path(path: str | None) -> str | None:
    if not path:
        return None
    parts = [p for p in path.split("/") if p]
    # .../v1/sandboxes/<id>[/...]  (a base-URL prefix may come first)
    for i, part in enumerate(parts[:-1]):
        if part == "sandboxes" and i > 0 and parts[i - 1] == "v1" and parts[i + 1] != "by-ip":
            from urllib.parse import unquote

            return unquote(parts[i + 1])
    return None


class BadRequestError(SandboxAPIError):
    """400 / 422: validation (unknown shape or rootfs, bad rule, relative file path, invalid transition...)."""

    default_status = 400

    def user_message(self) -> str:
        return _one_line(f"request rejected ({self.status_code}){self._suffix()}")


class AuthenticationError(SandboxAPIError):
    """401: missing, invalid or revoked API key."""

    default_status = 401

    def user_message(self) -> str:
        return "CreateOS rejected the API key (401): check CREATEOS_SANDBOX_API_KEY"


class PaymentRequiredError(SandboxAPIError):
    """402: out of credit (create, resume, fork, bandwidth recharge...). Not retryable."""

    default_status = 402

    def user_message(self) -> str:
        return "CreateOS account is out of credit (402): add credit to create, resume or fork sandboxes"


class PermissionDeniedError(SandboxAPIError):
    """403: authenticated but not allowed (quota, ACL, tenant mismatch)."""

    default_status = 403

    def user_message(self) -> str:
        return _one_line(f"CreateOS denied the request (403, quota or permission){self._suffix()}")


class NotFoundError(SandboxAPIError):
    """404: resource not found or not owned."""

    default_status = 404

    @property
    def sandbox_id(self) -> str | None:
        return _sandbox_id_from_path(self.path)

    def user_message(self) -> str:
        sid = self.sandbox_id
        path = self.path or ""
        # drop a server text that only repeats what the line already says
        suffix = "" if self.message.strip().lower() in ("not found", "sandbox not found") else self._suffix()
        if sid and path.rstrip("/").endswith("/files"):
            return _one_line(f"file or sandbox not found: {sid} (404){suffix}")
        if sid:
            return _one_line(f"sandbox not found: {sid} (404){suffix}")
        return _one_line(f"not found: {self.method or ''} {path} (404){suffix}".replace("  ", " "))


class ConflictError(SandboxAPIError):
    """409: invalid state transition or conflict (e.g. fork of a sandbox that is not paused)."""

    default_status = 409

    def user_message(self) -> str:
        return _one_line(f"not possible in the sandbox's current state (409){self._suffix()}")


class RateLimitError(SandboxAPIError):
    """429: rate limited. ``retry_after`` (seconds) comes from the ``Retry-After`` header when present."""

    default_status = 429

    def __init__(self, message: str = "rate limited", *, retry_after: float | None = None, **kwargs: Any) -> None:
        self.retry_after = retry_after
        super().__init__(message, **kwargs)

    def user_message(self) -> str:
        if self.retry_after is not None:
            wait = self.retry_after
            shown = f"{wait:.0f}" if wait >= 1 else f"{wait:.1f}"
            return f"rate limited by CreateOS (429), retry in {shown} s"
        return "rate limited by CreateOS (429), retry in a few seconds"


class ServerError(SandboxAPIError):
    """5xx: server or upstream error (502 is also a gateway timeout on long-held exec calls)."""

    default_status = 500

    def user_message(self) -> str:
        if self.status_code == 502:
            return _one_line(
                f"CreateOS gateway error (502, e.g. a long-held call timed out upstream){self._suffix()}"
            )
        return _one_line(f"CreateOS server error ({self.status_code}){self._suffix()}")


class ServiceUnavailableError(ServerError):
    """503: no host with capacity, API not configured, or not ready."""

    default_status = 503

    def user_message(self) -> str:
        return _one_line(f"CreateOS is temporarily unavailable (503){self._suffix()}")


class ProtocolError(SandboxAPIError):
    """The server answered something this client cannot understand: a non-JSend or non-JSON 2xx, an empty body where
    one was required, a redirect, a model that does not validate, or a bad NDJSON line."""

    def user_message(self) -> str:
        return _one_line(f"unexpected response from the sandbox server{self._suffix()}")


class APITransportError(SandboxAPIError):
    """The request could not be completed at the transport level (connect, read, write...), after retries."""

    def user_message(self) -> str:
        return _one_line(f"cannot reach the sandbox server{self._suffix()}")


class APITimeoutError(APITransportError):
    """The request timed out (connect, read, write or pool), after retries."""

    def user_message(self) -> str:
        return _one_line(f"the sandbox server did not answer in time{self._suffix()}")


_BY_STATUS: dict[int, type[SandboxAPIError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    402: PaymentRequiredError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    422: BadRequestError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def error_class_for_status(status_code: int) -> type[SandboxAPIError]:
    """The error class for an HTTP status (>= 400)."""
    cls = _BY_STATUS.get(status_code)
    if cls is not None:
        return cls
    if status_code >= 500:
        return ServerError
    return SandboxAPIError
