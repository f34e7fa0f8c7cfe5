"""Several real daemons on this host as one cluster, each test on both store backends
(docs/store.md): a TCPStore that n1 hosts, and an etcd that no daemon hosts (conftest).

Every test drives real daemons through the real elasticctl and waits on the daemons' own
streams (job documents, logs), never on a sleep.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from harness import ROOT, Control, alive, fake_nvidia_smi, wait_gone, worker_args
from store_attack import wait_for

EXAMPLE = str(ROOT / "examples" / "ddp_train.py")


def envs(out, ranks, attempt=None):
    suffix = "" if attempt is None else f"_attempt_{attempt}"
    return [json.loads((out / f"rank_{r}{suffix}.json").read_text()) for r in range(ranks)]


def test_formation_across_two_nodes(cluster_factory, shared_tmp):
    cluster = cluster_factory(2).start()
    out = shared_tmp / "env"
    out.mkdir()
    job = cluster[0].submit_wait(
        "--nnodes", "2", "--nproc-per-node", "2", *worker_args("--ddp", "--env-out", str(out))
    )
    assert job["state"] == "SUCCEEDED", job
    found = envs(out, 4)
    assert [e["RANK"] for e in found] == ["0", "1", "2", "3"]
    assert {e["WORLD_SIZE"] for e in found} == {"4"} and {e["GROUP_WORLD_SIZE"] for e in found} == {
        "2"
    }
    assert [e["GROUP_RANK"] for e in found] == ["0", "0", "1", "1"]
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in found}) == 1
    status = cluster[1].ctl("status", job["id"])  # any node shows any job
    print(json.dumps(status, indent=1))
    assert sorted(n["node"] for n in status["nodes"]) == ["n1", "n2"]
    assert [w["node"] for w in status["workers"]] == [status["nodes"][0]["node"]] * 2 + [
        status["nodes"][1]["node"]
    ] * 2
    # no daemon loads torch: the store host serves TCPStore's protocol itself, as the
    # members speak it (the workers, which import torch, are the daemons' children)
    assert [loads_torch(d.proc.pid) for d in cluster] == [False, False]


def loads_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch" in maps.read()


def test_a_failure_restarts_every_node_and_the_budget_is_job_wide(cluster_factory, shared_tmp):
    cluster = cluster_factory(2).start()
    out = shared_tmp / "env"
    out.mkdir()
    job = cluster[0].submit_wait(
        "--nnodes",
        "2",
        "--max-restarts",
        "1",
        *worker_args("--ddp", "--fail-rank", "1", "--fail-attempts", "1", "--env-out", str(out)),
    )
    assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
    for rank in (0, 1):
        assert envs(out, 2, attempt=1)[rank]["TORCHELASTIC_RESTART_COUNT"] == "1"
    failed = cluster[1].ctl(
        "submit",
        "--wait",
        "--nnodes",
        "2",
        "--max-restarts",
        "1",
        *worker_args("--ddp", "--fail-rank", "1"),
        expect=1,
    )[-1]
    assert failed["state"] == "FAILED" and failed["restarts"] == 1
    assert "boom from rank 1 on attempt 1" in failed["error"]["message"]


def test_scale_up_when_a_node_joins(cluster_factory, shared_tmp):
    cluster = cluster_factory(2)
    cluster.start()
    job = cluster[0].submit("--nnodes", "2:3", *worker_args("--sleep", "0"))
    cluster[0].wait_job(job["id"], lambda d: d["state"] == "RUNNING" and d["world_size"] == 2)
    third = cluster.add()
    third.start()
    doc = cluster[0].wait_job(
        job["id"],
        lambda d: (
            d["state"] == "RUNNING"
            and d["world_size"] == 3
            and sum(w["state"] == "HEALTHY" for w in d["workers"]) == 3
        ),
    )
    assert doc["restarts"] == 0 and doc["round"] >= 1  # a membership change uses no restart
    assert sorted(n["node"] for n in doc["nodes"]) == ["n1", "n2", "n3"]
    cluster[2].ctl("cancel", job["id"])


def test_training_survives_a_node_kill_with_the_same_loss(cluster_factory, shared_tmp):
    """A DDP job on 3 nodes loses one (SIGKILL) and ends with an undisturbed run's loss.

    The example is world-size invariant and resumes from its per-epoch checkpoint, so the
    only difference is floating-point summation order: 1e-4 relative is generous for that
    and far tighter than the loss changes between epochs (~5 %).  The undisturbed run is
    one worker on n1 (world size 1: one torch to start, not three), beside the job: the
    victim is never n1.  The job's epochs last 2 s, so that six are left after "epoch 1"
    when the victim dies: on a loaded machine the kill once came after the last, and the
    world of 2 only loaded the final checkpoint and ended.
    """
    cluster = cluster_factory(3, slots=2).start()
    epochs = "8"
    reference = cluster[0].submit(
        "--nnodes", "1", "--nodes", "n1", EXAMPLE, "--", "--epochs", epochs
    )
    ckpt = str(shared_tmp / "ckpt.pt")
    job = cluster[0].submit(
        "--nnodes",
        "2:3",
        EXAMPLE,
        "--",
        "--epochs",
        epochs,
        "--checkpoint",
        ckpt,
        "--epoch-seconds",
        "2",
    )
    cluster[0].wait_output(job["id"], ["epoch 1 loss"])
    nodes = cluster[0].ctl("status", job["id"])["nodes"]
    assert len(nodes) == 3
    victim_name = next(n["node"] for n in nodes if n["group_rank"] != 0 and n["node"] != "n1")
    victim = next(d for d in cluster.daemons if d.name == victim_name)
    victim.signal(signal.SIGKILL)
    victim.wait_exit()
    final = cluster[0].wait_job(
        job["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED"), timeout=180
    )
    assert final["state"] == "SUCCEEDED", final
    logs = cluster[0].ctl_run("logs", job["id"]).stdout
    assert "world_size 3" in logs, logs
    assert "world_size 2" in logs, f"no epoch trained at world size 2:\n{logs}"
    reference = cluster[0].wait_job(
        reference["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED")
    )
    assert reference["state"] == "SUCCEEDED" and reference["world_size"] == 1, reference
    assert _final_loss(cluster[0], job["id"]) == pytest.approx(
        _final_loss(cluster[0], reference["id"]), rel=1e-4
    )


def _final_loss(daemon, job_id):
    lines = [ln for ln in daemon.ctl_run("logs", job_id).stdout.splitlines() if " loss " in ln]
    return float(lines[-1].split(" loss ")[1].split()[0])


def test_node_loss_below_min_waits_then_fails_clearly(cluster_factory):
    cluster = cluster_factory(2).start()
    job = cluster[0].submit("--nnodes", "2", "--join-timeout", "4", *worker_args("--sleep", "0"))
    cluster[0].wait_job(job["id"], lambda d: d["state"] == "RUNNING" and d["world_size"] == 2)
    cluster[1].signal(signal.SIGKILL)
    cluster[1].wait_exit()
    doc = cluster[0].wait_job(job["id"], lambda d: d["state"] == "FAILED", timeout=60)
    message = doc["error"]["message"]
    assert "1" in message and "2" in message and ("node" in message or "min" in message), message


def test_a_lost_nodes_ranks_are_shown_lost_not_healthy(cluster_factory):
    """status once showed a dead node's rank HEALTHY, its last word, for as long as the
    job waited for it."""
    cluster = cluster_factory(2).start()
    job = cluster[0].submit("--nnodes", "2", "--join-timeout", "300", *worker_args("--sleep", "0"))[
        "id"
    ]
    cluster[0].wait_running(job, 2)  # n2's word that its rank is HEALTHY has reached n1
    cluster[1].signal(signal.SIGKILL)
    cluster[1].wait_exit()
    _nodes_when(cluster[0], lambda ns: _states(ns).get("n2") == "lost")
    doc = cluster[0].ctl("status", job)
    theirs = [w["state"] for w in doc["workers"] if w["node"] == "n2"]
    assert theirs and set(theirs) == {"LOST"}, doc["workers"]
    assert "LOST" in cluster[0].ctl_run("status", job).stdout
    cluster[0].ctl("cancel", job)


def test_a_node_loss_spends_no_restart_so_the_restart_count_stays(cluster_factory, shared_tmp):
    """The difference docs/concepts.md's "What a worker gets" states: the
    workers of the round that re-formed without a lost node see TORCHELASTIC_RESTART_COUNT 0
    (torchrun's would be 1: it charges its survivors' failed collective)."""
    cluster = cluster_factory(2).start()
    out = shared_tmp / "env"
    out.mkdir()
    job = cluster[0].submit("--nnodes", "1:2", *worker_args("--env-out", str(out), "--sleep", "0"))[
        "id"
    ]
    cluster[0].wait_running(job, 2)
    cluster[1].signal(signal.SIGKILL)
    cluster[1].wait_exit()

    def alone() -> dict | None:
        try:
            env = json.loads((out / "rank_0.json").read_text())
        except (OSError, ValueError):
            return None  # not yet written, or being written
        return env if env["GROUP_WORLD_SIZE"] == "1" else None

    env = wait_for(alone, 120, "the round without n2")
    assert env["TORCHELASTIC_RESTART_COUNT"] == "0"
    assert cluster[0].ctl("status", job)["restarts"] == 0
    cluster[0].ctl("cancel", job)


def test_exit_barrier_waits_for_the_slower_node(cluster_factory, shared_tmp):
    cluster = cluster_factory(2).start()
    gate = shared_tmp / "gate"  # group rank 1 ends once the test has seen the barrier
    job = cluster[0].submit("--nnodes", "2", *worker_args("--hold-group", f"1:{gate}"))
    waiting = cluster[0].wait_job(job["id"], lambda d: d.get("barrier") is not None)
    assert waiting["barrier"]["done"] == 1 and waiting["barrier"]["total"] == 2
    assert waiting["state"] == "RUNNING"
    gate.touch()
    final = cluster[0].wait_job(job["id"], lambda d: d["state"] in ("SUCCEEDED", "FAILED"))
    assert final["state"] == "SUCCEEDED"


def test_cancel_from_a_node_that_runs_none_of_the_job(cluster_factory, shared_tmp):
    cluster = cluster_factory(3).start()
    job = cluster[0].submit("--nnodes", "2", "--nodes", "n1,n2", *worker_args("--sleep", "0"))
    doc = cluster[2].wait_running(job["id"], 2)
    assert sorted(n["node"] for n in doc["nodes"]) == ["n1", "n2"]
    pids = [w["pid"] for w in doc["workers"]]
    assert cluster[2].ctl("cancel", job["id"])["state"] == "CANCELLED"
    assert wait_gone(pids, timeout=30) == []
    for daemon in cluster.daemons:
        assert daemon.ctl("status", job["id"])["state"] == "CANCELLED"


def test_two_jobs_share_the_gpus_of_the_nodes(cluster_factory, shared_tmp):
    cluster = cluster_factory(2, slots=8, env=fake_nvidia_smi(shared_tmp / "bin", 4)).start()
    outs = []
    jobs = []
    for i in range(2):
        out = shared_tmp / f"env{i}"
        out.mkdir()
        outs.append(out)
        jobs.append(
            cluster[0].submit(
                "--nnodes",
                "2",
                "--nproc-per-node",
                "2",
                *worker_args("--env-out", str(out), "--sleep", "0"),
            )
        )
    for job in jobs:
        cluster[0].wait_output(job["id"], [f"ready {r}" for r in range(4)])
    for node_rank in (0, 1):
        devices = []
        for out in outs:
            found = envs(out, 4)
            devices.append(
                {e["CUDA_VISIBLE_DEVICES"] for e in found if e["GROUP_RANK"] == str(node_rank)}
            )
        assert all(len(d) == 1 for d in devices)
        first, second = (set(next(iter(d)).split(",")) for d in devices)
        assert len(first) == 2 and len(second) == 2 and not first & second
    _nodes_when(
        cluster[1],
        lambda ns: (
            {(n["name"], n["gpus_free"], n["gpus_total"]) for n in ns}
            == {("n1", 0, 4), ("n2", 0, 4)}
        ),
    )
    for job in jobs:
        cluster[1].ctl("cancel", job["id"])


def test_drain_moves_a_job_off_a_node(cluster_factory):
    cluster = cluster_factory(2).start()
    job = cluster[0].submit("--nnodes", "1:2", *worker_args("--sleep", "0"))
    cluster[0].wait_job(job["id"], lambda d: d["state"] == "RUNNING" and d["world_size"] == 2)
    cluster[0].ctl("drain", "n2")
    doc = cluster[0].wait_job(
        job["id"],
        lambda d: (
            d["state"] == "RUNNING"
            and d["world_size"] == 1
            and [n["node"] for n in d["nodes"]] == ["n1"]
        ),
    )
    assert doc["restarts"] == 0
    _nodes_when(cluster[0], lambda ns: _states(ns) == {"n1": "up", "n2": "drained"})
    cluster[0].ctl("undrain", "n2")
    cluster[0].wait_job(job["id"], lambda d: d["state"] == "RUNNING" and d["world_size"] == 2)
    cluster[0].ctl("cancel", job["id"])


def _states(nodes):
    return {n["name"]: n["state"] for n in nodes}


def _nodes_when(daemon, predicate, timeout=30.0):
    """Follow the daemon's node list (it changes on heartbeats) until it matches."""
    with Control(daemon.socket) as control:
        for nodes in control.stream("nodes", {"watch": True}, timeout):
            if predicate(nodes):
                return nodes
    raise AssertionError("the node stream ended")


