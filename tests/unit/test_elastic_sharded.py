"""elasticd.elastic's sharded state, its pure parts: the packed values of a checkpoint, the
commits' names, a rank's share of the global batch, the mesh's refusal, the byte ranges a
reader reads; and the writer and reader themselves, across real gloo ranks
(tests/fixtures/tier_rw_worker.py): FSDP2 and AdamW saved by 3 ranks, loaded by 2 and by 1,
equal to the last bit, each rank reading only its rows, the optimizer's state made by DCP's
step or given uninitialized from the checkpoint's metadata."""

from __future__ import annotations

import json
import math
import socketserver
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from hostwide import free_port

from elasticd.elastic import batch_share, checkpoint, device_mesh
from elasticd.elastic.broadcast import pack, unpack
from elasticd.elastic.parallel import MeshError
from elasticd.elastic.sharded import CommitId

WORKER = Path(__file__).resolve().parents[1] / "fixtures" / "tier_rw_worker.py"


# -- packed values ---------------------------------------------------------------------------


def test_a_packed_value_comes_back_equal_with_its_types():
    value = {
        "lr": 0.1,
        "betas": (0.9, 0.999),
        "params": ["0.weight", "0.bias"],
        3: {None: True},
        "nan": float("nan"),
        "t": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        "scalar": torch.tensor(7),
        "empty": torch.empty(0, 4),
        "view": torch.arange(12.0).reshape(3, 4).t(),
    }
    back = unpack(pack(value))
    assert back["betas"] == (0.9, 0.999) and type(back["betas"]) is tuple
    assert back[3] == {None: True} and math.isnan(back["nan"])
    for key in ("t", "scalar", "empty", "view"):
        assert back[key].dtype == value[key].dtype and torch.equal(back[key], value[key]), key


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[:-3],  # cut short
        lambda data: data + b"x",  # bytes after it
        lambda data: b"PK" + data[2:],  # not a pack (a torch.save archive starts so)
        lambda data: data[:20],  # the skeleton cut
    ],
    ids=["short", "long", "magic", "skeleton"],
)
def test_a_damaged_pack_is_a_value_error(damage):
    with pytest.raises(ValueError):
        unpack(damage(pack({"t": torch.ones(4), "n": 1})))


def test_what_cannot_be_packed_is_named():
    with pytest.raises(TypeError, match="lr"):
        pack({"lr": object()}, name="group")


# -- commits ------------------------------------------------------------------------------------


def test_commit_names_order_as_the_commits_do():
    ids = [CommitId(0, 1), CommitId(0, 2), CommitId(0, 10), CommitId(3, 1), CommitId(12, 4)]
    assert sorted(ids, key=lambda c: c.encode()) == ids
    for ident in ids:
        assert CommitId.parse(ident.name) == ident
        assert CommitId.decode(ident.encode()) == ident
    assert CommitId.decode(-1) is None
    for name in ("step_40", "elastic-1", "elastic-a-1", None, "elastic-1-2/x"):
        assert CommitId.parse(name) is None


# -- the global batch ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
@pytest.mark.parametrize("micro", [None, 1, 2, 3])
def test_the_ranks_shares_cover_the_global_batch_once_and_weigh_it_whole(size, micro):
    global_batch = 17
    rows: list[int] = []
    weight = 0.0
    for rank in range(size):
        share = batch_share(global_batch, rank=rank, size=size, micro_batch=micro)
        mine = list(range(global_batch))[share.rows]
        rows += mine
        covered = []
        for part, w in share.micro:
            part_rows = mine[part]
            assert micro is None or len(part_rows) <= micro
            assert w == pytest.approx(len(part_rows) / global_batch * size)
            covered += part_rows
            weight += w
        assert covered == mine
    assert rows == list(range(global_batch))
    # averaged over the ranks (FSDP), the weights sum to one global batch
    assert weight / size == pytest.approx(1.0)


def test_a_batch_too_small_for_the_world_is_refused():
    with pytest.raises(ValueError, match="cannot feed"):
        batch_share(2, rank=0, size=3)
    with pytest.raises(ValueError):
        batch_share(8, rank=3, size=3)


