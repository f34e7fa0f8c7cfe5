"""What one user may submit (quotas, pure) and what a reply shows of a job (records, pure):
the caps on a command line, an environment and the jobs a user has not ended, each refusal
naming its config key; another user's job without its arguments or error text; `list` rows
that carry neither for anyone and stay small whatever was submitted."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest

from elasticd import config
from elasticd.control import server
from elasticd.core.model import Failure, JobSpec, JobState, PartState
from elasticd.core.quotas import SubmitLimits, argv_size, count_refusal, env_size, spec_refusal
from elasticd.core.records import (
    JobRecord,
    Outcome,
    Part,
    job_doc,
    list_row,
    listed_doc,
    others_view,
)
from elasticd.wire import protocol

KiB = 1024
LIMITS = SubmitLimits(argv_bytes=100, env_bytes=50, per_user=3)
SPEC = JobSpec(
    id="j-1",
    argv=("train.py", "--password", "hunter2"),
    python="/usr/bin/python3",
    workdir="/home/alice",
    uid=1001,
    gid=1001,
    user="alice",
    name="train.py",
    env={"DB_PASSWORD": "hunter2"},
    created=100.0,
)


def test_sizes_are_counted_as_execve_counts_them():
    assert argv_size(["a", "bc"]) == 5 and argv_size(["é"]) == 3
    assert env_size({"A": "1", "BC": ""}) == 4 + 4


@pytest.mark.parametrize(
    "changes, words",
    [
        ({}, None),
        ({"argv": ("x" * 99,)}, None),  # 99 bytes and a NUL: at the limit
        (
            {"argv": ("x" * 100,)},
            "command line is 101 bytes, over the limit (jobs.max_argv_bytes = 100)",
        ),
        ({"argv": ("t.py",) + ("y",) * 60}, "jobs.max_argv_bytes"),
        ({"env": {"A": "x" * 47}}, None),  # A=, 47 bytes and a NUL: at the limit
        (
            {"env": {"A": "x" * 48}},
            "environment (yours, with --env) is 51 bytes, over the limit (jobs.max_env_bytes = 50)",
        ),
        ({"workdir": "/" + "d" * 4096}, "workdir is longer than 4096 bytes"),
        ({"python": "/" + "p" * 4096}, "python is longer than 4096 bytes"),
        ({"nodes": tuple(f"n{i}" for i in range(4097))}, "--nodes may name at most 4096 nodes"),
        ({"exclude": ("h" * 256,)}, "--exclude may name at most 4096 nodes of at most 255 bytes"),
    ],
)
def test_spec_refusal(changes, words):
    spec = dataclasses.replace(SPEC, **{"env": {}, "argv": ("t.py",), **changes})
    found = spec_refusal(spec, LIMITS)
    assert found == words if words is None else words in found


@pytest.mark.parametrize(
    "open_jobs, limits, refused",
    [
        (0, LIMITS, False),
        (2, LIMITS, False),
        (3, LIMITS, True),
        (500, LIMITS, True),
        (10_000, SubmitLimits(per_user=0), False),  # 0: no limit
    ],
)
def test_count_refusal(open_jobs, limits, refused):
    found = count_refusal("nobody", open_jobs, limits)
    assert (found is not None) is refused
    if refused:
        assert f"nobody has {open_jobs} jobs that have not ended" in found
        assert f"(jobs.max_per_user = {limits.per_user})" in found


def test_the_defaults_are_the_configs():
    jobs = config.load().jobs
    assert jobs.limits == SubmitLimits() == SubmitLimits(128 * KiB, 128 * KiB, 100)
    assert config.load(overrides={"jobs.max_per_user": 0}).jobs.limits.per_user == 0
    with pytest.raises(config.ConfigError, match=r"jobs\.max_argv_bytes"):
        config.load(overrides={"jobs.max_argv_bytes": 0})


def failed_record() -> JobRecord:
    failure = Failure(
        rank=1,
        local_rank=1,
        node="n1",
        exit_code=1,
        message="RuntimeError: db password hunter2 refused",
        traceback="Traceback ...\nRuntimeError: db password hunter2 refused\n",
        timestamp=150.0,
    )
    workers = (
        {"rank": 0, "local_rank": 0, "node": "n1", "pid": 10, "state": "FAILED", "exit_code": 1},
    )
    return JobRecord(
        SPEC,
        1,
        {"n1": Part("n1", PartState.FAILED, round=0, group_rank=0, world_size=1, workers=workers)},
        Outcome(JobState.FAILED, 160.0, 1, "worker failed", failure, "n1"),
    )


def test_others_see_the_program_and_where_it_failed_not_the_arguments_or_the_error():
    full = job_doc(failed_record())
    assert full["argv"] == list(SPEC.argv) and "hunter2" in full["error"]["message"]
    assert full["redacted"] is False
    shown = others_view(full)
    assert "hunter2" not in json.dumps(shown)
    assert shown["argv"] == ["train.py"] and shown["redacted"] is True
    assert shown["error"] == {**full["error"], "message": "", "traceback": ""}
    hidden = ("argv", "error", "redacted", "checkpoint_dir")
    assert {k: v for k, v in shown.items() if k not in hidden} == {
        k: v for k, v in full.items() if k not in hidden
    }
    assert others_view({**full, "env": {"DB_PASSWORD": "hunter2"}}).get("env") is None
    assert others_view({**full, "checkpoint_dir": "/home/u/secret"}).get("checkpoint_dir") is None


def test_a_list_row_carries_no_arguments_environment_or_error_and_stays_small():
    big = dataclasses.replace(
        SPEC,
        argv=("train.py",) + ("x" * 1000,) * 3000,
        env={f"V{i}": "y" * 1000 for i in range(3000)},
    )
    record = dataclasses.replace(failed_record(), spec=big)
    row = list_row(record)
    assert len(json.dumps(row)) < 1000 and "hunter2" not in json.dumps(row)
    assert not {"argv", "env", "error", "workers", "nodes"} & row.keys()
    assert (
        row["state"],
        row["exit_code"],
        row["node_count"],
        row["workers_up"],
        row["workers_total"],
        row["world_size"],
    ) == ("FAILED", 1, 1, 0, 1, 1)
    assert listed_doc(record) == row


def test_a_reply_too_large_for_the_client_becomes_an_error_reply(monkeypatch):
    """The server's guard behind the caps: a result over MAX_REPLY is never sent as a frame
    the client would refuse; the request gets a too_large error instead."""
    sent: list[bytes] = []

    class Captured(server.Responder):
        async def _send(self, frame: bytes) -> None:
            sent.append(frame)

    async def handler(caller, request, reply) -> None:
        await reply.result({"jobs": ["x" * 2000]})

    monkeypatch.setattr(protocol, "MAX_REPLY", 1000)
    raw = protocol.encode_request(protocol.Request("r1", "list", {}))
    asyncio.run(
        server.answer(handler, None, raw, Captured(""), server.Outcomes(lambda op, result: None))
    )
    (frame,) = sent
    reply = protocol.decode_reply(frame)
    assert (reply.id, reply.ok, reply.code) == ("r1", False, "too_large")
    assert "over the control protocol's 1000" in reply.message
