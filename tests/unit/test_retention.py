"""Issue 15: the settings of bounded output and retention, and retention's decisions (pure);
the pruner on a real history file and a real board in memory, with a clock of the test's."""

import asyncio
import os

import pytest

from elasticd import config
from elasticd.core.model import Failure, JobSpec, JobState, PartState
from elasticd.core.records import JobRecord, Outcome, Part, expired
from elasticd.errors import ConfigError, StoreConnectionError
from elasticd.faults import Throttle
from elasticd.jobs import board as board_module
from elasticd.jobs.board import BoardFollower, JobBoard
from elasticd.jobs.history import History
from elasticd.jobs.registry import JobRegistry
from elasticd.jobs.retention import (
    BATCH,
    LEAST,
    MOST,
    BoardSweeper,
    Pruner,
    next_pass,
    prunable,
    stale_dirs,
    sweepable,
)
from elasticd.shell.logs import OutputLimit
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import SignedLines, Signer

DAY = 86400.0


def spec(job_id: str) -> JobSpec:
    return JobSpec(
        id=job_id,
        argv=("t.py",),
        python="/p",
        workdir="/w",
        uid=1,
        gid=1,
        user="u",
        name="t",
        created=1.0,
    )


def record(job_id: str, ended: float | None) -> JobRecord:
    outcome = Outcome(JobState.SUCCEEDED, ended) if ended is not None else None
    return JobRecord(spec(job_id), 1, outcome=outcome)


# -- the config keys ------------------------------------------------------------------------------


def test_output_and_history_defaults():
    cfg = config.load()
    assert cfg.output.limit == OutputLimit(100 * 1024 * 1024, 3)
    assert cfg.history.retention == 30 * DAY


@pytest.mark.parametrize(
    "tables, key, words",
    [
        (
            {"output": {"max_bytes": -1}},
            "output.max_bytes",
            "must be 0 (no limit) or at least 65536 bytes",
        ),
        (
            {"output": {"max_bytes": 1000}},
            "output.max_bytes",
            "must be 0 (no limit) or at least 65536 bytes",
        ),
        ({"output": {"max_bytes": "100MiB"}}, "output.max_bytes", "must be an integer"),
        ({"output": {"max_bytes": 1.5e6}}, "output.max_bytes", "must be an integer"),
        ({"output": {"backups": -1}}, "output.backups", "must be 0..100"),
        ({"output": {"backups": 101}}, "output.backups", "must be 0..100"),
        ({"output": {"backups": True}}, "output.backups", "must be an integer"),
        ({"output": {"rotate": 1}}, "output.rotate", "unknown key (known: max_bytes, backups)"),
        ({"history": {"retention": -1}}, "history.retention", "must be 0 or more"),
        ({"history": {"retention": "30d"}}, "history.retention", "must be a number"),
        ({"history": {"retention": float("nan")}}, "history.retention", "must be 0 or more"),
    ],
)
def test_bad_values_are_named(tables, key, words):
    with pytest.raises(ConfigError) as caught:
        config.from_tables(tables)
    assert caught.value.key == key and words in str(caught.value), str(caught.value)


@pytest.mark.parametrize(
    "tables, limit, retention",
    [
        ({"output": {"max_bytes": 0, "backups": 0}}, OutputLimit(0, 0), 30 * DAY),
        ({"output": {"max_bytes": 65536, "backups": 100}}, OutputLimit(65536, 100), 30 * DAY),
        ({"history": {"retention": 0}}, OutputLimit(100 << 20, 3), 0.0),
        ({"history": {"retention": 2}}, OutputLimit(100 << 20, 3), 2.0),
    ],
)
def test_good_values(tables, limit, retention):
    cfg = config.from_tables(tables)
    assert cfg.output.limit == limit and cfg.history.retention == retention
    assert isinstance(cfg.history.retention, float)


# -- the decisions ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ended, now, retention, want",
    [
        (None, 1e9, 1.0, False),  # running: never
        (100.0, 200.0, 100.0, True),  # exactly due
        (100.0, 199.0, 100.0, False),
        (100.0, 1e12, 0.0, False),  # 0: forever
    ],
)
def test_expired(ended, now, retention, want):
    outcome = Outcome(JobState.FAILED, ended) if ended is not None else None
    assert expired(outcome, now, retention) is want


