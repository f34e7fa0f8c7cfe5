"""Lightning, the real framework (lightning 2.6.6, pinned by packaging/venv.sh), under
elasticd: examples/lightning_train.py, a ``Trainer(strategy="ddp")`` script written as
Lightning's docs write one (CPU, gloo, ``ModelCheckpoint`` keeping ``last.ckpt``,
``fit(ckpt_path="last")``), run unchanged.

- under elasticrun it ends as under torchrun, the same command line word for word, with the
  same parameters (the script prints a checksum of them);
- ``Trainer(num_nodes=N)`` on a round of fewer nodes fails as Lightning fails it (docs/frameworks.md,
  "What does not: num_nodes"), and works through ``elasticd.elastic.lightning.elastic_trainer_kwargs``;
- on three daemons, ``--nnodes 2:3``, a node SIGKILLed mid-training: the job re-forms on two,
  resumes from ``last.ckpt`` and succeeds, with the script's ``num_nodes=3``;
- in place (``--in-place``, ``elasticd.elastic.lightning.elastic_fit``): Lightning's state
  committed in memory resumes exactly (one process, no daemons); on three daemons a node
  SIGKILLed leaves the survivors training in their own processes from the last in-memory
  commit, and the job succeeds; a node added to a job of two: the survivors stop at a commit,
  and the newcomer takes rank 0's state (the world of 3 starts at that step, none redone).

Lightning's import takes seconds of CPU per worker: few workers, few steps. Skipped, with
the reason, where lightning is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from harness import CLIENT_ENV, ROOT, beside_torchrun
from store_attack import Cluster, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("lightning") is None,
        reason="lightning is not installed (packaging/venv.sh installs lightning==2.6.6)",
    ),
]

SCRIPT = str(ROOT / "examples" / "lightning_train.py")
TIMEOUT = 600.0  # a loaded 2-core machine: each worker imports torch and Lightning
FINAL = re.compile(r"final step (\d+) checksum ([0-9a-f]+)")


def final(text: str) -> tuple[int, str]:
    found = FINAL.findall(text)
    assert len(found) == 1, text[-3000:]
    return int(found[0][0]), found[0][1]


def test_a_ddp_script_runs_unchanged_and_ends_as_under_torchrun(
    daemon: Any, shared_tmp: Path
) -> None:
    """The same command line, word for word, to torch's torchrun and to elasticrun (which
    submits it to the daemon and prints the workers' output as torchrun does)."""
    argv = [
        "--standalone",
        "--nproc-per-node",
        "2",
        SCRIPT,
        "--devices",
        "2",
        "--max-steps",
        "12",
        "--every",
        "4",
    ]
    ours, theirs = beside_torchrun(
        daemon, shared_tmp, argv, {**CLIENT_ENV, "PYTHONPATH": str(ROOT / "daemon")}, TIMEOUT
    )
    assert final(ours) == final(theirs) and final(ours)[0] == 12, (ours, theirs)
    assert (shared_tmp / "ckpt-elasticd" / "last.ckpt").is_file()
    assert (shared_tmp / "ckpt-torchrun" / "last.ckpt").is_file()


def test_num_nodes_as_the_docs_write_it_needs_the_integration(
    daemon: Any, shared_tmp: Path
) -> None:
    """num_nodes on one node: the script says num_nodes=2 and the round has 1 node (the
    same mismatch as a 3-node job that lost one). Lightning refuses it in every round; the
    integration gives Lightning the round's count and the job succeeds."""
    common = (
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "0",
        SCRIPT,
        "--",
        "--num-nodes",
        "2",
        "--max-steps",
        "3",
    )
    plain = daemon.submit_wait(*common, expect=1, timeout=TIMEOUT)  # --wait: 1 for a failed job
    assert plain["state"] == "FAILED", plain
    assert "does not match the world size" in plain["error"]["message"], plain["error"]
    job = daemon.submit_wait(*common, "--elasticd", timeout=TIMEOUT)
    assert job["state"] == "SUCCEEDED", job
    logs = daemon.ctl_run("logs", job["id"]).stdout
    assert "Trainer(num_nodes=2) asked; this round has 1 nodes" in logs, logs[-3000:]
    assert "start step 0 world 1 nodes 1" in logs and final(logs)[0] == 3, logs[-3000:]


