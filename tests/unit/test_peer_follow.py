"""A follower of another node's logs asks again after a failure (docs/concepts.md, "What a worker gets"): when,
how long it waits, and that no line is shown twice or lost across the asks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from elasticd.control.commands import RETRY_MAX, _PeerFollow, keep_asking, retry_pause
from elasticd.shell.logs import SeenLines


def line(rank: int, i: int, stream: str = "out") -> dict:
    return {
        "node": "n2",
        "attempt": 0,
        "rank": rank,
        "stream": stream,
        "text": f"{stream} {rank} {i}",
    }


def test_the_pause_doubles_from_one_second_to_ten():
    assert [retry_pause(n) for n in range(6)] == [1, 2, 4, 8, 10, 10]
    assert retry_pause(10**6) == RETRY_MAX


def test_asked_again_while_the_job_runs_and_a_few_times_after_while_the_node_lives():
    assert keep_asking(ended=False, alive=False, failures=100)
    assert keep_asking(ended=True, alive=True, failures=2)
    assert not keep_asking(ended=True, alive=True, failures=3)
    assert not keep_asking(ended=True, alive=False, failures=0)


@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 3))
def test_every_line_is_passed_on_once_whatever_the_asks_brought(cuts, ranks):
    """Each ask reads the files from their start and breaks off after some lines; the lines
    passed on are the stream's lines, in order, each once."""
    full = [line(r, i, s) for i in range(40) for r in range(ranks) for s in ("out", "err")]
    seen, passed = SeenLines(), []
    for cut in [*cuts, len(full)]:  # the last ask reads to the end
        stream_seen: dict = {}
        passed += seen.fresh(stream_seen, full[:cut])
    assert passed == full


def test_the_follower_says_once_it_is_unavailable_and_once_it_is_back():
    follow = _PeerFollow("n2")
    assert follow.failed(ended=False, alive=True)
    first = follow.unavailable(OSError("no answer"))
    assert len(first) == 1 and "unavailable for now (no answer)" in first[0]["text"]
    assert follow.failed(ended=False, alive=True) and follow.unavailable(OSError("again")) == []
    assert follow.failures == 2
    shown = follow.answered({"lines": [line(1, 0)]})
    assert [shown_line["text"] for shown_line in shown] == [
        "elasticd: logs of node n2 are back",
        "out 1 0",
    ]
    assert follow.answered({"lines": [line(1, 1)]}) == [line(1, 1)]
    assert follow.failed(ended=False, alive=True) and follow.failures == 1  # it had answered
    assert follow.answered({"lines": [line(1, 0), line(1, 1), line(1, 2)]}) == [line(1, 2)]
