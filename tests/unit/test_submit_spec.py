"""The JobSpec a submit request asks for (pure): defaults from the daemon's config, torchrun's
flags carried through, bad values refused as invalid_spec."""

import pytest

from elasticd import config
from elasticd.control.commands import spec_from_request
from elasticd.control.server import Caller
from elasticd.core.model import JobSpec
from elasticd.errors import InvalidSpec
from elasticd.jobs.accounts import account_of

CALLER = Caller(uid=1000, gid=1000, pid=1)
ARGS = {"argv": ["train.py"], "python": "/usr/bin/python3", "workdir": "/w"}


def build(**args):
    return spec_from_request(
        {**ARGS, **args}, CALLER, config.load(None), job_id="j-1", node="n1", now=5.0
    )


def test_torchrun_defaults():
    spec = build()
    assert (spec.role, spec.master_port, spec.nproc_per_node) == ("default", 0, 1)


def test_role_master_port_and_nproc_words_are_carried():
    spec = build(role="trainer", master_port=29555, nproc_per_node="auto")
    assert (spec.role, spec.master_port, spec.nproc_per_node) == ("trainer", 29555, "auto")


def test_the_schedulers_fields_are_carried_and_the_account_defaults_to_the_callers_group():
    import grp

    spec = build()
    assert (spec.priority, spec.preemptible, spec.nnodes_step) == (0, False, 1)
    assert spec.account == ""  # the caller's own group: kept empty, named where shown
    try:
        assert account_of(spec) == grp.getgrgid(CALLER.gid).gr_name
    except KeyError:  # no group 1000 on this host: its number
        assert account_of(spec) == "1000"
    spec = build(priority=-7, account="ml", preemptible=True, nnodes="2:8", nnodes_step=2)
    assert (spec.priority, spec.account, spec.preemptible, spec.nnodes_step) == (-7, "ml", True, 2)
    assert JobSpec.from_json(spec.to_json()) == spec


@pytest.mark.parametrize(
    "args, words",
    [
        ({"role": ""}, "role"),
        ({"master_port": 70000}, "master_port"),
        ({"nproc_per_node": "xpu"}, "one of N, gpu, cpu, auto"),
        ({"priority": 2_000_000}, "priority must be an integer from -1000000 to 1000000"),
        (
            {"nnodes": "3:3", "nnodes_step": 2},
            "no node count from 3 to 3 is a multiple of --nnodes-step 2",
        ),
        ({"account": "a b"}, "account must be a group name"),
    ],
)
def test_bad_values_are_invalid_specs(args, words):
    with pytest.raises(InvalidSpec, match=words):
        build(**args)


def test_spares_are_for_in_place_jobs_only():
    from elasticd.core.model import InvalidSpec, JobSpec

    base = dict(id="j-1", argv=("t.py",), python="/p", workdir="/w", uid=1, gid=1, user="u")
    assert JobSpec(**base, in_place=True, spares=2).spares == 2
    with pytest.raises(InvalidSpec, match="add --in-place"):
        JobSpec(**base, spares=1)
    with pytest.raises(InvalidSpec, match="spares must be"):
        JobSpec(**base, in_place=True, spares=-1)