def test_a_mesh_the_world_cannot_hold_is_refused_saying_what_would_fit(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(MeshError, match=r"3 workers.*tensor-parallel size of 2.*2, 4"):
        device_mesh(tp=2)


# -- what a reader reads ----------------------------------------------------------------------------


class _Item:
    def __init__(self, offsets, lengths):
        self.storage_offsets = torch.Size(offsets)
        self.lengths = torch.Size(lengths)


def test_a_reader_reads_the_rows_it_needs_of_a_chunk():
    stored = checkpoint.Stored("__1_0.distcp", 640, 6 * 4 * 4, "float32", (6, 4))
    assert stored.rows(_Item([2, 0], [3, 4])) == (640 + 2 * 16, 3 * 16, (3, 4))
    # columns (tensor parallel): the rows that hold them, narrowed after reading
    assert stored.rows(_Item([1, 2], [2, 2])) == (640 + 16, 2 * 16, (2, 4))
    scalar = checkpoint.Stored("__0_0.distcp", 64, 8, "int64", ())
    assert scalar.rows(_Item([], [])) == (64, 8, ())


def test_ranges_that_touch_or_overlap_are_fetched_as_one():
    assert checkpoint._merged([(10, 5), (0, 10), (30, 1), (14, 6)]) == [(0, 20), (30, 1)]


@pytest.mark.parametrize(
    "doc, error",
    [
        ({"format": "other"}, "not an elasticd checkpoint"),
        (
            {
                "format": checkpoint.FORMAT,
                "tensors": {
                    "w": {
                        "dtype": "float32",
                        "size": [2],
                        "requires_grad": False,
                        "chunks": [[[0], [2], "../x", 0, 8]],
                    }
                },
                "values": {},
            },
            "a data file named",
        ),
        (
            {
                "format": checkpoint.FORMAT,
                "tensors": {
                    "w": {
                        "dtype": "float32",
                        "size": [2],
                        "requires_grad": False,
                        "chunks": [[[0], [2], "__0_0.distcp", 0, 7]],
                    }
                },
                "values": {},
            },
            "holds 7 bytes",
        ),
        (
            {
                "format": checkpoint.FORMAT,
                "tensors": {
                    "w": {"dtype": "Storage", "size": [2], "requires_grad": False, "chunks": []}
                },
                "values": {},
            },
            "unknown dtype",
        ),
    ],
    ids=["format", "file", "length", "dtype"],
)
def test_metadata_that_is_not_sound_is_refused(doc, error):
    with pytest.raises(ValueError, match=error):
        checkpoint._metadata_from(doc, "here")


def test_a_reader_reads_a_checkpoint_s_metadata_once(tmp_path, monkeypatch):
    """Loading a commit looks at its metadata before DCP's load does (to give the optimizer
    its state): one read serves both, a fetch from another node where it is not here."""
    monkeypatch.delenv(checkpoint.TIER_ENV, raising=False)
    chunk = [[0], [2], "__0_0.distcp", 0, 8]
    for name, size in (("a", 2), ("b", 2)):
        (tmp_path / name).mkdir()
        tensor = {"dtype": "float32", "size": [size], "requires_grad": False, "chunks": [chunk]}
        doc = {"format": checkpoint.FORMAT, "tensors": {f"w{name}": tensor}, "values": {}}
        (tmp_path / name / checkpoint.METADATA).write_text(json.dumps(doc))
    reader = checkpoint.TierReader(tmp_path / "a")
    first = reader.read_metadata().storage_meta.load_id
    (tmp_path / "a" / checkpoint.METADATA).unlink()  # read again, it would be missing
    reader.reset(tmp_path / "a")  # as DCP's load does: a new load of the same checkpoint
    again = reader.read_metadata()
    assert set(again.state_dict_metadata) == {"wa"}
    assert again.storage_meta.load_id not in ("", first)
    reader.reset(tmp_path / "b")  # another checkpoint: its own metadata
    assert set(reader.read_metadata().state_dict_metadata) == {"wb"}
    reader.reset(tmp_path / "a")
    with pytest.raises(FileNotFoundError):
        reader.read_metadata()


class _HangingTier(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """A tier daemon that answers ``latest`` and holds no file, and never answers a fetch."""

    daemon_threads = True

    def __init__(self, path: str) -> None:
        self.asked = 0  # fetches asked for
        self.fetches: list[float] = []  # how long each fetch's connection stood, once it ended
        self.release = threading.Event()
        super().__init__(path, self._Handler)

    class _Handler(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            server = self.server
            assert isinstance(server, _HangingTier)
            for line in self.rfile:
                request = json.loads(line)
                if request["op"] == "fetch" and not request.get("here_only"):
                    server.asked += 1
                    self.connection.settimeout(60)
                    started = time.monotonic()
                    while not server.release.is_set() and self.rfile.read(1):
                        pass  # waits until the asker goes (EOF) or the test ends
                    server.fetches.append(time.monotonic() - started)
                    return
                answer = (
                    {"ok": True, "paths": {}}
                    if request["op"] == "fetch"
                    else {
                        "ok": True,
                        "checkpoint": {"id": "elastic-0-1", "files": {}, "here": []},
                    }
                )
                self.wfile.write(json.dumps(answer).encode() + b"\n")


def _fetching() -> list[str]:
    """The reader's fetch threads alive in this process."""
    return [t.name for t in threading.enumerate() if t.name == "elasticd-fetch"]


def test_a_load_that_fails_here_gives_up_its_fetch_and_leaves_the_tier_free(
    tmp_path: Path, monkeypatch
):
    """A rank's read of its own node's file failed (cut short) while the rest was fetched on
    a thread: the fetch held the tier's one connection, so the load's fallback (the tier's
    newest complete commit) waited out the fetch, up to 600 s.  The fetch is given up now,
    over a connection of its own."""
    monkeypatch.delenv(checkpoint.TIER_ENV, raising=False)
    path = tmp_path / "elastic-0-1"
    path.mkdir()
    tensors = {
        name: {
            "dtype": "float32",
            "size": [2],
            "requires_grad": False,
            "chunks": [[[0], [2], f"__{rank}_0.distcp", 0, 8]],
        }
        for rank, name in enumerate(("here", "fetched"))
    }
    doc = {"format": checkpoint.FORMAT, "tensors": tensors, "values": {}}
    (path / checkpoint.METADATA).write_text(json.dumps(doc))
    (path / "__0_0.distcp").write_bytes(b"\0" * 4)  # cut short: 8 bytes wanted
    server = _HangingTier(str(tmp_path / checkpoint.TIER_SOCKET))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    tier = checkpoint.Tier(tmp_path)
    try:
        state = {"here": torch.zeros(2), "fetched": torch.zeros(2)}
        with pytest.raises(BaseException, match="cut before 8"):
            checkpoint.load(state, "elastic-0-1", tier=tier)
        began = time.monotonic()
        assert tier.latest()["id"] == "elastic-0-1"  # free at once, not after 600 s
        assert time.monotonic() - began < 30
        # the fetch given up ends, whether the daemon was asked already (its connection is
        # ended, not left) or not yet (it is never asked)
        deadline = time.monotonic() + 30
        while _fetching() or len(server.fetches) < server.asked:
            assert time.monotonic() < deadline, (server.asked, server.fetches, _fetching())
            time.sleep(0.01)
        assert server.asked <= 1
    finally:
        server.release.set()
        tier.close()
        server.shutdown()
        server.server_close()


# -- across ranks -------------------------------------------------------------------------------------


def run_ranks(world: int, mode: str, path: Path, out: Path) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                str(rank),
                str(world),
                str(port),
                mode,
                str(path),
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(world)
    ]
    deadline = time.monotonic() + 120
    for proc in procs:
        try:
            output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        assert proc.returncode == 0, output.decode(errors="replace")[-3000:]


@pytest.fixture(scope="module")
def saved_by_three(tmp_path_factory):
    out = tmp_path_factory.mktemp("tier-rw")
    run_ranks(3, "save", out / "ckpt", out)
    return out


@pytest.mark.parametrize("world", [2, 1])
def test_fsdp2_and_adamw_saved_by_3_ranks_load_resharded_bit_for_bit(saved_by_three, world):
    out = saved_by_three
    run_ranks(world, "load", out / "ckpt", out)
    saved = json.loads((out / "saved.json").read_text())
    loaded = json.loads((out / f"loaded-{world}.json").read_text())
    for key in ("params", "moments", "second", "steps"):
        assert loaded[key] == saved[key], key
        assert loaded["dcp_planner"][key] == saved[key], key
    assert loaded["extra"] == {"step": 7, "name": "x", "t": [0.0, 1.0, 2.0], "pair": [1, None]}
    assert loaded["pair_is_tuple"]
    assert loaded["lr"] == loaded["dcp_planner_lr"] == 0.01
    # an optimizer given its state from the metadata loads as one DCP's step made it for
    assert loaded["given"]
    assert loaded["given_state"] == saved
    assert loaded["given_kinds"] == loaded["made_kinds"]
    # a commit one rank cannot read fails every rank's load at once, none left waiting
    assert set(loaded["one_rank_lost_it"]) == {"CheckpointException"}, loaded["one_rank_lost_it"]
    # each rank read its rows only: together, the tensors' bytes about once
    total = sum((out / "ckpt" / f"__{r}_0.distcp").stat().st_size for r in range(3))
    reads = [json.loads((out / f"read-{world}-{r}.json").read_text())["read"] for r in range(world)]
    assert sum(reads) <= total and max(reads) <= total / world + 1024, (reads, total)
    assert not any(
        json.loads((out / f"read-{world}-{r}.json").read_text())["fetched"] for r in range(world)
    )


# -- frameworks whose sharded strategies are refused in place -------------------------------------


def test_lightning_s_sharded_strategies_are_refused_in_place_and_ddp_is_not():
    pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy

    from elasticd.elastic import lightning

    for strategy in (FSDPStrategy(), ModelParallelStrategy()):
        with pytest.raises(lightning.ShardedStrategyError, match=r"ddp.*not .*Strategy"):
            lightning.refuse_sharded(strategy)
    lightning.refuse_sharded(DDPStrategy())


def test_accelerate_s_sharded_kinds_are_refused_in_place_and_multi_cpu_is_not():
    pytest.importorskip("accelerate")
    from accelerate.utils import DistributedType

    from elasticd.elastic import accelerate

    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM):
        with pytest.raises(accelerate.ShardedAcceleratorError, match=kind.value):
            accelerate.refuse_sharded(kind)
    for kind in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.NO):
        accelerate.refuse_sharded(kind)


