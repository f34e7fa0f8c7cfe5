"""A survivor of a re-form builds its FSDP2 model anew in the same process (docs/in-place.md,
"Sharded state"): three real processes go through rounds of 2, 3 and 2 ranks, one of them at
rank 0, then rank 1, then rank 1 again, as when a node joins and another is lost.  Each
round's parameters must be sharded for that round, and DCP must load a checkpoint saved in
the first round resharded into them (tests/fixtures/reform_mesh.py).  Without emptying
DTensor's caches at each new group, the third round's parameters came on the first round's
mesh, where that process was rank 0: DCP planned one row of the head for an empty shard."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from harness import PY, ROOT
from hostwide import free_port

FIXTURE = str(ROOT / "tests" / "fixtures" / "reform_mesh.py")
SIZES = "2,3,2"
PLANS = ("0,1,1", "1,2,-", "-,0,0")  # each process's rank per round


def test_each_rounds_shards_are_its_own_and_a_checkpoint_loads_resharded(tmp_path: Path):
    out = tmp_path / "rounds.jsonl"
    ports = ",".join(str(free_port()) for _ in SIZES.split(","))
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'daemon'}", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [PY, FIXTURE, str(out), str(tmp_path), plan, ports, SIZES],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for plan in PLANS
    ]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # one that failed leaves the others in a rendezvous
        codes = [proc.poll() for proc in procs]
        if all(code == 0 for code in codes) or any(code for code in codes):
            break
        time.sleep(0.1)
    for proc in procs:
        proc.kill()
    outputs = "\n".join(proc.communicate()[0] for proc in procs)
    assert [proc.returncode for proc in procs] == [0, 0, 0], outputs[-6000:]
    rounds = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted((r["round"], r["rank"]) for r in rounds) == [
        (0, 0),
        (0, 1),
        (1, 0),
        (1, 1),
        (1, 2),
        (2, 0),
        (2, 1),
    ]
    for r in rounds:
        for name, (local, planned) in r["shards"].items():
            assert local == planned, (r["round"], r["rank"], name)
        assert r["loaded"], r
    head = {(r["round"], r["rank"]): r["shards"]["1.weight"][0] for r in rounds}
    assert head[(2, 1)] == [0, 8] and head[(2, 0)] == [1, 8]
