"""The JobSpec a submit request asks for (pure): defaults from the daemon's config, torchrun's
flags carried through, bad values refused as invalid_spec."""

import pytest

from elasticd import config
from elasticd.control.commands import spec_from_request
from elasticd.control.server import Caller
from elasticd.errors import InvalidSpec

CALLER = Caller(uid=1000, gid=1000, pid=1)
ARGS = {"argv": ["train.py"], "python": "/usr/bin/python3", "workdir": "/w"}


def build(**args):
    return spec_from_request({**ARGS, **args}, CALLER, config.load(None), job_id="j-1", node="n1", now=5.0)


def test_torchrun_defaults():
    spec = build()
    assert (spec.role, spec.master_port, spec.nproc_per_node) == ("default", 0, 1)


def test_role_master_port_and_nproc_words_are_carried():
    spec = build(role="trainer", master_port=29555, nproc_per_node="auto")
    assert (spec.role, spec.master_port, spec.nproc_per_node) == ("trainer", 29555, "auto")


@pytest.mark.parametrize("args, words", [
    ({"role": ""}, "role"), ({"master_port": 70000}, "master_port"),
    ({"nproc_per_node": "xpu"}, "one of N, gpu, cpu, auto"),
])
def test_bad_values_are_invalid_specs(args, words):
    with pytest.raises(InvalidSpec, match=words):
        build(**args)
