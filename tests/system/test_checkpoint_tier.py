"""The checkpoint tier end to end: real daemons, real workers running examples/dcp_train.py
(FSDP2 or DDP on gloo, DCP saves into ELASTICD_CHECKPOINT_DIR, unchanged from a torchrun
script), real failures.  Each test asserts the step the job resumed from and the tensors.

- a worker SIGKILLed: the group restarts and reads the newest complete checkpoint from the
  node's memory (no --checkpoint-dir: nothing can come from disk), no committed step lost;
- a node SIGKILLed at --nnodes 2:3: the survivors re-form at 2 and read the checkpoint,
  resharded by DCP, its lost node's share coming from the copy; the parameters at the end
  are bitwise those of a reference run that restarted at world 2 from the same step on disk;
- a node and the node keeping its copy both lost: the disk copy is used, or, without one,
  the job fails naming the checkpoint and why;
- a save torn by a SIGKILL in the middle: the checkpoint before it is read;
- a node that joined (a scale-up on the restart path), then a node lost: the checkpoint the
  newcomer was given is still the one the job resumes from.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import signal
import subprocess
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness import PY, ROOT, worker_args
from local_users import local_users
from store_attack import Cluster, wait_for

pytestmark = pytest.mark.slow

SCRIPT = str(ROOT / "examples" / "dcp_train.py")


def events(report: Path) -> list[dict[str, Any]]:
    path = report / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def saved(report: Path, world: int | None = None) -> list[int]:
    return sorted(
        {e["step"] for e in events(report) if e["event"] == "save" and world in (None, e["world"])}
    )


def starts(report: Path) -> list[dict[str, Any]]:
    return [e for e in events(report) if e["event"] == "start"]


@pytest.fixture
def report(shared_tmp: Path) -> Path:
    path = shared_tmp / "report"
    path.mkdir(mode=0o777)
    return path


def train_args(report: Path, steps: int, *extra: str, step_time: float = 0.05) -> tuple[str, ...]:
    """The job's command line (one intra-op thread: the same float sums as a reference)."""
    return (
        "--env",
        "OMP_NUM_THREADS=1",
        SCRIPT,
        "--",
        "--steps",
        str(steps),
        "--save-every",
        "5",
        "--step-time",
        str(step_time),
        "--report",
        str(report),
        *extra,
    )


def two_workers(daemon: Any, *args: str) -> str:
    """A job of two workers on ``daemon`` that may restart once; its id."""
    return daemon.submit("--nproc-per-node", "2", "--max-restarts", "1", *args)["id"]


def worker_pids(daemon: Any, job: str) -> list[int]:
    doc = daemon.ctl("status", job)
    return [w["pid"] for w in doc["workers"] if w["pid"] and w["state"] == "HEALTHY"]


def test_a_killed_worker_restarts_its_group_from_the_nodes_memory(daemon, report):
    # held after step 10's save until the kill
    job = two_workers(daemon, *train_args(report, 60, "--pause-after-save", "10"))
    wait_for(lambda: len(saved(report)) >= 2, 120, "two checkpoints saved")
    doc = wait_for(
        lambda: (d := daemon.ctl("status", job)).get("checkpoint") and d, 60, "one complete"
    )
    complete = int(doc["checkpoint"]["id"].split("_")[1])
    os.kill(worker_pids(daemon, job)[0], signal.SIGKILL)
    ended = daemon.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 240)
    assert ended["state"] == "SUCCEEDED", ended
    resumed = [e["step"] for e in starts(report)][2:]  # after the first start of both ranks
    assert resumed and min(resumed) >= complete, (resumed, complete)
    done = [e for e in events(report) if e["event"] == "done"]
    assert {e["step"] for e in done} == {60} and len({e["sha256"] for e in done}) == 1


# -- several nodes -------------------------------------------------------------------------


@pytest.fixture
def trio(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="ckpt", store_apart=True)
    for role in ("a", "b", "c"):
        cluster.add(role)
    return cluster.start()


