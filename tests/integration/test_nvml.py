"""GPU inventory and health readings (docs/gpu-health.md): elasticd.cluster.nvml through the real
pynvml, which loads the NVML shim (tests/fixtures/nvml_shim.c) as it would load NVIDIA's
libnvidia-ml.so.1, in a process started with the shim's environment."""

from __future__ import annotations

import ctypes
import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fixtures.nvml_shim import ShimGpus, build_shim, shim_env

DAEMON = Path(__file__).resolve().parents[2] / "daemon"

# Opens NVML, prints the inventory (or the NvmlUnavailable), then per line of stdin: "read"
# prints the readings, "close" closes (twice: idempotent) and reads once more.
SCRIPT = r"""
import dataclasses, json, sys
if sys.argv[1:] == ["no-pynvml"]:
    sys.modules["pynvml"] = None
from elasticd.cluster.nvml import NvmlUnavailable, open_nvml
def say(value):
    print(json.dumps(value), flush=True)
try:
    nvml = open_nvml()
except NvmlUnavailable as e:
    say({"unavailable": str(e)})
    sys.exit(0)
say({"devices": [dataclasses.asdict(d) for d in nvml.devices]})
for line in sys.stdin:
    if line.strip() == "read":
        say([dataclasses.asdict(r) for r in nvml.read()])
    elif line.strip() == "close":
        nvml.close()
        nvml.close()
        try:
            nvml.read()
        except NvmlUnavailable as e:
            say({"closed": str(e)})
"""


class Host:
    """A process with NVML open on the shim's GPUs."""

    def __init__(self, env: dict[str, str], *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, *args],
            env=env,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.opened = self._answer()

    def _answer(self) -> Any:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 10)
        assert ready, "no answer from the NVML process in 10 s"
        line = self.proc.stdout.readline()
        assert line, f"the NVML process exited ({self.proc.wait()})"
        return json.loads(line)

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def read(self) -> dict[int, dict[str, Any]]:
        return {r["index"]: r for r in self.ask("read")}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_shim(tmp_path_factory.mktemp("nvml-shim"))


@pytest.fixture
def gpus(tmp_path: Path) -> ShimGpus:
    return ShimGpus(tmp_path / "gpus", 2)


@pytest.fixture
def start(shim: Path, gpus: ShimGpus) -> Iterator[Any]:
    hosts: list[Host] = []

    def start(*args: str, lib_dir: Path | None = None) -> Host:
        env = {**os.environ, **shim_env(lib_dir or shim.parent, gpus.path)}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(DAEMON), env.get("PYTHONPATH")]))
        hosts.append(Host(env, *args))
        return hosts[-1]

    yield start
    for host in hosts:
        host.stop()


CLEAN = {
    "lost": False,
    "xids": [],
    "ecc_uncorrected": 0,
    "rows_pending": False,
    "remap_failed": False,
    "slowdown": [],
}


def test_inventory_is_each_gpus_index_uuid_and_name(gpus, start):
    gpus.write()
    assert start().opened == {
        "devices": [
            {
                "index": 0,
                "uuid": "GPU-5e1f0000-0000-4000-8000-000000000000",
                "name": "NVIDIA H100 80GB HBM3",
            },
            {
                "index": 1,
                "uuid": "GPU-5e1f0000-0000-4000-8000-000000000001",
                "name": "NVIDIA H100 80GB HBM3",
            },
        ]
    }


def test_healthy_gpus_read_clean_and_close_is_idempotent(gpus, start):
    gpus.write()
    host = start()
    assert host.read() == {i: {"index": i, "uuid": gpus.gpus[i].uuid, **CLEAN} for i in (0, 1)}
    assert host.ask("close") == {"closed": "NVML is closed"}


def test_an_xid_is_read_once(gpus, start):
    gpus.write()
    host = start()
    gpus.xid(1, 79).write()
    first = host.read()
    assert (first[0]["xids"], first[1]["xids"]) == ([], [79])
    assert host.read()[1]["xids"] == []
    gpus.xid(0, 48).xid(0, 63).write()  # every pending event, in one read
    assert host.read()[0]["xids"] == [48, 63]


def test_memory_errors(gpus, start):
    gpus.write()
    host = start()
    gpus.ecc(0, 3).pending(0).remap_failed(0).pages_pending(1).write()
    got = host.read()
    assert got[0] == {**got[0], "ecc_uncorrected": 3, "rows_pending": True, "remap_failed": True}
    assert got[1] == {**got[1], "ecc_uncorrected": 0, "rows_pending": True, "remap_failed": False}


