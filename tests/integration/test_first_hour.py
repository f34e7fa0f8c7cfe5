"""The first hour with elasticd (docs/getting-started.md, daemon side): a cluster key from `elasticd keygen`,
two daemons on one host that agree on who hosts the store, `--allow-root`, jobs that could
never start refused at submit with a way out, torchrun's `--nproc-per-node cpu`, and a job's
role and fixed master port.  Real daemons, real elasticctl, real workers."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import uuid
from pathlib import Path

from harness import CLIENT_ENV, PY, WORKER, Daemon, free_port, node_states, worker_args

SLOTS_HINT = "a node's slots default to its CPU count; `elasticd --slots N` or node.slots in the config raises them"


def elasticd(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [PY, "-m", "elasticd", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=CLIENT_ENV,
        cwd=str(cwd),
    )


def test_keygen_writes_a_new_0600_key_and_never_overwrites_one(shared_tmp):
    key = shared_tmp / "cluster.key"
    done = elasticd("keygen", str(key), cwd=shared_tmp)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("\n") == 1 and str(key) in done.stdout and "every node" in done.stdout
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    written = key.read_text()
    assert len(bytes.fromhex(written.strip())) == 32  # the store host's format: 32 bytes, hex

    again = elasticd("keygen", str(key), cwd=shared_tmp)
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == (
        f"elasticd keygen: {key} already exists; not overwriting it (a cluster's "
        "nodes must share one key: copy that file, or remove it first)\n"
    )
    assert key.read_text() == written

    nowhere = elasticd("keygen", str(shared_tmp / "no" / "such" / "cluster.key"), cwd=shared_tmp)
    assert nowhere.returncode == 1
    assert f"the directory {shared_tmp / 'no' / 'such'} does not exist" in nowhere.stderr
    assert not (shared_tmp / "no").exists()


def test_keygen_is_in_the_help_and_every_daemon_flag_still_parses(shared_tmp):
    assert "elasticd keygen FILE" in elasticd("--help", cwd=shared_tmp).stdout
    own = elasticd("keygen", "--help", cwd=shared_tmp)
    assert own.returncode == 0 and "usage: elasticd keygen [-h] FILE" in own.stdout
    assert elasticd("keygen", cwd=shared_tmp).returncode == 2  # FILE is needed
    assert elasticd("--version", cwd=shared_tmp).stdout.startswith("elasticd ")
    bad = elasticd(
        "--standalone", "--slots", "-1", cwd=shared_tmp
    )  # flags reach the config as before
    assert bad.returncode == 2 and "node.slots" in bad.stderr


def test_two_daemons_on_one_host_agree_by_address_who_hosts_the_store(shared_tmp):
    """store.host left at auto: the daemon whose node.address is the endpoint's host hosts the
    store, the one on 127.0.0.2 joins it (before, it took 127.0.0.1 for its own, tried to
    host the store too and exited "Address already in use").  The key comes from keygen;
    the root-submitted job runs because both daemons have --allow-root."""
    key = shared_tmp / "keys" / "cluster.key"
    key.parent.mkdir()
    assert elasticd("keygen", str(key), cwd=shared_tmp).returncode == 0
    config = shared_tmp / "fh.toml"
    config.write_text("[node]\npeer_port = 0\n")  # other tests' daemons may hold the default
    store, cluster = f"127.0.0.1:{free_port()}", f"fh-{uuid.uuid4().hex[:8]}"

    def node(index: int) -> Daemon:
        return Daemon(
            shared_tmp,
            f"fh{index}",
            standalone=False,
            args=(
                "--config",
                str(config),
                "--cluster",
                cluster,
                "--store",
                store,
                "--node-address",
                f"127.0.0.{index}",
                "--cluster-key",
                str(key),
                "--slots",
                "1",
                "--allow-root",
            ),
        )

    first, second = node(1), node(2)
    try:
        first.start()
        second.start()
        states = node_states(first, lambda s: s == {"fh1": "up", "fh2": "up"})
        assert states == {"fh1": "up", "fh2": "up"}
        listed = second.ctl("nodes")
        assert {(n["name"], n["address"]) for n in listed} == {
            ("fh1", "127.0.0.1"),
            ("fh2", "127.0.0.2"),
        }
        done = second.submit_wait("--nnodes", "2", *worker_args())
        assert done["state"] == "SUCCEEDED", done
        # the outcome may reach fh2 before fh1's last part record does: wait for that too
        done = second.wait_job(
            done["id"], lambda j: sorted(w["node"] for w in j["workers"]) == ["fh1", "fh2"], 30
        )
        assert done["world_size"] == 2
        assert first.proc.poll() is None and second.proc.poll() is None
        assert "Address already in use" not in first.log_text() + second.log_text()
    finally:
        second.stop()
        first.stop()


def test_a_standalone_daemon_refuses_a_job_whose_min_needs_more_nodes(daemon_factory):
    daemon = daemon_factory("fh3", args=("--slots", "2")).start()
    done = daemon.ctl_run("submit", "--nnodes", "3", *worker_args())
    assert done.returncode == 1 and done.stdout == ""
    assert (
        done.stderr.count("\n") == 1
        and (
            "the daemon is standalone (a one-node cluster), so a job needing 3 nodes can never start; "
            "use --nnodes 1 or run a cluster"
        )
        in done.stderr
    ), done.stderr
    assert daemon.ctl("list", "--all") == []
    elastic = daemon.submit_wait("--nnodes", "1:3", *worker_args())  # only the min must be met
    assert elastic["state"] == "SUCCEEDED", elastic


def test_too_many_workers_for_the_default_slots_says_how_to_raise_them(daemon_factory):
    cpus = os.cpu_count() or 1
    daemon = daemon_factory("fh4", args=("--gpus", "0")).start()  # slots: one per CPU
    done = daemon.ctl_run("submit", "--nproc-per-node", str(cpus + 2), *worker_args())
    assert done.returncode == 1
    assert f"no node can run {cpus + 2} workers on its own: fh4 has {cpus} slots" in done.stderr
    assert SLOTS_HINT in done.stderr, done.stderr
    assert daemon.ctl("list", "--all") == []


def test_nproc_per_node_cpu_runs_one_worker_per_cpu(daemon_factory, shared_tmp):
    cpus = os.cpu_count() or 1
    daemon = daemon_factory("fh5", args=("--slots", str(max(8, cpus)))).start()
    out = shared_tmp / "env"
    out.mkdir()
    job = daemon.submit_wait("--nproc-per-node", "cpu", *worker_args("--env-out", str(out)))
    assert job["state"] == "SUCCEEDED", job
    envs = [json.loads((out / f"rank_{r}.json").read_text()) for r in range(cpus)]
    assert {e["WORLD_SIZE"] for e in envs} == {e["LOCAL_WORLD_SIZE"] for e in envs} == {str(cpus)}
    assert sorted(os.listdir(out)) == sorted(
        f"rank_{r}{s}.json" for r in range(cpus) for s in ("", "_attempt_0")
    )
    assert all(e["CUDA_VISIBLE_DEVICES"] == "" for e in envs)  # CPU workers are kept off GPUs


def test_nproc_per_node_words_beyond_torchruns_are_refused(daemon_factory):
    daemon = daemon_factory("fh6", args=("--slots", "2")).start()
    reply = daemon.request(
        "submit", argv=[str(WORKER)], python=PY, workdir=str(daemon.base), nproc_per_node="xpu"
    )
    assert (reply.ok, reply.code) == (False, "invalid_spec")
    assert "must be one of N, gpu, cpu, auto" in reply.message
    assert daemon.ctl("list", "--all") == []


def test_role_and_a_fixed_master_port_reach_the_workers_every_round(daemon_factory, shared_tmp):
    daemon = daemon_factory("fh7", args=("--slots", "2")).start()
    out = shared_tmp / "env"
    out.mkdir()
    port = free_port()
    job = daemon.submit_wait(
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--role",
        "trainer",
        "--master-port",
        str(port),
        *worker_args("--env-out", str(out), "--fail-rank", "1", "--fail-attempts", "1"),
    )
    assert job["state"] == "SUCCEEDED" and job["restarts"] == 1, job
    assert (job["role"], job["master_port"]) == ("trainer", port)
    for attempt in (0, 1):
        for rank in (0, 1):
            env = json.loads((out / f"rank_{rank}_attempt_{attempt}.json").read_text())
            assert env["ROLE_NAME"] == "trainer"
            assert env["MASTER_PORT"] == str(port)


def test_a_master_port_another_program_holds_fails_the_job_saying_so(daemon_factory):
    """Served anyway, the round's workers might meet in the other program's store."""
    daemon = daemon_factory("fh8", args=("--slots", "2")).start()
    port = free_port()
    with socket.create_server(("", port)):
        job = daemon.submit_wait(
            "--nproc-per-node", "2", "--master-port", str(port), *worker_args(), expect=1
        )
    assert job["state"] == "FAILED" and job["restarts"] == 0 and job["started"] is None, job
    said = job["error"]["message"]
    assert f"cannot host the store on 127.0.0.1:{port}" in said and "--master-port" in said


def test_a_bad_role_or_master_port_is_refused_at_submit(daemon_factory):
    daemon = daemon_factory("fh8", args=("--slots", "2")).start()
    for args, words in (
        ({"role": ""}, "role"),
        ({"role": "r" * 65}, "role"),
        ({"master_port": 65536}, "master_port"),
    ):
        reply = daemon.request(
            "submit", argv=[str(WORKER)], python=PY, workdir=str(daemon.base), **args
        )
        assert (reply.ok, reply.code) == (False, "invalid_spec") and words in reply.message, reply
    assert daemon.ctl("list", "--all") == []
