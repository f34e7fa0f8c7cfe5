"""Times on the command line (``usage --since/--until``), pure: an ISO date or time, local
unless it names its zone, or a time ago.  Nothing else: "yesterday" and "last week" are
refused with what is understood, rather than guessed at; nor a time before 1970 or after
9999 (``wire.numbers.check_time``, which the daemon applies too)."""

from __future__ import annotations

import argparse
import datetime
import math
import re
import time

from elasticd.wire.numbers import check_time

UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_AGO = re.compile(r"(\d+(?:\.\d+)?)([smhdw])", re.ASCII)
FORMS = (
    "an ISO date or time (2024-05-01, 2024-05-01T13:30, 2024-05-01 13:30:00+02:00, "
    "...Z for UTC) or a time ago (90s, 30m, 12h, 7d, 2w)"
)


def parse_when(text: str, now: float) -> float:
    """Unix seconds for ``text``: ``now`` less a time ago (``7d``), or an ISO 8601 date or
    date and time (a date alone is its midnight; without a zone, this machine's local
    time); "now" is now.  ValueError saying what is understood otherwise, or that the time
    lies outside 1970..9999."""
    text = text.strip()
    if text == "now":
        return now
    ago = _AGO.fullmatch(text)
    if ago:
        seconds = float(ago.group(1)) * UNITS[ago.group(2)]
        return check_time(now - seconds if math.isfinite(seconds) else -math.inf, repr(text))
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"expected {FORMS}, got {text!r}") from None
    try:
        stamp = moment.timestamp()  # naive: local time
    except (ValueError, OverflowError, OSError):  # a year this machine's clock cannot hold
        stamp = -math.inf if moment.year < 1970 else math.inf
    return check_time(stamp, repr(text))


def when(text: str) -> float:
    """parse_when for argparse, against this moment."""
    try:
        return parse_when(text, time.time())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
