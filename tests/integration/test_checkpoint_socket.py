"""The checkpoint tier's socket, as a job's worker speaks it: a real daemon, a real worker
(tests/fixtures/tier_socket_worker.py) that sends raw JSON lines to
``$ELASTICD_CHECKPOINT_DIR/.tier.sock`` and records each answer.

- ``saving`` then ``saved``: the share is described as its workers said (round, world,
  rank), not as the node's round is, and completes; ``wait`` answers when it is complete;
  ``fetch`` with ``here_only`` names the files held here, with no transfer;
- what a worker may not say (a checkpoint that is no directory, a file that is not there, a
  rank out of its world, more reports than the node's workers, a negative timeout, an
  unknown op) gets a clear error, and the daemon answers on;
- waits at once are bounded (a job cannot hold the daemon's coroutines without end).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT

pytestmark = pytest.mark.slow

WORKER = str(ROOT / "tests" / "fixtures" / "tier_socket_worker.py")


def test_workers_say_what_they_save_and_bad_requests_get_clear_errors(
    daemon: Any, shared_tmp: Path
) -> None:
    out = shared_tmp / "answers.json"
    job = daemon.submit("--nproc-per-node", "1", WORKER, "--", str(out))["id"]
    ended = daemon.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 120)
    assert ended["state"] == "SUCCEEDED", ended
    answers: dict[str, Any] = json.loads(out.read_text())

    assert answers["saving"] == {"ok": True}
    assert answers["saved"] == {"ok": True}
    assert answers["wait"] == {"ok": True, "complete": True}
    latest = answers["latest"]["checkpoint"]
    # described as the worker said: round 7, world 1 (the node's own round is 0)
    assert (latest["id"], latest["round"], latest["world"]) == ("commit_a", 7, 1), latest
    assert sorted(latest["files"]) == [".metadata", "__0_0.distcp"]
    assert answers["wait_unknown"] == {"ok": True, "complete": False}
    # the files held here, without a transfer: a one-node job's are all here
    here = answers["here_only"]["paths"]
    assert list(here) == ["__0_0.distcp"] and here["__0_0.distcp"].endswith("commit_a/__0_0.distcp")

    def refused(name: str, needle: str) -> None:
        answer = answers[name]
        assert answer["ok"] is False and needle in answer["error"], (name, answer)

    refused("saving_no_directory", "is not a directory")
    refused("saving_traversal", "bad checkpoint name")
    refused("saved_missing_file", "is not there")
    refused("saved_rank_out_of_world", "out of range")
    refused("saved_too_many_reports", "more reports")
    refused("wait_negative", "timeout must be")
    refused("unknown_op", "unknown op")
    refused("here_only_past_the_end", "no such range")
    waits = answers["waits"]
    assert waits["refused"] >= 1 and waits["answered"] >= 60, waits
    assert all("waits of this job" in error for error in waits["errors"]), waits

    doc = daemon.ctl("status", job)  # the daemon answers on
    assert doc["checkpoint"]["id"] == "commit_a", doc["checkpoint"]
