"""The kernel's reading of runner event lines (sandbox_kernel/sandbox/event_lines.py): a stream
event's text is published as the runner encoded it, and no line from the sandbox, however
forged, can make the kernel publish anything but valid JSON of what json.loads reads."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from sandbox_kernel.sandbox.event_lines import parse_event_line, stream_content

TRICKY_TEXT = 'plain, "quoted", back\\slash, tab\t, bell\x07, é, 漢字, 🙂, lone \ud800, "text": "x"}\n'


def as_runner_writes(text: str, **fields: Any) -> str:
    """A channel line as the runner writes one (see runner/wire.py encode_line): the cell's tag, then the
    event's fields, the text last, escaped to ASCII on its own."""
    head = json.dumps({"cell": "c-1", "seq": 3, "type": "stream", "name": "stdout", **fields})
    return head[:-1] + ', "text": ' + json.encoder.encode_basestring_ascii(text) + "}"


def fields_of(event: dict[Any, Any]) -> dict[str, Any]:
    """The event as JSON has it (without what the kernel keeps for itself)."""
    return {key: value for key, value in event.items() if isinstance(key, str)}


def check_agrees_with_json(line: str) -> Any:
    """parse_event_line reads `line` as json.loads does, and a stream event's content is
    valid JSON of exactly its name and text. Returns the event (None for a line that is not
    JSON)."""
    try:
        expected = json.loads(line)
    except ValueError:
        with pytest.raises(ValueError):
            parse_event_line(line)
        return None
    event = parse_event_line(line)
    if not isinstance(event, dict):
        assert event == expected
        return event
    assert fields_of(event) == expected
    if event.get("type") == "stream" and "name" in event and "text" in event:
        content = stream_content(event)
        packed = content if isinstance(content, bytes) else json.dumps(content).encode()
        assert json.loads(packed) == {"name": event["name"], "text": event["text"]}
    return event


@pytest.mark.parametrize("fields", [{}, {"parent": 'msg-"1"'}])
def test_the_runners_stream_text_is_published_as_it_wrote_it(fields: dict[str, Any]) -> None:
    line = as_runner_writes(TRICKY_TEXT, **fields)
    event = check_agrees_with_json(line)
    content = stream_content(event)
    assert isinstance(content, bytes)  # packed already: the text is not encoded again
    assert json.encoder.encode_basestring_ascii(TRICKY_TEXT).encode() in content
    assert json.loads(content) == {"name": "stdout", "text": TRICKY_TEXT}


@pytest.fixture
def runner() -> Any:
    """The runner's wire format (sandbox_kernel/guest/runner/wire.py)."""
    from sandbox_kernel.guest.runner import wire

    return wire


@pytest.mark.parametrize("text", [TRICKY_TEXT, TRICKY_TEXT * 300, "long printable line\n" * 1000])
def test_the_runner_writes_stream_text_last_and_escaped_as_expected(runner: Any, text: str) -> None:
    """What the runner's encoder makes of a stream event is the line the fast path expects."""
    written = runner.encode_line({"seq": 3, "type": "stream", "name": "stdout", "text": text, "parent": "p"})
    line = '{"cell": "c-1", ' + written.decode("ascii").rstrip("\n")[1:]
    assert line == as_runner_writes(text, parent="p")


def test_the_runners_escaping_of_long_text_is_json_encoders(runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """wire._json_string escapes long ASCII text with scans and replaces of its own: for
    texts of every character JSON escapes, and others, it writes what json's encoder writes."""
    shuffle = random.Random(7)
    alphabet = [chr(code) for code in range(0x80)] + ["é", "漢", "🙂", "\ud800"]
    shortest = runner._SCAN_FROM  # shorter texts are left to json's encoder
    texts = [TRICKY_TEXT * 400, ("x" * 1023 + "\n") * 20] + [
        "".join(shuffle.choices(alphabet, k=shuffle.choice([10, shortest - 1, shortest, 2 * shortest])))
        for _ in range(300)]
    texts += ["".join(shuffle.choices("ab \n\r\t\\\"", k=shortest)) + rare for rare in alphabet]
    for text in texts:
        assert runner._json_string(text) == json.encoder.encode_basestring_ascii(text).encode("ascii")

    # The check above must not pass by never taking the scanning path: without json's
    # encoder, typical long output is still escaped, and correctly.
    def unavailable(text: str) -> str:
        raise AssertionError("json's encoder was used")

    monkeypatch.setattr(json.encoder, "encode_basestring_ascii", unavailable)
    printed = 'a "quoted" line, a back\\slash,\ta tab\r\n' * (runner._SCAN_FROM // 20)
    assert json.loads(runner._json_string(printed)) == printed


@pytest.mark.parametrize("line", [
    # a field after the text: the text's JSON would carry it into the content
    '{"type": "stream", "name": "stdout", "text": "a", "evil": {"x": 1}}',
    '{"type": "stream", "name": "stdout", "text": "a", "text": "b"}',
    '{"text": "a", "type": "stream", "name": "stdout", "text": "b"}',
    '{"type": "stream", "name": "stdout", "text": "a\\q"}',  # not a JSON escape
    '{"type": "stream", "name": "stdout", "text": "a\tb"}',  # a raw control character
    '{"type": "stream", "name": "stdout", "text": "a"} trailing',
    '{"type": "stream", "name": "stdout", "text": 7}',
    '{"type": "stream", "name": {"nested": ["x"]}, "text": "a"}',
    '{"type": "display_data", "name": "stdout", "text": "a"}',
    '{"type": "stream", "name": "stdout", "text": "a\\"}, \\"x\\": \\"y"}',
    '{"type": "stream", "name": "stdout, "text": "a"}',
    '["not", "an", "object", "text": "a"}',
    '{"type": "stream", "name": "stdout", "text": "é raw"}',
    '{"type": "stream", "name": "stdout", "text": "lone \ud800 and \udcff raw"}',
    # characters of several bytes (or none, a lone surrogate) before the text
    '{"type": "stream", "name": "stdout", "parent": "ééé", "text": "a"}',
    '{"type": "stream", "parent": "\ud800\udcff\ud800", "name": "stdout", "text": "a"}',
])
def test_a_forged_line_is_read_as_json_reads_it(line: str) -> None:
    check_agrees_with_json(line)


def test_mangled_runner_lines_are_read_as_json_reads_them() -> None:
    """Lines from a runner that a cell replaced: an honest line with characters that matter
    to JSON inserted, deleted or swapped at random places (seeded: the same every run)."""
    honest = as_runner_writes('say "hi"\\n\n', parent="msg-1")
    significant = '"\\{}[]:, \tu0aé'
    shuffle = random.Random(13)
    packed_as_written = 0
    for _ in range(3000):
        chars = list(honest)
        for _ in range(shuffle.randint(1, 3)):
            spot = shuffle.randrange(len(chars))
            action = shuffle.randrange(3)
            if action == 0:
                chars.insert(spot, shuffle.choice(significant))
            elif action == 1:
                del chars[spot]
            else:
                chars[spot] = shuffle.choice(significant)
        event = check_agrees_with_json("".join(chars))
        if isinstance(event, dict) and event.get("type") == "stream" and "name" in event and "text" in event:
            packed_as_written += isinstance(stream_content(event), bytes)
    assert packed_as_written > 300  # the manglings that keep a valid stream line took the fast path
