"""A job's document when a node of its round is lost (docs/concepts.md): its ranks are
LOST, not the HEALTHY its node said last; what other nodes say, and a job that ended, are
shown as they are."""

from __future__ import annotations

from dataclasses import replace

from elasticctl import render
from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.records import JobRecord, Outcome, Part, job_doc


def spec() -> JobSpec:
    return JobSpec(
        id="j-000001",
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/",
        uid=1000,
        gid=1000,
        user="alice",
        created=1.0,
        min_nodes=2,
        max_nodes=3,
    )


def part(node: str, rank: int, state: PartState = PartState.RUNNING) -> Part:
    worker = {
        "rank": rank,
        "local_rank": 0,
        "node": node,
        "pid": 100 + rank,
        "state": "HEALTHY",
        "exit_code": None,
    }
    return Part(node=node, state=state, round=0, group_rank=rank, started=1.0, workers=(worker,))


def record(**kw: object) -> JobRecord:
    return JobRecord(spec(), 1, {"a": part("a", 0), "b": part("b", 1), "c": part("c", 2)}, **kw)


def test_a_lost_nodes_ranks_show_lost_and_the_others_as_their_nodes_say():
    doc = job_doc(record(), lost={"b"})
    assert [w["state"] for w in doc["workers"]] == ["HEALTHY", "LOST", "HEALTHY"]
    assert [n["state"] for n in doc["nodes"]] == ["RUNNING", "LOST", "RUNNING"]
    assert "LOST" in render.workers_table(doc["workers"])


def test_without_lost_nodes_the_document_is_what_the_nodes_said():
    assert job_doc(record(), lost=()) == job_doc(record())


def test_an_ended_job_and_a_part_that_ended_are_shown_as_they_ended():
    ended = record(outcome=Outcome(JobState.SUCCEEDED, 2.0, 0))
    assert [w["state"] for w in job_doc(ended, lost={"b"})["workers"]] == ["HEALTHY"] * 3
    left = JobRecord(
        spec(),
        1,
        {
            "a": part("a", 0),
            "b": part("b", 1, PartState.BARRIER),
            "c": part("c", 2, PartState.SUCCEEDED),
        },
    )
    states = [n["state"] for n in job_doc(left, lost={"b", "c"})["nodes"]]
    assert states == ["RUNNING", "LOST", "SUCCEEDED"]


def test_a_hang_found_in_an_earlier_round_is_still_named():
    """A classic job restarts after a hang: the node that failed the rank may still be in
    the old round while the others formed the next one; status says why it restarted."""
    hung = replace(part("b", 1), hung="hung: rank 1 on b made no progress for 5 s")
    newer = {"a": replace(part("a", 0), round=1), "b": hung}
    doc = job_doc(JobRecord(spec(), 1, newer))
    assert [w["node"] for w in doc["workers"]] == ["a"]
    assert doc["hung"] == ["hung: rank 1 on b made no progress for 5 s"]