def _one_rank(tier: str, body: str) -> dict:
    """``body`` run by one gloo rank with a 1-rank FSDP2 model, AdamW and ``commits``: the
    ShardedCommits of ``tier``'s class ``Tier`` (a fake of the daemon's socket); what it
    prints last, as JSON."""
    script = "\n".join([_ONE_RANK_HEAD, textwrap.dedent(tier), _ONE_RANK_MODEL, body])
    done = subprocess.run(
        [sys.executable, "-c", script, str(free_port())],  # the tests' own port (hostwide)
        capture_output=True,
        text=True,
        timeout=240,
        env={
            "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "daemon"),
            "PATH": "/usr/bin:/bin",
        },
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


_ONE_RANK_HEAD = """
import json, os, socket, sys, tempfile
import torch, torch.nn as nn, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from elasticd.elastic import ElasticUsageError, checkpoint, runtime, sharded

sharded.COMPLETE_WAIT = 0.3  # seconds a commit that never completes is waited for
here = tempfile.mkdtemp()
open(os.path.join(here, checkpoint.TIER_SOCKET), "w").close()
"""

_ONE_RANK_MODEL = """
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1",
                  ELASTICD_ROUND="0")
runtime.init_default_group("gloo")
mesh = init_device_mesh("cpu", (1,))
model = nn.Linear(8, 8)
fully_shard(model, mesh=mesh)
opt = torch.optim.AdamW(model.parameters())
commits = sharded.ShardedCommits(Tier(here))
"""


def test_a_load_that_fails_on_a_ranks_own_commit_falls_back_to_the_newest_complete() -> None:
    """A rank's own last commit that never completes (its copy refused: the keeper is full)
    was proposed again at each try, each waiting for it: the ranks gave up after three, and
    the job re-formed, where the newest complete commit was there to load."""
    tier = """
        class Tier(checkpoint.Tier):  # elastic-0-1 is complete; its own elastic-0-2 never is
            def latest(self): return {"id": "elastic-0-1"}
            def wait(self, ident, timeout): return ident == "elastic-0-1"
            def saving(self, ident): pass
            def saved(self, ident, files, place): pass
    """
    found = _one_rank(
        tier,
        """
saved = commits.save(model, opt, {"step": 1})
commits.flush()
commits.last = sharded.CommitId(0, 2)  # its own newest: its copy was refused, say
attrs = commits.load(model, opt)
print(json.dumps({"saved": saved.name, "loaded": attrs, "last": commits.last.name}))
""",
    )
    assert found == {"saved": "elastic-0-1", "loaded": {"step": 1}, "last": "elastic-0-1"}


def test_a_scripts_own_save_beside_the_commits_is_refused_not_taken_for_none() -> None:
    """A script that commits its state and also saves DCP checkpoints of its own into the
    tier: the tier keeps the newest complete one only, so each deleted the other, and after
    a failure the ranks found no commit (the newest was ``step_40``) and started over.  The
    commit after such a save, and the load, now say what is wrong."""
    tier = """
        class Tier(checkpoint.Tier):  # the script's own step_40 is the newest complete
            def latest(self): return {"id": "step_40"}
            def wait(self, ident, timeout): return True
            def saving(self, ident): pass
            def saved(self, ident, files, place): pass
    """
    found = _one_rank(
        tier,
        """
out = {}
commits.save(model, opt, {"step": 1})
for what, call in (("commit", lambda: commits.save(model, opt, {"step": 2})),
                   ("load", lambda: commits.load(model, opt))):
    try:
        call()
    except ElasticUsageError as exc:
        out[what] = str(exc)
print(json.dumps(out))
""",
    )
    assert set(found) == {"commit", "load"}
    assert all("holds step_40" in why and "another directory" in why for why in found.values())
