"""A private daemon's job (daemon/elasticd/private.py) against an in-memory store: the job's id
agreed by the first claim, this node's own command line put in place of the record's, a job
whose settings differ refused with the reason, the GPUs elasticrun was given, the store's
loss and elasticrun's end, each telling elasticrun on the channel."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
from pathlib import Path

import pytest

from elasticd.config import DaemonConfig
from elasticd.core.model import JobState
from elasticd.core.records import JobRecord, Outcome
from elasticd.jobs.board import IdTaken
from elasticd.private import Private, PrivateError
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer

ROOT = "elasticd/elasticrun-t"
REQUEST = {
    "argv": ["train.py", "--lr", "0.1", "--token", "s3cret"],
    "kind": "script",
    "python": "/usr/bin/python3",
    "workdir": "/work",
    "env": {"WANDB_API_KEY": "s3cret", "CUDA_VISIBLE_DEVICES": "2,3"},
    "nnodes": "2:3",
    "nproc_per_node": 2,
    "max_restarts": 0,
}


def private(tmp_path: Path, name: str, request: dict | None = None, keyless: bool = False):
    """A Private of its own directory, and elasticrun's end of its channel."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "job.json").write_text(
        json.dumps({"request": request or REQUEST, "run_id": "t", "keyless": keyless})
    )
    ours, theirs = socket.socketpair()
    return Private(str(directory), ours.detach()), theirs


def said(channel: socket.socket) -> list[dict]:
    channel.settimeout(5)
    data = b""
    while not data.endswith(b"\n"):
        data += channel.recv(65536)
    return [json.loads(line) for line in data.splitlines()]


def test_the_first_claim_wins_and_every_node_runs_its_own_line(tmp_path):
    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        first, _ = private(tmp_path, "a")
        other = {**REQUEST, "argv": ["train.py", "--lr", "0.2"], "env": {"HOST": "b"}}
        second, _ = private(tmp_path, "b", other)
        await first.claim(store, signer, ROOT, DaemonConfig(), "a-1")
        await second.claim(store, signer, ROOT, DaemonConfig(), "b-2")
        return first, second

    first, second = asyncio.run(main())
    assert first.submits and not second.submits
    assert first.job_id == second.job_id and first.job_id.startswith("j-")
    record_spec = dataclasses.replace(first.own, argv=("train.py",), env={})  # as published
    for node, line in ((first, REQUEST), (second, {"argv": ["train.py", "--lr", "0.2"]})):
        runs = node.spec(record_spec)
        assert list(runs.argv) == line["argv"]
        assert runs.env == node.own.env and runs.uid == os.getuid()
    assert second.spec(record_spec).env == {"HOST": "b"}
    with pytest.raises(PrivateError, match=f"runs job {first.job_id} only"):
        first.spec(dataclasses.replace(record_spec, id="j-000000"))


def test_a_claim_under_another_key_is_refused_saying_why(tmp_path):
    async def main():
        store = AsyncMemoryStore(MemoryStore())
        first, _ = private(tmp_path, "a")
        await first.claim(store, Signer(b"k" * 32, "elasticrun-t"), ROOT, DaemonConfig(), "a")
        second, _ = private(tmp_path, "b")
        await second.claim(store, Signer(b"x" * 32, "elasticrun-t"), ROOT, DaemonConfig(), "b")

    with pytest.raises(PrivateError, match="does not open with this node's key"):
        asyncio.run(main())


CLAIM, JOB = f"{ROOT}/elasticrun/claim", f"{ROOT}/elasticrun/job"


async def join(node: Private, store: AsyncMemoryStore, signer: Signer) -> None:
    """What a node's daemon does once up, up to the job's submit (the job key)."""
    await node.agree(store, signer, ROOT)
    if node.submitted:
        await store.set(JOB, signer.seal(JOB, {"job": node.job_id}))


