"""The job document is derived from the nodes' parts and the outcome (pure)."""

import pytest

from elasticd.core.model import Failure, JobSpec, JobState
from elasticd.core.model import PartState as P
from elasticd.core.records import (
    JobRecord,
    Outcome,
    Part,
    current_parts,
    history_row,
    job_doc,
    job_state,
    record_from_history,
)

SPEC = JobSpec(
    id="j-1",
    argv=("t.py",),
    python="/p",
    workdir="/w",
    uid=1,
    gid=1,
    user="u",
    name="t",
    min_nodes=1,
    max_nodes=3,
    nproc_per_node=2,
    max_restarts=2,
    created=100.0,
)


def part(node, state, round=0, rank=0, **kw):
    workers = tuple(
        {
            "rank": rank * 2 + i,
            "local_rank": i,
            "node": node,
            "pid": 10 + i,
            "state": "HEALTHY",
            "exit_code": None,
        }
        for i in range(2)
    )
    return Part(node, state, round=round, group_rank=rank, workers=workers, **kw)


@pytest.mark.parametrize(
    "states, outcome, want",
    [
        ([], None, JobState.PENDING),
        ([P.RENDEZVOUS], None, JobState.RENDEZVOUS),
        ([P.RENDEZVOUS, P.RUNNING], None, JobState.RUNNING),
        ([P.RESTARTING, P.RENDEZVOUS], None, JobState.RESTARTING),
        ([P.BARRIER, P.RUNNING], None, JobState.RUNNING),
        ([P.LEFT, P.STOPPED], None, JobState.PENDING),
        ([P.RUNNING], JobState.CANCELLED, JobState.CANCELLED),
        ([P.SUCCEEDED, P.SUCCEEDED], JobState.SUCCEEDED, JobState.SUCCEEDED),
    ],
)
def test_job_state(states, outcome, want):
    parts = [Part(f"n{i}", s) for i, s in enumerate(states)]
    out = Outcome(outcome, 1.0) if outcome else None
    assert job_state(parts, out) == want


def test_doc_shows_the_latest_round_only():
    record = JobRecord(
        SPEC,
        3,
        {
            "a": part("a", P.LEFT, round=0),
            "b": part("b", P.RUNNING, round=1, rank=0, restarts=1, started=5.0, world_size=4),
            "c": part("c", P.RUNNING, round=1, rank=1, world_size=4, started=7.0),
        },
    )
    doc = job_doc(record)
    assert doc["state"] == "RUNNING" and doc["round"] == 1 and doc["world_size"] == 4
    assert [n["node"] for n in doc["nodes"]] == ["b", "c"]
    assert [w["rank"] for w in doc["workers"]] == [0, 1, 2, 3]
    assert doc["restarts"] == 1 and doc["started"] == 5.0 and doc["error"] is None
    assert doc["nnodes"] == "1:3" and doc["max_restarts"] == 2 and doc["user"] == "u"
    assert [p.node for p in current_parts(record)] == ["b", "c"]


def test_doc_of_a_failure_carries_the_root_cause():
    cause = Failure(
        rank=3,
        local_rank=1,
        node="c",
        exit_code=1,
        message="ValueError: x",
        traceback="Traceback...",
        timestamp=9.0,
    )
    record = JobRecord(
        SPEC, 1, {}, Outcome(JobState.FAILED, 12.0, 1, "rank 3 on c: ValueError: x", cause, "c")
    )
    doc = job_doc(record)
    assert doc["state"] == "FAILED" and doc["exit_code"] == 1 and doc["ended"] == 12.0
    assert (
        doc["error"]["message"] == "ValueError: x" and doc["error"]["traceback"] == "Traceback..."
    )
    cancelled = JobRecord(
        SPEC, 1, {}, Outcome(JobState.CANCELLED, 12.0, None, "cancelled by root", None, "n1")
    )
    assert job_doc(cancelled)["error"]["message"] == "cancelled by root"


def test_outcome_must_be_terminal():
    with pytest.raises(ValueError):
        Outcome.from_json({"state": "RUNNING", "ended": 1})


def test_history_row_round_trip():
    record = JobRecord(
        SPEC,
        4,
        {"b": part("b", P.RUNNING, round=2, barrier={"done": 1, "total": 2, "deadline": 3.0})},
        Outcome(JobState.SUCCEEDED, 5.0, 0, "", None, "b"),
    )
    again = record_from_history(history_row(record))
    assert (again.spec, again.seq, again.parts, again.outcome) == (
        record.spec,
        4,
        record.parts,
        record.outcome,
    )
