"""Usage records (core/usage.py; docs/scheduler.md): each node's spans of a job from its record, the
totals per user and account that `elasticctl usage` shows, and the decayed usage the
fair share reads; what a part says of itself (core/part.py) and what the registry carries
when a node takes a job again.  Pure, but for the registry and the board in memory."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_core_part import JOB, Drive, in_place_running, info
from test_held_jobs import Node

from elasticctl import render
from elasticd.core import events as ev
from elasticd.core import instructions as do
from elasticd.core.model import GPU, JobSpec, JobState, PartState, WorkerState
from elasticd.core.records import JobRecord, Outcome, Part
from elasticd.core.usage import (
    MAX_BEFORE,
    Span,
    Total,
    UsageSums,
    carried,
    decayed,
    report,
    spans,
    totals,
)
from elasticd.rendezvous import NextRound
from elasticd.store.memory import MemoryStore

GROUPS = {100: "staff", 0: "root"}.get


def spec(job_id: str = "j-000001", user: str = "alice", gid: int = 100, **kw) -> JobSpec:
    return JobSpec(
        **{
            **dict(
                id=job_id,
                argv=("t.py",),
                python="/p",
                workdir="/w",
                uid=1000,
                gid=gid,
                user=user,
                min_nodes=1,
                max_nodes=3,
            ),
            **kw,
        }
    )


def part(
    node: str,
    state: PartState,
    ran: float | None,
    updated: float,
    *,
    slots: int = 2,
    gpus: int = 0,
    round: int | None = 0,
    **kw,
) -> Part:
    return Part(
        node=node,
        state=state,
        round=round,
        ran=ran,
        updated=updated,
        slots=slots,
        gpus=gpus,
        started=kw.pop("started", ran),
        **kw,
    )


def record(*parts: Part, outcome: Outcome | None = None, **kw) -> JobRecord:
    return JobRecord(spec(**kw), 1, {p.node: p for p in parts}, outcome)


# -- spans -----------------------------------------------------------------------------------------


def test_a_finished_part_is_one_span_from_its_first_run_to_its_end_charged_to_the_primary_group():
    job = record(part("n1", PartState.SUCCEEDED, 100.0, 160.0, slots=2, gpus=1))
    assert spans(job, GROUPS) == [Span("j-000001", "n1", "alice", "staff", 100.0, 160.0, 2, 1)]
    assert spans(job)[0].account == "100"  # no resolver: the group's number, as ls -l shows it
    named = record(part("n1", PartState.SUCCEEDED, 100.0, 160.0), account="ml")
    assert spans(named, GROUPS)[0].account == "ml"  # the job's own account


def test_waiting_is_free_a_running_part_has_no_end_and_a_late_node_is_charged_from_its_own_run():
    job = record(
        part("n1", PartState.RUNNING, 100.0, 101.0),
        part("n2", PartState.RUNNING, 130.0, 131.0, started=100.0),  # the job's first start
        part("n3", PartState.RENDEZVOUS, None, 140.0, round=None, started=100.0),
    )
    assert [(s.node, s.start, s.end) for s in spans(job, GROUPS)] == [
        ("n1", 100.0, None),
        ("n2", 130.0, None),
    ]
    totals_ = totals(spans(job, GROUPS), since=0.0, until=150.0, by="user")
    assert totals_ == {"alice": Total(50.0 + 20.0, 2 * 70.0, 0.0, 1)}


def test_a_part_that_never_said_it_ended_ends_with_its_round_or_its_job():
    # n2 was lost in round 0: the survivor re-formed round 1 and reported at 150
    lost = part("n2", PartState.RUNNING, 100.0, 101.0, round=0)
    survivor = part("n1", PartState.RUNNING, 100.0, 150.0, round=1)
    assert {s.node: s.end for s in spans(record(survivor, lost), GROUPS)} == {
        "n1": None,
        "n2": 150.0,
    }
    ended = Outcome(JobState.SUCCEEDED, 140.0, 0)
    assert {s.node: s.end for s in spans(record(survivor, lost, outcome=ended), GROUPS)} == {
        "n1": 140.0,
        "n2": 140.0,
    }  # the job's end comes first; a part in the last round ends with it


def test_a_part_of_an_older_daemon_is_charged_from_the_jobs_start_with_its_workers():
    workers = tuple({"rank": r, "local_rank": r, "pid": 1, "state": "SUCCEEDED"} for r in range(4))
    old = Part("n1", PartState.SUCCEEDED, round=0, started=100.0, updated=160.0, workers=workers)
    assert spans(record(old), GROUPS) == [
        Span("j-000001", "n1", "alice", "staff", 100.0, 160.0, 4, 0)
    ]
    assert spans(record(old, nproc_per_node=GPU), GROUPS)[0].gpus == 4
    never_ran = Part(
        "n1", PartState.STOPPED, started=100.0, updated=160.0
    )  # no round: it never ran
    assert spans(record(never_ran), GROUPS) == []


def test_what_a_record_of_another_version_holds_that_is_no_time_is_left_out():
    junk = part(
        "n1",
        PartState.SUCCEEDED,
        100.0,
        160.0,
        before=(("x", 1.0, 1, 0), (1.0,), (50.0, 60.0, 1, 0)),
    )
    assert [(s.start, s.end) for s in spans(record(junk), GROUPS)] == [(50.0, 60.0), (100.0, 160.0)]
    assert spans(record(part("n1", PartState.SUCCEEDED, math.nan, 160.0)), GROUPS) == []
    backwards = part("n1", PartState.SUCCEEDED, 100.0, 90.0)  # a clock stepped back
    assert spans(record(backwards), GROUPS)[0].end == 100.0


# -- what a part says of itself, and what the registry carries ------------------------------------


def published(d: Drive) -> list[Part]:
    return [i.part for i in d.said if isinstance(i, do.Publish)]


def test_a_part_says_when_its_workers_first_ran_and_what_it_holds_through_restarts():
    d = Drive(started=500.0)  # the job ran elsewhere from 500 (wall clock): this node joins later
    d.part.gpus = ("0", "1")
    d.start()
    d.mono = 200.0
    d.joined(info())
    d(ev.RestorePrepared(JOB, d.op(do.PrepareRestore)))  # the job ran: its checkpoint first
    d.workers(WorkerState.HEALTHY, WorkerState.HEALTHY)
    d.mono = 300.0
    d.workers(WorkerState.HEALTHY, WorkerState.FAILED)  # a restart: the same part goes on
    d(ev.PeersProbed(JOB, d.op(do.Probe), ()))
    d(ev.WorkersStopped(JOB, d.op(do.StopWorkers)))
    d(ev.RoundRequested(JOB, d.op(do.RequestRound), NextRound.OPENED))
    d.mono = 400.0
    d.joined(info(round=1, restarts=1))
    d(ev.RestorePrepared(JOB, d.op(do.PrepareRestore)))
    parts = published(d)
    assert [p.state for p in parts][:2] == [PartState.RENDEZVOUS, PartState.RUNNING] and parts[
        -1
    ].round == 1
    assert parts[0].ran is None and {p.ran for p in parts[1:]} == {1200.0}  # waiting was free
    assert {p.started for p in parts} == {500.0}  # the job's first start, not this node's
    assert {(p.slots, p.gpus) for p in parts} == {(2, 2)}


def test_in_place_a_first_round_part_is_charged_from_when_its_workers_start():
    """A job's first round is formed before its workers start: they start placed.  (A part
    that warms workers up is charged from its first warm-up: test_core_part.)"""
    d = Drive(in_place=True)
    in_place_running(d)
    parts = published(d)
    first = next(p for p in parts if p.state is PartState.RUNNING)
    assert {p.ran for p in parts if p.state is PartState.RENDEZVOUS} == {None}
    assert first.ran == first.updated and parts[-1].ran == first.ran


def test_a_node_that_takes_a_job_again_carries_its_earlier_span():
    old = part("n1", PartState.LEFT, 100.0, 120.0, slots=1)
    new = part("n1", PartState.RENDEZVOUS, None, 200.0, round=None)
    again = carried(old, new)
    assert again.before == ((100.0, 120.0, 1, 0),)
    running_again = carried(again, replace(new, state=PartState.RUNNING, ran=210.0, round=3))
    assert running_again.before == again.before  # the same part's reports keep what it carries
    assert (
        carried(None, new) is new
        and carried(part("n1", PartState.RUNNING, 1.0, 2.0), new).before == ()
    )
    job = record(replace(running_again, state=PartState.SUCCEEDED, updated=260.0))
    assert [(s.start, s.end, s.slots) for s in spans(job, GROUPS)] == [
        (100.0, 120.0, 1),
        (210.0, 260.0, 2),
    ]


def test_at_most_max_before_spans_are_carried_the_closest_merged():
    before = tuple((10.0 * i, 10.0 * i + 5, 1, 0) for i in range(MAX_BEFORE))
    old = part("n1", PartState.LEFT, 318.0, 400.0, slots=3, before=before)  # 3 s after the last one
    kept = carried(old, part("n1", PartState.RENDEZVOUS, None, 2000.0, round=None)).before
    assert len(kept) == MAX_BEFORE and kept[:2] == before[:2]
    assert kept[-1] == (310.0, 400.0, 3, 0)  # the smallest gap is charged, with the larger share


def test_the_registry_carries_a_nodes_earlier_span_and_the_board_takes_it_to_the_others(tmp_path):
    store = MemoryStore()
    n1, n2 = Node("n1", store, tmp_path), Node("n2", store, tmp_path)
    job = "j-000001"

    async def scenario() -> None:
        await n1.board.publish_spec(spec(), 1)
        await n1.follower.resync()
        n1.report(job, part("n1", PartState.RUNNING, 100.0, 100.0))
        n1.report(job, part("n1", PartState.LEFT, 100.0, 130.0))  # reclaimed for another job
        n1.report(
            job, part("n1", PartState.RENDEZVOUS, None, 200.0, round=None, started=100.0)
        )  # back
        n1.report(job, part("n1", PartState.RUNNING, 210.0, 210.0, round=2, started=100.0))
        assert n1.registry.get(job).parts["n1"].before == ((100.0, 130.0, 2, 0),)
        assert await n1.flush()
        await n2.follower.resync()
        seen = n2.registry.get(job)
        assert [(s.start, s.end) for s in spans(seen, GROUPS)] == [(100.0, 130.0), (210.0, None)]

    asyncio.run(scenario())


# -- totals, decay, the report ---------------------------------------------------------------------


def test_totals_by_user_and_account_clip_to_the_window_and_count_jobs():
    a = spans(
        record(
            part("n1", PartState.SUCCEEDED, 0.0, 100.0, slots=2, gpus=1),
            part("n2", PartState.SUCCEEDED, 50.0, 100.0, slots=1),
        ),
        GROUPS,
    )
    b = spans(
        record(
            part("n1", PartState.SUCCEEDED, 100.0, 200.0, slots=4),
            job_id="j-000002",
            user="bob",
            account="ml",
        ),
        GROUPS,
    )
    by_user = totals(a + b, since=50.0, until=150.0, by="user")
    assert by_user == {
        "alice": Total(50.0 + 50.0, 100.0 + 50.0, 50.0, 1),
        "bob": Total(50.0, 200.0, 0.0, 1),
    }
    assert set(totals(a + b, since=50.0, until=150.0, by="account")) == {"staff", "ml"}
    assert totals(a + b, since=200.0, until=300.0) == {}  # touching the window is not using it
    with pytest.raises(ValueError, match="by must be one of user, account"):
        totals(a, since=0.0, until=1.0, by="node")


def test_report_filters_by_user_and_account_and_shows_names_and_numbers_only():
    all_spans = spans(record(part("n1", PartState.SUCCEEDED, 0.0, 3600.0)), GROUPS) + spans(
        record(
            part("n1", PartState.SUCCEEDED, 0.0, 7200.0, gpus=1),
            job_id="j-000002",
            user="bob",
            account="ml",
        ),
        GROUPS,
    )
    doc = report(all_spans, since=None, until=10000.0, user="bob")
    assert doc == {
        "since": None,
        "until": 10000.0,
        "users": [
            {
                "user": "bob",
                "node_seconds": 7200.0,
                "slot_seconds": 14400.0,
                "gpu_seconds": 7200.0,
                "jobs": 1,
            }
        ],
        "accounts": [
            {
                "account": "ml",
                "node_seconds": 7200.0,
                "slot_seconds": 14400.0,
                "gpu_seconds": 7200.0,
                "jobs": 1,
            }
        ],
    }
    assert [
        r["user"] for r in report(all_spans, since=None, until=1e4, account="staff")["users"]
    ] == ["alice"]
    assert report(all_spans, since=None, until=1e4, user="carol")["users"] == []
    text = render.usage_tables({**doc, "retention": 30 * 86400})
    assert "the oldest job known (ended jobs are kept 30d)" in text
    assert "bob   2.00        4.00        2.00       1" in text and "ml       2.00" in text
    assert render.hours(1.0) == "<0.01" and render.hours(0) == "0.00"


def test_decay_is_the_closed_form_of_a_half_life():
    h = 3600.0
    one = [Span("j", "n", "u", "a", 0.0, 100.0, 1, 0)]
    steps = 100000
    numeric = (
        sum(2 ** (-(200.0 - (i + 0.5) * 100.0 / steps) / h) for i in range(steps)) * 100.0 / steps
    )
    assert decayed(one, 200.0, h)["a"] == pytest.approx(numeric, rel=1e-9)
    assert decayed(one, 100.0 + h, h)["a"] == pytest.approx(
        decayed(one, 100.0, h)["a"] / 2, rel=1e-12
    )
    assert decayed(one, 100.0, 1e15)["a"] == pytest.approx(100.0, rel=1e-9)  # no decay to speak of
    assert decayed(one, 100.0, 0.0) == {"a": 0.0}  # no history kept
    assert decayed(one, 50.0, h)["a"] < 50.0  # what comes after now is not used yet
    running_ = [replace(one[0], end=None)]
    assert decayed(running_, 50.0, h) == decayed([replace(one[0], end=50.0)], 50.0, h)


# -- properties ------------------------------------------------------------------------------------

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
times = st.floats(0.0, 1e6, allow_nan=False)


@st.composite
def some_spans(draw) -> list[Span]:
    found = []
    for i in range(draw(st.integers(0, 8))):
        start, length = draw(times), draw(st.floats(0.0, 1e5))
        end = None if draw(st.booleans()) and i % 3 == 0 else start + length
        found.append(
            Span(
                f"j-{i % 4}",
                f"n{i % 3}",
                draw(st.sampled_from(["alice", "bob"])),
                draw(st.sampled_from(["ml", "staff"])),
                start,
                end,
                draw(st.integers(1, 8)),
                draw(st.integers(0, 8)),
            )
        )
    return found


@PROPERTY
@given(some_spans(), times, st.floats(1.0, 1e7))
def test_decayed_usage_is_never_more_than_the_usage(found, now, half_life):
    used = totals(found, since=-math.inf, until=now, by="account")
    for account, value in decayed(found, now, half_life).items():
        assert 0.0 <= value <= used.get(account, Total()).node_seconds * (1 + 1e-12)


@PROPERTY
@given(some_spans(), times, st.floats(1.0, 1e7))
def test_finished_usage_halves_over_one_half_life(found, now, half_life):
    finished = [
        replace(s, end=min(s.end if s.end is not None else now, now))
        for s in found
        if s.start <= now
    ]
    later = decayed(finished, now + half_life, half_life)
    for account, value in decayed(finished, now, half_life).items():
        assert later[account] == pytest.approx(value / 2, rel=1e-9, abs=1e-300)


@PROPERTY
@given(some_spans(), st.lists(times, min_size=3, max_size=3), st.sampled_from(["user", "account"]))
def test_window_clipping_is_additive(found, cuts, by):
    a, b, c = sorted(cuts)
    whole = totals(found, since=a, until=c, by=by)
    parts = [totals(found, since=a, until=b, by=by), totals(found, since=b, until=c, by=by)]
    for key, total in whole.items():
        for field in ("node_seconds", "slot_seconds", "gpu_seconds"):
            split = sum(getattr(p.get(key, Total()), field) for p in parts)
            assert split == pytest.approx(getattr(total, field), rel=1e-9, abs=1e-6)
    assert set(whole) == set(parts[0]) | set(parts[1])


# -- running sums: what the fair share reads at every plan ---------------------------------------


@st.composite
def histories(draw) -> list[tuple[float, JobRecord]]:
    """Records of a few jobs as they change over time: (when it was read, the record)."""
    now, out = 1000.0, []
    for _ in range(draw(st.integers(1, 12))):
        now += draw(st.floats(0.0, 5e4))
        job = draw(st.integers(0, 3))
        ran = now - draw(st.floats(0.0, 2e4))
        ended = draw(st.booleans())
        state = PartState.SUCCEEDED if ended else PartState.RUNNING
        end = now - draw(st.floats(0.0, ran and now - ran)) if ended else now
        parts = [part(f"n{job}", state, ran, end, slots=draw(st.integers(1, 4)))]
        if draw(st.booleans()):
            parts.append(part("m", PartState.RUNNING, ran + 1.0, now))
        account = ("ml", "")[job % 2]
        out.append((now, record(*parts, job_id=f"j-{job:06d}", account=account)))
    return out


def _used(found: dict[str, float]) -> dict[str, float]:
    return {account: value for account, value in found.items() if value >= 1e-9}


@PROPERTY
@given(histories(), st.floats(0.0, 1e5), st.sampled_from([60.0, 3600.0, 7 * 86400.0]))
def test_running_sums_are_the_decayed_usage_of_every_records_latest(history, after, half_life):
    """Fed each record as it changes, the sums say what ``decayed`` says of every job's
    latest record, at any later time (also past many half-lives: the reference moves on)."""
    sums, latest = UsageSums(half_life, GROUPS), {}
    for now, rec in history:
        sums.update(rec, now)
        latest[rec.id] = rec
        want = decayed((sp for r in latest.values() for sp in spans(r, GROUPS)), now, half_life)
        assert _used(sums.at(now)) == pytest.approx(_used(want), rel=1e-9, abs=1e-9)
    later = history[-1][0] + after
    want = decayed((sp for r in latest.values() for sp in spans(r, GROUPS)), later, half_life)
    assert _used(sums.at(later)) == pytest.approx(_used(want), rel=1e-9, abs=1e-9)


def test_running_sums_keep_no_history_with_no_half_life_and_survive_a_long_silence():
    rec = record(part("a", PartState.SUCCEEDED, 0.0, 3600.0))
    none = UsageSums(0.0, GROUPS)
    none.update(rec, 3600.0)
    assert none.at(7200.0) == {}
    sums = UsageSums(1.0, GROUPS)  # a half-life of a second: 10**5 of them go by, no overflow
    sums.update(rec, 3600.0)
    assert sums.at(3600.0) == pytest.approx({"staff": 1 / math.log(2)})
    assert sums.at(1e5) == {"staff": 0.0}
    again = record(part("a", PartState.SUCCEEDED, 2e5 - 10, 2e5))
    sums.update(again, 2e5)
    assert sums.at(2e5) == pytest.approx(decayed(spans(again, GROUPS), 2e5, 1.0))