def test_a_ready_node_is_listed_at_once_by_every_node(cluster_factory):
    """READY=1 means the node has joined: right after it, a one-shot `nodes` anywhere lists it."""
    cluster = cluster_factory(3).start()
    for daemon in (cluster[0], cluster[2]):
        assert _states(daemon.ctl("nodes")) == {"n1": "up", "n2": "up", "n3": "up"}


def test_lost_node_shows_as_lost(cluster_factory):
    cluster = cluster_factory(3).start()
    _nodes_when(cluster[0], lambda ns: _states(ns) == {"n1": "up", "n2": "up", "n3": "up"})
    cluster[2].signal(signal.SIGKILL)
    cluster[2].wait_exit()
    started = time.monotonic()
    _nodes_when(cluster[0], lambda ns: _states(ns).get("n3") == "lost")
    assert time.monotonic() - started < 10


def test_logs_of_another_node_come_over_the_peer_channel(cluster_factory):
    cluster = cluster_factory(2).start()
    job = cluster[0].submit_wait("--nodes", "n2", *worker_args("--print", "2"))
    status = cluster[0].ctl("status", job["id"])
    assert [n["node"] for n in status["nodes"]] == ["n2"]
    text = cluster[0].ctl_run("logs", job["id"]).stdout
    assert "out 0 1" in text and "err 0 1" in text


