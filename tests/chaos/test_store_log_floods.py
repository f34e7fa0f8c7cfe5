"""A keyless store client that makes a daemon say the same thing again and again: each line
an outsider can cause at will is logged once per log.summary_interval, with how many more
there were (faults.Throttle).

    a running job's rendezvous state (and its head) deleted every 0.1 s: each deletion is
    restored by a member at its next duty; "restored round" said at most twice per daemon
    ..................................................... test_a_state_deleted_again_and_again
    the store's epoch deleted and written back, again and again: each time the nodes take
    it for a reset store and publish their jobs again; "the store was reset" said at most
    twice per daemon .................................... test_an_epoch_deleted_and_written_back

The jobs keep running throughout (same workers, no restart), on both backends.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
from store_attack import attacker
from test_store_forgery import assert_still_running, cancel_and_check, observe, two_node_job
from test_store_wakeups import cluster  # noqa: F401  (the fixture: c10d and etcd)

WATCH = 8.0  # seconds the attack goes on


class Again:
    """``act(client)`` from a thread of its own every ``every`` seconds while open."""

    def __init__(self, cluster: Any, act: Any, every: float = 0.1) -> None:
        self._client = attacker(cluster)
        self._act, self._every = act, every
        self._stop = threading.Event()
        self.times = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._act(self._client)
            except Exception:  # the store is gone: the test says so
                return
            self.times += 1
            self._stop.wait(self._every)

    def __enter__(self) -> Again:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(30)


def said(daemon: Any, words: str) -> int:
    return sum(
        1 for line in daemon.log_path.read_text(errors="replace").splitlines() if words in line
    )


@pytest.mark.slow
def test_a_state_deleted_again_and_again_is_restored_and_said_once(cluster, shared_tmp, figures):
    n1, _n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    job, pids = two_node_job(n1, shared_tmp)
    before = [said(d, "restored round") for d in cluster]

    def delete(store: Any) -> None:  # the head too: each duty then reads the state
        store.delete(f"rdzv/{job}/state")
        store.delete(f"rdzv/{job}/head")

    with Again(cluster, delete) as deleting:
        observe(WATCH, lambda: assert_still_running(cluster, job, pids))
    lines = [said(d, "restored round") - b for d, b in zip(cluster, before)]
    figures.add(
        f"log floods ({'etcd' if cluster.etcd else 'c10d'}): a state deleted {deleting.times} "
        "times: 'restored round' lines per daemon",
        " / ".join(map(str, lines)),
    )
    assert sum(lines) >= 1 and all(n <= 2 for n in lines), lines
    cancel_and_check(cluster, n1, job, pids)


@pytest.mark.slow
def test_an_epoch_deleted_and_written_back_is_said_once(cluster, shared_tmp, figures):
    n1, _n2 = cluster.add("n1"), cluster.add("n2")
    cluster.start()
    job, pids = two_node_job(n1, shared_tmp)
    epoch = attacker(cluster).read("epoch")
    before = [said(d, "the store was reset") for d in cluster]
    flip = {"deleted": False}

    def toggle(store: Any) -> None:
        if flip["deleted"]:
            store.write("epoch", epoch)
        else:
            store.delete("epoch")
        flip["deleted"] = not flip["deleted"]

    with Again(cluster, toggle, every=0.6) as toggling:
        observe(WATCH, lambda: assert_still_running(cluster, job, pids))
    lines = [said(d, "the store was reset") - b for d, b in zip(cluster, before)]
    figures.add(
        f"log floods ({'etcd' if cluster.etcd else 'c10d'}): the epoch deleted / written back "
        f"{toggling.times} times: 'the store was reset' lines per daemon",
        " / ".join(map(str, lines)),
    )
    assert all(n <= 2 for n in lines), lines
    cancel_and_check(cluster, n1, job, pids)
