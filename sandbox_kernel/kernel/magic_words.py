"""A magic line's words, with `{expr}` and `$name` filled in from the notebook's variables.

The variables live in the sandbox, so every filled-in value is untrusted: code in the sandbox
chooses it. The host therefore splits the line the user typed into words itself, asks the
sandbox only for the values of the expressions in it, and puts each value inside the word it
was written in. A value can never become more than that one word, never an option, never the
command, and never a host path outside the notebook's folder (`check_host_path`). The sandbox
sees the expressions and answers with a JSON list; anything else is refused.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

# How much the sandbox may answer for one line's values: a magic argument is a name, a rule
# or a path, and an answer past this is refused rather than held.
MAX_ANSWER = 64 * 1024
NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")

# Run in the sandbox (silently, no history): each expression's str() in the notebook's
# names, or null where it fails, as one JSON line. The helper is removed again so the
# notebook's namespace is left as it was.
VALUES_CODE = """\
def __sandbox_kernel_values(expressions, names):
    values = []
    for expression in expressions:
        try:
            values.append(str(eval(expression, names)))
        except Exception:
            values.append(None)
    return values
try:
    print(__import__("json").dumps(__sandbox_kernel_values(%(expressions)r, globals())), end="")
finally:
    del __sandbox_kernel_values
"""


class MagicLineError(Exception):
    """The line cannot be split, or the sandbox's answer for its values cannot be used."""


@dataclass(frozen=True)
class Expression:
    code: str
    typed: str  # as in the line: `{code}` or `$code`


Piece = str | Expression


@dataclass(frozen=True)
class Word:
    """One argument of a magic line; `from_sandbox` when a value of the sandbox is part of it."""

    text: str
    from_sandbox: bool = False
    literal_prefix: str = ""  # what the user typed before the first value (all of it if none)

    def is_option(self) -> bool:
        return self.text.startswith("-")

    def option_typed_by_user(self) -> bool:
        """`--name={x}` is an option the user wrote with a value of the sandbox: fine. A value
        that itself starts with `-` would be the sandbox choosing an option: not."""
        prefix = self.literal_prefix
        return prefix.startswith("-") and "=" in prefix


def split_words(line: str) -> list[list[Piece]]:
    """The line's words as the user typed them: split at blanks outside quotes and braces,
    quotes removed, `{expr}` and `$name` kept as expressions (`{{`, `}}` and `$$` stand for
    the characters themselves, as in IPython)."""
    words: list[list[Piece]] = []
    pieces: list[Piece] = []
    literal: list[str] = []
    in_word = False
    quote: str | None = None
    i = 0

    def flush_literal() -> None:
        if literal:
            pieces.append("".join(literal))
            literal.clear()

    while i < len(line):
        char = line[i]
        if quote is None and char.isspace():
            if in_word:
                flush_literal()
                words.append(pieces)
                pieces = []
                in_word = False
            i += 1
            continue
        in_word = True
        if quote is None and char in "'\"":
            quote = char
            i += 1
        elif char == quote:
            quote = None
            i += 1
        elif line.startswith(("{{", "}}", "$$"), i):
            literal.append(char)
            i += 2
        elif char == "{":
            end = closing_brace(line, i)
            flush_literal()
            pieces.append(Expression(line[i + 1:end], line[i:end + 1]))
            i = end + 1
        elif char == "$" and (name := NAME.match(line, i + 1)):
            flush_literal()
            pieces.append(Expression(name.group(0), "$" + name.group(0)))
            i = name.end()
        else:
            literal.append(char)
            i += 1
    if quote is not None:
        raise MagicLineError("no closing quotation")
    if in_word:
        flush_literal()
        words.append(pieces)
    return words


def closing_brace(line: str, start: int) -> int:
    """Where the `{` at `start` closes, nested braces and quoted strings counted."""
    depth = 0
    quote: str | None = None
    for i in range(start, len(line)):
        char = line[i]
        if quote is not None:
            if char == quote:
                quote = None
        elif char in "'\"":
            quote = char
        elif char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return i
    raise MagicLineError("a '{' with no closing '}'")


def expressions_of(words: list[list[Piece]]) -> list[str]:
    """Each distinct expression once, in order of appearance."""
    seen: dict[str, None] = {}
    for pieces in words:
        for piece in pieces:
            if isinstance(piece, Expression):
                seen.setdefault(piece.code, None)
    return list(seen)


def parse_values(answer: str, expressions: list[str]) -> dict[str, str] | None:
    """The sandbox's answer checked: one string (or null, where evaluating failed) per
    expression. None when one failed: like IPython, the line is then used as typed."""
    if len(answer) > MAX_ANSWER:
        raise MagicLineError("the values of the line's expressions are too long")
    try:
        values = json.loads(answer)
    except ValueError:
        raise MagicLineError("the sandbox gave no usable values for the line's expressions") from None
    if (not isinstance(values, list) or len(values) != len(expressions)
            or not all(value is None or isinstance(value, str) for value in values)):
        raise MagicLineError("the sandbox gave no usable values for the line's expressions")
    if any(value is None for value in values):
        return None
    for expression, value in zip(expressions, values):
        if CONTROL.search(value):
            raise MagicLineError(f"the value of {{{expression}}} has control characters")
    return dict(zip(expressions, values))


def fill_in(words: list[list[Piece]], values: dict[str, str] | None) -> list[Word]:
    """Each word with its values put in; with no values, each expression as it was typed."""
    filled: list[Word] = []
    for pieces in words:
        text: list[str] = []
        prefix: str | None = None
        for piece in pieces:
            if isinstance(piece, str):
                text.append(piece)
            elif values is None:
                text.append(piece.typed)
            else:
                if prefix is None:
                    prefix = "".join(text)
                text.append(values[piece.code])
        joined = "".join(text)
        filled.append(Word(joined, prefix is not None, joined if prefix is None else prefix))
    return filled


def check_words(words: list[Word], has_command: bool) -> None:
    """A value of the sandbox is an argument, never the command and never an option."""
    if has_command and words and words[0].from_sandbox:
        raise MagicLineError("the command itself cannot come from a notebook variable")
    for word in words:
        if word.from_sandbox and word.is_option() and not word.option_typed_by_user():
            raise MagicLineError(f"a notebook variable's value cannot be an option: {word.text!r}")


def check_host_path(word: Word, notebook_dir: Path) -> None:
    """A host path that a value of the sandbox chose stays in the notebook's folder, symlinks
    resolved: the sandbox must not pick what of this machine is read or written."""
    if not word.from_sandbox:
        return
    folder = Path(os.path.realpath(notebook_dir))
    resolved = Path(os.path.realpath(folder / os.path.expanduser(word.text)))
    if resolved != folder and folder not in resolved.parents:
        raise MagicLineError(f"{word.text!r} comes from a notebook variable and is outside this "
                             f"notebook's folder: type such a path literally")