def test_logs_of_a_job_whose_node_is_lost_answer_at_once(cluster_factory):
    """n2 dies with a job's rank on it: `logs` on n1 shows its own ranks and says n2's are
    unavailable, without waiting out the peer timeout (15 s) for a node known lost."""
    cluster = cluster_factory(2).start()
    job = cluster[0].submit("--nnodes", "1:2", *worker_args("--print", "1", "--sleep", "0"))["id"]
    cluster[0].wait_running(job, 2)
    cluster[1].signal(signal.SIGKILL)
    cluster[1].wait_exit()
    _nodes_when(cluster[0], lambda ns: _states(ns).get("n2") == "lost")
    done = cluster[0].ctl_run("logs", job, timeout=10)  # TimeoutExpired: it waited on n2
    assert "out 0 0" in done.stdout and "logs of node n2 unavailable" in done.stdout, done
    cluster[0].ctl("cancel", job)


def test_logs_follow_takes_in_a_node_that_joins_later(cluster_factory):
    """`logs -f` asked before a node joined the job still shows that node's ranks."""
    cluster = cluster_factory(2)
    cluster[0].start()
    job = cluster[0].submit("--nnodes", "1:2", *worker_args("--print", "1", "--sleep", "0"))["id"]
    with Control(cluster[0].socket) as control:
        stream = control.stream("logs", {"job": job, "follow": True}, 60)
        texts = set()
        while "out 0 0" not in texts:  # the stream is live, and n2 not started yet
            texts |= {line["text"] for line in next(stream).get("lines", [])}
        cluster[1].start()
        while "out 1 0" not in texts:  # rank 1 runs on n2 once the job scaled up
            texts |= {line["text"] for line in next(stream).get("lines", [])}
    cluster[0].ctl("cancel", job)


