"""Placement (pure): oldest job first, constraints, room, disjoint GPUs."""

import pytest

from elasticd.records import JobRecord, Outcome, Part
from elasticd.model import JobSpec, JobState, PartState
from elasticd.placement import Offer, Resources, fit, place


def record(job_id, seq, nproc=1, nnodes=(1, 1), nodes=(), exclude=(), parts=(), outcome=None):
    spec = JobSpec(id=job_id, argv=("t.py",), python="/p", workdir="/w", uid=1, gid=1, user="u",
                   nproc_per_node=nproc, min_nodes=nnodes[0], max_nodes=nnodes[1], nodes=nodes,
                   exclude=exclude)
    return JobRecord(spec, seq, {p.node: p for p in parts}, outcome)


GPUS = ("0", "1", "2", "3")


@pytest.mark.parametrize("nproc, free, has_gpus, offer", [
    (2, Resources(4), False, (2, ())),
    (5, Resources(4), False, None),
    ("gpu", Resources(8, GPUS), True, (4, GPUS)),
    ("gpu", Resources(8, ()), True, None),
    ("gpu", Resources(2, GPUS), True, None),
    (2, Resources(8, ("2", "3")), True, (2, ("2", "3"))),
    (3, Resources(8, ("2", "3")), True, None),
])
def test_fit(nproc, free, has_gpus, offer):
    got = fit(record("j", 1, nproc=nproc).spec, free, has_gpus)
    assert (got and (got.nproc, got.gpus)) == offer or (got is None and offer is None)


def test_oldest_first_and_resources_are_used_up():
    jobs = [record("j-b", 2, nproc=2), record("j-a", 1, nproc=2), record("j-c", 3, nproc=1)]
    assert place(jobs, "n1", Resources(3), has_gpus=False, busy=set()) == [
        Offer("j-a", 2, ()), Offer("j-c", 1, ())]


def test_gpus_are_split_between_jobs():
    jobs = [record("j-a", 1, nproc=2), record("j-b", 2, nproc=2)]
    offers = place(jobs, "n1", Resources(8, GPUS), has_gpus=True, busy=set())
    assert [o.gpus for o in offers] == [("0", "1"), ("2", "3")]


@pytest.mark.parametrize("job, why", [
    (record("j", 1, nodes=("n2",)), "not among --nodes"),
    (record("j", 1, exclude=("n1",)), "excluded"),
    (record("j", 1, outcome=Outcome(JobState.CANCELLED, 1.0)), "ended"),
    (record("j", 1, nnodes=(1, 2), parts=(Part("a", PartState.RUNNING), Part("b", PartState.RUNNING))),
     "at its max"),
    (record("j", 1, parts=(Part("n1", PartState.SUCCEEDED),)), "our share ended"),
])
def test_jobs_this_node_does_not_offer_itself_to(job, why):
    assert place([job], "n1", Resources(8), has_gpus=False, busy=set()) == [], why


def test_busy_draining_and_left():
    job = record("j", 1, nnodes=(1, 3), parts=(Part("n1", PartState.LEFT), Part("a", PartState.RUNNING)))
    assert place([job], "n1", Resources(8), has_gpus=False, busy=set()) == [Offer("j", 1, ())]
    assert place([job], "n1", Resources(8), has_gpus=False, busy={"j"}) == []
    assert place([job], "n1", Resources(8), has_gpus=False, busy=set(), draining=True) == []


def _node(name, slots, gpus=0):
    return {"name": name, "slots_total": slots, "gpus_total": gpus}


@pytest.mark.parametrize("nproc, nodes, exclude, words", [
    (2, [_node("a", 4)], (), None),
    (8, [_node("a", 4), _node("b", 8)], (), None),                 # b could
    (8, [_node("a", 4), _node("b", 8)], ("b",), "no node can run 8 workers on its own: a has 4 slots"),
    ("gpu", [_node("a", 4)], (), "no node can run one worker per GPU"),
    ("gpu", [_node("a", 4, 2)], (), None),
    (3, [_node("a", 8, 2)], (), "a has 8 slots and 2 GPUs"),       # a GPU node: one GPU a worker
    (1, [_node("a", 1)], ("a",), "every node is excluded"),
    (9, [], (), None),                                              # nothing seen yet: no verdict
])
def test_never_fits(nproc, nodes, exclude, words):
    from elasticd.placement import never_fits
    problem = never_fits(record("j", 1, nproc=nproc, exclude=exclude).spec, nodes)
    assert problem is None if words is None else words in problem


def test_never_fits_names_unknown_nodes():
    from elasticd.placement import never_fits
    spec = record("j", 1, nodes=("a", "zz", "yy")).spec
    assert never_fits(spec, [_node("a", 4)]) == "no node named yy, zz"