def kill_node(daemon: Any) -> None:
    """SIGKILL a node: its daemon and every process it started (its workers), at once."""
    proc = psutil.Process(daemon.proc.pid)
    victims = [proc, *proc.children(recursive=True)]
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            pass
    daemon.wait_exit()


def complete(daemon: Any, job: str, step: int, on_disk: bool = False) -> dict[str, Any]:
    """Wait until ``step`` is the job's newest complete checkpoint (on disk too, if asked)."""

    def ready() -> dict[str, Any] | None:
        checkpoint = daemon.ctl("status", job).get("checkpoint") or {}
        good = checkpoint.get("id") == f"step_{step}" and (checkpoint.get("on_disk") or not on_disk)
        return checkpoint if good else None

    return wait_for(ready, 120, f"step_{step} complete{' and on disk' if on_disk else ''}")


def samples(daemon: Any, name: str) -> dict[str, float]:
    """The daemon's metric samples called ``name``, by their labels' text."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics").read()
    found: dict[str, float] = {}
    for line in text.decode().splitlines():
        sample, _, value = line.rpartition(" ")
        if sample == name or sample.startswith(name + "{"):
            found[sample[len(name) :]] = float(value)
    return found


def restores(daemon: Any) -> dict[str, float]:
    """elasticd_checkpoint_restores_total by source, from the daemon's metrics."""
    found = samples(daemon, "elasticd_checkpoint_restores_total")
    return {labels.split('source="')[1].split('"')[0]: n for labels, n in found.items()}