def test_prunable_leaves_running_jobs_and_jobs_busy_here():
    records = [record("old", 10.0), record("busy", 10.0), record("new", 95.0), record("run", None)]
    assert prunable(records, now=100.0, retention=50.0, busy={"busy"}) == ["old"]
    assert prunable(records, now=100.0, retention=0.0, busy=set()) == []


@pytest.mark.parametrize(
    "ended, now, retention, want",
    [
        ([], 0.0, 30 * DAY, MOST),  # nothing ended: an hour (a job may end meanwhile)
        ([], 0.0, 10.0, 10.0),  # a short retention: no later than it
        ([100.0], 120.0, 30.0, 10.0),  # the next job is due in 10 s
        ([100.0], 500.0, 30.0, LEAST),  # due and not pruned (the pass could not): soon
        ([None, 100.0], 100.0, 30 * DAY, MOST),  # due in a month: an hour
    ],
)
def test_next_pass(ended, now, retention, want):
    records = [record(f"j{i}", e) for i, e in enumerate(ended)]
    assert next_pass(records, now, retention) == want


def test_a_due_job_still_busy_here_does_not_make_the_timer_a_poll():
    records = [record("stuck", 100.0), record("later", 400.0)]
    assert next_pass(records, 500.0, 200.0, busy={"stuck"}) == 100.0  # "later" is due then
    assert next_pass(records[:1], 500.0, 200.0, busy={"stuck"}) == 200.0  # min(retention, MOST)


def test_stale_dirs_are_old_directories_of_unknown_jobs():
    entries = [("known", 0.0), ("lost", 0.0), ("fresh", 95.0)]
    assert stale_dirs(entries, {"known"}, now=100.0, retention=10.0) == ["lost"]
    assert stale_dirs(entries, set(), now=100.0, retention=0.0) == []


# -- the pruner, the registry and the board -----------------------------------------------------------


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def logs_of(root, job_id: str) -> str:
    path = os.path.join(root, job_id, "attempt_0")
    os.makedirs(path)
    with open(os.path.join(path, "rank_0.out"), "w") as f:
        f.write("hello\n")
    return os.path.join(root, job_id)


def test_the_pruner_forgets_ended_jobs_with_their_output_and_keeps_the_rest(tmp_path):
    clock = Clock(1000.0)
    history = History(str(tmp_path / "history.sqlite"))
    registry = JobRegistry(history, retention=100.0, clock=clock)
    root = str(tmp_path / "logs")
    ended = {"j-old": 800.0, "j-busy": 800.0, "j-new": 950.0, "j-run": None}
    for job_id, when in ended.items():
        registry.add(spec(job_id), 1)
        if when is not None:
            registry.set_outcome(job_id, Outcome(JobState.SUCCEEDED, when))
        logs_of(root, job_id)
    lost = logs_of(root, "j-lost")  # a job whose row went with a corrupt history
    os.utime(lost, (0, 0))
    pruned: list[list[str]] = []
    pruner = Pruner(registry, root, busy=lambda: ["j-busy"], on_pruned=pruned.append, clock=clock)

    assert asyncio.run(pruner.prune()) == ["j-old"]
    assert pruned == [["j-old"]] and registry.find("j-old") is None
    assert sorted(os.listdir(root)) == ["j-busy", "j-new", "j-run"]
    assert sorted(job_id for job_id, _ in history.load()) == ["j-busy", "j-new", "j-run"]

    clock.now = 2000.0  # later: the one that was busy is done, the running one still runs
    assert asyncio.run(Pruner(registry, root, busy=list, clock=clock).prune()) == [
        "j-busy",
        "j-new",
    ]
    assert os.listdir(root) == ["j-run"] and [r.id for r in registry.jobs()] == ["j-run"]
    history.close()


