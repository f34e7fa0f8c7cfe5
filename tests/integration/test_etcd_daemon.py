"""Two real daemons whose store is a real etcd (store.backend = "etcd"; docs/store.md): they meet
there without a store host and run a two-node job, driven by the real elasticctl.  The etcd
wants TLS with a client certificate and a password, so every store key of the config is used."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest
from fixtures.etcd import EtcdCluster, require_etcd
from harness import Daemon, free_port, worker_args

from elasticd.store.signing import create_key


@pytest.fixture
def etcd(shared_tmp: Path):
    require_etcd()
    with EtcdCluster(shared_tmp / "etcd-data", tls=True, password="s3cret") as cluster:
        yield cluster


def etcd_daemons(factory, base: Path, etcd: EtcdCluster, count: int) -> list[Daemon]:
    """Daemons of one cluster on this host, node i on 127.0.0.i; node names carry a random
    tag (a daemon kills what it finds in its node's job cgroups at start)."""
    tag = uuid.uuid4().hex[:6]
    key = base / f"etcd-{tag}.key"
    create_key(str(key))  # with etcd no daemon makes the key: every node has it beforehand
    password = base / f"etcd-{tag}.password"
    password.write_text(etcd.password + "\n")
    password.chmod(0o600)
    tls = etcd.tls
    daemons = []
    for index in range(1, count + 1):
        config = base / f"etcd-{tag}-{index}.toml"
        config.write_text(
            f"[jobs]\nallow_root = true\n[node]\npeer_port = {free_port()}\n"
            f'[store]\nbackend = "etcd"\nendpoints = {json.dumps(etcd.endpoints)}\n'
            f'ca_file = "{tls.ca}"\ncert_file = "{tls.client_cert}"\n'
            f'key_file = "{tls.client_key}"\nuser = "root"\npassword_file = "{password}"\n'
            "connect_timeout = 30\n"
        )
        args = (
            "--cluster",
            f"etcd{tag}",
            "--node-address",
            f"127.0.0.{index}",
            "--cluster-key",
            str(key),
            "--slots",
            "2",
            "--config",
            str(config),
        )
        daemons.append(
            factory(f"n{index}-{tag}", args=args, standalone=False, metrics_port=free_port())
        )
    return daemons


def loads(pid: int, library: str) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return library in maps.read()


def test_two_daemons_meet_in_etcd_and_run_a_two_node_job(daemon_factory, shared_tmp, etcd):
    first, second = etcd_daemons(daemon_factory, shared_tmp, etcd, 2)
    first.start(wait=False)
    second.start(wait=False)
    for daemon in (first, second):
        daemon.wait_notify("READY=1", 60)
    out = shared_tmp / "env"
    out.mkdir()
    job = first.submit_wait(
        "--nnodes", "2", "--nproc-per-node", "1", *worker_args("--ddp", "--env-out", str(out))
    )
    assert job["state"] == "SUCCEEDED", job
    ranks = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert {e["WORLD_SIZE"] for e in ranks} == {"2"} and sorted(e["GROUP_RANK"] for e in ranks) == [
        "0",
        "1",
    ]
    status = second.ctl("status", job["id"])  # any node shows any job
    assert sorted(n["node"] for n in status["nodes"]) == sorted([first.name, second.name])
    assert {n["name"]: n["state"] for n in second.ctl("nodes")} == {
        first.name: "up",
        second.name: "up",
    }
    # nobody hosts a TCPStore, so no daemon loads torch; the store is etcd's
    assert not any(loads(d.proc.pid, "libtorch") for d in (first, second))
    assert all(f"store {','.join(etcd.endpoints)}" in d.log_text() for d in (first, second))


def test_a_daemon_without_the_cluster_key_stops_with_a_clear_error(
    daemon_factory, shared_tmp, etcd
):
    (daemon,) = etcd_daemons(daemon_factory, shared_tmp, etcd, 1)
    daemon.args = tuple(
        a if not a.endswith(".key") else str(shared_tmp / "missing.key") for a in daemon.args
    )
    daemon.start(wait=False)
    assert daemon.wait_exit(60) == 1
    assert "config key 'cluster.key_file'" in daemon.log_text()