def reference(shared_tmp: Path, checkpoint: Path, step: int, steps: int) -> str:
    """torchrun at world 2 from ``checkpoint`` (a DCP step on disk): the final SHA-256."""
    ref, report = shared_tmp / "ref-ckpt", shared_tmp / "ref-report"
    report.mkdir()
    ref.mkdir()
    subprocess.run(["cp", "-r", str(checkpoint), str(ref / f"step_{step}")], check=True)
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    args = ["--steps", str(steps), "--save-every", "1000", "--ckpt-dir", str(ref)]
    done = subprocess.run(
        [*torchrun, SCRIPT, *args, "--report", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    finals = {json.loads((report / f"final-{r}.json").read_text())["sha256"] for r in (0, 1)}
    assert len(finals) == 1
    starts_at = {e["step"] for e in events(report) if e["event"] == "start"}
    assert starts_at == {step}, starts_at
    return finals.pop()


def test_a_lost_node_re_forms_from_the_copy_resharded_bitwise_as_from_disk(
    trio: Cluster, report: Path, shared_tmp: Path
) -> None:
    a, b, c = trio
    disk = shared_tmp / "disk"
    disk.mkdir(mode=0o777)
    job = a.submit(
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--last-call-timeout",
        "1",
        "--checkpoint-dir",
        str(disk),
        "--keep-checkpoints",
        "10",
        *train_args(report, 40, "--pause-after-save", "20"),
    )["id"]
    held = complete(a, job, 20, on_disk=True)
    assert held["world"] == 3 and sorted(held["held"]) == sorted(d.name for d in trio)
    assert all(held["copies"].values()), held  # every share has its copy on another node
    for daemon in trio:  # each node timed its share's way to disk (the disk lag metric)
        assert samples(daemon, "elasticd_checkpoint_disk_seconds_count")[""] >= 1
    kill_node(c)
    ended = a.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    assert ended["state"] == "SUCCEEDED", ended
    after = [e for e in starts(report) if e["world"] == 2]
    assert after and {e["step"] for e in after} == {20}, starts(report)
    done = {e["sha256"] for e in events(report) if e["event"] == "done"}
    assert len(done) == 1
    assert done == {reference(shared_tmp, disk / "step_20", 20, 40)}
    # the lost node's share came from its copy, on a survivor
    assert restores(a).get("copy", 0) + restores(b).get("copy", 0) >= 1


@pytest.mark.parametrize("on_disk", [True, False], ids=["disk", "lost"])
def test_a_node_and_the_keeper_of_its_copy_lost(
    trio: Cluster, report: Path, shared_tmp: Path, on_disk: bool
) -> None:
    b = trio[1]
    disk = shared_tmp / "disk"
    disk.mkdir(mode=0o777)
    extra = ("--checkpoint-dir", str(disk)) if on_disk else ()
    job = b.submit(
        "--nnodes",
        "1:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--last-call-timeout",
        "1",
        *extra,
        *train_args(report, 30, "--pause-after-save", "15"),
    )["id"]
    held = complete(b, job, 15, on_disk=on_disk)
    copies = held["copies"]
    # two nodes gone: one, and the node that keeps its copy (neither the survivor)
    lost = next(n for n, keeper in copies.items() if b.name not in (n, keeper))
    keeper = copies[lost]
    for daemon in trio:
        if daemon.name in (lost, keeper):
            kill_node(daemon)
    ended = b.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    if on_disk:
        assert ended["state"] == "SUCCEEDED", ended
        assert {e["step"] for e in starts(report) if e["world"] == 1} == {15}
        assert restores(b).get("disk", 0) >= 1
    else:
        assert ended["state"] == "FAILED", ended
        message = ended["error"]["message"]
        assert "checkpoint step_15" in message and "cannot be restored" in message, message
        assert lost in message and "lost" in message, message


def test_a_node_that_joined_keeps_the_checkpoint_it_was_given_for_the_next_loss(
    daemon_factory: Any, shared_tmp: Path, report: Path
) -> None:
    """Scaled up on the restart path, a newcomer is given the newest complete checkpoint
    before its workers start.  It once described it as its own share of its round, which hid
    the older round's shares: the checkpoint looked torn, and the next restart deleted it on
    every node and started the job from nothing."""
    cluster = Cluster(daemon_factory, shared_tmp, prefix="ckjoin", store_apart=True)
    a, b = cluster.add("a"), cluster.add("b")
    cluster.start()
    job = a.submit(
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        # step_15, at 3, is 5 s away when the kill comes
        *train_args(report, 20, "--pause-after-save", "10", step_time=1.0),
    )["id"]
    held = complete(a, job, 10)
    assert held["world"] == 2, held
    c = cluster.add("c")
    c.start()  # the job grows to 3, every worker started again from step_10
    wait_for(
        lambda: [e for e in starts(report) if e["world"] == 3],
        120,
        "the job restarted at world 3",
    )
    assert {e["step"] for e in starts(report) if e["world"] == 3} == {10}
    kill_node(b)
    ended = a.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    assert ended["state"] == "SUCCEEDED", ended
    last = [e for e in starts(report) if e["world"] == 2][-2:]  # the two ranks after the loss
    assert {e["step"] for e in last} == {10}, starts(report)


def test_a_save_torn_by_a_sigkill_leaves_the_one_before_in_force(daemon, report):
    job = two_workers(daemon, *train_args(report, 30, "--die-in-save", "15"))
    ended = daemon.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 240)
    assert ended["state"] == "SUCCEEDED", ended
    resumed = [e["step"] for e in starts(report)][2:]
    assert resumed and set(resumed) == {10}, starts(report)


def same_bytes(one: Path, other: Path) -> bool:
    try:
        return one.read_bytes() == other.read_bytes()
    except FileNotFoundError:
        return False


def test_a_copy_whose_owner_renamed_it_away_is_dropped_where_it_was_kept(trio: Cluster) -> None:
    """A file written to a temporary name, copied to another node, then renamed: the copy of
    the temporary name goes from the node that kept it (a node holds its own shares and the
    copies of what their owners still hold, not every name a file ever had), and the file
    under its new name is copied."""
    a = trio[0]
    job = a.submit("--nnodes", "3", "--nproc-per-node", "1", *worker_args("--sleep", "0"))["id"]
    a.wait_job(job, lambda d: d["state"] == "RUNNING" and d["world_size"] == 3)
    tiers = [Path(d.runtime_dir) / "checkpoints" / job for d in trio]
    data = os.urandom(1 << 20)

    def copies(name: str) -> list[Path]:
        return [p for tier in tiers for p in tier.glob(f".copies/{a.name}/{name}/{name}")]

    def whole(name: str) -> list[Path]:
        return [p for p in copies(name) if p.read_bytes() == data]

    (tiers[0] / "state.pt.tmp").write_bytes(data)
    kept = wait_for(lambda: whole("state.pt.tmp"), 60, "the temporary name's copy landed")
    os.replace(tiers[0] / "state.pt.tmp", tiers[0] / "state.pt")
    wait_for(lambda: whole("state.pt"), 60, "the file under its new name copied")
    wait_for(lambda: not copies("state.pt.tmp"), 30, f"{kept[0]} dropped")
    assert not [p for tier in tiers for p in tier.glob(".copies/*/state.pt.tmp")]


@pytest.mark.parametrize("owner", ["root", "a user"])
def test_files_each_rank_wrote_itself_follow_their_ranks_to_other_nodes(
    trio: Cluster, report: Path, shared_tmp: Path, owner: str
) -> None:
    """torch.save per rank, unchanged: rank 0's node lost; the survivors become ranks 0 and
    1, each finding its rank's file of step 20 (one from the lost node's copy, one fetched
    from the node that wrote it).  A user's job: what the daemons put in its directories
    (copies, fetched files) is made with the user's rights, so it is theirs."""
    with contextlib.ExitStack() as stack:
        by: dict[str, str] = {}
        if owner != "root":
            by["user"] = stack.enter_context(local_users("trainer"))["trainer"]
            shared_tmp.chmod(0o755)
            report.chmod(0o777)
        _files_follow_their_ranks(trio, report, by)


def _files_follow_their_ranks(trio: Cluster, report: Path, by: dict[str, str]) -> None:
    b = trio[1]
    script = str(ROOT / "tests" / "fixtures" / "rank_files.py")
    job = b.submit(
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "2",
        "--last-call-timeout",
        "1",
        script,
        "--",
        "40",
        str(report),
        **by,
    )["id"]

    tiers = {d.name: Path(d.runtime_dir) / "checkpoints" / job for d in trio}

    def copied_at_20() -> bool:
        """Every rank saved step 20 (its last), and each node keeps its ring neighbour's file
        of it: each copy's bytes are its owner's (not its mtime against the save's time: a
        file's times come from the kernel's coarse clock, up to a tick behind time.time())."""
        saves = [e for e in events(report) if e["event"] == "save" and e["step"] == 20]
        if len(saves) < 3:
            return False
        copies = [path for tier in tiers.values() for path in tier.glob(".copies/*/*/*.pt")]
        return len(copies) == 3 and all(
            same_bytes(c, tiers[c.parent.parent.name] / c.name) for c in copies
        )

    wait_for(copied_at_20, 120, "every rank's file of step 20 saved and copied")
    rank0 = next(
        d
        for d in trio
        if d.name == next(n["node"] for n in b.ctl("status", job)["nodes"] if n["ranks"] == [0])
    )
    kill_node(rank0)
    ended = b.wait_job(job, lambda j: j["state"] in ("SUCCEEDED", "FAILED"), 300)
    assert ended["state"] == "SUCCEEDED", ended
    again = [e for e in starts(report) if e["world"] == 2]
    assert sorted((e["rank"], e["step"], e["from"]) for e in again) == [(0, 20, 0), (1, 20, 1)]
    # each file as its rank found it, restored from a copy or fetched: its user's
    uid = pwd.getpwnam(by["user"]).pw_uid if by else 0
    assert [e["uid"] for e in again] == [uid, uid], again
    # the temporary names (rank<N>.pt.tmp, renamed at once) were never taken for
    # checkpoints that went missing: a rename away is forgotten, a vanished file is no news
    for d in trio:
        if d is not rank0:
            assert "landing failed" not in d.log_text() and ".tmp" not in str(
                d.ctl("status", job).get("checkpoints", "")
            )