def test_store_host_restart_while_a_job_runs(cluster_factory, store_backend):
    """The store goes away and comes back while a job runs on n2 and n3.  c10d: its host n1
    restarts, and the new store is empty (the daemons publish everything again); etcd: the
    one member restarts and keeps its data."""
    cluster = cluster_factory(3).start()
    job = cluster[1].submit("--nnodes", "2", "--nodes", "n2,n3", *worker_args("--sleep", "0"))
    doc = cluster[1].wait_running(job["id"], 2)
    assert not any(RESET in daemon.log_text() for daemon in cluster)  # a fresh start is not a reset
    pids = [w["pid"] for w in doc["workers"]]
    cluster[0].wait_running(job["id"], 2)  # both parts are in the store (n1 read them there)
    if store_backend == "etcd":
        cluster.etcd.kill(0)
    else:
        cluster[0].stop()
    cluster[1].wait_notify("STATUS=", timeout=10, contains="unreachable")
    assert (
        "store 127.0.0.1" in cluster[1].ctl_run("version").stdout
        and "UNREACHABLE" in cluster[1].ctl_run("version").stdout
    )
    assert cluster[1].ctl("status", job["id"])["state"] == "RUNNING"  # answered from its registry
    assert all(alive(pid) for pid in pids)  # workers keep running without the store
    if store_backend == "etcd":
        cluster.etcd.start(0)
    else:
        cluster[0].start()
    cluster[1].wait_status(lambda line: "unreachable" not in line, timeout=60)  # reached again
    again = cluster[1].wait_running(job["id"], 2, timeout=60)
    assert [w["pid"] for w in again["workers"]] == pids  # no restart was needed
    # c10d: n2 says so once (also when it read the new store before its host marked it); etcd kept it
    assert cluster[1].log_text().count(RESET) == (0 if store_backend == "etcd" else 1)
    # (c10d: republished to the new store; etcd: kept)
    assert [w["pid"] for w in cluster[0].wait_running(job["id"], 2, timeout=30)["workers"]] == pids
    cluster[0].ctl(
        "cancel", job["id"]
    )  # n1 runs none of the job: the cancel goes through the store
    assert wait_gone(pids, timeout=30) == []