def test_a_forgotten_job_is_not_taken_back_from_the_board(tmp_path):
    clock = Clock(1000.0)
    registry = JobRegistry(History(str(tmp_path / "history.sqlite")), retention=100.0, clock=clock)
    board = JobBoard(AsyncMemoryStore(MemoryStore()), Signer(b"k" * 32, "c"), "c")
    follower = BoardFollower(board, registry, "n1")

    async def scenario() -> None:
        for job_id, ended in (("j-old", 800.0), ("j-new", 950.0)):
            seq = await board.publish_spec(spec(job_id))
            outcome = Outcome(JobState.SUCCEEDED, ended)
            await board.publish_outcome(job_id, outcome)
            await board.publish_ended(spec(job_id), seq, outcome)
        await follower.resync()  # as at start, or after a store reset
        assert [r.id for r in registry.jobs()] == ["j-new"]
        await follower.fetch("j-old")  # `elasticctl status j-old`
        assert registry.find("j-old") is None

    asyncio.run(scenario())


# -- the store's side: the observer deletes ended jobs' records ---------------------------------


class RaceOnce(AsyncMemoryStore):
    """A memory store that publishes ``job`` (with ``seq``, if given) through the first
    board given, right before the first compare-and-set of a key that ends with ``key``."""

    def __init__(self, key: str, job: str, seq: int | None = None) -> None:
        super().__init__(MemoryStore())
        self.boards: list[JobBoard] = []
        self._key, self._job, self._seq = key, job, seq
        self.raced = False

    async def compare_set(self, key, expected, desired):
        if key.endswith(self._key) and not self.raced:
            self.raced = True
            await self.boards[0].publish_spec(spec(self._job), self._seq)
        return await super().compare_set(key, expected, desired)


def test_the_observer_deletes_the_records_of_jobs_ended_past_the_retention_and_no_others(
    tmp_path,
):
    # a job is submitted elsewhere right before the index's first rewrite: it keeps its line
    store = RaceOnce("/jobs/index/0", "j-meanwhile")
    board_signer = Signer(b"k" * 32, "c")
    board = JobBoard(store, board_signer, "c")
    store.boards.append(board)
    observing = [False]
    sweeper = BoardSweeper(
        board, lambda: observing[0], 100.0, told=Throttle(), clock=lambda: 1000.0
    )

    async def keys() -> set[str]:
        names = ("spec", "outcome", "parts", "part")
        wanted = [
            f"elasticd/c/jobs/{n}/{j}" + ("/n1" if n == "part" else "")
            for j in ("j-old", "j-new", "j-running", "j-forged")
            for n in names
        ]
        found = await store.get_many(wanted)
        return {k.split("/jobs/")[1] for k, v in zip(wanted, found) if v is not None}

    async def scenario() -> None:
        written: dict[str, bytes | None] = {}
        for job_id, ended in (("j-old", 800.0), ("j-new", 950.0), ("j-running", None)):
            seq = await board.publish_spec(spec(job_id))
            written[job_id] = await store.get(f"elasticd/c/jobs/spec/{job_id}")
            await board.publish_part(job_id, Part("n1", PartState.SUCCEEDED))
            if ended is not None:
                outcome = Outcome(JobState.SUCCEEDED, ended)
                await board.publish_outcome(job_id, outcome)
                await board.publish_ended(spec(job_id), seq, outcome)
        rendezvous = [
            f"elasticd/c/rdzv/{job_id}/{k}"
            for job_id in ("j-old", "j-new", "j-running")
            for k in ("state", "head", "rev/7", "hb/n1", "round/3/joins", "round/3/join/0")
        ]
        for k in rendezvous:
            await store.set(k, b"x")
        # an old outcome that does not open (forged): its job is held, never deleted
        await board.publish_spec(spec("j-forged"))
        await store.set("elasticd/c/jobs/outcome/j-forged", b"junk")
        before = await keys()
        board_index_line = (await store.get("elasticd/c/jobs/index/0") or b"").splitlines(True)[0]
        assert await sweeper.sweep() == [] and await keys() == before  # not the observer
        observing[0] = True
        assert await sweeper.sweep() == ["j-old"]
        # its outcome stays: a spec written back reads as a job that ended
        assert await keys() == before - {"spec/j-old", "parts/j-old", "part/j-old/n1"}
        # and its rendezvous keys, no other job's
        assert [await store.get(k) is None for k in rendezvous] == [True] * 6 + [False] * 12
        index = SignedLines(board_signer, "elasticd/c/jobs/index/0", lambda b: b["name"], print)
        names = index.fold(await store.get("elasticd/c/jobs/index/0"))
        assert names == ["j-new", "j-running", "j-forged", "j-meanwhile"]
        _, changes = await board.snapshot()
        assert {c.job_id for c in changes} == {"j-new", "j-running", "j-forged", "j-meanwhile"}
        assert await sweeper.sweep() == []  # nothing else is due
        # anyone who reaches the store kept j-old's first spec record and index line and
        # writes them back: a node that never knew the job reads it with its outcome
        replayed = written["j-old"]
        assert replayed is not None
        await store.set("elasticd/c/jobs/spec/j-old", replayed)
        await store.append("elasticd/c/jobs/index/0", board_index_line)
        newcomer = JobRegistry(
            History(str(tmp_path / "newcomer.sqlite")), retention=100.0, clock=Clock(1000.0)
        )
        await BoardFollower(board, newcomer, "n9").resync()
        old = newcomer.find("j-old")  # never an open job that runs again
        assert old is None or (old.outcome is not None and old.outcome.ended == 800.0)
        # published again (a node that held it open, after a store reset): a follower of
        # the log reads the spec with its outcome
        position = await board.head()
        await board.publish_spec(spec("j-old"), 1)
        _, changes = await board.follow(position, 1.0)
        assert [(c.kind, c.job_id) for c in changes] == [("spec", "j-old"), ("outcome", "j-old")]
        # a new job that drew an ended job's id is open: its records stay
        seq = await board.publish_spec(spec("j-reused"))
        outcome = Outcome(JobState.SUCCEEDED, 700.0)
        await board.publish_outcome("j-reused", outcome)
        await board.publish_ended(spec("j-reused"), seq, outcome)
        await board.publish_spec(spec("j-reused"))  # the new job, with no outcome of its own
        assert await sweeper.sweep() == []
        assert await store.get("elasticd/c/jobs/spec/j-reused") is not None
        assert newcomer.find("j-running") is not None

    asyncio.run(scenario())
    assert store.raced


