"""Placement (pure): oldest job first, constraints, room, disjoint GPUs."""

import pytest

from elasticd.core.model import JobSpec, JobState, PartState
from elasticd.core.placement import (
    Offer,
    Resources,
    beyond_standalone,
    choose_offers,
    fit,
    never_fits,
)
from elasticd.core.records import JobRecord, Outcome, Part


def record(
    job_id, seq, nproc=1, nnodes=(1, 1), nodes=(), exclude=(), parts=(), outcome=None, step=1
):
    spec = JobSpec(
        id=job_id,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1,
        gid=1,
        user="u",
        nproc_per_node=nproc,
        min_nodes=nnodes[0],
        max_nodes=nnodes[1],
        nodes=nodes,
        exclude=exclude,
        nnodes_step=step,
    )
    return JobRecord(spec, seq, {p.node: p for p in parts}, outcome)


GPUS = ("0", "1", "2", "3")


@pytest.mark.parametrize(
    "nproc, free, has_gpus, offer",
    [
        (2, Resources(4), False, (2, ())),
        (5, Resources(4), False, None),
        ("gpu", Resources(8, GPUS), True, (4, GPUS)),
        ("gpu", Resources(8, ()), True, None),
        ("gpu", Resources(2, GPUS), True, None),
        (2, Resources(8, ("2", "3")), True, (2, ("2", "3"))),
        (3, Resources(8, ("2", "3")), True, None),
        # cpu: one worker per CPU of the node, no GPU taken (GPUs or not)
        ("cpu", Resources(8, (), cpus=2), False, (2, ())),
        ("cpu", Resources(8, GPUS, cpus=6), True, (6, ())),
        ("cpu", Resources(4, (), cpus=6), False, None),  # more CPUs than slots
        ("cpu", Resources(8, ()), False, None),  # CPU count unknown (an older daemon)
        # auto: gpu on a node with GPUs, cpu on one without
        ("auto", Resources(8, GPUS, cpus=16), True, (4, GPUS)),
        ("auto", Resources(8, (), cpus=16), True, None),  # a GPU node whose GPUs are all taken
        ("auto", Resources(8, (), cpus=2), False, (2, ())),
        ("auto", Resources(1, (), cpus=2), False, None),
    ],
)
def test_fit(nproc, free, has_gpus, offer):
    got = fit(record("j", 1, nproc=nproc).spec, free, has_gpus)
    assert (got and (got.nproc, got.gpus)) == offer or (got is None and offer is None)


def test_oldest_first_and_resources_are_used_up():
    jobs = [record("j-b", 2, nproc=2), record("j-a", 1, nproc=2), record("j-c", 3, nproc=1)]
    assert choose_offers(jobs, "n1", Resources(3), has_gpus=False, busy=set()) == [
        Offer("j-a", 2, ()),
        Offer("j-c", 1, ()),
    ]


def test_a_cpu_job_leaves_the_gpus_and_the_cpu_count_to_the_jobs_behind_it():
    jobs = [
        record("j-a", 1, nproc="cpu"),
        record("j-b", 2, nproc="gpu"),
        record("j-c", 3, nproc="auto"),
    ]
    offers = choose_offers(jobs, "n1", Resources(12, GPUS, cpus=4), has_gpus=True, busy=set())
    assert offers == [Offer("j-a", 4, ()), Offer("j-b", 4, GPUS)]  # j-c: no GPU left


def test_gpus_are_split_between_jobs():
    jobs = [record("j-a", 1, nproc=2), record("j-b", 2, nproc=2)]
    offers = choose_offers(jobs, "n1", Resources(8, GPUS), has_gpus=True, busy=set())
    assert [o.gpus for o in offers] == [("0", "1"), ("2", "3")]