def test_unsupported_queries_give_neutral_values(gpus, start):
    gpus.unsupported(0, "ecc", "pending", "pages", "slowdown", "xids").xid(0, 79).write()
    got = start().read()
    assert got[0] == {"index": 0, "uuid": gpus.gpus[0].uuid, **CLEAN, "ecc_uncorrected": None}
    assert got[1]["ecc_uncorrected"] == 0


def test_a_lost_gpu_reads_lost_and_the_others_fine(gpus, start):
    gpus.write()
    host = start()
    gpus.lose(1).xid(1, 79).write()
    got = host.read()
    assert got[1] == {
        "index": 1,
        "uuid": gpus.gpus[1].uuid,
        **CLEAN,
        "lost": True,
        "xids": [79],
        "ecc_uncorrected": None,
    }
    assert got[0] == {"index": 0, "uuid": gpus.gpus[0].uuid, **CLEAN}


def test_a_gpu_lost_before_open_is_in_the_inventory_and_reads_lost(gpus, start):
    gpus.lose(0).write()
    host = start()
    assert host.opened["devices"][0] == {"index": 0, "uuid": "", "name": ""}
    got = host.read()
    assert (got[0]["lost"], got[1]) == (True, {"index": 1, "uuid": gpus.gpus[1].uuid, **CLEAN})


def test_slowdown_reasons(gpus, start):
    # 0x1 (idle) and 0x10 (sync boost) are not slowdowns for a GPU's health
    gpus.slowdown(0, 0x8 | 0x40 | 0x1 | 0x10).slowdown(1, 0x80 | 0x20 | 0x4).write()
    got = start().read()
    assert got[0]["slowdown"] == ["hw slowdown", "hw thermal"]
    assert got[1]["slowdown"] == ["hw power brake", "sw thermal", "sw power"]


def real_nvml_here() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
        return True
    except OSError:
        return False


def test_without_a_driver_nvml_is_unavailable_with_the_reason(gpus, start, tmp_path):
    # no state file: the shim's "driver" is not loaded
    assert start().opened == {"unavailable": "nvmlInit failed: Driver Not Loaded"}
    assert (
        start("no-pynvml")
        .opened["unavailable"]
        .startswith("pynvml is not importable (pip install nvidia-ml-py)")
    )
    if real_nvml_here():
        pytest.skip("this host has NVIDIA's libnvidia-ml.so.1: no library is not testable")
    assert start(lib_dir=tmp_path / "nowhere").opened == {
        "unavailable": "nvmlInit failed: NVML Shared Library Not Found"
    }


def test_a_flood_of_xids_is_read_in_one_check(gpus, start):
    gpus.write()
    host = start()
    gpus.xid(0, 13, times=20000).xid(0, 43).write()
    assert host.read()[0]["xids"] == [13] * 20000 + [43]
    assert host.read()[0]["xids"] == []


def test_a_daemon_says_a_flood_of_xids_in_a_line_per_code(shim, gpus, daemon_factory, tmp_path):
    """A program that makes its GPU report Xid 13 20,000 times in one check: the daemon's log
    has one line for it (it had 20,000, 2.2 MB in 6 s), and the metric counts all."""
    from harness import free_port
    from store_attack import metric, wait_for

    gpus.write()
    config = tmp_path / "health.toml"
    config.write_text("[gpu]\nhealth_interval = 0.2\n[node]\npeer_port = 0\n")
    daemon = daemon_factory(
        "xids",
        args=("--slots", "2", "--config", str(config)),
        env={
            **shim_env(shim.parent, gpus.path),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(DAEMON), os.environ.get("PYTHONPATH")])
            ),
        },
        metrics_port=free_port(),
    ).start()
    gpus.xid(0, 13, times=20000).write()
    wait_for(lambda: metric(daemon, 'elasticd_gpu_xids_total{xid="13"}') == 20000, 60, "counted")
    gpus.xid(1, 13, times=5).xid(0, 13, times=300).write()  # the next checks: held back for gpu 0
    wait_for(lambda: metric(daemon, 'elasticd_gpu_xids_total{xid="13"}') == 20305, 60, "counted")
    lines = [line for line in daemon.log_path.read_text().splitlines() if "xid 13" in line]
    assert len(lines) == 2, lines  # gpu 0's first check, gpu 1's: held back for the interval
    assert any("gpu 0: xid 13" in line and "20000 in this check" in line for line in lines)
    assert any("gpu 1: xid 13" in line and "5 in this check" in line for line in lines)
    assert daemon.log_path.stat().st_size < 100_000