RESET = "the store was reset"


def test_a_cluster_started_together_does_not_take_its_new_store_for_a_reset(
    cluster_factory, store_backend, shared_tmp
):
    """Nodes started with the store host read its store before the
    host marked it (the host runs nvidia-smi in between: slowed down here), then read the mark
    and warned "the store was reset (its host restarted)" on every fresh start."""
    cluster = cluster_factory(2)
    slow = shared_tmp / "slow-bin"
    slow.mkdir()
    (slow / "nvidia-smi").write_text("#!/bin/sh\nsleep 4\n")
    (slow / "nvidia-smi").chmod(0o755)
    cluster[0].env = {**cluster[0].env, "PATH": f"{slow}:{os.environ['PATH']}"}
    early = cluster[1].start(wait=False)
    cluster[0].start()
    early.wait_notify("READY=1", timeout=60)
    _nodes_when(
        early, lambda ns: _states(ns) == {"n1": "up", "n2": "up"}
    )  # n2 read n1's record: after the mark
    assert not any(RESET in daemon.log_text() for daemon in cluster), early.log_text()


def test_a_daemon_started_before_the_store_host_waits_for_it(cluster_factory, store_backend):
    cluster = cluster_factory(2)
    if store_backend == "etcd":
        cluster.etcd.kill(0)  # the etcd cluster is down
    early = cluster[1].start(wait=False)
    assert not early.ready()  # it cannot be: there is no store to reach yet
    if store_backend == "etcd":
        cluster.etcd.start(0)  # the store comes up...
    cluster[0].start()  # (c10d: the store host comes up...)
    early.wait_notify("READY=1", timeout=60)  # ...and only then is the early daemon ready
    assert not any(m.startswith("READY=1") for m in early.messages[:-1])
    _nodes_when(cluster[0], lambda ns: _states(ns) == {"n1": "up", "n2": "up"})


