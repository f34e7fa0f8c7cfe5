"""The one liveness rule, table by table (the node list and every rendezvous use it)."""

import pytest

from elasticd.core.liveness import Beat, KeepAlive, observe, silent

KA = KeepAlive(interval=1.0, attempts=3)


@pytest.mark.parametrize(
    "beat, now, dead",
    [
        (None, 100.0, False),  # never seen: not judged
        (Beat(5, 10.0, reads=3), 13.0, True),  # still for 3 s and 3 reads
        (Beat(5, 10.0, reads=3), 12.9, False),
        (Beat(5, 10.0, reads=2), 60.0, False),  # long, but one stalled read: no verdict yet
        (Beat(None, 10.0, reads=5), 20.0, True),  # a counter that never appeared
    ],
)
def test_silent(beat, now, dead):
    assert silent(beat, KA, now) is dead


def test_observe_counts_reads_and_restarts_on_any_change():
    first = observe(None, 4, now=1.0)
    assert first == Beat(4, 1.0, 0)
    assert observe(first, 4, now=2.0) == Beat(4, 1.0, 1)
    assert observe(first, 5, now=2.0) == Beat(5, 2.0, 0)
    assert observe(first, 1, now=2.0) == Beat(1, 2.0, 0)  # a store reset restarts the counter
    assert KA.dead_after == 3.0
