"""elasticd.elastic.runtime's group forming, on torch's real TCPStore and gloo."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from harness import ROOT
from hostwide import free_port

AFTER_A_FAILED_INIT = textwrap.dedent("""
    import datetime, os, socket
    import torch.distributed as dist
    from elasticd.elastic.runtime import init_default_group
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]  # nobody listens there
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="1", WORLD_SIZE="2",
                      TORCH_DIST_INIT_BARRIER="0")
    try:
        dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=0.2))
    except Exception:
        pass
    assert not dist.is_initialized()
    os.environ.update(RANK="0", WORLD_SIZE="1")
    init_default_group("gloo")
    print(dist.distributed_c10d._get_default_group().group_name)
""")


def test_a_group_formed_after_a_failed_init_has_the_name_its_peers_have():
    """A failed init left torch's counter at 1: the next default group was "1", and its peers'
    "0" (a 3-node in-place job hung in gloo's rendezvous after a forming was given up)."""
    run = subprocess.run(
        [sys.executable, "-c", AFTER_A_FAILED_INIT],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split()[-1] == "0"


# A worker whose round-2 forming is given up (a place in round 3 came) while its init is
# stuck on a peer that still listens: the init connects again after each failure, as
# torch's store client does while it is built.  ``once``: it gives up at the second
# failure; ``never``: it never does.
STUCK_FORMING = textwrap.dedent("""
    import os, socket, sys, time
    from elasticd.elastic import runtime
    from elasticd.elastic.errors import GroupAborted
    agent, mode = sys.argv[1], sys.argv[2]
    def init_default_group(backend):
        failures = 0
        while True:
            try:
                with socket.create_connection(("127.0.0.1", int(os.environ["MASTER_PORT"]))) as conn:
                    if conn.recv(1) == b"":  # shut down: the peer never answers otherwise
                        failures += 1
            except OSError:  # the peer's backlog is full: again
                time.sleep(0.01)
            if mode == "once" and failures == 2:
                raise RuntimeError("gloo: connection closed by peer")
    runtime.init_default_group = init_default_group
    worker = runtime.Runtime(agent, 0, "gloo")
    try:
        worker.join("start")
    except GroupAborted as exc:
        worker.channel.place_after(worker.round, "failure", str(exc))
""")


def _stuck_forming(
    mode: str, base: Path
) -> tuple[subprocess.Popen[str], list[dict], socket.socket]:
    """The worker (STUCK_FORMING) placed in round 2 with a peer that listens and never
    answers, then in round 3 once it connected there; returns it, what it asked (the agent
    is gone then) and the peer, still listening."""
    path = str(base / "agent.sock")
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(path)
    agent.listen()
    peer = socket.create_server(("127.0.0.1", 0))
    env = {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(peer.getsockname()[1]),
    }
    worker = subprocess.Popen(
        [sys.executable, "-c", STUCK_FORMING, path, mode],
        text=True,
        stderr=subprocess.PIPE,
        env={"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"},
    )
    conn, _ = agent.accept()
    conn.settimeout(60)
    lines = conn.makefile("r")
    asked = []
    for doc in map(json.loads, lines):
        if doc["op"] == "ready":
            asked.append(doc)
            break
    conn.sendall(json.dumps({"op": "place", "round": 2, "env": env}).encode() + b"\n")
    peer.settimeout(60)
    held = peer.accept()  # the worker forms round 2 there
    conn.sendall(
        json.dumps({"op": "place", "round": 3, "env": {**env, "RANK": "0"}}).encode() + b"\n"
    )
    conn.settimeout(30)
    try:
        asked += [doc for doc in map(json.loads, lines) if doc["op"] == "ready"]
    except (OSError, ValueError):
        pass
    for sock in (held[0], conn, agent):
        sock.close()
    return worker, asked, peer


def test_a_given_up_forming_that_connects_again_fails_and_the_worker_asks_anew(tmp_path: Path):
    """The newer place shut the forming's sockets down once; the init connected again and
    waited there (gloo's timeout: 30 minutes) while its round's peers formed round 3."""
    worker, asked, peer = _stuck_forming("once", tmp_path)
    try:
        assert worker.wait(30) == 0, worker.stderr.read()
        assert [(a["round"], a["why"]) for a in asked] == [(-1, "start"), (2, "failure")]
    finally:
        worker.kill()
        peer.close()


def test_a_given_up_forming_that_never_ends_ends_the_worker(tmp_path: Path):
    """As a store client retrying a rank 0 that gave the round up (py-spy, in a hang of
    test_in_place's late first round): the worker exits, and its agent restarts it."""
    worker, asked, peer = _stuck_forming("never", tmp_path)
    try:
        assert worker.wait(60) == 75
        assert "still forms after 5 s; this worker exits" in worker.stderr.read()
        assert [a["why"] for a in asked] == ["start"]
    finally:
        worker.kill()
        peer.close()


def test_nccl_asynchronous_errors_are_named_and_success_is_none():
    """group_error reads Backend.get_error (NCCL's asynchronous error; stand-ins here: no GPU)."""
    import enum

    from elasticd.elastic.runtime import group_error

    class ErrorType(enum.Enum):
        SUCCESS = 0
        REMOTE_ERROR = 3

    class Backend:
        def __init__(self, error):
            self.error = error

        def get_error(self):
            return self.error

    class Unsupported:
        def get_error(self):
            raise RuntimeError("not supported by this backend")

    assert group_error(Backend(ErrorType.SUCCESS)) is None
    assert group_error(Backend(ErrorType.REMOTE_ERROR)) == "REMOTE_ERROR"
    assert group_error(Unsupported()) is None
    assert group_error(object()) is None


RECORDER = textwrap.dedent("""
    import json, os, socket, sys
    import torch.distributed as dist
    from elasticd.elastic import runtime
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(sys.argv[1])
    agent.listen()
    runtime.Runtime(sys.argv[1], 0, "gloo")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    dist.destroy_process_group()
    print(json.dumps({k: os.environ.get(k) for k in runtime.RECORDER_SIZES}))
""")


def _script(code: str, *args: str, timeout: float = 120, **env: str) -> tuple[Any, str]:
    """Run ``code`` in a fresh interpreter (its own torch.distributed state) with the worker
    library on its path: what its last line of output says (JSON), and its stderr."""
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin", **env},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _recorder(base: Path, **env: str) -> tuple[dict[str, str | None], str]:
    return _script(RECORDER, str(base / "agent.sock"), str(free_port()), **env)


def test_no_flight_recorder_by_the_name_this_torch_reads_and_no_warning(tmp_path: Path):
    """torch 2.8 renamed the flight recorder's size: the old name warned in every in-place
    worker's output that it is deprecated."""
    sizes, stderr = _recorder(tmp_path)
    assert sizes == {"TORCH_FR_BUFFER_SIZE": "0", "TORCH_NCCL_TRACE_BUFFER_SIZE": None}
    assert "deprecated" not in stderr


def test_a_flight_recorder_size_the_job_sets_wins_under_either_name(tmp_path: Path):
    sizes, _ = _recorder(tmp_path, TORCH_NCCL_TRACE_BUFFER_SIZE="100")
    assert sizes == {"TORCH_FR_BUFFER_SIZE": None, "TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}


def test_the_flight_recorders_name_follows_torchs_version():
    from elasticd.elastic.runtime import recorder_size_name

    assert recorder_size_name("2.13.0+cpu") == "TORCH_FR_BUFFER_SIZE"
    assert recorder_size_name("2.8.0a0+git1234") == "TORCH_FR_BUFFER_SIZE"
    assert recorder_size_name("2.7.1+cu126") == "TORCH_NCCL_TRACE_BUFFER_SIZE"
    assert recorder_size_name("3.0.0") == "TORCH_FR_BUFFER_SIZE"


# A worker in round 0's group (gloo, a world of one) whose main thread then waits for good, as
# one stuck in a collective that an abort does not end; ``asks``: it asks for a newer place
# once the abort came (as GroupAborted makes a healthy worker do), and waits for it.
STUCK_IN_ROUND = textwrap.dedent("""
    import sys, threading, time
    from elasticd.elastic import runtime
    worker = runtime.Runtime(sys.argv[1], 0, "gloo")
    worker.join("start")
    print("formed", flush=True)
    if sys.argv[2] == "asks":
        while not worker.aborted:
            time.sleep(0.01)
        worker.join("abort")
    threading.Event().wait()
""")


def _stuck_in_round(mode: str, base: Path) -> tuple[subprocess.Popen[str], socket.socket]:
    """The worker (STUCK_IN_ROUND) placed in round 0, formed, then told round 0 is aborted;
    returns it and the agent's connection."""
    path = str(base / "agent.sock")
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(path)
    agent.listen()
    port = str(free_port())
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    worker = subprocess.Popen(
        [sys.executable, "-c", STUCK_IN_ROUND, path, mode],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={
            "PYTHONPATH": f"{ROOT}/daemon",
            "PATH": "/usr/bin:/bin",
            "ELASTICD_REJOIN_TIMEOUT": "2",
        },
    )
    conn, _ = agent.accept()
    agent.close()
    conn.settimeout(60)
    lines = conn.makefile("r")
    for doc in map(json.loads, lines):
        if doc["op"] == "ready":
            break
    conn.sendall(json.dumps({"op": "place", "round": 0, "env": env}).encode() + b"\n")
    assert worker.stdout is not None and worker.stdout.readline().strip() == "formed"
    conn.sendall(json.dumps({"op": "abort", "round": 1}).encode() + b"\n")
    return worker, conn


def test_a_worker_that_an_abort_leaves_stuck_in_its_round_ends_itself(tmp_path: Path):
    """gloo, torch 2.13: a survivor of a node frozen mid-allreduce waited in gloo's waitSend
    for 30 minutes after the abort closed its sockets (test_detector's paused node)."""
    worker, conn = _stuck_in_round("stuck", tmp_path)
    try:
        assert worker.wait(60) == 75
        assert "aborted and this worker is still in it after 1 s" in worker.stderr.read()
    finally:
        worker.kill()
        conn.close()


def test_a_worker_that_asks_for_a_newer_place_after_an_abort_is_not_ended(tmp_path: Path):
    worker, conn = _stuck_in_round("asks", tmp_path)
    try:
        asked = json.loads(conn.makefile("r").readline())
        assert (asked["op"], asked["round"], asked["why"]) == ("ready", 0, "abort")
        with pytest.raises(subprocess.TimeoutExpired):
            worker.wait(3)  # three times the limit (half of 2 s): it waits for its place
    finally:
        worker.kill()
        conn.close()


def test_the_daemon_knows_the_status_of_a_worker_that_gave_its_round_up():
    from elasticd.core import policy
    from elasticd.elastic import runtime

    assert policy.GIVEN_UP_EXIT == runtime.GIVEN_UP_EXIT


def test_an_aborted_round_is_given_up_at_half_the_jobs_rejoin_timeout():
    """Before the daemon's rejoin timer stalls the round (a restart of every worker), the
    stuck worker is gone and replaced."""
    from elasticd.elastic.runtime import abort_limit

    assert abort_limit("60") == 30.0 and abort_limit("8") == 4.0
    assert abort_limit("") == abort_limit("junk") == abort_limit("nan") == 30.0
    assert abort_limit("-1") == abort_limit("inf") == 30.0


REFORMS = textwrap.dedent("""
    import gc, json, os, sys, tempfile
    import torch, torch.nn as nn, torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate, Shard, _random
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    from torch.distributed.device_mesh import init_device_mesh
    from elasticd.elastic import checkpoint, runtime, sharded

    gc.disable()  # what is freed without a full collection, as between two re-forms
    here = tempfile.mkdtemp()
    open(os.path.join(here, checkpoint.TIER_SOCKET), "w").close()

    class Tier(checkpoint.Tier):  # a tier that takes every commit at once
        def latest(self): return None
        def wait(self, ident, timeout): return True
        def saving(self, ident): pass
        def saved(self, ident, files, place): pass

    commits = sharded.ShardedCommits(Tier(here))
    model = nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 256)).sum().backward()
    opt.step()
    stagers, out = [], {}
    for round, port in enumerate(sys.argv[1:]):  # the tests' own ports (hostwide)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0",
                          WORLD_SIZE="1", ELASTICD_ROUND=str(round))
        runtime.init_default_group("gloo")
        commits.save(model, opt, {"step": round})
        commits.flush()
        stagers.append(commits._stager)
        mesh = init_device_mesh("cpu", (1,))
        DTensor.from_local(torch.ones(4, 2), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
        _random._rng_tracker = object()  # as DTensor's first random op leaves it
        dist.destroy_process_group()
    out["cached"] = [len(s._state_dict_stager._cached_storage_mapping) for s in stagers]
    runtime.forget_meshes()
    out["transforms"] = _gen_transform_infos.cache_info().currsize
    out["rng"] = _random._rng_tracker is None
    print(json.dumps(out))
""")


def test_a_re_form_lets_the_staging_buffers_and_dtensors_caches_go(tmp_path: Path):
    """The staging buffers of the rounds before (a copy of the rank's state each, kept by a
    reference cycle until a full collection), the transforms DTensor cached with the rank's
    old coordinate, and its random-number tracker (made by a collective of the old world)."""
    found, _ = _script(REFORMS, *(str(free_port()) for _ in range(3)), timeout=240)
    assert found["cached"][:2] == [0, 0] and found["cached"][2] > 0  # the round's own is kept
    assert found["transforms"] == 0 and found["rng"]


FAILURES = textwrap.dedent("""
    import json, socket, sys
    from elasticd.elastic import ElasticUsageError, GroupAborted, runtime
    from elasticd.elastic.checkpoint import TierError
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(sys.argv[1])
    agent.listen()
    worker = runtime.Runtime(sys.argv[1], 0, "gloo")
    print(json.dumps({
        "gloo": worker.is_group_failure(RuntimeError("[gloo] Connection closed by peer")),
        "aborted": worker.is_group_failure(GroupAborted("gone")),
        "script": worker.is_group_failure(RuntimeError("shapes do not match")),
        "usage": worker.is_group_failure(ElasticUsageError(
            "elasticd: this state's model belongs to an earlier round's process group")),
        "tier": worker.is_group_failure(TierError(
            "the checkpoint tier at /run/x/.tier.sock: timed out")),
    }))
""")


def test_a_misuse_of_the_library_is_the_scripts_error_not_a_broken_group(tmp_path: Path):
    """Its message names the process group: taken for a group failure, the job re-formed,
    ran the function again, failed the same way, and re-formed again, for good.  So did the
    tier's errors, whose text is its socket's ("timed out"): a tier that refuses a commit
    (the job over its cap) refuses it again in every round."""
    found, _ = _script(FAILURES, str(tmp_path / "agent.sock"))
    assert found == {
        "gloo": True,
        "aborted": True,
        "script": False,
        "usage": False,
        "tier": False,
    }