def test_a_tampered_node_record_is_refused_and_counted(cluster_factory):
    import urllib.request

    cluster = cluster_factory(2).start()
    _nodes_when(cluster[0], lambda ns: _states(ns) == {"n1": "up", "n2": "up"})
    store = cluster.store_client()  # a TCPStore client, or an etcd client, with no key
    key = f"elasticd/{cluster.name}/nodes/n2/record"
    forged = json.loads(store.get(key))
    forged["body"]["info"]["slots"] = 999  # the MAC no longer matches
    store.set(key, json.dumps(forged).encode())
    store.close()

    def refused() -> float:
        url = f"http://127.0.0.1:{cluster[1].metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        return float(
            next(
                ln.split()[1]
                for ln in text.splitlines()
                if ln.startswith("elasticd_store_refused_records_total ")
            )
        )

    # n1 reads n2's record only when n2 announces a new version; n2 checks its own record
    # on every heartbeat duty, refuses the forgery and publishes its record again.  That
    # has no event of its own: look ten times per heartbeat interval, with a deadline.
    deadline = time.monotonic() + 15
    while refused() < 1 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert refused() >= 1  # counted...
    assert f"refused store record {key}" in cluster[1].log_text()  # ...logged
    nodes = _nodes_when(cluster[0], lambda ns: _states(ns) == {"n1": "up", "n2": "up"})
    assert all(n["slots_total"] != 999 for n in nodes)  # ...and never used
    store = cluster.store_client()
    assert json.loads(store.get(key))["body"]["info"]["slots"] != 999  # replaced by n2's own
    store.close()
    assert cluster[1].request("version").ok  # n2 put its own record right again


@pytest.mark.c10d_only("how a client shows output; the store plays no part")
def test_run_shows_every_nodes_output_with_torchruns_local_rank_prefix(cluster_factory):
    """`elasticctl run --tee 3` on a two-node job: each node's ranks prefixed by their local
    rank, as each node's torchrun would show them; stderr to stderr; exit 0."""
    cluster = cluster_factory(2).start()
    done = cluster[0].ctl_run(
        "run", "--nnodes", "2", "--nproc-per-node", "2", "--tee", "3", *worker_args("--print", "1")
    )
    assert done.returncode == 0, done.stderr
    assert sorted(done.stdout.splitlines()) == [
        "[default0]:out 0 0",
        "[default0]:out 2 0",
        "[default1]:out 1 0",
        "[default1]:out 3 0",
    ]
    assert {"[default0]:err 0 0", "[default1]:err 3 0"} <= set(done.stderr.splitlines())


@pytest.mark.c10d_only("the memory bound of the TCPStore that a daemon hosts")
def test_a_store_filled_to_its_bound_refuses_the_filler_and_the_cluster_goes_on(cluster_factory):
    """store.max_memory: a keyless client that writes 1 MiB values into a store bounded at
    16 MiB is cut off once it is full, the store host says so and keeps what it held; with
    the filler's keys deleted, a job runs on both nodes."""
    from elasticd.errors import StoreConnectionError

    cluster = cluster_factory(2)
    cluster.config.write_text(cluster.config.read_text() + '[store]\nmax_memory = "16M"\n')
    cluster.start()
    filler = cluster.store_client()
    with pytest.raises(StoreConnectionError):
        for n in range(64):  # torch's set is not answered: a refusal shows at a later call
            filler.set(f"fill/{n}", b"x" * (1 << 20))
    wait_for(lambda: "the store holds" in cluster[0].log_text(), 30, "the host's warning")
    cleaner = cluster.store_client()
    held = [n for n in range(64) if cleaner.get(f"fill/{n}") is not None]
    assert 8 <= len(held) < 16 and held == list(range(len(held))), held  # within 16 MiB
    assert cleaner.get("fill/0") == b"x" * (1 << 20)  # what the store held is kept
    for n in held:
        cleaner.delete(f"fill/{n}")
    cleaner.close()
    job = cluster[0].submit_wait("--nnodes", "2", *worker_args())
    assert job["state"] == "SUCCEEDED", job
    assert all(d.proc is not None and d.proc.poll() is None for d in cluster)
