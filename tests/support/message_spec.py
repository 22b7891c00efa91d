"""The Jupyter messaging protocol (5.4) as checks: what each message a kernel sends must hold.

Written from the protocol's documentation (messaging.html), for the message types these
tests receive; a message of an unknown type only has its header checked.
"""

from __future__ import annotations

from typing import Any

HEADER = {"msg_id": str, "msg_type": str, "username": str, "session": str, "version": str}
MIME_BUNDLE = {"data": dict, "metadata": dict}

# msg_type: {field: type, or a tuple of allowed values}
CONTENT: dict[str, dict[str, Any]] = {
    "status": {"execution_state": ("busy", "idle", "starting")},
    "execute_input": {"code": str, "execution_count": int},
    "stream": {"name": ("stdout", "stderr"), "text": str},
    "display_data": {**MIME_BUNDLE, "transient": dict},
    "update_display_data": {**MIME_BUNDLE, "transient": dict},
    "execute_result": {**MIME_BUNDLE, "execution_count": int},
    "error": {"ename": str, "evalue": str, "traceback": list},
    "clear_output": {"wait": bool},
    "input_request": {"prompt": str, "password": bool},
    "kernel_info_reply": {"status": ("ok",), "protocol_version": str, "implementation": str,
                          "implementation_version": str, "language_info": dict, "banner": str},
    "interrupt_reply": {"status": ("ok", "error")},
    "shutdown_reply": {"status": ("ok", "error"), "restart": bool},
    "debug_reply": {"type": ("response",), "success": bool, "command": str, "request_seq": int},
    "debug_event": {"type": ("event",), "event": str, "seq": int},
}
# Kernel subshells (JEP 91): the replies on the control channel, when their status is "ok"
# (an error reply has status "error" and evalue).
SUBSHELL_REPLIES: dict[str, dict[str, Any]] = {
    "create_subshell_reply": {"subshell_id": str},
    "delete_subshell_reply": {},
    "list_subshell_reply": {"subshell_id": list},
}
PAYLOADS: dict[str, dict[str, Any]] = {
    "page": {"data": dict, "start": int},
    "set_next_input": {"text": str, "replace": bool},
    "ask_exit": {"keepkernel": bool},
    "edit_magic": {"filename": str},
}


def _check_fields(where: str, content: dict[str, Any], fields: dict[str, Any]) -> None:
    for name, expected in fields.items():
        assert name in content, f"{where}: no {name!r} in {content}"
        value = content[name]
        if isinstance(expected, tuple):
            assert value in expected, f"{where}: {name}={value!r}, not one of {expected}"
        else:
            assert isinstance(value, expected) and not (expected is int and isinstance(value, bool)), \
                f"{where}: {name}={value!r} is not {expected.__name__}"


def _check_bundle(where: str, bundle: dict[str, Any]) -> None:
    for mime, value in bundle["data"].items():
        assert "/" in mime, f"{where}: {mime!r} is not a mime type"
        if mime.startswith("text/") or mime.startswith("image/") and not mime.endswith("json"):
            assert isinstance(value, str), f"{where}: {mime} data must be text (base64 for images)"


def _check_execute_reply(content: dict[str, Any]) -> None:
    _check_fields("execute_reply", content, {"status": ("ok", "error", "aborted")})
    if content["status"] == "aborted":
        return
    _check_fields("execute_reply", content, {"execution_count": int})
    if content["status"] == "error":
        _check_fields("execute_reply", content, CONTENT["error"])
        return
    _check_fields("execute_reply", content, {"payload": list, "user_expressions": dict})
    for item in content["payload"]:
        assert item.get("source") in PAYLOADS, f"execute_reply: unknown payload {item}"
        _check_fields(f"{item['source']} payload", item, PAYLOADS[item["source"]])
    for key, result in content["user_expressions"].items():
        where = f"user_expressions[{key!r}]"
        _check_fields(where, result, {"status": ("ok", "error")})
        if result["status"] == "ok":
            _check_fields(where, result, MIME_BUNDLE)
            _check_bundle(where, result)
        else:
            _check_fields(where, result, CONTENT["error"])


def validate(msg: dict[str, Any]) -> None:
    """Raise AssertionError, naming the field, if msg breaks the protocol."""
    _check_fields("header", msg["header"], HEADER)
    assert isinstance(msg["parent_header"], dict) and isinstance(msg["metadata"], dict)
    msg_type, content = msg["header"]["msg_type"], msg["content"]
    assert msg["msg_type"] == msg_type
    if msg_type == "execute_reply":
        _check_execute_reply(content)
    elif msg_type in SUBSHELL_REPLIES:
        _check_fields(msg_type, content, {"status": ("ok", "error")})
        _check_fields(msg_type, content, SUBSHELL_REPLIES[msg_type] if content["status"] == "ok" else {"evalue": str})
        if msg_type == "list_subshell_reply" and content["status"] == "ok":
            assert all(isinstance(item, str) for item in content["subshell_id"]), f"{msg_type}: ids must be str"
    elif msg_type in CONTENT:
        _check_fields(msg_type, content, CONTENT[msg_type])
        if "data" in CONTENT[msg_type]:
            _check_bundle(msg_type, content)
        if msg_type == "update_display_data":
            assert isinstance(content["transient"].get("display_id"), str), "update_display_data needs a display_id"
        if msg_type == "error" or msg_type == "stream":
            assert all(isinstance(line, str) for line in content.get("traceback", []))