def test_a_node_that_stops_before_its_submit_withdraws_its_claim_only(tmp_path):
    """Ctrl-C, or a failed start, after this node won the claim: the next node (this one run
    again) claims anew instead of adopting a job that will never be submitted."""

    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        first, _ = private(tmp_path, "a")
        await first.claim(store, signer, ROOT, DaemonConfig(), "a-1")
        await first.withdraw(store, signer, ROOT)
        again, _ = private(tmp_path, "b")
        await again.claim(store, signer, ROOT, DaemonConfig(), "a-2")
        assert again.submits and again.job_id == first.job_id  # never submitted: the same id
        theirs = await store.get(CLAIM)
        await first.withdraw(store, signer, ROOT)  # not its claim any more: left alone
        assert await store.get(CLAIM) == theirs
        await join(again, store, signer)
        await again.withdraw(store, signer, ROOT)  # submitted: the job's for good
        held = signer.open(CLAIM, await store.get(CLAIM)).body
        assert held == {"job": again.job_id, "node": "a-2", "state": "submitting"}

    asyncio.run(main())


def test_a_withdrawn_claim_is_taken_at_once_by_a_node_that_waits(tmp_path):
    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        first, _ = private(tmp_path, "a")
        second, _ = private(tmp_path, "b")
        await first.claim(store, signer, ROOT, DaemonConfig(), "a-1")
        await second.claim(store, signer, ROOT, DaemonConfig(), "b-2")
        await first.withdraw(store, signer, ROOT)
        await asyncio.wait_for(join(second, store, signer), 5)  # CLAIM_STALE is 30 s
        assert second.submitted and second.job_id == first.job_id

    asyncio.run(main())


def test_a_claim_whose_node_died_before_its_submit_is_taken_over_by_one_node(tmp_path, monkeypatch):
    """SIGKILL leaves no time to withdraw: the claim stands, never followed by a submit.  The
    nodes that wait take it over after CLAIM_STALE, one of them to submit the job under the
    same id; the claim's node, if it was only slow, waits for that one."""
    import elasticd.private as module

    monkeypatch.setattr(module, "CLAIM_STALE", 0.2)
    monkeypatch.setattr(module, "CLAIM_POLL", 0.02)

    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        dead, second, third = (private(tmp_path, name)[0] for name in "abc")
        for node in (dead, second, third):
            await node.claim(store, signer, ROOT, DaemonConfig(), node.directory)
        await asyncio.wait_for(
            asyncio.gather(join(second, store, signer), join(third, store, signer)), 10
        )
        assert [second.submitted, third.submitted].count(True) == 1
        assert second.job_id == third.job_id == dead.job_id
        await dead.agree(store, signer, ROOT)  # it was only slow
        assert not dead.submitted

    asyncio.run(main())


def test_a_claim_whose_node_died_in_its_submit_is_taken_over_too(tmp_path, monkeypatch):
    """Killed after its claim went SUBMITTING, before the job was on the board: the nodes
    that waited for it waited out their join timeout (600 s by default) and failed."""
    import elasticd.private as module

    monkeypatch.setattr(module, "CLAIM_STALE", 0.2)
    monkeypatch.setattr(module, "CLAIM_POLL", 0.02)

    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        dead, second = (private(tmp_path, name)[0] for name in "ab")
        for node in (dead, second):
            await node.claim(store, signer, ROOT, DaemonConfig(), node.directory)
        await dead.agree(store, signer, ROOT)
        assert dead.submitted  # and killed here, its job never submitted
        await asyncio.wait_for(join(second, store, signer), 10)
        assert second.submitted and second.job_id == dead.job_id

    asyncio.run(main())


class _Board:
    """A node's submit and fetch, where another node submitted the job first."""

    def __init__(self) -> None:
        self.record: JobRecord | None = None

    async def submit(self, spec):
        self.record = JobRecord(spec, seq=1)
        raise IdTaken(spec.id)

    async def fetch(self, job_id):
        return self.record