@pytest.fixture
def cluster(daemon_factory: Any, shared_tmp: Path) -> Cluster:
    cluster = Cluster(daemon_factory, shared_tmp, prefix="lightning")
    for role in ("a", "b", "c"):
        cluster.add(role)
    return cluster.start()


def test_a_node_loss_resumes_from_last_ckpt_and_succeeds(
    cluster: Cluster, shared_tmp: Path
) -> None:
    """--nnodes 2:3, one worker per node, the script's Trainer(num_nodes=3) through the
    integration; a node (not rank 0's, not the store's) SIGKILLed once last.ckpt exists."""
    a = cluster[0]
    ckpt = shared_tmp / "ckpt"
    job = a.submit(
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        SCRIPT,
        "--",
        "--num-nodes",
        "3",
        "--elasticd",
        "--ckpt-dir",
        str(ckpt),
        "--max-steps",
        "25",
        "--every",
        "5",
        "--step-seconds",
        "0.25",
    )["id"]
    doc = a.wait_running(job, 3, TIMEOUT)
    a.wait_output(job, ["start step 0 world 3 nodes 3"], TIMEOUT)
    wait_for(lambda: (ckpt / "last.ckpt").is_file(), TIMEOUT, "a last.ckpt")
    rank_of = {w["node"]: w["rank"] for w in doc["workers"]}
    victim = max(
        (d for d in cluster.daemons[1:] if rank_of[d.name] != 0), key=lambda d: rank_of[d.name]
    )
    killed = time.monotonic()
    victim.signal(signal.SIGKILL)
    victim.wait_exit(30)
    end = a.wait_job(job, lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), TIMEOUT)
    took = time.monotonic() - killed
    assert end["state"] == "SUCCEEDED", end
    logs = a.ctl_run("logs", job).stdout
    resumed = [int(s) for s in re.findall(r"start step (\d+) world 2 nodes 2", logs)]
    assert resumed and resumed[0] > 0 and resumed[0] % 5 == 0, logs[-4000:]
    assert "Trainer(num_nodes=3) asked; this round has 2 nodes" in logs, logs[-4000:]
    assert final(logs)[0] == 25
    assert end["restarts"] == 0, "a node loss spends no restart"
    print(f"node SIGKILLed -> job SUCCEEDED in {took:.1f} s, resumed at step {resumed[0]}")


