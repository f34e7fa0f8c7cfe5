"""What bounds a job on a node: the decision table, the sizes it reads, the record it
publishes (decoded from other nodes defensively)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from elasticd.core.containment import (
    RLIMIT,
    V1,
    V2,
    Containment,
    JobLimits,
    decide,
    parse_memory,
    summary,
)

GiB = 1 << 30


@pytest.mark.parametrize(
    "value, total, size",
    [
        ("0", GiB, 0),
        ("1073741824", 0, GiB),
        ("64G", 0, 64 * GiB),
        ("512M", 0, 512 << 20),
        ("512MiB", 0, 512 << 20),
        ("2 GB", 0, 2 * GiB),
        ("1t", 0, 1 << 40),
        ("16k", 0, 16 << 10),
        ("90%", 10 * GiB, 9 * GiB),
        ("12.5%", 8 * GiB, GiB),
        ("100%", GiB, GiB),
    ],
)
def test_parse_memory(value, total, size):
    assert parse_memory(value, total) == size


@pytest.mark.parametrize("value", ["", "-1", "1.5G", "64X", "G", "0%", "101%", "90 %%", "ten"])
def test_parse_memory_refuses(value):
    with pytest.raises(ValueError):
        parse_memory(value, GiB)


def facts(**kw):
    base = dict(
        cgroup_reason="",
        controls={"pids": V2, "memory": V2},
        lacking={},
        pids_per_worker=1024,
        memory=0,
        slots=8,
        pid_max=4194304,
    )
    return base | kw


NO_PIDS = "/sys/fs/cgroup/unified does not offer it (cgroup.controllers: hugetlb)"


@pytest.mark.parametrize(
    "given_facts, pids_by, memory_by, missing",
    [
        (facts(), V2, V2, []),
        (
            facts(controls={"pids": V1, "memory": V1}, memory=GiB),
            V1,
            V1,
            [],
        ),  # a hybrid host's twins
        # no pids controller: RLIMIT_NPROC, and the node says so, and why
        (
            facts(controls={"memory": V2}, lacking={"pids": NO_PIDS}),
            RLIMIT,
            V2,
            [
                f"no pids controller ({NO_PIDS}): a job's processes and threads are bounded by "
                f"RLIMIT_NPROC instead (1024 per worker)"
            ],
        ),
        # no cgroups at all
        (
            facts(cgroup_reason="disabled by jobs.cgroup = off", controls={}),
            RLIMIT,
            "",
            [
                "no cgroups for jobs (disabled by jobs.cgroup = off): a job's processes are tracked by "
                "process group only",
                "no pids controller (no job cgroups): ",
            ],
        ),
        # a memory limit asked for and nothing to enforce it with
        (
            facts(controls={"pids": V2}, lacking={"memory": "x"}, memory=GiB),
            V2,
            "",
            ["jobs.max_memory is not enforced: no memory controller (x)"],
        ),
        # no limits asked for: nothing is missing, RLIMIT_NPROC is not set either
        (facts(controls={}, lacking={"pids": "y", "memory": "z"}, pids_per_worker=0), "", "", []),
        # the jobs together could still take every pid
        (
            facts(slots=64, pid_max=32768),
            V2,
            V2,
            [
                "64 slots x jobs.max_pids_per_worker 1024 = 65536 tasks, more than kernel.pid_max 32768"
            ],
        ),
        (facts(slots=64, pid_max=0), V2, V2, []),  # pid_max not known: nothing said
    ],
)
def test_decide(given_facts, pids_by, memory_by, missing):
    containment = decide(**given_facts)
    assert (containment.pids_by, containment.memory_by) == (pids_by, memory_by)
    assert containment.cgroup is (not given_facts["cgroup_reason"])
    assert len(containment.missing) == len(missing)
    for said, start in zip(containment.missing, missing):
        assert said.startswith(start), said
    if pids_by == RLIMIT:
        assert "does not bind jobs that run as root" in containment.missing[-1]


def test_what_a_job_gets():
    cgroup = decide(**facts(memory=GiB))
    assert cgroup.job_limits(4) == JobLimits(pids=4096, memory=GiB)
    assert cgroup.job_limits(0) == JobLimits(pids=1024, memory=GiB)  # never 0 (that is no limit)
    assert cgroup.rlimit_nproc(4) == 0  # the cgroup bounds it: the user's other tasks do not count
    fallback = decide(**facts(controls={}, lacking={"pids": "p", "memory": "m"}, memory=GiB))
    assert fallback.job_limits(4) == JobLimits()  # no cgroup to write them in
    assert fallback.rlimit_nproc(4) == 4096
    assert Containment().job_limits(2) == JobLimits() and Containment().rlimit_nproc(2) == 0
    assert summary(cgroup) == (
        f"job limits: tasks 1024 per worker ({V2}), memory {GiB} bytes ({V2})"
    )
    assert (
        summary(decide(**facts(controls={}, pids_per_worker=0)))
        == "job limits: tasks no limit (nothing enforces it), memory no limit (nothing enforces it)"
    )


def test_round_trip():
    containment = decide(**facts(controls={}, lacking={"pids": "p"}, memory=GiB))
    assert Containment.from_json(json.loads(json.dumps(containment.to_json()))) == containment


@pytest.mark.parametrize(
    "doc, decoded",
    [
        (None, None),
        ([], None),
        ("cgroup", None),
        ({}, Containment()),
        (
            {"cgroup": 1, "pids_per_worker": True, "memory": -5, "pids_by": 7, "missing": "x"},
            Containment(),
        ),
        (
            {"cgroup": True, "pids_per_worker": 2**70, "memory_by": "m" * 100, "missing": [1, "a"]},
            Containment(cgroup=True, memory_by="m" * 40, missing=("a",)),
        ),
        ({"missing": ["n" * 5000] * 20}, Containment(missing=("n" * 1000,) * 8)),
    ],
)
def test_from_json_is_tolerant(doc, decoded):
    assert Containment.from_json(doc) == decoded


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@given(
    st.dictionaries(
        st.sampled_from(["cgroup", "pids_per_worker", "pids_by", "memory", "memory_by", "missing"]),
        JSON,
    )
    | JSON
)
def test_from_json_never_raises(doc):
    decoded = Containment.from_json(doc)
    assert decoded is None or (len(decoded.missing) <= 8 and decoded.pids_per_worker >= 0)
