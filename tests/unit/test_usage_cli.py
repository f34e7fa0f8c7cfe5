"""`elasticctl usage`'s side (docs/scheduler.md): the times --since and --until take, and what is
refused before any daemon is asked (exit 2)."""

from __future__ import annotations

import datetime
import time

import pytest

from elasticctl import cli
from elasticctl.when import parse_when

NOW = 1_700_000_000.0
UTC = datetime.UTC


@pytest.mark.parametrize(
    "text, expected",
    [
        ("now", NOW),
        ("90s", NOW - 90),
        ("30m", NOW - 1800),
        ("12h", NOW - 43200),
        ("7d", NOW - 7 * 86400),
        ("2w", NOW - 14 * 86400),
        ("1.5h", NOW - 5400),
        (" 7d ", NOW - 7 * 86400),
        ("2024-05-01T00:00Z", datetime.datetime(2024, 5, 1, tzinfo=UTC).timestamp()),
        (
            "2024-05-01 13:30:00+02:00",
            datetime.datetime(2024, 5, 1, 11, 30, tzinfo=UTC).timestamp(),
        ),
        ("2024-05-01", datetime.datetime(2024, 5, 1).timestamp()),  # local midnight
        ("2024-05-01T13:30", datetime.datetime(2024, 5, 1, 13, 30).timestamp()),
    ],
)
def test_times_are_iso_or_a_time_ago(text, expected):
    assert parse_when(text, NOW) == expected


@pytest.mark.parametrize(
    "text",
    [
        "yesterday-ish",
        "yesterday",
        "7 d",
        "-7d",
        "7D",
        "7days",
        "1e5h",
        "",
        "٣d",
        "2024-13-01",
    ],
)
def test_anything_else_is_refused_saying_what_is_understood(text):
    with pytest.raises(
        ValueError, match=r"expected an ISO date or time .* or a time ago \(90s, 30m, 12h, 7d, 2w\)"
    ):
        parse_when(text, NOW)


@pytest.mark.parametrize(
    "text",
    [
        "99999999999999w",  # an OverflowError's traceback in elasticctl before
        "3000000000d",  # "usage from -8211695-11-21" before
        "9" * 400 + "w",
        "0001-01-01",
        "1969-12-31T23:59:59Z",
        "10000-01-01",
    ],
)
def test_a_time_before_1970_or_after_9999_is_refused(text):
    with pytest.raises(ValueError, match=r"must lie between 1970-01-01 and 9999-12-31|ISO date"):
        parse_when(text, NOW)


@pytest.mark.parametrize("option", ["--since", "--until"])
@pytest.mark.parametrize("text", ["99999999999999w", "3000000000d", "0001-01-01"])
def test_an_out_of_range_time_is_a_usage_error_not_a_traceback(option, text, capsys):
    assert cli.main(["--socket", "/nonexistent/control.sock", "usage", option, text]) == 2
    err = capsys.readouterr().err
    assert f"argument {option}:" in err and "must lie between 1970-01-01 and 9999-12-31" in err
    assert "Traceback" not in err


def test_the_edges_of_the_range_are_times():
    assert parse_when("1970-01-01T00:00:00Z", NOW) == 0.0
    assert parse_when("9999-12-31T23:59:59Z", NOW) == 253402300799.0


def test_the_command_line(capsys):
    args = cli.parse_args(
        ["usage", "--user", "alice", "--account", "ml", "--since", "7d", "--json"]
    )
    assert (args.handler.__name__, args.user, args.account, args.json) == (
        "cmd_usage",
        "alice",
        "ml",
        True,
    )
    assert abs(args.since - (time.time() - 7 * 86400)) < 60 and args.until is None
    with pytest.raises(SystemExit) as exit:
        cli.parse_args(["usage", "--since", "yesterday-ish"])
    assert exit.value.code == 2
    assert "argument --since: expected an ISO date or time" in capsys.readouterr().err


def test_a_window_that_ends_before_it_starts_is_refused_before_asking(capsys):
    assert (
        cli.main(["--socket", "/nonexistent/usage.sock", "usage", "--since", "1h", "--until", "2h"])
        == 2
    )
    assert "elasticctl: --since must be before --until and now" in capsys.readouterr().err
