"""Sharded models in place, end to end: real daemons, real workers running
examples/fsdp_elastic_train.py (FSDP2 over the job's world, optionally x tensor parallel;
gloo on CPU), ``--in-place``.  Each round the survivors build the model for the new world and
``TorchState.attach`` loads the last commit from the job's checkpoint tier, resharded.

- a node SIGKILLed (3 -> 2): the survivors keep their processes, spend no restart and resume
  from the last commit; at the end their parameters are bitwise those of torchrun at world 2
  started from the same commit on disk;
- a node joining (2 -> 3): the newcomer loads the commit the others just made, and nobody
  redoes a step;
- a worker SIGKILLed with two workers a node: the three others train on while its
  replacement warms up, then it joins them;
- a 2D mesh (FSDP x TP over 4 workers) re-formed at 2 after a node loss;
- the loss, step by step, of a run that went 3 -> 2 -> 3 against one that stayed at 3, with
  the same global batch.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import PY, ROOT, free_port
from store_attack import Cluster, metric, wait_for

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "examples" / "fsdp_elastic_train.py")


def events(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def starts(report: Path, world: int | None = None, since: float = 0.0) -> dict[int, dict]:
    """The newest ``start`` of each pid (in a world of ``world``, after ``since``)."""
    found: dict[int, dict[str, Any]] = {}
    for e in events(report):
        if e["event"] == "start" and world in (None, e["world"]) and e["time"] >= since:
            found[e["pid"]] = e
    return found


def formed(report: Path, world: int, since: float = 0.0) -> dict[int, dict] | None:
    """``world`` ranks started in one round after ``since`` (by pid), else None."""
    by_round: dict[int, dict[int, dict[str, Any]]] = {}
    for pid, e in starts(report, world, since).items():
        by_round.setdefault(e["round"], {})[pid] = e
    full = [group for group in by_round.values() if len(group) == world]
    return full[-1] if full else None


def stepped_checksums(report: Path, step: int, before: float) -> set[float]:
    """The parameters' sums the ranks reported at ``step`` (``--digest``) before ``before``."""
    return {
        e["checksum"]
        for e in events(report)
        if e["event"] == "step" and e["step"] == step and e["time"] < before
    }


def stepped(report: Path, pids: set[int], past: int, since: float = 0.0) -> bool:
    """Every one of ``pids`` finished a step past ``past`` since ``since``."""
    done = {
        e["pid"]
        for e in events(report)
        if e["event"] == "step" and e["step"] > past and e["time"] >= since
    }
    return pids <= done


@pytest.fixture
def report(shared_tmp: Path) -> Path:
    path = shared_tmp / "report"
    path.mkdir(mode=0o777)
    return path


RESTORED = "elasticd_checkpoint_restored_bytes_total"  # fetched for a reader, by source


def cluster_of(daemon_factory: Any, shared_tmp: Path, roles: str, prefix: str) -> Cluster:
    """Nodes named after ``roles``; the store apart, so that any of them may die."""
    cluster = Cluster(daemon_factory, shared_tmp, prefix=prefix, store_apart=True)
    for role in roles:
        cluster.add(role)
    return cluster


def submit(
    daemon: Any,
    report: Path,
    *options: str,
    nnodes: str,
    nproc: int = 1,
    steps: int = 100_000,
    args: tuple[str, ...] = (),
) -> str:
    """An in-place job of the example (one intra-op thread: the same float sums as a
    reference run under torchrun)."""
    return daemon.submit(
        "--in-place",
        "--nnodes",
        nnodes,
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        "--env",
        "OMP_NUM_THREADS=1",
        *options,
        SCRIPT,
        "--",
        "--steps",
        str(steps),
        "--step-time",
        "0.05",
        "--report",
        str(report),
        *args,
    )["id"]


def kill_node(daemon: Any) -> None:
    """SIGKILL a node: its daemon and every process it started (its workers), at once."""
    proc = psutil.Process(daemon.proc.pid)
    for victim in [proc, *proc.children(recursive=True)]:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    daemon.wait_exit()


