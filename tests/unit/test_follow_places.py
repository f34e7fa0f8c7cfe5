"""elasticctl.follow.RankPlaces: a rank's local rank, from job documents that may not hold
its node's part yet (output comes straight from the node, parts through the store)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from elasticctl.follow import RankPlaces


def answers(*docs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from docs
    while True:
        yield docs[-1]


def job(state: str, *workers: tuple[int, int]) -> dict[str, Any]:
    return {
        "round": 0,
        "state": state,
        "workers": [{"rank": rank, "local_rank": local} for rank, local in workers],
    }


def test_a_rank_whose_part_comes_late_is_asked_for_again_until_it_is_known():
    first = job("RUNNING", (0, 0), (1, 1))  # n1's part only
    later = job("RUNNING", (0, 0), (1, 1), (2, 0), (3, 1))
    docs, slept = answers(first, first, later), []
    places = RankPlaces(lambda: next(docs), patience=3.0, pause=0.1, sleep=slept.append)
    assert places.local_rank(0, 2) == 0
    assert slept == [0.1, 0.1]
    assert places.local_rank(0, 3) == 1 and len(slept) == 2, "known: not asked again"


def test_an_ended_job_is_not_waited_for_and_a_rank_it_lacks_keeps_its_global_rank():
    docs, slept = answers(job("SUCCEEDED", (0, 0))), []
    places = RankPlaces(lambda: next(docs), patience=3.0, pause=0.1, sleep=slept.append)
    assert places.local_rank(0, 5) == 5 and slept == []


def test_a_rank_never_shown_is_waited_for_at_most_the_patience_and_once():
    docs, slept = answers(job("RUNNING", (0, 0))), []
    places = RankPlaces(lambda: next(docs), patience=1.0, pause=0.25, sleep=slept.append)
    assert places.local_rank(0, 7) == 7 and sum(slept) <= 1.0
    assert places.local_rank(0, 7) == 7 and sum(slept) <= 1.0, "asked once per rank"
    assert places.local_rank(None, 7) is None and places.local_rank(0, None) is None