def test_the_index_is_kept_in_pieces_and_an_emptied_old_piece_goes(monkeypatch):
    """One key for the whole index passed etcd's request limit (1.5 MiB) at about 12,500
    jobs, and was written again whole at each submit.  Pieces of INDEX_SPAN jobs (2 here);
    a store written before the pieces (its jobs listed in the index's own key) still reads,
    and forgets, as before."""
    monkeypatch.setattr(board_module, "INDEX_SPAN", 2)
    store = AsyncMemoryStore(MemoryStore())
    signer = Signer(b"k" * 32, "c")
    board = JobBoard(store, signer, "c")
    sweeper = BoardSweeper(board, lambda: True, 100.0, told=Throttle(), clock=lambda: 1000.0)
    root = "elasticd/c/jobs"

    def lines(key: str, raw: bytes | None) -> list:
        return SignedLines(signer, f"{root}/{key}", lambda b: b, print).fold(raw)

    async def listed() -> dict[str, list]:
        index = await store.get(f"{root}/index")
        pieces = [line["piece"] for line in lines("index", index) if "piece" in line]
        held = {"index": [line["name"] for line in lines("index", index) if "name" in line]}
        for piece in pieces:
            held[piece] = [
                line["name"] for line in lines(piece, await store.get(f"{root}/{piece}"))
            ]
        return held

    async def end(job_id: str, seq: int, ended: float) -> None:
        outcome = Outcome(JobState.SUCCEEDED, ended)
        await board.publish_outcome(job_id, outcome)
        await board.publish_ended(spec(job_id), seq, outcome)

    async def scenario() -> None:
        legacy = SignedLines(signer, f"{root}/index", lambda b: b, print).line({"name": "j-legacy"})
        await store.append(f"{root}/index", legacy)  # a store from before the pieces
        await board.publish_outcome("j-legacy", Outcome(JobState.FAILED, 10.0))  # spec gone
        seqs = {
            job_id: await board.publish_spec(spec(job_id))
            for job_id in "j-1 j-2 j-3 j-4 j-5".split()
        }
        assert seqs == {"j-1": 1, "j-2": 2, "j-3": 3, "j-4": 4, "j-5": 5}
        assert await listed() == {
            "index": ["j-legacy"],
            "index/0": ["j-1"],
            "index/1": ["j-2", "j-3"],
            "index/2": ["j-4", "j-5"],
        }
        _, changes = await board.snapshot()
        assert [c.job_id for c in changes if c.kind == "spec"] == [
            "j-1",
            "j-2",
            "j-3",
            "j-4",
            "j-5",
        ]
        assert {c.job_id for c in changes if c.kind == "outcome"} == {"j-legacy"}
        for job_id in ("j-1", "j-2", "j-5"):
            await end(job_id, seqs[job_id], 500.0)
        assert sorted(await sweeper.sweep()) == ["j-1", "j-2", "j-5", "j-legacy"]
        # index/0, emptied, is unlisted; its key stays, empty (a store deletes no key only
        # while it is empty)
        assert await listed() == {"index": [], "index/1": ["j-3"], "index/2": ["j-4"]}
        assert await store.get(f"{root}/index/0") == b""
        await end("j-4", seqs["j-4"], 500.0)
        assert await sweeper.sweep() == ["j-4"]
        assert await listed() == {"index": [], "index/1": ["j-3"]}
        assert await board.publish_spec(spec("j-6")) == 6  # piece 3
        assert await listed() == {"index": [], "index/1": ["j-3"], "index/3": ["j-6"]}
        await end("j-3", seqs["j-3"], 500.0)
        assert await sweeper.sweep() == ["j-3"]
        assert await listed() == {"index": [], "index/3": ["j-6"]}
        _, changes = await board.snapshot()
        assert [c.job_id for c in changes if c.kind == "spec"] == ["j-6"]
        # a seq as high as a counter can be still makes a piece the index lists
        await store.add(f"{root}/seq", 10**15)
        assert await board.publish_spec(spec("j-7")) == 10**15 + 7
        _, changes = await board.snapshot()
        assert [c.job_id for c in changes if c.kind == "spec"] == ["j-6", "j-7"]

    asyncio.run(scenario())