def complete(daemon: Any, job: str, name: str, on_disk: bool = False) -> dict[str, Any]:
    """Wait until ``name`` is the job's newest complete checkpoint (on disk too, if asked)."""

    def ready() -> dict[str, Any] | None:
        checkpoint = daemon.ctl("status", job).get("checkpoint") or {}
        good = checkpoint.get("id") == name and (checkpoint.get("on_disk") or not on_disk)
        return checkpoint if good else None

    return wait_for(ready, 120, f"{name} complete{' and on disk' if on_disk else ''}")


def commit_at(report: Path, step: int, pids: set[int]) -> str | None:
    """The name of the commit made at ``step``, once all of ``pids`` made it."""
    made = {
        e["pid"]: e["name"] for e in events(report) if e["event"] == "commit" and e["step"] == step
    }
    names = {made[pid] for pid in pids if pid in made}
    return names.pop() if len(names) == 1 and pids <= set(made) else None


def torchrun(shared_tmp: Path, world: int, steps: int, *args: str) -> Path:
    """The example under torchrun at ``world`` ranks (standalone): its report directory."""
    report = shared_tmp / f"ref-{world}-{time.monotonic_ns()}"
    report.mkdir()
    command = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world)]
    done = subprocess.run(
        [*command, SCRIPT, "--steps", str(steps), "--report", str(report), *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "daemon")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return report


def final_sha(report: Path, world: int) -> str:
    finals = {json.loads((report / f"final-{r}.json").read_text())["sha256"] for r in range(world)}
    assert len(finals) == 1, finals
    return finals.pop()


# -- a node lost -------------------------------------------------------------------------------


@pytest.mark.parametrize("lost", ["last-rank", "rank-0"])
def test_a_lost_node_re_forms_in_place_resharded_bitwise_as_from_disk(
    daemon_factory: Any, shared_tmp: Path, report: Path, lost: str
) -> None:
    """The node of the last rank or of rank 0 (a rank whose shard of the head, one row over
    three ranks, was empty now needs the row, which only the lost node held).  Either way
    the keeper of the lost node's copy takes the new rank that reads the lost share: the
    last one (the survivors swap: kept in order, they would fetch half the state) or rank
    0 (they keep their order)."""
    cluster = cluster_of(daemon_factory, shared_tmp, "abc", "shard").start()
    a = cluster[0]
    disk = shared_tmp / "disk"
    disk.mkdir(mode=0o777)
    hold, steps = 20, 40
    job = submit(
        a,
        report,
        "--checkpoint-dir",
        str(disk),
        "--keep-checkpoints",
        "100",
        nnodes="2:3",
        steps=steps,
        args=("--commit-every", "5", "--hold-at", str(hold), "--digest"),
    )
    three = wait_for(lambda: formed(report, 3), 180, "3 ranks training")
    workers = a.ctl("status", job)["workers"]
    where = {w["pid"]: w["node"] for w in workers}
    rank = 0 if lost == "rank-0" else len(workers) - 1
    c = next(d for d in cluster if d.name == next(w["node"] for w in workers if w["rank"] == rank))
    name = wait_for(lambda: commit_at(report, hold, set(three)), 180, f"a commit at {hold}")
    held = complete(a, job, name, on_disk=True)
    assert held["world"] == 3 and all(held["copies"].values()), held
    for daemon in cluster:  # every node's view, which its rendezvous record declares
        complete(daemon, job, name)
    survivors = {pid for pid in three if where[pid] != c.name}
    if c is a:
        a = next(d for d in cluster if d is not c)

    killed_at = time.time()
    kill_node(c)
    two = wait_for(lambda: formed(report, 2, killed_at), 120, "the survivors re-formed at 2")
    assert set(two) == survivors, "the survivors kept their processes"
    assert {e["step"] for e in two.values()} == {hold}, two
    assert {e["loaded"] for e in two.values()} == {held["id"]}, (two, held)
    assert {e["checksum"] for e in two.values()} == stepped_checksums(report, hold, killed_at)
    keeper = held["copies"][c.name]
    ranks = {where[pid]: e["rank"] for pid, e in two.items()}
    assert ranks[keeper] == (0 if lost == "rank-0" else 1), (ranks, held["copies"])
    # the lost share was read where its copy is: kept in their old order, the survivors
    # would fetch all of it from the copy (the last rank lost); what does travel from a
    # copy is what every rank reads, DCP's metadata where the lost node wrote it (rank 0)
    fetched = {
        source: sum(metric(d, f'{RESTORED}{{source="{source}"}}') for d in cluster if d is not c)
        for source in ("copy", "memory")
    }
    assert fetched["copy"] < held["size"] / 3 / 2 and fetched["memory"] > 0, (fetched, held)
    ended = a.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    assert ended["state"] == "SUCCEEDED", ended
    assert a.ctl("status", job)["restarts"] == 0, "a lost node spends no restart"
    reference = torchrun(shared_tmp, 2, steps, "--resume-from", str(disk / held["id"]))
    starts_at = {e["step"] for e in events(reference) if e["event"] == "start"}
    assert starts_at == {hold}, starts_at
    assert final_sha(report, 2) == final_sha(reference, 2)


# -- a node joining ----------------------------------------------------------------------------


def test_a_joining_node_loads_the_commit_the_others_just_made(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    cluster = cluster_of(daemon_factory, shared_tmp, "ab", "join")
    c = cluster.add("c")
    cluster.daemons.remove(c)  # started later
    a, _b = cluster.start()
    job = submit(a, report, nnodes="2:3")
    two = wait_for(lambda: formed(report, 2), 180, "2 ranks training")
    wait_for(lambda: stepped(report, set(two), 10), 120, "a few steps at 2")

    joined_at = time.time()
    c.start()
    three = wait_for(lambda: formed(report, 3, joined_at), 180, "the job grew to 3")
    assert set(two) < set(three), "the members kept their processes"
    newcomer = (set(three) - set(two)).pop()
    resumed = {e["step"] for e in three.values()}
    assert len(resumed) == 1, three
    step = resumed.pop()
    # the commit made at the step the members were interrupted at (its commit() raised the
    # interrupt, so the example did not report it): newer than every commit reported
    loaded = {e["loaded"] for e in three.values()}
    reported = {e["name"] for e in events(report) if e["event"] == "commit"}
    assert len(loaded) == 1 and None not in loaded and not loaded & reported, (loaded, three)
    # every step was taken once: at 2 up to the commit that the newcomer loaded, then at 3
    taken = [(e["pid"], e["step"], e["world"]) for e in events(report) if e["event"] == "step"]
    for pid in two:
        mine = [s for p, s, _ in taken if p == pid]
        assert mine == sorted(set(mine)), f"a step redone by {pid}"
        assert [s for p, s, w in taken if p == pid and w == 2] == list(range(1, step + 1))
    wait_for(lambda: stepped(report, set(three), step + 3, joined_at), 120, "3 ranks train on")
    first = min(e["step"] for e in events(report) if e["event"] == "step" and e["pid"] == newcomer)
    assert first == step + 1, "the newcomer trains from the committed step"
    assert a.ctl("status", job)["restarts"] == 0
    a.ctl("cancel", job)


def test_a_node_joining_before_the_rounds_first_commit_under_a_fixed_master_port(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    """``--master-port P``: c joins while a's and b's round has made no commit yet, so
    their first commit makes the writers' group in that round's store after a's daemon
    joined the next round.  That round's store is at P + 1: the first commit finds its own
    store, and the job grows to 3 with no restart."""
    cluster = cluster_of(daemon_factory, shared_tmp, "ab", "joinport")
    c = cluster.add("c")
    cluster.daemons.remove(c)  # started later
    a, _b = cluster.start()
    port = free_port(2)
    slow = ("--commit-every", "20", "--step-time", "0.3")  # the first commit 6 s in
    job = submit(a, report, "--master-port", str(port), nnodes="2:3", args=slow)
    two = wait_for(lambda: formed(report, 2), 180, "2 ranks training")
    assert not [e for e in events(report) if e["event"] == "commit"]
    c.start()
    three = wait_for(lambda: formed(report, 3), 180, "the job grew to 3")
    assert set(two) < set(three), "the members kept their processes"
    assert {e["loaded"] for e in three.values()} != {None}, "the newcomer loaded a commit"
    at = next(iter(three.values()))["step"]
    wait_for(lambda: stepped(report, set(three), at + 1), 120, "3 ranks train on")
    assert a.ctl("status", job)["restarts"] == 0
    a.ctl("cancel", job)


# -- a worker lost, two a node ------------------------------------------------------------------


def test_a_lost_worker_s_peers_train_on_while_its_replacement_warms_up(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    a, b = cluster_of(daemon_factory, shared_tmp, "ab", "twoper").start()
    job = submit(a, report, nnodes="2:2", nproc=2)
    four = wait_for(lambda: formed(report, 4), 180, "4 ranks training")
    wait_for(lambda: stepped(report, set(four), 5), 120, "a few steps at 4")
    where = {w["pid"]: w["node"] for w in a.ctl("status", job)["workers"]}
    lost = next(pid for pid, e in four.items() if where[pid] == b.name and e["rank"] == 3)

    killed_at = time.time()
    os.kill(lost, signal.SIGKILL)
    three = wait_for(lambda: formed(report, 3, killed_at), 120, "the others re-formed at 3")
    assert set(three) == set(four) - {lost}, "the others kept their processes"
    at = next(iter(three.values()))["step"]
    wait_for(lambda: stepped(report, set(three), at + 2, killed_at), 120, "training at 3")
    again = wait_for(lambda: formed(report, 4, killed_at), 180, "the replacement joined")
    assert set(three) < set(again) and lost not in again
    rejoined = {e["step"] for e in again.values()}
    assert len(rejoined) == 1 and rejoined.pop() > at, "the replacement took the step trained at 3"
    assert a.ctl("status", job)["restarts"] == 1
    a.ctl("cancel", job)


# -- a 2D mesh ----------------------------------------------------------------------------------


def test_a_2d_mesh_re_forms_at_half_the_size_after_a_node_loss(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    a, b = cluster_of(daemon_factory, shared_tmp, "ab", "twod").start()
    job = submit(a, report, nnodes="1:2", nproc=2, args=("--tp", "2", "--digest"))
    four = wait_for(lambda: formed(report, 4), 180, "4 ranks training (dp 2 x tp 2)")
    assert {e["dp"] for e in four.values()} == {2}
    wait_for(lambda: stepped(report, set(four), 5), 120, "a few steps")
    where = {w["pid"]: w["node"] for w in a.ctl("status", job)["workers"]}

    killed_at = time.time()
    kill_node(b)
    two = wait_for(lambda: formed(report, 2, killed_at), 120, "re-formed at 2 (dp 1 x tp 2)")
    assert set(two) == {pid for pid in four if where[pid] == a.name}
    assert {e["dp"] for e in two.values()} == {1}
    at = next(iter(two.values()))["step"]
    assert {e["checksum"] for e in two.values()} == stepped_checksums(report, at, killed_at), (
        "the commit holds the model as it was at its step (staged, then written while the "
        "ranks trained on)"
    )
    wait_for(lambda: stepped(report, set(two), at + 3, killed_at), 120, "training at 2")
    a.ctl("cancel", job)


# -- the global batch ---------------------------------------------------------------------------


def test_the_loss_of_a_3_2_3_run_follows_an_uninterrupted_one(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    a, _b, c = cluster_of(daemon_factory, shared_tmp, "abc", "batch").start()
    steps, hold, back = 40, 12, 20  # held at 12 for the loss, at 20 (at 2) for the return
    job = submit(
        a, report, nnodes="2:3", steps=steps, args=("--hold-at", str(hold), "--hold-at", str(back))
    )
    three = wait_for(lambda: formed(report, 3), 180, "3 ranks training")
    name = wait_for(lambda: commit_at(report, hold, set(three)), 180, f"a commit at {hold}")
    complete(a, job, name)
    killed_at = time.time()
    kill_node(c)
    two = wait_for(lambda: formed(report, 2, killed_at), 120, "the survivors re-formed at 2")
    wait_for(lambda: stepped(report, set(two), back - 1, killed_at), 120, "8 steps at 2")
    back_at = time.time()
    c.start()
    wait_for(lambda: formed(report, 3, back_at), 180, "back at 3")
    ended = a.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    assert ended["state"] == "SUCCEEDED", ended

    reference = torchrun(shared_tmp, 3, steps)
    expected = curve(reference)
    got = curve(report)
    worlds = {w for _, w in got.values()}
    assert worlds == {2, 3}, worlds
    assert sorted(got) == sorted(expected) == list(range(1, steps + 1))
    for step, (loss, world) in sorted(got.items()):
        want = expected[step][0]
        assert abs(loss - want) <= 1e-4 * abs(want) + 1e-6, (step, world, loss, want)


def curve(report: Path) -> dict[int, tuple[float, int]]:
    """Step -> (the global batch's loss, the world it was taken in), the last time each step
    was taken (a step taken again after a failure replaces the first)."""
    found: dict[int, tuple[float, int]] = {}
    for e in events(report):
        if e["event"] == "step" and e["rank"] == 0:
            found[e["step"]] = (e["loss"], e["world"])
    return found


# -- a commit over the job's cap ----------------------------------------------------------------


def test_a_commit_over_the_jobs_cap_fails_the_job_at_the_commit_after_it(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    """A commit returns once staged; its write, refused for the job's checkpoint memory, is
    the error the next commit raises: the job fails with the reason, and no later commit is
    reported."""
    (a,) = cluster_of(daemon_factory, shared_tmp, "a", "cap").start()
    # about 4.2M parameters: each rank's part of a commit is about 25 MB, over 4 MiB
    big = ("--hidden", "512", "--ffn", "2048", "--commit-every", "1")
    cap = ("--checkpoint-memory", "4M", "--max-restarts", "0")
    job = submit(a, report, *cap, nnodes="1", nproc=2, steps=5, args=big)
    a.wait_output(job, ["No space left on device"], 240)
    ended = a.wait_job(job, lambda j: j["state"] in ("FAILED", "SUCCEEDED"), 120)
    assert ended["state"] == "FAILED", ended
    commits = {e["step"] for e in events(report) if e["event"] == "commit"}
    assert commits == {1}, f"only the first commit returned (staged): {commits}"
    wait_for(lambda: "its checkpoint directory is full" in a.log_text(), 30, "the daemon's reason")


def test_a_commit_whose_copy_is_refused_for_the_cap_fails_the_job_with_the_reason(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    """Each node's own share of a commit fits its cap, but not with the copy of the other
    node's: the copy is refused there, and the commit after it fails the job with that
    reason instead of waiting for a completion that cannot come (COMPLETE_WAIT, 600 s)."""
    a, b = cluster_of(daemon_factory, shared_tmp, "ab", "refused").start()
    # about 4.2M parameters: each node's share of a commit is about 25 MB, under 40 MiB;
    # with the other node's copy, about 50 MB, over it
    big = ("--hidden", "512", "--ffn", "2048", "--commit-every", "1")
    cap = ("--checkpoint-memory", "40M", "--max-restarts", "0")
    job = submit(a, report, *cap, nnodes="2", steps=50, args=big)
    ended = a.wait_job(job, lambda j: j["state"] in ("FAILED", "SUCCEEDED"), 240)
    assert ended["state"] == "FAILED", ended
    # most often the copy is refused; where a copy took the space before a node's own
    # write landed, that write is refused instead (the other test's case)
    error = (ended.get("error") or {}).get("message", "")
    assert "[Errno 28]" in error, ended
    if "cannot be complete" in error:
        assert "was refused there" in error and "checkpoint memory" in error, error
        assert any("refused its copy" in d.log_text() for d in (a, b)), "no daemon said why"
    commits = {e["step"] for e in events(report) if e["event"] == "commit"}
    assert commits == {1}, f"only the first commit returned (staged): {commits}"
