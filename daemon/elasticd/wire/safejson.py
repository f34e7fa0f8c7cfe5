"""JSON that someone else wrote: decoded within bounds, or refused with one exception.

A stdlib-only leaf (the CLI may import it).  Every value the daemon reads from the store,
a file a job can write, a worker's channel or a socket goes through :func:`loads`, so no
such value can raise anything but :class:`Undecodable`: not a ``RecursionError`` from
``"[" * 100000``, not an ``OverflowError`` from ``1e999`` or a 4000-digit integer, not a
``UnicodeDecodeError``.  What it returns is nested at most ``max_depth`` deep, holds only
finite numbers, integers within 64 bits and valid Unicode, so re-encoding it (a MAC over
its canonical form, a reply) cannot fail either.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64  # no record, request or file of ours nests deeper than a few levels
MAX_INT = 1 << 63  # versions, times in microseconds, sizes: all far inside this


class Undecodable(ValueError):
    """The bytes are not JSON within the bounds; the message says why, in a few words."""


def loads(raw: bytes | bytearray | str, *, max_bytes: int, max_depth: int = MAX_DEPTH) -> Any:
    """The JSON value in ``raw``, or :class:`Undecodable`.  ``max_bytes`` bounds the input
    (checked before any parsing), ``max_depth`` the nesting of lists and objects (checked
    before parsing too: the parser recurses once a level, and near Python's recursion limit
    any finalizer that the garbage collector runs meanwhile fails)."""
    if len(raw) > max_bytes:
        raise Undecodable(f"{len(raw)} bytes, more than {max_bytes}")
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    except UnicodeDecodeError:
        raise Undecodable("not UTF-8") from None
    if _deeper_than(text, max_depth):
        raise Undecodable(f"nested more than {max_depth} deep")
    try:
        value = json.loads(
            text, parse_constant=_no_constant, parse_float=_finite_float, parse_int=_bounded_int
        )
    except RecursionError:  # a max_depth near Python's recursion limit
        raise Undecodable(f"nested more than {max_depth} deep") from None
    except Undecodable:  # the hooks' refusals
        raise
    except ValueError as exc:  # JSONDecodeError; int()'s digit limit
        raise Undecodable(f"not JSON: {_short(exc)}") from None
    if (not text.isascii() or "\\u" in text) and _SURROGATE.search(text):  # ~20 ms a MB
        _check(value, max_depth)
    return value


_SURROGATE = re.compile("\\\\u[dD][89abcdefABCDEF]|[\ud800-\udfff]")  # escaped, or in a str given
# A string, to its closing quote or else to the end (JSON fails there, so nothing after it
# nests): wherever its loop stops, the rest matches, so nothing backtracks: linear time.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*\\?(?:"|\Z)', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")


def _deeper_than(text: str, max_depth: int) -> bool:
    """Whether the text nests deeper than ``max_depth``, its brackets counted outside its
    strings as a JSON parser reads them, up to where it would fail (or further: then it
    fails either way)."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    depth = 0
    for bracket in _NOT_BRACKET.sub("", _STRING.sub("", text)):
        if bracket in "[{":
            depth += 1
            if depth > max_depth:
                return True
        else:
            depth -= 1
            if depth <= 0:  # the value ended (or never began): JSON fails at what follows
                return False
    return False


def _no_constant(name: str) -> Any:
    raise Undecodable(f"{name} is not a number JSON allows")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Undecodable(f"number {_short(text)} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > 20:  # before int(): a huge digit string is slow to convert
        raise Undecodable(f"integer {_short(text)} is out of range")
    value = int(text)
    if not -MAX_INT <= value < MAX_INT:
        raise Undecodable(f"integer {text} is out of range")
    return value


def _check(value: Any, max_depth: int) -> None:
    """Depth and text, without recursion: a list holds (item, depth) pairs still to look at."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(item)
        elif isinstance(item, (dict, list)):
            if depth >= max_depth:
                raise Undecodable(f"nested more than {max_depth} deep")
            if isinstance(item, dict):
                stack.extend((key, depth) for key in item)
                stack.extend((v, depth + 1) for v in item.values())
            else:
                stack.extend((v, depth + 1) for v in item)


def _check_text(text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise Undecodable(
            f"text {_short(text)!r} is not valid Unicode (a lone surrogate)"
        ) from None


def _short(text: object, limit: int = 60) -> str:
    words = str(text)
    return words if len(words) <= limit else words[:limit] + "..."
