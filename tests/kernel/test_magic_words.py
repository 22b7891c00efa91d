"""A magic line's words and the sandbox's values for its `{expr}` and `$name` (no kernel)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandbox_kernel.kernel.magic_words import (
    MAX_ANSWER,
    Expression,
    MagicLineError,
    Word,
    check_host_path,
    check_words,
    expressions_of,
    fill_in,
    parse_values,
    split_words,
)


def filled(line: str, values: dict[str, str] | None) -> list[Word]:
    return fill_in(split_words(line), values)


def test_words_are_split_at_blanks_outside_quotes_and_braces() -> None:
    assert split_words("attach {d['a b']} --fresh") == [["attach"], [Expression("d['a b']", "{d['a b']}")], ["--fresh"]]
    assert split_words("fork --name 'my fork'") == [["fork"], ["--name"], ["my fork"]]
    assert split_words("x{{y}} $$HOME") == [["x{y}"], ["$HOME"]]
    assert split_words("a/$name.attr/b") == [["a/", Expression("name.attr", "$name.attr"), "/b"]]
    assert split_words("{ {'k': 1}['k'] }") == [[Expression(" {'k': 1}['k'] ", "{ {'k': 1}['k'] }")]]
    with pytest.raises(MagicLineError):
        split_words("attach 'unclosed")
    with pytest.raises(MagicLineError):
        split_words("attach {unclosed")


def test_each_expression_is_asked_for_once() -> None:
    assert expressions_of(split_words("{a} $a {b} x{a}")) == ["a", "b"]


def test_a_value_stays_one_word_however_it_looks() -> None:
    words = filled("attach {x}", {"x": "name --destroy-previous"})
    assert [w.text for w in words] == ["attach", "name --destroy-previous"]
    assert words[1].from_sandbox and not words[0].from_sandbox


def test_a_value_can_be_neither_the_command_nor_an_option() -> None:
    with pytest.raises(MagicLineError, match="command itself"):
        check_words(filled("{c}", {"c": "status"}), has_command=True)
    with pytest.raises(MagicLineError, match="cannot be an option"):
        check_words(filled("attach {x}", {"x": "--destroy-previous"}), has_command=True)
    with pytest.raises(MagicLineError, match="cannot be an option"):
        check_words(filled("attach -{x}", {"x": "-fresh"}), has_command=True)
    # an option the user typed may take a value of the sandbox
    check_words(filled("fork --name={n}", {"n": "-odd-but-one-value"}), has_command=True)
    check_words(filled("attach {x}", {"x": "sb-123"}), has_command=True)


def test_without_values_the_line_is_as_typed() -> None:
    words = filled("attach {me.strip()} $me", None)
    assert [w.text for w in words] == ["attach", "{me.strip()}", "$me"]
    assert not any(w.from_sandbox for w in words)


def test_the_sandboxs_answer_is_checked() -> None:
    assert parse_values('["a", "b"]', ["x", "y"]) == {"x": "a", "y": "b"}
    assert parse_values('["a", null]', ["x", "y"]) is None  # one failed: the line as typed
    for answer in ('%egress open', '["a"]', '{"x": "a"}', '[1, 2]', '["a", "b", "c"]'):
        with pytest.raises(MagicLineError):
            parse_values(answer, ["x", "y"])
    with pytest.raises(MagicLineError, match="control characters"):
        parse_values(json.dumps(["a\n%upload /etc/shadow"]), ["x"])
    with pytest.raises(MagicLineError, match="too long"):
        parse_values(json.dumps(["a" * MAX_ANSWER]), ["x"])


def test_a_host_path_from_the_sandbox_stays_in_the_notebooks_folder(tmp_path: Path) -> None:
    folder = tmp_path / "notebook"
    (folder / "data").mkdir(parents=True)
    (folder / "escape").symlink_to(tmp_path)
    inside = [Word("data/x.csv", True), Word("x.csv", True), Word("/etc/passwd", False), Word(".", True)]
    for word in inside:
        check_host_path(word, folder)
    for text in ("/etc/passwd", "../secret", "~/.ssh/id_rsa", "escape/secret", "data/../../secret"):
        with pytest.raises(MagicLineError, match="outside this notebook's folder"):
            check_host_path(Word(text, True), folder)
