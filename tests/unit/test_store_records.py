"""What the board, the node registry and each node's own rules make of a store that someone
else writes to (docs/security.md, "The store"): the pure rules and the store-facing classes over the in-memory
store.  The same attacks against real daemons are in tests/chaos/test_store_*.py."""

from __future__ import annotations

import asyncio
import time

import pytest

from elasticd.core.model import JobSpec, JobState
from elasticd.core.placement import refusal
from elasticd.core.records import Outcome
from elasticd.jobs.board import BoardReset, JobBoard
from elasticd.store.firewall import ruleset, table_name
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

SIGNER = Signer(b"k" * 32, "c")
JOBS = "elasticd/c/jobs"


def spec(job_id: str = "j-000001", **kw) -> JobSpec:
    fields = dict(
        id=job_id,
        argv=("train.py",),
        python="/usr/bin/python3",
        workdir="/",
        uid=1000,
        gid=1000,
        user="alice",
        env={"SECRET_TOKEN": "hunter2"},
        created=1.0,
    )
    return JobSpec(**{**fields, **kw})


def run(coro):
    return asyncio.run(coro)


class Board:
    def __init__(self) -> None:
        self.store = MemoryStore()
        self.refused: list[tuple[str, str]] = []
        self.board = JobBoard(
            AsyncMemoryStore(self.store),
            SIGNER,
            "c",
            on_refused=lambda key, why: self.refused.append((key, why)),
        )


def test_a_spec_in_the_store_shows_no_secret_and_does_not_open_under_another_job():
    b = Board()
    run(b.board.publish_spec(spec("j-000001")))
    raw = b.store.get(f"{JOBS}/spec/j-000001")
    assert b"hunter2" not in raw and b"SECRET_TOKEN" not in raw and b"alice" not in raw
    b.store.set(f"{JOBS}/spec/j-000002", raw)
    assert run(b.board.read_job("j-000002")) == [] and b.refused
    [change] = run(b.board.read_job("j-000001"))
    assert change.value[1].env == {"SECRET_TOKEN": "hunter2"} and change.value[2] is None


def test_an_outcome_copied_from_another_job_holds_the_job_and_a_cancel_replaces_it():
    b = Board()
    for job_id in ("j-000001", "j-000002"):
        run(b.board.publish_spec(spec(job_id)))
    run(b.board.publish_outcome("j-000001", Outcome(JobState.SUCCEEDED, 1.0, 0)))
    b.store.set(f"{JOBS}/outcome/j-000002", b.store.get(f"{JOBS}/outcome/j-000001"))
    kinds = {c.kind: c.value for c in run(b.board.read_job("j-000002"))}
    assert "outcome" not in kinds and "another key" in kinds["held"]
    cancelled = Outcome(JobState.CANCELLED, 2.0, None, "cancelled by alice")
    assert run(b.board.publish_outcome("j-000002", cancelled)) == cancelled
    kinds = {c.kind: c.value for c in run(b.board.read_job("j-000002"))}
    assert kinds["outcome"] == cancelled and "held" not in kinds


def test_a_valid_outcome_is_never_replaced():
    b = Board()
    first = Outcome(JobState.SUCCEEDED, 1.0, 0)
    assert run(b.board.publish_outcome("j-000001", first)) == first
    assert run(b.board.publish_outcome("j-000001", Outcome(JobState.CANCELLED, 2.0))) == first


@pytest.mark.parametrize("attack", ["forged entry", "bumped counter", "counter went back"])
def test_a_broken_change_log_asks_for_a_resync_instead_of_skipping(attack):
    b = Board()
    run(b.board.publish_spec(spec("j-000001")))
    position = run(b.board.head())
    if attack == "forged entry":  # over the change at ``position``: a number that was taken
        b.store.set(f"{JOBS}/log/{position}", b"spec/j-000009")
        position -= 1
    elif attack == "bumped counter":
        b.store.add(f"{JOBS}/log", 1_000_000)
    else:
        b.store.add(f"{JOBS}/log", -1)
        position += 5
    with pytest.raises(BoardReset):
        run(b.board.follow(position, 0.05))
    # the resync reads the signed records whatever the counters say
    _head, changes = run(b.board.snapshot())
    assert [c.job_id for c in changes if c.kind == "spec"] == ["j-000001"]


