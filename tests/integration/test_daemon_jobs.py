"""A real standalone elasticd, real elasticctl, real worker processes."""

from __future__ import annotations

import json
import os
import signal

import pytest
from harness import CLIENT_ENV, ROOT, free_port, sleeping_job, wait_gone, worker_args

EXAMPLE = str(ROOT / "examples" / "ddp_train.py")


def test_ddp_training_job_succeeds(daemon):
    done = daemon.ctl_run("submit", "--nproc-per-node", "2", "--wait", EXAMPLE, "--epochs", "2")
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()
    assert "exit barrier" not in done.stdout  # a one-node job has nobody to wait for
    job_id = daemon.ctl("list")[0]["id"]
    status = daemon.ctl("status", job_id)
    assert status["state"] == "SUCCEEDED" and status["exit_code"] == 0
    assert [w["rank"] for w in status["workers"]] == [0, 1]
    assert all(w["state"] == "SUCCEEDED" and w["exit_code"] == 0 for w in status["workers"])
    logs = daemon.ctl_run("logs", job_id).stdout
    assert "epoch 0 loss" in logs and "epoch 1 loss" in logs and "world_size 2" in logs


def test_workers_get_the_torchrun_environment(daemon, shared_tmp):
    out = shared_tmp / "env"
    out.mkdir()
    job_id = daemon.submit_wait(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "2",
        "--env",
        "EXTRA=1",
        *worker_args("--env-out", str(out)),
    )["id"]
    envs = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    for rank, env in enumerate(envs):
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "default"
        assert env["TORCHELASTIC_RUN_ID"] == job_id
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"attempt_0/rank_{rank}.error.json")
        assert env["OMP_NUM_THREADS"] == "1" and env["EXTRA"] == "1"
        assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
        assert env["PATH"] == CLIENT_ENV["PATH"]  # the submitter's environment
        assert "CUDA_VISIBLE_DEVICES" not in env
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]


STORE_CLIENTS = """
import os
from datetime import timedelta
from torch.distributed import TCPStore

# no rank hosts a store: the round's is served by the daemon, from before any worker starts
store = TCPStore(
    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
    timeout=timedelta(seconds=30),
)
rank = int(os.environ["RANK"])
store.set(f"rank{rank}", str(os.getpid()))
store.wait([f"rank{1 - rank}"])
print("met", store.get(f"rank{1 - rank}").decode())
"""


@pytest.mark.parametrize("port", ["fresh", "fixed"])
def test_the_rounds_store_is_served_before_its_workers_start(daemon, shared_tmp, port):
    """torchrun's agent store: every rank a client (``TORCHELASTIC_USE_AGENT_STORE=True``),
    none refused for being first (torch's client then backs off half a second)."""
    script = shared_tmp / "store_clients.py"
    script.write_text(STORE_CLIENTS)
    fixed = ["--master-port", str(free_port())] if port == "fixed" else []
    done = daemon.ctl_run("submit", "--nproc-per-node", "2", *fixed, "--wait", str(script))
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()
    logs = daemon.ctl_run("logs", daemon.ctl("list")[0]["id"]).stdout
    assert logs.count("met ") == 2, logs


def test_failed_rank_restarts_the_group_once(daemon):
    done = daemon.ctl_run(
        "submit",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--wait",
        *worker_args("--fail-rank", "1", "--fail-attempts", "1", "--ddp"),
    )
    assert done.returncode == 0, done.stdout + done.stderr + daemon.log_text()
    status = daemon.ctl("list")[0]
    assert status["state"] == "SUCCEEDED" and status["restarts"] == 1 and status["round"] == 1
    attempts = sorted(os.listdir(daemon.state_dir / "logs" / status["id"]))
    assert attempts == ["attempt_0", "attempt_1"]