def test_the_environment_gives_lightning_each_rounds_nodes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The integration's pure part, on a round's environment as elasticd sets it."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from elasticd.elastic.lightning import ElasticdEnvironment, elastic_trainer_kwargs

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert elastic_trainer_kwargs(num_nodes=3) == {"num_nodes": 3, "plugins": []}, (
        "outside a launcher: as given"
    )
    round_env = {
        "TORCHELASTIC_RUN_ID": "j-1",
        "GROUP_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }
    for name, value in round_env.items():
        monkeypatch.setenv(name, value)
    kwargs = elastic_trainer_kwargs(num_nodes=3)
    assert kwargs["num_nodes"] == 2 and [type(p) for p in kwargs["plugins"]] == [
        ElasticdEnvironment
    ]
    assert "Trainer(num_nodes=3) asked; this round has 2 nodes" in capsys.readouterr().err
    own = LightningEnvironment()
    assert elastic_trainer_kwargs(num_nodes=2, plugins=[own])["plugins"] == [own]
    env = kwargs["plugins"][0]
    assert (env.world_size(), env.global_rank(), env.node_rank(), env.num_nodes()) == (4, 0, 1, 2)
    env.validate_settings(num_devices=2, num_nodes=2)
    with pytest.raises(
        ValueError,
        match=r"num_nodes=3\), but this round has 2 nodes: pass \*\*elastic_trainer_kwargs",
    ):
        env.validate_settings(num_devices=2, num_nodes=3)
    with pytest.raises(ValueError, match=r"devices=1\), but this node runs 2 workers"):
        env.validate_settings(num_devices=1, num_nodes=4)
    monkeypatch.setenv("WORLD_SIZE", "3")  # 2 workers here, 1 on the other node
    with pytest.raises(ValueError, match="the same number of workers on every node"):
        env.validate_settings(num_devices=2, num_nodes=2)


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def round_starts(path: Path, world: int, after: float = 0.0) -> dict[int, dict[str, Any]] | None:
    """rank -> its newest "start" event in a world of ``world`` after ``after``, once every
    rank of that world has one (else None)."""
    found = {
        e["rank"]: e
        for e in events(path)
        if e["event"] == "start" and e["world"] == world and e["t"] > after
    }
    return found if len(found) == world else None


def until(daemon: Any, job: str, condition: Any, what: str) -> Any:
    """wait_for(condition), failing at once, with the job's error, if the job ends first."""

    def check() -> Any:
        value = condition()
        if not value:
            doc = daemon.ctl("status", job)
            assert doc["state"] not in ("SUCCEEDED", "FAILED", "CANCELLED"), (what, doc)
        return value

    return wait_for(check, TIMEOUT, what, interval=1.0)


def test_in_place_a_commit_in_memory_resumes_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-place state path without daemons: a fit stopped at step 18, its commit of step
    16 (an epoch's end: 256 samples in batches of 16) sent through the no-pickle codec that a
    sync uses, and a new Trainer's fit from it ends with the same parameters as a fit that
    never stopped. (Mid-epoch, Lightning restarts the epoch's data unless the dataloader is
    stateful: the steps are right, the batches not the same.) With no commit in memory, as
    in a group restart's fresh processes, ``ckpt_path`` (a file) is where fit resumes."""
    import sys

    import lightning as L
    from torch.utils.data import DataLoader

    from elasticd.elastic.broadcast import decode, encode
    from elasticd.elastic.lightning import LightningState, elastic_fit

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("ELASTICD_AGENT_SOCKET", raising=False)
    monkeypatch.chdir(tmp_path)
    for logger in logging.root.manager.loggerDict.values():  # lightning's, torch's: bound to
        for handler in getattr(logger, "handlers", []):  # sys.stderr at import, maybe an
            if getattr(getattr(handler, "stream", None), "closed", False):  # earlier capsys's
                monkeypatch.setattr(handler, "stream", sys.stderr)
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from lightning_train import Regressor, checksum, data
    finally:
        sys.path.remove(str(ROOT / "examples"))

    def trainer(steps: int, callbacks: tuple[Any, ...] = ()) -> Any:
        return lambda **kw: L.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=list(callbacks),
            **kw,
        )

    class Batches(L.Callback):
        taken = 0

        def on_train_batch_end(self, *args: Any) -> None:
            self.taken += 1

    def model() -> Any:
        L.seed_everything(0, verbose=False)
        return Regressor(0.05, 0.0)

    loader = DataLoader(data(256), batch_size=16)
    straight = model()
    done = elastic_fit(trainer(40), straight, loader, every_n_steps=16)
    assert done.global_step == 40
    first = model()
    state = LightningState(first)
    elastic_fit(trainer(18), first, loader, every_n_steps=16, state=state)
    state.restore()  # what a failure does: back to the commit of step 16
    assert state.checkpoint["global_step"] == 16
    state.checkpoint = decode(*encode(state.checkpoint))  # what a newcomer's sync receives
    second = Regressor(0.05, 0.0)  # a newcomer's own model, its own weights
    resumed = LightningState(second)
    resumed.checkpoint = state.checkpoint
    assert (
        elastic_fit(trainer(40), second, loader, every_n_steps=16, state=resumed).global_step == 40
    )
    assert checksum(second) == checksum(straight)
    # No commit in memory (a group restart's fresh processes): ckpt_path, e.g. a last.ckpt.
    saved = tmp_path / "step40.ckpt"
    done.save_checkpoint(str(saved))
    batches = Batches()
    assert (
        elastic_fit(
            trainer(42, (batches,)), Regressor(0.05, 0.0), loader, ckpt_path=str(saved)
        ).global_step
        == 42
    )
    assert batches.taken == 2


def submit_in_place(
    daemon: Any, shared_tmp: Path, *, max_steps: int, step_seconds: float
) -> tuple[str, Path]:
    """The script's --in-place (elastic_fit, a commit every 5 steps) as an --in-place
    --nnodes 2:3 job of one worker per node; its id and the workers' event file."""
    report_dir = shared_tmp / "report"
    report_dir.mkdir(mode=0o777)
    report = report_dir / "events.jsonl"
    job = daemon.submit(
        "--in-place",
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--max-restarts",
        "3",
        "--last-call-timeout",
        "1",
        SCRIPT,
        "--",
        "--in-place",
        "--num-nodes",
        "3",
        "--max-steps",
        str(max_steps),
        "--every",
        "5",
        "--step-seconds",
        str(step_seconds),
        "--report",
        str(report),
    )["id"]
    return job, report


def test_in_place_a_node_loss_keeps_the_survivors_and_resumes_from_memory(
    cluster: Cluster, shared_tmp: Path
) -> None:
    """--in-place --nnodes 2:3, the script's --in-place (elastic_fit, a commit every 5
    steps, no checkpoint files): node c SIGKILLed once the world of 3 is past a commit."""
    a, _b, c = cluster
    job, report = submit_in_place(a, shared_tmp, max_steps=40, step_seconds=0.2)
    three = until(a, job, lambda: round_starts(report, 3), "3 ranks training")
    until(
        a,
        job,
        lambda: any(
            e["event"] == "step" and e["world"] == 3 and e["step"] >= 12 for e in events(report)
        ),
        "step 12 in the world of 3",
    )
    killed_at = time.time()
    c.signal(signal.SIGKILL)  # the node dies: its daemon, and with it its worker
    c.wait_exit(30)
    end = a.wait_job(job, lambda d: d["state"] in ("SUCCEEDED", "FAILED", "CANCELLED"), TIMEOUT)
    assert end["state"] == "SUCCEEDED", end
    two = round_starts(report, 2, killed_at)
    assert two is not None, events(report)[-10:]
    assert {e["pid"] for e in two.values()} == {three[0]["pid"], three[1]["pid"]}, (
        "the survivors kept their processes"
    )
    # the last step of the world of 3: c's worker dies with its daemon, a moment after the
    # signal, so the three may finish (and commit) one more step after killed_at
    before = max(e["step"] for e in events(report) if e["event"] == "step" and e["world"] == 3)
    resumed = two[0]["step"]
    assert {e["step"] for e in two.values()} == {resumed}
    assert resumed % 5 == 0 and 10 <= resumed <= before and before - resumed <= 5, (resumed, before)
    logs = a.ctl_run("logs", job).stdout
    assert final(logs)[0] == 40, logs[-3000:]
    assert "Restored all states from the checkpoint at elasticd-memory://" in logs, logs[-3000:]
    assert end["restarts"] == 0, "a node loss spends no restart"
    print(f"resumed at step {resumed}, {before - resumed} steps redone")


def test_in_place_a_node_added_grows_the_job_and_the_newcomer_takes_rank_0s_state(
    daemon_factory: Any, shared_tmp: Path
) -> None:
    """--in-place --nnodes 2:3 on two daemons; a third daemon started mid-training. The
    job trains until cancelled: a newcomer's warm-up (Python, torch, Lightning) has no bound
    on a loaded machine that a max_steps could be sized to outlast."""
    cluster = Cluster(daemon_factory, shared_tmp, prefix="lightgrow")
    a, _ = cluster.add("a"), cluster.add("b")
    cluster.start()
    job, report = submit_in_place(a, shared_tmp, max_steps=100000, step_seconds=0.1)
    two = until(a, job, lambda: round_starts(report, 2), "2 ranks training")
    until(
        a,
        job,
        lambda: any(e["event"] == "step" and e["step"] >= 7 for e in events(report)),
        "step 7 in the world of 2",
    )
    added_at = time.time()
    cluster.add("c").start()
    three = until(a, job, lambda: round_starts(report, 3, added_at), "the job grew to 3")
    assert {e["pid"] for e in two.values()} < {e["pid"] for e in three.values()}, (
        "the survivors kept their processes"
    )
    started = {e["step"] for e in three.values()}
    assert len(started) == 1, three  # the newcomer too: rank 0's state, not step 0
    step = started.pop()
    last_of_two = max(e["step"] for e in events(report) if e["event"] == "step" and e["world"] == 2)
    assert step >= 10 and step % 5 == 0 and step == last_of_two, (step, last_of_two)
    until(
        a,
        job,
        lambda: any(
            e["event"] == "step" and e["world"] == 3 and e["step"] > step + 5
            for e in events(report)
        ),
        "3 ranks train on",
    )
    assert a.ctl("status", job)["restarts"] == 0
    assert a.ctl("cancel", job)["state"] == "CANCELLED"
    print(f"grew at step {step}, none redone")