def test_a_job_published_into_a_piece_as_the_sweep_unlists_it_stays_listed(monkeypatch):
    monkeypatch.setattr(board_module, "INDEX_SPAN", 2)
    # right before the sweep unlists the emptied piece 0, a node publishes a job into it (it
    # republishes an open job with its old seq after a store reset): it finds the piece
    # still listed and lists it no more
    store = RaceOnce("/jobs/index", "j-again", 1)
    board = JobBoard(store, Signer(b"k" * 32, "c"), "c")
    store.boards.append(board)
    sweeper = BoardSweeper(board, lambda: True, 100.0, told=Throttle(), clock=lambda: 1000.0)

    async def scenario() -> None:
        seq = await board.publish_spec(spec("j-old"))
        assert seq == 1  # piece 0, which j-again goes to as well
        for job_id in ("j-2", "j-3", "j-4"):
            await board.publish_spec(spec(job_id))
        outcome = Outcome(JobState.SUCCEEDED, 500.0)
        await board.publish_outcome("j-old", outcome)
        await board.publish_ended(spec("j-old"), seq, outcome)
        assert await sweeper.sweep() == ["j-old"]
        assert store.raced
        _, changes = await board.snapshot()
        assert [c.job_id for c in changes if c.kind == "spec"] == ["j-again", "j-2", "j-3", "j-4"]

    asyncio.run(scenario())


def test_a_forgotten_job_s_outcome_keeps_how_it_ended_not_its_traceback():
    """The outcome stays (a spec written back must read as ended); its error's text, up to
    64 KiB of traceback a failed job, does not."""
    store = AsyncMemoryStore(MemoryStore())
    board = JobBoard(store, Signer(b"k" * 32, "c"), "c")
    sweeper = BoardSweeper(board, lambda: True, 100.0, told=Throttle(), clock=lambda: 1000.0)
    error = Failure(0, 0, "n1", 1, "RuntimeError: boom", traceback="  File ...\n" * 6000)
    failed = Outcome(JobState.FAILED, 500.0, 1, "rank 0 failed", error, "")
    key = "elasticd/c/jobs/outcome/j-failed"

    async def scenario() -> None:
        seq = await board.publish_spec(spec("j-failed"))
        spec_record = await store.get("elasticd/c/jobs/spec/j-failed")
        await board.publish_outcome("j-failed", failed)
        await board.publish_ended(spec("j-failed"), seq, failed)
        whole = await store.get(key) or b""
        assert len(whole) > 60_000 and b"boom" not in whole  # encrypted: the owner's to read
        assert await sweeper.sweep() == ["j-failed"]
        kept = await store.get(key) or b""
        assert len(kept) < 400, len(kept)
        # a spec record written back reads as the job that ended, when it ended
        await store.set("elasticd/c/jobs/spec/j-failed", spec_record)
        changes = await board.read_job("j-failed")
        (outcome,) = [c.value for c in changes if c.kind == "outcome"]
        assert outcome == Outcome(JobState.FAILED, 500.0, 1, "rank 0 failed")

    asyncio.run(scenario())


