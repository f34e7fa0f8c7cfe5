"""An abort against this library's own collectives on gloo (elasticd.elastic.collectives): real
gloo groups in real processes, whose sockets are shut down as the runtime's abort does.

Gloo (torch 2.13) loses a send that it queued after EPIPE: the collective waits for it until
the group's timeout. Without the slices and the kept group, ranks of the first test waited
there (300 s here) or in ``destroy_process_group``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import textwrap
import time

from harness import ROOT
from hostwide import free_port

from elasticd.store.tcpserver import TCPStoreServer

# One rank of a world whose group is formed anew ``trials`` times on one TCPStore; in each
# round the rank loops all_reduce until its own abort (at a random moment) shuts the group's
# sockets down and says so; prints how many of its collectives the abort had to leave.
ABORTED_LOOPS = textwrap.dedent("""
    import datetime, random, sys, threading, time
    import torch, torch.distributed as dist
    from elasticd.elastic import collectives, runtime
    from elasticd.elastic.errors import GroupAborted

    rank, world, port, trials = map(int, sys.argv[1:5])
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0,
                          timeout=datetime.timedelta(seconds=60))
    aborted = threading.Event()
    collectives.abandon_when(aborted.is_set)

    def abort(group):
        time.sleep(random.uniform(0.01, 0.2))
        runtime.shut_down(group)  # as the runtime's abort does
        aborted.set()

    left = 0
    for trial in range(trials):
        aborted.clear()
        before = runtime.socket_fds()
        dist.init_process_group("gloo", store=dist.PrefixStore(f"trial{trial}", store),
                                rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
        value = torch.ones(2, dtype=torch.int64)
        collectives.all_reduce(value)  # every pair connected
        group = runtime.opened_since(before)
        aborter = threading.Thread(target=abort, args=(group,))
        aborter.start()
        try:
            while True:
                collectives.all_reduce(value)
        except GroupAborted:
            left += 1
        except RuntimeError as exc:
            assert "connection closed" in str(exc).lower() or "gloo" in str(exc).lower(), exc
        aborter.join()
        dist.destroy_process_group()
    print("left", left, flush=True)
""")


def test_collectives_leave_a_group_their_abort_broke_even_where_gloo_lost_a_send(figures):
    port, world, trials = free_port(), 3, 30
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", ABORTED_LOOPS, str(rank), str(world), str(port), str(trials)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"},
        )
        for rank in range(world)
    ]
    try:
        done = [rank.communicate(timeout=240) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    for rank, (_, err) in zip(ranks, done):
        assert rank.returncode == 0, err[-3000:]
    left = sum(int(out.split()[-1]) for out, _ in done)
    figures.add("gloo collectives the abort left (lost sends)", f"{left} of {world * trials}")


# Rank 0 of a world of two whose rank 1 never enters the collective: the abort comes while it
# waits; then its group is destroyed, a new one formed and used, and the process exits.
LEFT_WAITING = textwrap.dedent("""
    import datetime, sys, threading, time
    import torch, torch.distributed as dist
    from elasticd.elastic import collectives
    from elasticd.elastic.errors import GroupAborted

    rank, port, fresh = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    if rank == 1:
        print("formed", flush=True)
        threading.Event().wait()
    aborted = threading.Event()
    collectives.abandon_when(aborted.is_set)
    threading.Timer(0.5, aborted.set).start()
    started = time.monotonic()
    try:
        collectives.all_reduce(torch.ones(1))
    except GroupAborted:
        print(f"left after {time.monotonic() - started:.2f}", flush=True)
    dist.destroy_process_group()
    print("destroyed", flush=True)
    alone = dist.TCPStore("127.0.0.1", fresh, 1, True)
    dist.init_process_group("gloo", store=alone, rank=0, world_size=1)
    value = torch.full((1,), 7.0)
    collectives.all_reduce(value)
    print(f"formed again {value.item():g}", flush=True)
""")


def test_a_collective_left_by_an_abort_lets_the_worker_form_a_new_group_and_exit():
    port, fresh = free_port(), free_port()
    env = {"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"}
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", LEFT_WAITING, str(rank), str(port), str(fresh)],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )
        for rank in (0, 1)
    ]
    try:
        out, err = ranks[0].communicate(timeout=120)  # 300 s: the collective's own timeout
        assert ranks[0].returncode == 0, err[-3000:]
        lines = out.splitlines()
        assert lines[0].startswith("left after ")
        assert lines[1:] == ["destroyed", "formed again 7"]
    finally:
        for rank in ranks:
            rank.kill()
            rank.communicate()


# An in-place worker (the runtime, a stand-in agent) placed as rank 0 of a world of two whose
# rank 1 never enters a collective, in a group whose sockets the abort does not shut down (a
# subgroup formed after the round's: as stuck as a lost send): the abort comes, the collective
# leaves the group (kept, with the round's store server), and the worker asks for a new place.
LEFT_AS_RANK_0 = textwrap.dedent("""
    import sys
    import torch, torch.distributed as dist
    from elasticd.elastic import collectives, runtime
    from elasticd.elastic.errors import GroupAborted
    worker = runtime.Runtime(sys.argv[1], 0, "gloo")
    worker.join("start")
    both = dist.new_group([0, 1])
    print("entering", flush=True)
    try:
        collectives.all_reduce(torch.ones(1), group=both)
    except GroupAborted as exc:
        print("left", flush=True)
        worker.join("failure", str(exc))
    print("formed again", flush=True)
""")
PEER = textwrap.dedent("""
    import threading
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="env://")
    dist.new_group([0, 1])
    print("formed", flush=True)
    threading.Event().wait()
