"""Numbers read from text that someone else wrote (a command line, a request, a config, an
environment variable, a program's output, a record): one strict grammar, ASCII only.

Python's ``int()`` and ``float()`` take more than a number: underscores (``int("1_0")``
is 10), any Unicode decimal digit (Arabic-Indic ``"\\u0661\\u0660"`` is 10), whitespace
around it, a plus sign, and for ``float()`` also ``nan``, ``inf`` and ``infinity``.  So a
raw request for nnodes ``"1_0:2_0"`` was 10:20.  Here a whole number is ``[-]digits`` and
a decimal ``[-]digits[.digits][e[+-]digits]`` (or ``.digits``), digits being 0-9 and
nothing else, finite; anything else is a ValueError that names what was expected.
Numbers that are JSON values (a record's fields) are checked by type: an int is an int,
never a string.

Also here, for the CLI and the daemon alike: the Unix times a request may name.
"""

from __future__ import annotations

import math
import re

_WHOLE = re.compile(r"-?[0-9]+")
_DECIMAL = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")
MAX_DIGITS = 18  # a whole number fits a signed 64-bit integer
_MAX_DECIMAL = 64  # characters of a decimal: more is no number anyone means


def whole(text: str, *, signed: bool = False) -> int:
    """``text`` as a whole number (``-`` only when ``signed``); ValueError otherwise."""
    if (
        not isinstance(text, str)
        or not _WHOLE.fullmatch(text)
        or (text.startswith("-") and not signed)
    ):
        raise ValueError(f"expected a whole number (digits 0-9), got {text!r}")
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"expected a whole number of at most {MAX_DIGITS} digits, got {text!r}")
    return int(text)


def is_whole(text: str) -> bool:
    """Whether ``text`` is a non-negative whole number as :func:`whole` reads one."""
    try:
        whole(text)
    except ValueError:
        return False
    return True


def decimal(text: str, *, signed: bool = False) -> float:
    """``text`` as a finite number (``-`` only when ``signed``); ValueError otherwise."""
    if (
        not isinstance(text, str)
        or len(text) > _MAX_DECIMAL
        or not _DECIMAL.fullmatch(text)
        or (text.startswith("-") and not signed)
    ):
        raise ValueError(f"expected a number (digits 0-9, a point, an exponent), got {text!r}")
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a number within range, got {text!r}")
    return value


def json_int(value: object, what: str = "value") -> int:
    """A JSON value that must be a whole number (not a bool, not a string of digits)."""
    if type(value) is not int:
        raise ValueError(f"{what} must be a whole number, got {value!r}")
    return value


def json_number(value: object, what: str = "value") -> float:
    """A JSON value that must be a finite number (an int or a float, not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{what} must be a number, got {value!r}")
    return float(value)


# -- times ----------------------------------------------------------------------------------

EARLIEST = 0.0  # 1970-01-01T00:00:00Z: no job ran before
LATEST = 253402300799.0  # 9999-12-31T23:59:59Z: the last second a date can show


def check_time(seconds: float, what: str = "time") -> float:
    """Unix ``seconds`` within EARLIEST..LATEST; ValueError saying so otherwise."""
    if type(seconds) not in (int, float) or not EARLIEST <= seconds <= LATEST:
        raise ValueError(
            f"{what} must lie between 1970-01-01 and 9999-12-31 (unix seconds "
            f"{EARLIEST:.0f} to {LATEST:.0f}), got {seconds!r}"
        )
    return float(seconds)
