"""control.server.Summary: a kind of event anyone can cause often (a refused peer handshake,
issue 24 row 0g) is logged once, then summed up in one line per interval (pure: the time is
given)."""

from __future__ import annotations

from elasticd.control.server import Summary


def test_the_first_is_logged_the_rest_counted_and_summed_up_once_per_interval():
    summary = Summary(60.0)
    assert summary.note("a", 0.0) is True
    assert [summary.note(f"b{i}", 1.0 + i) for i in range(1499)] == [False] * 1499
    assert summary.due() == 60.0
    assert summary.flush(59.9) is None
    assert summary.flush(60.0) == (1499, "b1498")
    assert summary.due() is None and summary.flush(200.0) is None  # nothing since
    assert summary.note("c", 70.0) is False  # within the interval the summary opened
    assert summary.flush(120.0) == (1, "c")


def test_after_a_quiet_interval_the_next_one_is_logged_itself():
    summary = Summary(60.0)
    assert summary.note("a", 0.0)
    assert not summary.note("b", 30.0)
    assert summary.flush(60.0) == (1, "b")
    assert summary.note("c", 130.0) is True  # a whole quiet interval since the last line
    assert summary.due() is None