def test_exhausted_restarts_fail_with_the_root_cause(daemon):
    done = daemon.ctl_run(
        "submit",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--wait",
        *worker_args("--fail-rank", "1"),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "boom from rank 1 on attempt 1" in done.stdout + done.stderr
    status = daemon.ctl("status", daemon.ctl("list")[0]["id"])
    assert status["state"] == "FAILED" and status["exit_code"] == 1 and status["restarts"] == 1
    error = status["error"]
    assert error["rank"] == 1 and "ValueError: boom from rank 1 on attempt 1" in error["message"]
    assert "Traceback" in error["traceback"] and "raise ValueError" in error["traceback"]
    human = daemon.ctl_run("status", status["id"]).stdout
    assert "boom from rank 1" in human and "FAILED" in human


def test_cancel_stops_every_process_of_the_job(daemon, shared_tmp):
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--child")
    assert daemon.ctl("cancel", job_id)["state"] == "CANCELLED"
    assert wait_gone(pids, timeout=5) == []  # cancel returns once this node's workers are gone
    assert daemon.ctl("status", job_id)["state"] == "CANCELLED"


def test_sigkill_escalation_for_workers_ignoring_sigterm(daemon_factory, shared_tmp):
    config = shared_tmp / "grace.toml"
    config.write_text("[jobs]\nstop_grace = 1\n")
    daemon = daemon_factory(args=("--slots", "2", "--config", str(config))).start()
    job_id, pids = sleeping_job(daemon, shared_tmp, 1, "--ignore-term")
    daemon.ctl("cancel", job_id)
    assert wait_gone(pids, timeout=5) == []


def test_daemon_sigterm_cancels_jobs_and_exits_zero(daemon, shared_tmp):
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--child")
    daemon.signal(signal.SIGTERM)
    daemon.wait_notify("STOPPING=1")
    assert daemon.wait_exit() == 0
    assert wait_gone(pids, timeout=1) == []
    daemon.start()
    status = daemon.ctl("status", job_id)
    assert status["state"] == "CANCELLED" and "shut down" in status["error"]["message"]


def test_daemon_sigkill_leaves_no_worker_and_next_start_marks_failed(daemon, shared_tmp):
    job_id, pids = sleeping_job(daemon, shared_tmp, 2, "--child")
    workers = [w["pid"] for w in daemon.ctl("status", job_id)["workers"]]
    daemon.signal(signal.SIGKILL)
    daemon.wait_exit()
    assert wait_gone(workers, timeout=5) == []  # PR_SET_PDEATHSIG
    daemon.start()  # the next start kills what stayed in the workers' process groups
    assert wait_gone(pids, timeout=5) == []
    status = daemon.ctl("status", job_id)
    assert status["state"] == "FAILED" and "daemon died" in status["error"]["message"]


def test_history_survives_a_restart(daemon):
    job_id = daemon.submit_wait(*worker_args())["id"]
    daemon.stop()
    daemon.start()
    listed = daemon.ctl("list")
    assert [(j["id"], j["state"]) for j in listed] == [(job_id, "SUCCEEDED")]
    assert "SUCCEEDED" in daemon.ctl_run("list").stdout


def test_missing_script_is_refused_at_submit(daemon):
    done = daemon.ctl_run("submit", "no_such_script.py")
    assert done.returncode == 1 and "no_such_script.py not found in " in done.stderr
    done = daemon.ctl_run("submit", "/no/such/script.py")
    assert done.returncode == 1 and done.stderr.endswith("script /no/such/script.py not found\n")
    assert daemon.ctl("list") == []
    assert daemon.request("version").ok  # and the daemon goes on


def test_logs_interleave_ranks_with_a_prefix(daemon):
    job_id = daemon.submit_wait("--nproc-per-node", "2", *worker_args("--print", "3"))["id"]
    text = daemon.ctl_run("logs", job_id).stdout
    for rank in (0, 1):
        for i in range(3):
            assert f"out {rank} {i}" in text and f"err {rank} {i}" in text
    only = daemon.ctl_run("logs", job_id, "--rank", "1").stdout
    assert "out 1 0" in only and "out 0 0" not in only
    docs = [json.loads(x) for x in daemon.ctl_run("--json", "logs", job_id).stdout.splitlines()]
    assert any(
        line["text"] == "out 0 2" and line["rank"] == 0
        for doc in docs
        for line in doc.get("lines", [doc])
    )


def test_logs_follow_streams_until_the_job_ends(daemon):
    job = daemon.submit("--nproc-per-node", "2", *worker_args("--print", "5", "--sleep", "1"))
    done = daemon.ctl_run("logs", "-f", job["id"], timeout=60)
    assert done.returncode == 0
    for rank in (0, 1):
        assert f"out {rank} 4" in done.stdout
    assert done.stdout.count("out 0 0") == 1  # nothing repeated between file and live stream