def test_a_node_that_took_over_a_slow_claim_runs_the_job_its_node_submitted(tmp_path, monkeypatch):
    """Two nodes submit the job when one took over the other's claim while it was slow, not
    dead: the second finds the job on the board (IdTaken) and runs it as a node that waited
    would; it sets the job's key too (the first may have died between its submit and that)."""
    import elasticd.private as module

    monkeypatch.setattr(module, "CLAIM_STALE", 0.2)

    async def main():
        store = AsyncMemoryStore(MemoryStore())
        signer = Signer(b"k" * 32, "elasticrun-t")
        node, _ = private(tmp_path, "a")
        await node.claim(store, signer, ROOT, DaemonConfig(), "a")
        await node.join_job(store, signer, ROOT, _Board())
        assert node.submitted and not node.submits
        assert signer.open(JOB, await store.get(JOB)).body == {"job": node.job_id}

    asyncio.run(main())


def claimed(tmp_path: Path, name: str = "a", request: dict | None = None) -> Private:
    async def main():
        node, _ = private(tmp_path, name, request)
        await node.claim(
            AsyncMemoryStore(MemoryStore()), Signer(b"k" * 32, "c"), ROOT, DaemonConfig(), "n"
        )
        return node

    return asyncio.run(main())


def test_a_job_whose_settings_differ_from_this_lines_is_refused(tmp_path):
    node = claimed(tmp_path)
    theirs = dataclasses.replace(node.own, min_nodes=1, max_nodes=4, nproc_per_node=8)
    with pytest.raises(PrivateError) as info:
        node.check(JobRecord(theirs, seq=1))
    assert "min_nodes 2 here, 1 in the job; max_nodes 3 here, 4 in the job" in str(info.value)
    assert "nproc_per_node 2 here, 8 in the job" in str(info.value)
    node.check(JobRecord(node.own, seq=1))  # the same settings: taken


def test_a_rendezvous_id_that_already_ran_is_refused(tmp_path):
    node = claimed(tmp_path)
    ended = JobRecord(node.own, seq=1, outcome=Outcome(JobState.SUCCEEDED, ended=1.0))
    with pytest.raises(PrivateError, match=r"already ran to its end here .* new --rdzv-id"):
        node.check(ended)


@pytest.mark.parametrize(
    "visible, gpus", [("2,3", ("2", "3")), ("", ()), ("GPU-a1, GPU-b2", ("GPU-a1", "GPU-b2"))]
)
def test_the_gpus_are_those_elasticrun_was_given(tmp_path, visible, gpus):
    node, _ = private(tmp_path, "a", {**REQUEST, "env": {"CUDA_VISIBLE_DEVICES": visible}})
    assert node.gpus() == gpus
    assert private(tmp_path, "b", {**REQUEST, "env": {}})[0].gpus() is None  # the node's own


def test_workers_get_the_rendezvous_id_as_torchruns_do(tmp_path):
    node = claimed(tmp_path)
    assert node.worker_env(node.own) == {"TORCHELASTIC_RUN_ID": "t"}


def test_a_store_that_does_not_answer_ends_the_job_here_saying_why(tmp_path, monkeypatch):
    import elasticd.private as module

    monkeypatch.setattr(module, "STORE_LOST_AFTER", 0.05)
    node, elasticrun = private(tmp_path, "a")

    async def main():
        stop = asyncio.Event()
        node.store_health(False, "connection refused", stop, "h1:29400")
        node.store_health(True, "", stop, "h1:29400")  # back: the timer is off
        await asyncio.sleep(0.1)
        assert not stop.is_set()
        node.store_health(False, "connection refused", stop, "h1:29400")
        await asyncio.wait_for(stop.wait(), 5)

    asyncio.run(main())
    (news,) = said(elasticrun)
    assert "store at h1:29400 has not answered for 0.05 s (connection refused)" in news["error"]
    assert "--rdzv-backend etcd" in news["error"] and node.code == 1


def test_elasticrun_gone_before_the_daemon_serves_cancels_its_start(tmp_path):
    node, elasticrun = private(tmp_path, "a")

    async def start_up() -> int:
        await asyncio.sleep(60)  # a start-up that waits for a store, say
        return 0

    async def main() -> int:
        asyncio.get_running_loop().call_later(0.05, elasticrun.close)
        return await node.supervise(start_up, lambda: False)

    assert asyncio.run(main()) == 1 and node.orphaned.is_set()
    node.remove_directory()
    assert not (tmp_path / "a").exists()
