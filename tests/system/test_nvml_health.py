"""GPU health on real daemons, with NVML answered by the C shim (tests/fixtures/nvml_shim.c)
that nvidia-ml-py loads exactly as it would load the driver's libnvidia-ml.so.1: GPUs by
UUID in CUDA_VISIBLE_DEVICES; an Xid 79 takes a GPU out within an interval and the job on
it re-forms without it while its other GPU stays; ECC rising and a lost GPU take theirs
out; `undrain --gpu` readmits; a node without NVML counts its GPUs as before."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from fixtures.nvml_shim import ShimGpus, build_shim, shim_env
from harness import Daemon, fake_nvidia_smi, worker_args
from store_attack import wait_for

pytestmark = pytest.mark.c10d_only("the GPUs are each node's own; the store plays no part")
# checks every 0.2 s; a peer port of its own (the default one may be another test run's)
HEALTH = "[gpu]\nhealth_interval = 0.2\n[node]\npeer_port = 0\n"


def shim_gpus(base, node: str, lib) -> tuple[ShimGpus, dict[str, str]]:
    gpus = ShimGpus(base / f"{node}-nvml.state", 2)
    for gpu in gpus.gpus:
        gpu.uuid = f"GPU-{node}0000-0000-4000-8000-{gpu.index:012x}"
    return gpus.write(), shim_env(lib.parent, gpus.path)


def workers(out, ranks: int) -> list[dict[str, str]]:
    found = []
    for rank in range(ranks):
        path = out / f"rank_{rank}.json"
        found.append(json.loads(path.read_text()) if path.exists() else {})
    return found


def nodes(daemon: Daemon) -> dict[str, dict]:
    return {n["name"]: n for n in daemon.ctl("nodes")}


def metrics(daemon: Daemon) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_a_bad_gpu_is_taken_out_and_its_job_reforms_without_it(
    cluster_factory, shared_tmp, store_backend
):
    lib = build_shim(shared_tmp / "nvml")
    cluster = cluster_factory(2, slots=4)
    with open(cluster.config, "a") as config:
        config.write(HEALTH)
    states = {}
    for daemon in cluster:
        states[daemon.name], daemon.env = shim_gpus(shared_tmp, daemon.name, lib)
    cluster.start()
    n1, n2 = states["n1"], states["n2"]
    uuids = {name: [g.uuid for g in gpus.gpus] for name, gpus in states.items()}
    out = shared_tmp / "env"
    out.mkdir()
    job = cluster[0].submit(
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "gpu",
        *worker_args("--env-out", str(out), "--sleep", "0"),
    )["id"]
    cluster[0].wait_output(job, [f"ready {r}" for r in range(4)])
    seen = workers(out, 4)
    by_node = {e["GROUP_RANK"]: e["CUDA_VISIBLE_DEVICES"] for e in seen}
    assert sorted(by_node.values()) == sorted(",".join(u) for u in uuids.values()), seen

    n2.xid(1, 79).write()  # n2's second GPU falls off the bus
    wait_for(
        lambda: nodes(cluster[0])["n2"].get("gpus_out") == {"1": "xid 79"},
        15,
        "n2's gpu 1 taken out",
    )
    assert nodes(cluster[0])["n2"]["gpus_total"] == 1
    # the job re-forms without it: n2 runs one worker, on its good GPU
    wait_for(
        lambda: (
            sorted(
                w["node"]
                for w in cluster[0].ctl("status", job)["workers"]
                if w["state"] in ("HEALTHY", "RUNNING")
            )
            == ["n1", "n1", "n2"]
        ),
        60,
        "the job re-formed on n1's two GPUs and n2's good one",
    )
    cluster[0].wait_output(job, [f"ready {r}" for r in range(3)])
    n2_worker = next(
        e for e in workers(out, 3) if e.get("GROUP_RANK") == "1" and e["WORLD_SIZE"] == "3"
    )
    assert n2_worker["CUDA_VISIBLE_DEVICES"] == uuids["n2"][0]
    shown = cluster[1].ctl_run("nodes").stdout
    assert "n2: gpus 1/2, gpu 1: xid 79" in shown, shown
    text = metrics(cluster[1])
    assert "elasticd_gpus_out 1.0" in text and 'elasticd_gpu_faults_total{why="xid 79"} 1.0' in text
    assert 'elasticd_gpu_xids_total{xid="79"} 1.0' in text
    assert (
        "gpu 1 ({}) taken out of this node's offer: xid 79".format(uuids["n2"][1])
        in cluster[1].log_text()
    )

    # n1: uncorrectable ECC errors rise on gpu 0, gpu 1 is lost; an Xid 13 (a program's) is said only
    n1.xid(0, 13).write()
    wait_for(
        lambda: "gpu 0: xid 13 (an application or driver error" in cluster[0].log_text(),
        15,
        "xid 13 said",
    )
    n1.ecc(0, 2).lose(1).write()
    wait_for(
        lambda: set(nodes(cluster[1])["n1"].get("gpus_out") or {}) == {"0", "1"},
        15,
        "n1's GPUs out",
    )
    assert nodes(cluster[1])["n1"]["gpus_out"] == {
        "0": "ecc: 2 new uncorrectable errors (2 in all)",
        "1": "lost (NVML: GPU is lost)",
    }
    wait_for(
        lambda: (
            [
                w["node"]
                for w in cluster[0].ctl("status", job)["workers"]
                if w["state"] in ("HEALTHY", "RUNNING")
            ]
            == ["n2"]
        ),
        60,
        "the job on n2 alone",
    )

    # an operator readmits n2's gpu 1 (n1's stay out); a bad index is refused
    assert cluster[0].ctl("undrain", "n2", "--gpu", "1") == {"name": "n2", "drain": False, "gpu": 1}
    wait_for(lambda: not nodes(cluster[0])["n2"].get("gpus_out"), 15, "n2's gpu 1 readmitted")
    assert (
        nodes(cluster[0])["n2"]["gpus_total"] == 2 and len(nodes(cluster[0])["n1"]["gpus_out"]) == 2
    )
    assert (
        "gpu 1 ({}) back in the offer: readmitted by root".format(uuids["n2"][1])
        in cluster[1].log_text()
    )
    refused = cluster[0].ctl_run("undrain", "n2", "--gpu", "x")
    assert refused.returncode == 2 and "not a GPU index: 'x'" in refused.stderr
    cluster[0].ctl("cancel", job)


def test_without_nvml_a_node_counts_its_gpus_as_before_and_says_so_once(shared_tmp):
    lib = build_shim(shared_tmp / "nvml")
    env = {
        **fake_nvidia_smi(shared_tmp / "bin", 2),
        **shim_env(lib.parent, shared_tmp / "absent.state"),
    }
    daemon = Daemon(shared_tmp, "nonvml", env=env).start()
    try:
        (node,) = daemon.ctl("nodes")
        assert (node["gpus_total"], node.get("gpus_out")) == (2, {})
        said = [line for line in daemon.log_text().splitlines() if "no NVML here" in line]
        assert len(said) == 1 and "Driver Not Loaded" in said[0], said
        out = shared_tmp / "env"
        out.mkdir()
        job = daemon.submit("--nproc-per-node", "gpu", *worker_args("--env-out", str(out)))["id"]
        assert daemon.wait_job(job, lambda d: d["state"] == "SUCCEEDED")
        assert {e["CUDA_VISIBLE_DEVICES"] for e in workers(out, 2)} == {"0,1"}
    finally:
        daemon.stop()


def test_an_nvml_that_hangs_is_said_once_and_neither_stalls_the_daemon_nor_its_exit(shared_tmp):
    """A sick GPU can make NVML calls hang: the check that does not answer is said once, the
    daemon goes on serving (a job runs), the next checks wait for that read rather than
    start more, and a stop ends the daemon at once, the read still hanging."""
    lib = build_shim(shared_tmp / "nvml")
    gpus = ShimGpus(shared_tmp / "hang.state", 2).write()
    config = shared_tmp / "hang.toml"
    config.write_text("[gpu]\nhealth_interval = 0.2\n[jobs]\nallow_root = true\n")
    daemon = Daemon(
        shared_tmp, "hangs", args=("--config", str(config)), env=shim_env(lib.parent, gpus.path)
    ).start()
    try:
        gpus.hang(0, 600).write()
        wait_for(lambda: "NVML did not answer within 1 s" in daemon.log_text(), 15, "the hang said")
        job = daemon.submit("--nproc-per-node", "1", *worker_args())["id"]
        assert daemon.wait_job(job, lambda d: d["state"] == "SUCCEEDED", timeout=60)
        assert daemon.log_text().count("NVML did not answer") == 1
        hangs = (shared_tmp / "hang.state.hangs").read_text().splitlines()
        assert hangs == ["gpu 0"], hangs  # one read hangs, the later checks start none
        started = time.monotonic()
        assert daemon.stop() == 0 and time.monotonic() - started < 10
        assert "NVML still busy in a read: not shut down" in daemon.log_text()
    finally:
        daemon.stop()
