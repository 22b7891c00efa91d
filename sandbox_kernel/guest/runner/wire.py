"""The runner's wire format: events and replies as the ASCII JSON lines it writes (a stream
event's text last, see protocol.py), files written whole, and checks of request fields."""
from __future__ import annotations

import base64
import json
import os

from .. import protocol


def _json_default(value: object) -> object:
    # Jupyter carries binary mime data (image/png, ...) as base64 text.
    if isinstance(value, (bytes, bytearray)):
        return base64.b64encode(value).decode("ascii")
    return repr(value)


def encode_line(obj: dict) -> bytes:
    # ensure_ascii: the exec API hands our stdout over as text; keep it pure ASCII.
    text = obj.get("text") if obj.get(protocol.TYPE) == protocol.STREAM else None
    if isinstance(text, str):
        # A stream event's text goes last (the kernel publishes it as written here: see
        # protocol.py), escaped on its own, which is faster than within the dict.
        head = json.dumps({key: value for key, value in obj.items() if key != "text"}, default=_json_default)
        return b"".join((head[:-1].encode("ascii"), b', "text": ', _json_string(text), b"}\n"))
    return (json.dumps(obj, ensure_ascii=True, default=_json_default) + "\n").encode("ascii")


# Below about this many characters json's encoder is quicker than the scans of _json_string
# (measured: equal at 8 KiB, the scans 2.4 times quicker at 64 KiB).
_SCAN_FROM = 8192
# What JSON escapes in ASCII text: control characters, DEL (json.dumps escapes it too), the
# quote and the backslash. The common ones are replaced in _json_string; a text with any
# of the rare ones is left to json's encoder.
_COMMON_ESCAPES = ((b"\\", b"\\\\"), (b'"', b'\\"'), (b"\n", b"\\n"), (b"\r", b"\\r"), (b"\t", b"\\t"))
_RARE_ESCAPES = tuple(bytes([code]) for code in (*range(0x20), 0x7F) if code not in b"\n\r\t")


def _json_string(text: str) -> bytes:
    """`text` as a JSON string, byte for byte what json.encoder.encode_basestring_ascii writes.

    That encoder looks at one character at a time (about 4 ms per MiB here, the runner's
    largest cost in a long print). Output is mostly printable ASCII with newlines, for which
    memchr-speed scans and replaces do the same work in about a quarter of the time.
    """
    if len(text) >= _SCAN_FROM and text.isascii():
        raw = text.encode("ascii")
        if not any(rare in raw for rare in _RARE_ESCAPES):
            for plain, escaped in _COMMON_ESCAPES:  # the backslash first: the others add some
                raw = raw.replace(plain, escaped)
            return b"".join((b'"', raw, b'"'))
    return json.encoder.encode_basestring_ascii(text).encode("ascii")


def is_int_at_least(value: object, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def write_json_atomically(path: str, obj: dict) -> None:
    temporary = "%s.%d.tmp" % (path, os.getpid())
    with open(temporary, "w") as output:
        json.dump(obj, output)
    os.replace(temporary, path)
