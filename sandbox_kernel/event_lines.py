"""The runner's event lines, as the kernel reads them: one JSON object per line.

A stream event's text is most of what a busy cell sends, and publishing it on IOPub would
encode it to JSON a second time (jupyter_client's packer), after the runner already did.
The runner writes a stream event's ``text`` as its last field (runner_protocol), so the
kernel keeps that field's JSON string as it came and builds the message content around it
(``stream_content``): the text is decoded once (to count it and to check it) and never
encoded again. A line from the sandbox is never trusted: the kept string is used only when
the JSON decoder itself read it as exactly one string, so the content built around it is
valid JSON with exactly that text; any other line is parsed whole, as before.
"""

from __future__ import annotations

import json
from typing import Any

from . import runner_protocol as protocol

# How the runner's encoder (json.dumps, default separators) writes the last field's key.
_TEXT_FIELD = ', "text": '
# The key under which a parsed stream event keeps its text's JSON string. Not a string, so
# no key of a line from the sandbox can be it.
_ENCODED_TEXT = object()


def parse_event_line(line: str) -> Any:
    """The value of one line (ValueError if it is not JSON)."""
    head, field, encoded = line.partition(_TEXT_FIELD)
    if field and encoded.endswith("}"):
        encoded = encoded[:-1]
        try:
            event, text = json.loads(head + "}"), json.loads(encoded)
        except ValueError:
            event = text = None
        if (isinstance(event, dict) and event.get(protocol.TYPE) == protocol.STREAM and isinstance(text, str)
                and "text" not in event):
            event["text"] = text
            event[_ENCODED_TEXT] = encoded
            return event
    return json.loads(line)


def stream_content(event: dict[str, Any]) -> dict[str, Any] | bytes:
    """A stream event's message content: packed already (JSON bytes) when the event came
    from parse_event_line with its text's JSON string, else a dict for the session to pack."""
    encoded = event.get(_ENCODED_TEXT)
    if encoded is None:
        return {"name": event["name"], "text": event["text"]}
    # A lone surrogate (a line that reached us through JSON, as the exec API's stdout does,
    # can hold one) has no UTF-8: written as its JSON escape, which is what it was.
    text = encoded.encode("utf-8", "backslashreplace")
    return b'{"name": %s, "text": %s}' % (json.dumps(event["name"]).encode(), text)
