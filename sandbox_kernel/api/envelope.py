"""JSend envelope helpers, used by both the server (builders) and the client (parser).

Builders::

    success(data)            -> {"status": "success", "data": data}
    fail(data)               -> {"status": "fail", "data": data}       (4xx; data: dict (may carry "code"), str or None)
    error(message, code)     -> {"status": "error", "message": ..., "code": ...}   (5xx / coded failures)
    paginated(items, total=, limit=, offset=) -> the doubly nested page payload to pass to success()

Client side: :func:`parse_response` turns an ``httpx.Response`` into the JSend ``data`` or raises the typed error of
:mod:`.errors`; :func:`unwrap_page` extracts items and pagination from a list payload (current and legacy shapes).
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Sequence

import httpx

from sandbox_kernel.api.errors import (
    ProtocolError,
    RateLimitError,
    SandboxAPIError,
    error_class_for_status,
    parse_retry_after,
    redact,
)
from sandbox_kernel.api.models import Pagination
from sandbox_kernel.api.wire import to_jsonable

__all__ = [
    "success",
    "fail",
    "error",
    "paginated",
    "to_jsonable",
    "parse_response",
    "error_from_response",
    "protocol_error",
    "request_id_of",
    "unwrap_page",
    "LEGACY_LIST_KEYS",
]

#: keys of the legacy list payloads ``{"shapes": [...]}`` etc.
LEGACY_LIST_KEYS = ("shapes", "templates", "disks")


# --------------------------------------------------------------------------------------------------------------
# Builders


def success(data: Any = None) -> dict[str, Any]:
    return {"status": "success", "data": to_jsonable(data)}


def fail(data: Any = None) -> dict[str, Any]:
    return {"status": "fail", "data": to_jsonable(data)}


def error(message: str, code: int | str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"status": "error", "message": message}
    if code is not None:
        body["code"] = code
    return body


def paginated(items: Sequence[Any], *, total: int, limit: int, offset: int) -> dict[str, Any]:
    """The ``data`` payload of a paginated route (pass it to :func:`success`)."""
    items = list(items)
    return {
        "data": to_jsonable(items),
        "pagination": {"total": total, "limit": limit, "offset": offset, "count": len(items)},
    }


# --------------------------------------------------------------------------------------------------------------
# Client-side parsing


def request_id_of(response: httpx.Response) -> str | None:
    return response.headers.get("x-request-id") or response.headers.get("x-fc-request-id") or None


def _path_of(response: httpx.Response, path: str | None) -> str | None:
    if path is not None:
        return path
    try:
        return response.request.url.path
    except RuntimeError:  # response without a request
        return None


def _method_of(response: httpx.Response, method: str | None) -> str | None:
    if method is not None:
        return method
    try:
        return response.request.method
    except RuntimeError:
        return None


def protocol_error(
    message: str,
    response: httpx.Response | None = None,
    *,
    method: str | None = None,
    path: str | None = None,
    secrets: Iterable[str | None] = (),
) -> ProtocolError:
    kwargs: dict[str, Any] = {"method": method, "path": path}
    if response is not None:
        kwargs.update(
            status_code=response.status_code,
            method=_method_of(response, method),
            path=_path_of(response, path),
            request_id=request_id_of(response),
        )
    return ProtocolError(redact(message, list(secrets)), **kwargs)


def _render_data(data: Any) -> str:
    if isinstance(data, dict) and isinstance(data.get("message"), str):
        return data["message"]  # the server's own sentence; a machine "code" is kept apart
    if isinstance(data, dict):
        parts = []
        for key in sorted(data, key=str):
            value = data[key]
            if not isinstance(value, str):
                value = json.dumps(value, ensure_ascii=False, default=str)
            parts.append(f"{key}: {value}")
        return "; ".join(parts)
    if isinstance(data, list):
        return "; ".join(str(v) for v in data)
    return str(data)


def _redact_deep(value: Any, secrets: list[str | None]) -> Any:
    if isinstance(value, str):
        return redact(value, secrets)
    if isinstance(value, list):
        return [_redact_deep(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: _redact_deep(v, secrets) for k, v in value.items()}
    return value


def error_from_response(
    response: httpx.Response,
    *,
    method: str | None = None,
    path: str | None = None,
    secrets: Iterable[str | None] = (),
) -> SandboxAPIError:
    """The typed error for a non-2xx response whose body has been read (JSend or not)."""
    secrets = list(secrets)
    status = response.status_code
    message: str | None = None
    code: str | int | None = None
    data: Any = None
    body: Any = None
    raw = response.content
    if raw:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            body = None
    if isinstance(body, dict):
        data = body.get("data")
        if isinstance(body.get("message"), str) and body["message"]:
            message = body["message"]
        top_code = body.get("code")
        if isinstance(top_code, (int, str)) and not isinstance(top_code, bool) and top_code not in ("", 0):
            code = top_code
        if isinstance(data, dict) and isinstance(data.get("code"), str) and data["code"]:
            code = data["code"]
        if message is None:
            if isinstance(data, str) and data:
                message = data
            elif isinstance(data, dict) and data:
                message = _render_data(data)
            elif isinstance(body.get("error"), str) and body["error"]:  # non-JSend {"error": "..."}
                message = body["error"]
            elif isinstance(body.get("detail"), str) and body["detail"]:  # e.g. FastAPI default errors
                message = body["detail"]
    elif isinstance(body, str) and body:
        message = body
    if message is None:
        message = response.reason_phrase or "request failed"
    kwargs: dict[str, Any] = dict(
        status_code=status,
        method=_method_of(response, method),
        path=_path_of(response, path),
        code=redact(code, secrets) if isinstance(code, str) else code,
        request_id=request_id_of(response),
        data=_redact_deep(data, secrets),
    )
    cls = error_class_for_status(status)
    message = redact(message, secrets)
    if cls is RateLimitError:
        return RateLimitError(message, retry_after=parse_retry_after(response.headers.get("retry-after")), **kwargs)
    return cls(message, **kwargs)


def parse_response(
    response: httpx.Response,
    *,
    method: str | None = None,
    path: str | None = None,
    secrets: Iterable[str | None] = (),
) -> Any:
    """The JSend ``data`` of a read response, or raise.

    * 2xx JSend ``success`` -> ``data`` (None if absent); 204/205 with an empty body -> None;
    * any other 2xx (empty, not JSON, not a JSend object, JSend status != success) -> :class:`ProtocolError`;
    * 3xx -> :class:`ProtocolError` (redirects are never followed);
    * >= 400 -> the typed :class:`SandboxAPIError` subclass.
    """
    secrets = list(secrets)
    status = response.status_code
    if 200 <= status < 300:
        raw = response.content
        if not raw.strip():
            if status in (204, 205):
                return None
            raise protocol_error(f"empty body on HTTP {status}", response, method=method, path=path)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            ctype = response.headers.get("content-type", "?")
            raise protocol_error(
                f"response is not JSON (content-type {ctype})", response, method=method, path=path
            ) from None
        if not isinstance(body, dict) or "status" not in body:
            raise protocol_error("response is not a JSend envelope", response, method=method, path=path)
        if body["status"] != "success":
            raise protocol_error(
                f"2xx response with JSend status {body['status']!r}",
                response,
                method=method,
                path=path,
                secrets=secrets,
            )
        return body.get("data")
    if 300 <= status < 400:
        raise protocol_error(f"unexpected redirect (HTTP {status})", response, method=method, path=path)
    raise error_from_response(response, method=method, path=path, secrets=secrets)


def unwrap_page(data: Any) -> tuple[list[Any], Pagination | None]:
    """Items and pagination of a list payload.

    Accepts ``{"data": [...], "pagination": {...}}`` (current), ``{"shapes"|"templates"|"disks": [...]}`` and a bare
    array (legacy; no pagination), and None (an empty list). Anything else -> :class:`ProtocolError`.
    """
    if data is None:
        return [], None
    if isinstance(data, list):
        return data, None
    if isinstance(data, dict):
        items = data.get("data")
        if isinstance(items, list):
            pag = data.get("pagination")
            pagination = None
            if isinstance(pag, dict):
                try:
                    pagination = Pagination.from_wire(pag)
                except ValueError:
                    raise ProtocolError("invalid pagination object") from None
            return items, pagination
        for key in LEGACY_LIST_KEYS:
            if isinstance(data.get(key), list):
                return data[key], None
    raise ProtocolError("list payload is neither a page, a legacy list nor an array")