""")


def _left_as_rank_0(
    base, same_port: bool, agent_store: bool = False
) -> tuple[int | None, str, str]:
    """Run LEFT_AS_RANK_0 to its new place (round 1: at the same store address or another)
    and to its end; its exit status (None: still running 60 s later), stdout and stderr.
    ``agent_store``: the stand-in agent serves each round's store, as the daemon does (a
    fresh one for round 1, where round 0's was), and tells the workers so."""
    path = str(base / "agent.sock")
    agent = socket.socket(socket.AF_UNIX)
    agent.bind(path)
    agent.listen()
    port, other = str(free_port()), str(free_port())
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    served = []
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        served.append(TCPStoreServer("127.0.0.1", int(port)))
    clean = {"PYTHONPATH": f"{ROOT}/daemon", "PATH": "/usr/bin:/bin"}
    worker = subprocess.Popen(
        [sys.executable, "-c", LEFT_AS_RANK_0, path],
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=clean,
    )
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER],
        text=True,
        stdout=subprocess.PIPE,
        env={**clean, **env, "RANK": "1"},
    )
    try:
        conn, _ = agent.accept()
        conn.settimeout(120)
        lines = conn.makefile("r")

        def asked() -> dict:
            return next(doc for doc in map(json.loads, lines) if doc["op"] == "ready")

        asked()
        place = {"op": "place", "round": 0, "env": {**env, "RANK": "0"}}
        conn.sendall(json.dumps(place).encode() + b"\n")
        assert worker.stdout is not None and worker.stdout.readline().strip() == "entering"
        assert peer.stdout is not None and peer.stdout.readline().strip() == "formed"
        time.sleep(1)  # the collective has begun (it waits for rank 1 for good)
        conn.sendall(json.dumps({"op": "abort", "round": 1}).encode() + b"\n")
        assert worker.stdout.readline().strip() == "left"
        assert asked()["why"] == "failure"
        again = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port if same_port else other}
        if agent_store:  # the round before's store closes: its port is the next round's
            served.pop().close()
            served.append(TCPStoreServer("127.0.0.1", int(again["MASTER_PORT"])))
            again["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        place = {"op": "place", "round": 1, "env": {**again, "RANK": "0", "WORLD_SIZE": "1"}}
        conn.sendall(json.dumps(place).encode() + b"\n")
        try:
            status = worker.wait(60)
        except subprocess.TimeoutExpired:
            status = None
        worker.kill()
        out, err = worker.communicate()
        conn.close()
        return status, out, err
    finally:
        for process in (worker, peer):
            process.kill()
            process.communicate()
        agent.close()
        for server in served:
            server.close()


def test_a_worker_whose_left_group_holds_its_next_rounds_store_port_exits_to_be_replaced(
    tmp_path,
):
    """A fixed --master-port: rank 0's kept group still hosts the old round's store there
    (with its keys), so the next round could not form on it."""
    status, _, err = _left_as_rank_0(tmp_path, same_port=True)
    assert status == 75, err[-3000:]
    assert "still hosts the store of its round; this worker exits" in err


def test_a_worker_whose_agent_serves_the_store_forms_its_next_round_at_the_same_port(
    tmp_path,
):
    """A fixed --master-port where the agent serves each round's store (the daemon does):
    the kept group holds no server, so the worker forms its next round there."""
    status, out, err = _left_as_rank_0(tmp_path, same_port=True, agent_store=True)
    assert status == 0 and out.strip().endswith("formed again"), err[-3000:]


def test_a_worker_that_left_a_group_forms_its_next_round_elsewhere(tmp_path):
    status, out, err = _left_as_rank_0(tmp_path, same_port=False)
    assert status == 0 and out.strip().endswith("formed again"), err[-3000:]  # and exits
