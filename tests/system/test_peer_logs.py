"""`elasticctl logs -f` follows other nodes' ranks through a peer that does not answer for a
while (right after a cluster formed, peers refuse each other until
they know each other's keys, and the follower used to give up on them for the whole job).

The peer is made silent by stopping its daemon (SIGSTOP) and brought back (SIGCONT); every
wait is on the follower's own output or the job's document, never on a sleep.
"""

from __future__ import annotations

import collections
import os
import queue
import re
import signal
import subprocess
import threading

import pytest
from harness import CLIENT_ENV, PY, worker_args

LINES = 3


class Follower:
    """``elasticctl logs -f JOB`` run on a daemon, its stdout and stderr read line by line."""

    def __init__(self, daemon, job: str) -> None:
        self.proc = subprocess.Popen(
            [PY, "-m", "elasticctl", "--socket", daemon.socket, "logs", "-f", job],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=CLIENT_ENV,
            cwd=str(daemon.base),
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float) -> None:
        """Until a line holds ``needle``; AssertionError if the output ended or the time ran out."""
        while not any(needle in line for line in self.lines):
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {needle!r} within {timeout} s: {self.lines}") from None
            assert line is not None, f"the follower ended without {needle!r}: {self.lines}"
            self.lines.append(line)

    def finish(self, timeout: float) -> int:
        """Its exit code, once its output is read to the end."""
        while (line := self._queue.get(timeout=timeout)) is not None:
            self.lines.append(line)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.c10d_only("the peer channel between daemons; the store plays no part")
def test_logs_follow_waits_out_a_peer_that_does_not_answer(cluster_factory, shared_tmp):
    cluster = cluster_factory(2)
    # n2's daemon is stopped for longer than the peer timeout (node.peer_timeout, 5 s here):
    # it must not count as lost (neither by its heartbeat nor by the failure detector, which
    # takes a frozen daemon for a frozen node within half a second)
    with open(cluster.config, "a") as config:
        config.write(
            "[rendezvous]\nkeep_alive_max_attempt = 120\n[node]\npeer_timeout = 5.0\n"
            "[detector]\nenabled = false\n"
        )
    cluster.start()
    go = shared_tmp / "go"
    os.mkfifo(go)
    hold = os.open(go, os.O_RDWR)  # a writer from the start: every worker blocks in read()
    follower = None
    try:
        job = cluster[0].submit(
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            *worker_args("--wait-for", str(go), "--print", str(LINES)),
        )["id"]
        cluster[0].wait_running(job, 2)
        nodes = cluster[0].ctl("status", job)["nodes"]
        here = next(n["ranks"][0] for n in nodes if n["node"] == cluster[0].name)  # n1's rank
        cluster[1].signal(signal.SIGSTOP)
        follower = Follower(cluster[0], job)
        follower.wait_for("logs of node n2 unavailable for now", timeout=60)
        os.close(hold)  # the workers print and exit while n2's daemon is still stopped
        hold = None
        follower.wait_for(f"out {here} 2", timeout=60)  # n1's rank prints meanwhile
        cluster[1].signal(signal.SIGCONT)
        assert follower.finish(timeout=120) == 0, follower.lines
    finally:
        if hold is not None:
            os.close(hold)
        cluster[1].signal(signal.SIGCONT)
        if follower is not None:
            follower.stop()
    texts = [re.sub(r"^\[rank [^]]*\] ", "", line) for line in follower.lines]  # "[rank 0 err] "
    counts, shown = collections.Counter(texts), "\n".join(follower.lines)
    for rank in (0, 1):
        for i in range(LINES):
            assert counts[f"out {rank} {i}"] == 1 and counts[f"err {rank} {i}"] == 1, shown
    notices = [text for text in texts if text.startswith("elasticd: logs of node n2")]
    assert (
        len(notices) == 2
        and "unavailable for now" in notices[0]
        and notices[1].endswith("are back")
    ), shown
    assert cluster[0].ctl("status", job)["state"] == "SUCCEEDED"