def test_junk_written_ahead_of_the_change_log_is_no_news_and_costs_a_back_off():
    """Junk at the next number, which nobody took yet, ends the follower's wait at once (as
    does, on TCPStore, anyone's read of the missing key): no reset, no resync of the whole
    board, a pause that doubles; the change that takes the number overwrites the junk."""
    b = Board()
    run(b.board.publish_spec(spec("j-000001")))
    position = run(b.board.head())
    for n in range(position + 1, position + 50):
        b.store.set(f"{JOBS}/log/{n}", b"spec/j-000009")
    pauses = []
    for _ in range(4):
        started = time.monotonic()
        assert run(b.board.follow(position, 5.0)) == (position, [])
        pauses.append(time.monotonic() - started)
    assert b.board.quiet.pauses == 4 and pauses[-1] > pauses[0], pauses
    run(b.board.publish_spec(spec("j-000002")))
    moved, changes = run(b.board.follow(position, 5.0))
    assert moved == position + 1 and [c.job_id for c in changes] == ["j-000002"]


def test_a_snapshot_does_not_walk_a_bumped_counter_and_skips_forged_index_lines():
    b = Board()
    run(b.board.publish_spec(spec("j-000001")))
    b.store.add(f"{JOBS}/seq", 10**9)
    b.store.append(f"{JOBS}/index", b"j-999999\n" * 1000)
    started = time.monotonic()
    _, changes = run(b.board.snapshot())
    assert [c.job_id for c in changes] == ["j-000001"] and time.monotonic() - started < 1.0
    assert len(b.refused) == 1000


@pytest.mark.parametrize(
    "job, allow_root, local_user, refused",
    [
        (spec(uid=0, user="root"), False, "root", "jobs.allow_root = false"),
        (spec(uid=0, user="root"), True, "root", None),
        (spec(), False, None, "does not exist here"),
        (spec(), False, "bob", "uid 1000 is bob here, not alice"),
        (spec(), False, "alice", None),
        (spec(user="1000"), False, "bob", None),  # the submitting node knew no name for the uid
    ],
)
def test_each_node_applies_its_own_rules(job, allow_root, local_user, refused):
    why = refusal(job, allow_root=allow_root, local_user=local_user)
    assert (why is None) if refused is None else (refused in why)


def test_the_store_rule_rejects_every_other_user():
    member = ruleset(
        table_name("default", "gpu-01.lan"), port=29400, uid=0, store_address="10.0.0.1"
    )
    assert "table inet elasticd_default_gpu_01_lan {" in member
    assert "tcp dport 29400 ip daddr 10.0.0.1 meta skuid != 0 reject with tcp reset" in member
    host = ruleset("t", port=29400, uid=0, store_address=None)
    assert "tcp dport 29400 fib daddr type local meta skuid != 0 reject" in host
    assert "ip6 daddr fd00::1" in ruleset("t", port=1, uid=0, store_address="fd00::1")


def test_an_ended_job_stays_ended_when_its_outcome_is_deleted_and_an_older_spec_is_refused():
    b = Board()
    job = spec("j-000001")
    seq = run(b.board.publish_spec(job))
    submitted = b.store.get(f"{JOBS}/spec/j-000001")
    outcome = Outcome(JobState.SUCCEEDED, 1.0, 0)
    run(b.board.publish_outcome(job.id, outcome))
    run(b.board.publish_ended(job, seq, outcome))
    b.store.delete(f"{JOBS}/outcome/j-000001")
    [change] = run(b.board.read_job(job.id))
    assert change.value == (seq, job, outcome)
    b.store.set(f"{JOBS}/spec/j-000001", submitted)  # written back by someone who kept it
    assert run(b.board.read_job(job.id)) == [] and "older than version 1" in b.refused[-1][1]
