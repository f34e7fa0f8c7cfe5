"""An --in-place job grown onto a node whose worker never asks for its place and just
computes.  It used to run there for good at full CPU, charged nothing (usage counted from
the first round a part ran; warming up was free and never ended) and shown nowhere in
``status``.  Now the node's part is charged from the moment its workers run, ``status``
shows it warming, and at the job's join timeout the worker is stopped as failed: the
failure spends a restart, and the job fails once none is left, saying why."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

JOIN_TIMEOUT = 12.0

# Trains (asks for its place at once and waits in elastic.run) until the marker exists;
# a worker started after that computes without ever asking.
_SCRIPT = """
import os, sys, time
marker = sys.argv[1]
if os.path.exists(marker):
    open(marker + ".computing", "a").close()
    while True:
        sum(i * i for i in range(100000))
from elasticd import elastic
elastic.init("gloo")
state = elastic.ObjectState(step=0)

@elastic.run
def train(state):
    while True:
        time.sleep(0.05)
        state.step += 1
        state.commit()

train(state)
"""


def _part(doc: dict[str, Any], node: str) -> dict[str, Any] | None:
    return next((p for p in doc.get("nodes") or () if p["node"] == node), None)


def test_a_warm_up_that_never_asks_is_charged_shown_and_failed_at_its_join_timeout(
    daemon_factory: Any, shared_tmp: Path
) -> None:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="warm")
    a = cluster.add("a")
    b = cluster.add("b")
    cluster.daemons.remove(b)  # b starts once the job runs on a
    cluster.start()
    script, marker = shared_tmp / "warm.py", shared_tmp / "quiet"
    script.write_text(_SCRIPT)
    job = a.submit(
        "--in-place",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        "--join-timeout",
        str(JOIN_TIMEOUT),
        "--last-call-timeout",
        "1",
        str(script),
        "--",
        str(marker),
    )["id"]
    a.wait_job(job, lambda j: j["state"] == "RUNNING" and j["workers"], 120)
    marker.touch()
    cluster.daemons.append(b)
    b.start()
    started = time.time()
    wait_for(lambda: Path(str(marker) + ".computing").exists(), 60, "b's worker computing")

    # shown: b's part warms up; charged: its part says it ran from when its worker started
    def warming() -> dict[str, Any] | None:
        doc = a.ctl("status", job)
        part = _part(doc, b.name)
        return doc if part is not None and part["state"] == "WARMING" else None

    wait_for(warming, 30, f"status shows {b.name}'s part warming up")

    # failed at its join timeout: no restart left, so the job fails and says why
    ended = a.wait_job(job, lambda j: j["state"] in ("FAILED", "SUCCEEDED", "CANCELLED"), 120)
    assert ended["state"] == "FAILED", ended
    message = ended["error"]["message"]
    assert f"did not ask for its place within {JOIN_TIMEOUT:g} s" in message, message
    assert "must call elasticd.elastic.run" in message, message
    assert time.time() - started >= JOIN_TIMEOUT - 1  # not before its deadline

    # charged: b's part from when its worker started, on top of a's whole run
    def parts_ended() -> dict[str, Any] | None:
        doc = a.ctl("status", job)
        return doc if all(p["state"] != "RUNNING" for p in doc["nodes"]) else None

    doc = wait_for(parts_ended, 60, "the job's parts ended")
    user = a.ctl("usage")["users"][0]
    a_span = doc["ended"] - doc["started"]
    assert user["node_seconds"] >= a_span + JOIN_TIMEOUT - 2.0, (user, a_span)