def test_an_outcome_is_cut_to_fit_the_store_keeping_the_end_of_its_traceback():
    """Error text comes from users' code: 16K characters of message twice and 64K of
    traceback, each emoji 12 bytes of JSON, sealed a third larger, passed etcd's 1.5 MiB."""
    wide = "\U0001f525" * 16384
    error = Failure(0, 0, "n1", 1, wide, traceback=wide * 4 + "RuntimeError: the end")
    huge = Outcome(JobState.FAILED, 500.0, 1, wide, error, "")
    store = AsyncMemoryStore(MemoryStore())
    board = JobBoard(store, Signer(b"k" * 32, "c"), "c")

    async def scenario() -> None:
        final = await board.publish_outcome("j-huge", huge)
        assert final == board_module.fitted(huge) and final.error is not None
        assert final.error.traceback.endswith("RuntimeError: the end")
        assert final.error.traceback.startswith("[elasticd: ")
        raw = await store.get("elasticd/c/jobs/outcome/j-huge") or b""
        assert len(raw) < 400 * 1024, len(raw)
        (change,) = [c for c in await board.read_job("j-huge") if c.kind == "outcome"]
        assert change.value == final

    asyncio.run(scenario())
    small = Outcome(JobState.FAILED, 1.0, 1, "m", Failure(0, 0, "n1", 1, "x", "tb"))
    assert board_module.fitted(small) is small


class NoListing(AsyncMemoryStore):
    """A TCPStore whose key list the store cannot send (a store full of junk keys)."""

    async def delete_under(self, prefixes):
        raise StoreConnectionError("lost the store: the key list was too long")


def test_retention_goes_on_when_the_rendezvous_keys_cannot_be_deleted(caplog):
    store = NoListing(MemoryStore())
    board = JobBoard(store, Signer(b"k" * 32, "c"), "c")
    sweeper = BoardSweeper(board, lambda: True, 100.0, told=Throttle(), clock=lambda: 1000.0)

    async def scenario() -> None:
        seq = await board.publish_spec(spec("j-old"))
        await board.publish_spec(spec("j-new"))
        outcome = Outcome(JobState.SUCCEEDED, 500.0)
        await board.publish_outcome("j-old", outcome)
        await board.publish_ended(spec("j-old"), seq, outcome)
        assert await sweeper.sweep() == ["j-old"]
        assert await sweeper.sweep() == []  # forgotten: not read again at the next pass
        _, changes = await board.snapshot()
        assert [c.job_id for c in changes if c.kind == "spec"] == ["j-new"]

    asyncio.run(scenario())
    assert "the rendezvous keys of 1 jobs stay: lost the store" in caplog.text


def test_sweepable_takes_the_oldest_expired_jobs_a_batch_at_a_time():
    ended = {f"j-{i:04d}": Outcome(JobState.SUCCEEDED, 1000.0 - i) for i in range(BATCH + 50)}
    ended["j-recent"] = Outcome(JobState.FAILED, 999.0)  # within the retention
    due = sweepable(ended, now=1000.0, retention=5.0)
    assert len(due) == BATCH and "j-recent" not in due
    assert due[0] == f"j-{BATCH + 49:04d}"  # the oldest first
    assert sweepable(ended, now=1000.0, retention=0.0) == []  # retention 0: kept forever
    assert sweepable({"j-recent": ended["j-recent"]}, now=1000.0, retention=5.0) == []