@pytest.mark.parametrize(
    "job, why",
    [
        (record("j", 1, nodes=("n2",)), "not among --nodes"),
        (record("j", 1, exclude=("n1",)), "excluded"),
        (record("j", 1, outcome=Outcome(JobState.CANCELLED, 1.0)), "ended"),
        (
            record(
                "j",
                1,
                nnodes=(1, 2),
                parts=(Part("a", PartState.RUNNING), Part("b", PartState.RUNNING)),
            ),
            "at its max",
        ),
        (record("j", 1, parts=(Part("n1", PartState.SUCCEEDED),)), "our share ended"),
    ],
)
def test_jobs_this_node_does_not_offer_itself_to(job, why):
    assert choose_offers([job], "n1", Resources(8), has_gpus=False, busy=set()) == [], why


def test_busy_draining_and_left():
    job = record(
        "j", 1, nnodes=(1, 3), parts=(Part("n1", PartState.LEFT), Part("a", PartState.RUNNING))
    )
    assert choose_offers([job], "n1", Resources(8), has_gpus=False, busy=set()) == [
        Offer("j", 1, ())
    ]
    assert choose_offers([job], "n1", Resources(8), has_gpus=False, busy={"j"}) == []
    assert choose_offers([job], "n1", Resources(8), has_gpus=False, busy=set(), draining=True) == []


def _node(name, slots, gpus=0, cpus=None):
    node = {"name": name, "slots_total": slots, "gpus_total": gpus}
    return node if cpus is None else {**node, "cpus_total": cpus}  # None: an older daemon's entry


@pytest.mark.parametrize(
    "nproc, nodes, exclude, words",
    [
        (2, [_node("a", 4)], (), None),
        (8, [_node("a", 4), _node("b", 8)], (), None),  # b could
        (
            8,
            [_node("a", 4), _node("b", 8)],
            ("b",),
            "no node can run 8 workers on its own: a has 4 slots",
        ),
        ("gpu", [_node("a", 4)], (), "no node can run one worker per GPU"),
        ("gpu", [_node("a", 4, 2)], (), None),
        (3, [_node("a", 8, 2)], (), "a has 8 slots and 2 GPUs"),  # a GPU node: one GPU a worker
        (1, [_node("a", 1)], ("a",), "every node is excluded"),
        (9, [], (), None),  # nothing seen yet: no verdict
        ("cpu", [_node("a", 2, cpus=2)], (), None),
        ("cpu", [_node("a", 8, 4, cpus=8)], (), None),  # a GPU node runs CPU workers too
        (
            "cpu",
            [_node("a", 2, cpus=4)],
            (),
            "no node can run one worker per CPU on its own: a has 2 slots, 4 CPUs",
        ),
        (
            "cpu",
            [_node("a", 2)],
            (),
            "no node can run one worker per CPU",
        ),  # an older daemon: CPUs unknown
        ("auto", [_node("a", 2, cpus=2)], (), None),
        ("auto", [_node("a", 8, 2, cpus=8)], (), None),
        (
            "auto",
            [_node("a", 1, 2, cpus=8)],
            (),
            "no node can run one worker per GPU (per CPU on a node without GPUs)",
        ),
    ],
)
def test_never_fits(nproc, nodes, exclude, words):
    problem = never_fits(record("j", 1, nproc=nproc, exclude=exclude).spec, nodes)
    assert problem is None if words is None else words in problem


def test_never_fits_names_unknown_nodes():
    spec = record("j", 1, nodes=("a", "zz", "yy")).spec
    assert never_fits(spec, [_node("a", 4)]) == "no node named yy, zz; the job could never start"


SLOTS_HINT = "a node's slots default to its CPU count; `elasticd --slots N` or node.slots in the config raises them"


@pytest.mark.parametrize(
    "nproc, node, hint",
    [
        (4, _node("n1", 2, cpus=2), True),  # more slots would do
        ("cpu", _node("n1", 2, cpus=4), True),
        (3, _node("n1", 8, 2, cpus=8), False),  # a GPU node: one GPU a worker, slots are not short
        ("gpu", _node("n1", 8, cpus=8), False),  # no GPU at all
    ],
)
def test_never_fits_says_how_to_raise_slots_when_slots_are_short(nproc, node, hint):
    problem = never_fits(record("j", 1, nproc=nproc).spec, [node])
    assert problem.startswith("no node can run ") and "; the job could never start" in problem
    assert (SLOTS_HINT in problem) is hint


