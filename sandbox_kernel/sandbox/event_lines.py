"""The runner's event lines, as the kernel reads them: one JSON object per line.

A stream event's text is most of what a busy cell sends, and publishing it on IOPub would
encode it to JSON a second time (jupyter_client's packer), after the runner already did.
The runner writes a stream event's ``text`` as its last field (guest/protocol.py), so the
kernel keeps that field's JSON string as it came and builds the message content around it
(``stream_content``): the text is decoded once (to count it and to check it), where it
lies in the line, and never encoded again. A line from the sandbox is never trusted: the
kept string is used only when the JSON decoder itself read it as exactly one string, so the
content built around it is valid JSON with exactly that text; any other line is parsed
whole, as before.
"""

from __future__ import annotations

import json
from json.decoder import scanstring
from typing import Any

from sandbox_kernel.guest import protocol

# How the runner's encoder (json.dumps, default separators) writes the last field's key.
_TEXT_FIELD = ', "text": '
# The key under which a parsed stream event keeps its line and where its text's field
# starts. Not a string, so no key of a line from the sandbox can be it.
_TEXT_IN_LINE = object()


def parse_event_line(line: str) -> Any:
    """The value of one line (ValueError if it is not JSON)."""
    field = line.find(_TEXT_FIELD)
    start = field + len(_TEXT_FIELD)  # where the text's JSON string begins, at its quote
    if field >= 0 and line.startswith('"', start) and line.endswith('"}'):
        # The string is read where it is (a MiB, in a long print: a copy of it costs).
        try:
            event = json.loads(line[:field] + "}")
            text, end = scanstring(line, start + 1)
        except ValueError:
            event = None
        else:
            if end != len(line) - 1:  # the string ended before the line's last "}"
                event = None
        if (isinstance(event, dict) and event.get(protocol.TYPE) == protocol.STREAM
                and "text" not in event):
            event["text"] = text
            event[_TEXT_IN_LINE] = (line, field)
            return event
    return json.loads(line)


def stream_content(event: dict[str, Any]) -> dict[str, Any] | bytes:
    """A stream event's message content: packed already (JSON bytes) when the event came
    from parse_event_line with its line, else a dict for the session to pack."""
    kept = event.get(_TEXT_IN_LINE)
    if kept is None:
        return {"name": event["name"], "text": event["text"]}
    line, field = kept
    # The line's end from its text field on (`"text": "..."}`) is the content's end too.
    # A lone surrogate (a line that reached us through JSON, as the exec API's stdout does,
    # can hold one) has no UTF-8: written as its JSON escape, which is what it was.
    encoded = line.encode("utf-8", "backslashreplace")
    text_field = len(line[:field + 2].encode("utf-8", "backslashreplace"))  # in bytes: the head may not be ASCII
    return b'{"name": %s, ' % json.dumps(event["name"]).encode() + memoryview(encoded)[text_field:]