def test_never_fits_the_first_hour_message():
    problem = never_fits(record("j", 1, nproc=4).spec, [_node("n1", 2, cpus=2)])
    assert problem == (
        "no node can run 4 workers on its own: n1 has 2 slots, 2 CPUs and 0 GPUs; "
        f"the job could never start ({SLOTS_HINT})"
    )


@pytest.mark.parametrize(
    "nnodes, refused", [((1, 1), False), ((1, 3), False), ((2, 2), True), ((3, 4), True)]
)
def test_a_standalone_daemon_refuses_only_jobs_whose_min_needs_more_nodes(nnodes, refused):
    problem = beyond_standalone(record("j", 1, nnodes=nnodes).spec)
    if not refused:
        assert problem is None
    else:
        assert problem == (
            f"the daemon is standalone (a one-node cluster), so a job needing "
            f"{nnodes[0]} nodes can never start; use --nnodes 1 or run a cluster"
        )


def test_a_standalone_daemon_refuses_a_step_that_rounds_min_past_one_node():
    assert beyond_standalone(record("j", 1, nnodes=(1, 3), step=1).spec) is None
    assert beyond_standalone(record("j", 1, nnodes=(1, 4), step=2).spec) == (
        "the daemon is standalone (a one-node cluster), so a job needing 2 nodes "
        "(--nnodes-step 2) can never start; use --nnodes 1 or run a cluster"
    )


@pytest.mark.parametrize(
    "free, has_gpus, spares, gpus",
    [
        (Resources(4), False, 2, ()),  # room for both spares
        (Resources(2), False, 1, ()),  # room for one
        (Resources(1), False, 0, ()),  # none: the job still runs
        (Resources(8, GPUS), True, 2, GPUS[:3]),  # a spare takes a GPU of its own
        (Resources(8, GPUS[:1]), True, 0, GPUS[:1]),  # no GPU left for a spare
    ],
)
def test_spares_take_what_is_free_beyond_the_workers(free, has_gpus, spares, gpus):
    """Hot spares, --spares K: up to K warm workers a node, in free slots (and GPUs), never
    at the cost of the job's own workers; the jobs behind it see them used."""
    spec = record("j-a", 1, nproc=1).spec
    job = JobRecord(JobSpec(**{**spec.__dict__, "in_place": True, "spares": 2}), 1, {}, None)
    offers = choose_offers(
        [job, record("j-b", 2, nproc=1)], "n1", free, has_gpus=has_gpus, busy=set()
    )
    assert (offers[0].spares, offers[0].gpus, offers[0].slots) == (spares, gpus, 1 + spares)
    assert len(offers) == (
        2 if free.slots > 1 + spares and (not has_gpus or len(free.gpus) > len(gpus)) else 1
    )


def test_the_part_of_a_node_judged_lost_leaves_room_in_a_full_job():
    """A full job whose member was lost takes another node (a hot spare) in its place: the
    lost node's last word is no member, until it says something newer."""
    said = Part("n2", PartState.RUNNING)
    full = record("j-1", 1, nnodes=(2, 2), parts=(Part("n1", PartState.RUNNING), said))
    assert choose_offers([full], "n3", Resources(4), has_gpus=False, busy=set()) == []
    lost = {("j-1", "n2"): said}
    offers = choose_offers([full], "n3", Resources(4), has_gpus=False, busy=set(), lost=lost)
    assert [offer.job_id for offer in offers] == ["j-1"]
    back = record(
        "j-1",
        1,
        nnodes=(2, 2),
        parts=(Part("n1", PartState.RUNNING), Part("n2", PartState.RESTARTING)),
    )
    assert choose_offers([back], "n3", Resources(4), has_gpus=False, busy=set(), lost=lost) == []
