"""The checkpoint tier on this node: each job's checkpoint directory, kept in memory, its
shares copied to another node, restored before a restarted round's workers read, written
to the job's ``--checkpoint-dir`` in the background.  What to do is decided by
core/checkpoints.py; this module carries it out (files, copies, the user's disk).

Each job gets a directory (``ELASTICD_CHECKPOINT_DIR`` in its workers' environment): a tmpfs
of its own, mounted with the job's cap as its size and its user as its owner (0700), when
the daemon runs as root; else a directory on ``/dev/shm``.  Its pages are charged to the
memory cgroup of the process that writes them: the workers' (their job's limit counts
them), the daemon's for the copies it keeps of other nodes' shares.

A checkpoint is noticed by inotify, never polled: DCP writes ``.metadata`` last (rank 0's
node); the other nodes learn of it from rank 0's node's manifest on the board.  Then each
node hashes its share while streaming it to the node that keeps its copy (the peer data
plane, cluster/tierlink.py: CURVE, authenticated and encrypted), and publishes its
manifest in its part record.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import functools
import hashlib
import json
import logging
import os
import shutil
import socket
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO, Protocol, TypeVar

from elasticd.aio import back_off
from elasticd.core import checkpoints as cp
from elasticd.core import events as ev
from elasticd.core.model import JobSpec
from elasticd.core.records import JobRecord
from elasticd.errors import CheckpointsFull
from elasticd.journal import about
from elasticd.shell import writeback
from elasticd.shell.inotify import (
    IN_CLOSE_WRITE,
    IN_CREATE,
    IN_DELETE,
    IN_DONT_FOLLOW,
    IN_MOVED_FROM,
    IN_MOVED_TO,
    IN_ONLYDIR,
    IN_Q_OVERFLOW,
    Change,
    Watcher,
)
from elasticd.shell.userfs import rights_of, with_rights_of

log = logging.getLogger(__name__)
R = TypeVar("R")

CHECKPOINT_ENV = "ELASTICD_CHECKPOINT_DIR"
TIER_SOCKET = ".tier.sock"  # in the job's directory: its workers ask the tier there
_MAX_REQUEST = 1024 * 1024  # bytes of one worker's request line
_MAX_RANGES = 65536  # byte ranges one fetch may ask for
# spans of fetched bytes a job's files may keep apart (jd.fetched): past it, a file's every
# gap is fetched with what was asked, and the file is one span again
_MAX_FETCHED = 1 << 18
_MAX_CLAIMED = 64  # checkpoints a job's workers may be saving at once (``saving``, unlanded)
_MAX_LOCAL = 4096  # workers a node's report may count
_MAX_WAITS = 64  # a job's workers' ``wait``s at once
_DROP_TRIES = 4  # a copy's drop, sent again after 1, 2 and 4 s: else it stays to the job's end
# seconds a share's keeper may be out of the round (left, or lost) before the share is
# copied to its new keeper: not at once, where the recovery needs the network and the
# CPU, and a save of the new round usually makes the old one moot by then
REKEEP_AFTER = 30.0
# seconds a restart waits for the records that show the checkpoint its round agreed on
# complete on this node (they are on their way: a member saw it complete)
AGREE_WAIT = 30.0
# seconds a file of a copy may land with no chunk before it is dropped: its sender gives up
# after 30 s without an answer (cluster/tierlink.py TIMEOUT), so one silent four times as
# long was lost or gave up, and its partial file would hold memory until the job ends
_LANDING_IDLE = 120.0
COPIES = ".copies"  # other nodes' shares kept here: COPIES/<owner>/<checkpoint>/<file>
RANGES = ".ranges"  # byte ranges fetched for a reader: RANGES/<checkpoint>/<file> (sparse)
_CHUNK = 8 * 1024 * 1024
# a checkpoint's directory the job swapped for a link to elsewhere is not watched there
_WATCHED = (
    IN_CREATE
    | IN_CLOSE_WRITE
    | IN_MOVED_TO
    | IN_DELETE
    | IN_MOVED_FROM
    | IN_DONT_FOLLOW
    | IN_ONLYDIR
)
# directories of one job watched at once (its own and one per checkpoint): inotify watches
# are counted against root's, for every root service of the host
_MAX_WATCHED = 256
_MS_NOSUID, _MS_NODEV, _MNT_DETACH = 2, 4, 2


class TierPeers(Protocol):
    """The data plane to other nodes' tiers (cluster/tierlink.py)."""

    async def send(
        self, node: str, job: str, ckpt: str, name: str, source: BinaryIO
    ) -> cp.FileFacts:
        """Stream this node's file (open for reading) to ``node``, which keeps it as a copy
        of this node's share (it checks the size and SHA-256 sent last); returns them."""
        ...

    async def drop(self, node: str, job: str, ckpt: str) -> None:
        """Tell ``node`` that this node's checkpoint ``ckpt`` is gone: its copy goes too."""
        ...

    async def fetch(
        self,
        node: str,
        job: str,
        owner: str,
        ckpt: str,
        name: str,
        into: int,
        ranges: list[tuple[int, int]] | None = None,
        *,
        size: int | None = None,
    ) -> cp.FileFacts | None:
        """Write ``ranges`` of ``owner``'s file as ``node`` holds it into the file open for
        writing as ``into``, at their offsets; None: the whole file, whose size and SHA-256
        (of the bytes written) it returns.  ``size``, for the whole file: its manifest's, the
        size ``node``'s file must have (else refused before a byte is fetched)."""
        ...

    def alive(self, node: str) -> bool: ...
    def domain(self, node: str) -> str: ...


class TierMetrics(Protocol):
    def checkpoint_saved(self, seconds: float, copied: float | None) -> None: ...
    def checkpoint_on_disk(self, seconds: float) -> None: ...
    def checkpoint_held(self, job: str, nbytes: int) -> None: ...
    def checkpoint_restored(self, source: str, nbytes: int) -> None: ...


class NoMetrics:
    def checkpoint_saved(self, seconds: float, copied: float | None) -> None:
        pass

    def checkpoint_on_disk(self, seconds: float) -> None:
        pass

    def checkpoint_held(self, job: str, nbytes: int) -> None:
        pass

    def checkpoint_restored(self, source: str, nbytes: int) -> None:
        pass


def tier_root(config: Any) -> str:
    """Where a daemon keeps its jobs' checkpoint directories (in its runtime directory)."""
    return os.path.join(config.paths.runtime_dir, "checkpoints")


@dataclass(frozen=True)
class TierSettings:
    node: str
    root: str  # where jobs' directories go
    node_cap: int  # bytes every job's directory here may hold together (0: no cap)
    job_cap: int  # a job's, unless it asks for less (0: what the node has left)


@dataclass(frozen=True)
class Report:
    """A worker's ``saved``: its rank in which round wrote which files of a checkpoint."""

    round: int
    world: int
    rank: int
    local_world: int  # the workers of this node in that round: the share is whole once all told
    files: tuple[str, ...]


@dataclass
class JobDir:
    """One job's checkpoint directory on this node, and what the tier knows of it."""

    spec: JobSpec
    path: str
    cap: int
    mounted: bool
    round: int = -1  # the round this node's workers are in, their world size and ranks
    world: int = 0
    ranks: tuple[int, ...] = ()
    manifests: dict[str, cp.Manifest] = field(default_factory=dict)  # this node's shares
    busy: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # id -> landing it
    writing: dict[str, asyncio.Future[None]] = field(default_factory=dict)  # id -> to disk
    data_on_disk: set[str] = field(default_factory=set)  # ids whose data files are on disk
    on_disk: list[str] = field(default_factory=list)  # ids whole on disk, oldest first
    record: JobRecord | None = None
    first_seen: dict[str, float] = field(default_factory=dict)  # id -> when it appeared
    deleting: set[str] = field(default_factory=set)  # paths being removed now
    # (id, file, its SHA-256) -> the spans of it fetched into RANGES, merged and sorted
    fetched: dict[tuple[str, str, str], list[tuple[int, int]]] = field(default_factory=dict)
    fetched_spans: int = 0  # how many, all files together
    server: asyncio.AbstractServer | None = None  # the workers' socket
    # id -> (copies that failed in a row, when the next may be tried: monotonic)
    retry: dict[str, tuple[int, float]] = field(default_factory=dict)
    # id -> why its copy cannot land now (the other node's tier for the job is full): the
    # workers waiting for it to be complete are told, rather than left to wait it out
    refused: dict[str, str] = field(default_factory=dict)
    # ids its workers said they save (``saving``), and each rank's ``saved`` report: their
    # shares are described from the reports, not from the round this node is in now
    claimed: dict[str, dict[int, Report]] = field(default_factory=dict)
    # DCP checkpoints this node put in place for a restart: other nodes' saves (all of their
    # files), never described as this node's own share of a later round
    placed: set[str] = field(default_factory=set)
    # DCP checkpoints saved into again after this node described (or put in place) them:
    # never described here again (until the directory is deleted), so never a mix of saves
    spoiled: set[str] = field(default_factory=set)
    # id -> since when (monotonic) the keeper of this node's share has been out of the round
    keeper_gone: dict[str, float] = field(default_factory=dict)
    # id -> the nodes landings of it copied to and have not finished: where its files may
    # have landed when a landing is cut short (the buddy may have changed since it began)
    sending: dict[str, set[str]] = field(default_factory=dict)
    # files a rank wrote itself that this node described or put in place: name -> (inode,
    # mtime, ctime, size) then, and its SHA-256.  A later write changes the first: a file whose
    # stat still matches is that version (not described again when the daemon put it in
    # place; trusted at a restore only where the version wanted is that one)
    known_files: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)  # set, then replaced
    waits: int = 0  # its workers' waits now
    consider_soon: bool = False  # a ``_consider`` for the record's last changes is due
    watches_spent: bool = False  # it has as many directories watched as a job may
    # its workers were stopped (a restart): nothing lands, nor is pruned, until the next
    # round's start, so that what it declares joining that round is what it holds then
    frozen: bool = False
    cut_short: set[str] = field(default_factory=set)  # landings the stop cancelled

    @property
    def job(self) -> str:
        return self.spec.id

    def let_go(self, name: str) -> None:
        """Forget what is noted of checkpoint ``name`` (deleted, renamed away, pruned);
        ``spoiled`` stays until its directory goes (the caller's)."""
        self.data_on_disk.discard(name)  # a save under its name again is a new one
        for notes in (
            self.claimed,
            self.first_seen,
            self.known_files,
            self.keeper_gone,
            self.retry,
            self.refused,
            self.sending,
        ):
            notes.pop(name, None)
        self.placed.discard(name)

    def rights(self) -> contextlib.AbstractContextManager[None]:
        """The rights the daemon's calls on paths in this directory are made with: its
        user's, whose it is (shell/userfs.py; synchronous code only)."""
        return rights_of(self.spec.uid, self.spec.gid)

    def as_user(self, call: Callable[..., R]) -> Callable[..., R]:
        """``call`` with the directory's user's rights, in whatever thread runs it."""
        return with_rights_of(self.spec.uid, self.spec.gid, call)

    def found(self) -> list[cp.Manifest]:
        """Every node's manifests of the job: the record's, and this node's own (newer)."""
        parts = [] if self.record is None else list(self.record.parts.values())
        theirs = cp.manifests((p.node, p.checkpoints) for p in parts if p.node != self.node_name)
        return theirs + list(self.manifests.values())

    node_name: str = ""


class CheckpointTier:
    """Every job's checkpoint directory on this node (one task group: ``run``)."""

    def __init__(
        self,
        settings: TierSettings,
        peers: TierPeers,
        post: Callable[[ev.Event], None],
        *,
        metrics: TierMetrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.settings = settings
        self._peers = peers
        self._post = post
        self._metrics = metrics or NoMetrics()
        self._clock = clock
        self._jobs: dict[str, JobDir] = {}
        self._watcher: Watcher | None = None
        self._tasks: asyncio.TaskGroup | None = None
        # work given before ``run`` began
        self._waiting: list[tuple[str, str, Callable[[], Awaitable[None]]]] = []
        # a file of a copy being received -> its hash, its size so far, when its last chunk came
        self._receiving: dict[tuple[str, str, str, str], tuple[Any, int, float]] = {}
        # receive and drop run in threads, from the bulk port's loop and CURVE's at once
        self._landing = threading.Lock()

    # -- the tier's life -------------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled: copies, restores and writes to disk run in this group."""
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                for what, job, work in self._waiting:
                    self._spawn(what, job, work)
                self._waiting.clear()
                await asyncio.Future()  # until cancelled
        finally:
            self._tasks = None
            if self._watcher is not None:
                self._watcher.close()
                self._watcher = None

    def _spawn(
        self, what: str, job: str, work: Callable[[], Awaitable[None]]
    ) -> asyncio.Future[None]:
        """Background work that must never end the group: its failure is logged.  Work
        given before ``run`` began waits for it.  ``work`` makes the coroutine when the task
        starts: a task cancelled before it starts leaves none behind un-awaited."""
        if self._tasks is None:
            waiting: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            self._waiting.append((what, job, lambda: _then(work, waiting)))
            return waiting

        async def guarded() -> None:
            try:
                await work()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job %s: checkpoint tier: %s failed", job, what, extra=about(job))

        return self._tasks.create_task(guarded())

    # -- jobs -----------------------------------------------------------------------------------

    def open(self, spec: JobSpec) -> str:
        """The job's directory here (made, mounted and watched now); its workers' env var."""
        if spec.id in self._jobs:
            return self._jobs[spec.id].path
        path = os.path.join(self.settings.root, spec.id)
        cap = self._cap(spec)
        os.makedirs(self.settings.root, mode=0o755, exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        mounted = _mount_tmpfs(path, cap, spec.uid, spec.gid) if os.getuid() == 0 else False
        if os.getuid() == 0 and not mounted:
            os.chown(path, spec.uid, spec.gid)
        os.chmod(path, 0o700)
        jd = JobDir(spec, path, cap, mounted, node_name=self.settings.node)
        self._jobs[spec.id] = jd
        self._rescan(jd)
        self._spawn("serving workers", spec.id, functools.partial(self._serve_workers, jd))
        return path

    def _cap(self, spec: JobSpec) -> int:
        """What the job's directory may hold here (its tmpfs's size: the kernel refuses a
        write past it): what it asked, else the tier's default for a job, never more than
        the node's cap for all jobs (0: no cap).  Jobs' caps may add up to more than the
        node's: a checkpoint that lands while the node holds more than its cap is deleted
        (``_over_node_cap``), so the node never holds more than its cap for long."""
        caps = [c for c in (spec.checkpoint_memory, self.settings.job_cap) if c]
        asked = caps[0] if caps else self.settings.node_cap
        return min(asked, self.settings.node_cap) if self.settings.node_cap else asked

    async def close(self, job: str) -> None:
        """The part ended here: everything the job had in this node's memory is gone."""
        jd = self._jobs.get(job)
        if jd is None:
            return
        self._warn_if_full(jd)
        with self._landing:  # no copy lands in it from now on (``receive`` looks again)
            del self._jobs[job]
            for key in [k for k in self._receiving if k[1] == job]:
                del self._receiving[key]
        for task in [*jd.busy.values(), *jd.writing.values()]:
            task.cancel()
        _changed(jd)
        if jd.server is not None:
            jd.server.close()
        if self._watcher is not None:
            for directory in _dirs_under(jd.path):
                self._watcher.unwatch(directory)
        if jd.mounted:
            _unmount(jd.path)
        await asyncio.to_thread(shutil.rmtree, jd.path, True)
        self._metrics.checkpoint_held(job, 0)

    def _warn_if_full(self, jd: JobDir) -> None:
        why = self.full(jd.job)
        if why:
            log.warning("job %s: %s", jd.job, why, extra=about(jd.job))

    def round(self, job: str, round: int, world: int, ranks: tuple[int, ...]) -> None:
        """This node's workers are ``ranks`` of ``world`` in ``round``: what it saves next
        is theirs."""
        jd = self._jobs.get(job)
        if jd is not None:
            jd.round, jd.world, jd.ranks = round, world, tuple(sorted(ranks))
            jd.frozen = False
            self._consider(jd)

    def stopped(self, job: str) -> None:
        """The job's workers are being stopped for a restart: the saves landing now are cut
        short, and nothing more lands or is pruned here until the next round starts.  Else
        a copy finishing after the stop made a save complete on this node alone: it put that
        one in place and pruned the one before, while a node that had decided earlier put
        the one before in place: their ranks loaded different steps."""
        jd = self._jobs.get(job)
        if jd is not None:
            _freeze(jd)

    def record_changed(self, record: JobRecord) -> None:
        """Another node's manifests, or the job's members, changed."""
        jd = self._jobs.get(record.id)
        if jd is None:
            return
        jd.record = record
        if not jd.consider_soon:  # once for every change that came meanwhile
            jd.consider_soon = True
            asyncio.get_running_loop().call_soon(self._consider_now, jd)
        _changed(jd)

    def _consider_now(self, jd: JobDir) -> None:
        """``_consider``, for the record changes that came since it was asked for.  Each
        save a node describes comes back as a change of its record: considered one by one,
        a job's thousand small files made a thousand scans of its directory on the event
        loop, each of them longer (minutes of stall); those that queue up while the loop
        is busy are now considered together."""
        jd.consider_soon = False
        if self._jobs.get(jd.job) is jd:  # not closed meanwhile
            self._consider(jd)

    def directory(self, job: str) -> str | None:
        jd = self._jobs.get(job)
        return jd.path if jd is not None else None

    # -- noticing saves -----------------------------------------------------------------------

    def _changed(self, change: Change) -> None:
        if change.mask & IN_Q_OVERFLOW:
            for each in list(self._jobs.values()):
                self._rescan(each)
            return
        jd = self._owner(change.directory)
        if jd is None:
            return
        if change.directory == jd.path:  # an entry of the job's directory
            if change.name.startswith("."):
                return
            entry = os.path.join(jd.path, change.name)
            if change.is_dir and change.mask & (IN_CREATE | IN_MOVED_TO):
                self._watch(jd, entry)
                jd.first_seen.setdefault(change.name, self._clock())
                self._consider(jd)
            elif change.mask & (IN_DELETE | IN_MOVED_FROM):  # deleted, or renamed away
                jd.spoiled.discard(change.name)  # a directory made again is a new checkpoint
                self._forget(jd, change.name)
            elif not change.is_dir and change.mask & (IN_CLOSE_WRITE | IN_MOVED_TO):
                self._land_file(jd, change.name)
            elif not change.is_dir and change.mask & IN_CREATE:
                jd.first_seen[change.name] = self._clock()
        elif change.name == cp.METADATA and change.mask & (IN_MOVED_TO | IN_CLOSE_WRITE):
            self._consider(jd)
        elif change.mask & IN_CLOSE_WRITE and not change.name.startswith("."):
            self._written_into(jd, os.path.basename(change.directory))
        elif change.mask & IN_CREATE:
            jd.first_seen.setdefault(os.path.basename(change.directory), self._clock())

    def _written_into(self, jd: JobDir, name: str) -> None:
        """A file of checkpoint ``name`` was written.  Before its share is described that is
        the save itself; after (or once the daemon put it in place), the job is saving into
        it again: its manifest no longer says what is there, and a restore would mix this
        node's new files with the other nodes' old ones (or their copies).  So it is not a
        checkpoint here any more, and its name is not taken up again: DCP overwrites each
        file in place, so no moment tells the new save whole from a mix."""
        if name in jd.spoiled or not (name in jd.manifests or name in jd.placed):
            return
        jd.spoiled.add(name)
        log.warning(
            "job %s: checkpoint %s was saved into again: it is no longer restored (a "
            "checkpoint's name is not reused: save each under a new one, as step_N, or delete "
            "the old one first)",
            jd.job,
            name,
            extra=about(jd.job),
        )
        self._forget(jd, name)

    def _owner(self, directory: str) -> JobDir | None:
        for jd in self._jobs.values():
            if directory == jd.path or os.path.dirname(directory) == jd.path:
                return jd
        return None

    def _watch(self, jd: JobDir, directory: str) -> None:
        if self._watcher is None:
            self._watcher = Watcher(self._changed)
        if self._watcher.watching(jd.path) >= _MAX_WATCHED:
            if not jd.watches_spent:
                jd.watches_spent = True
                log.warning(
                    "job %s: %d directories of checkpoints watched, no more: a checkpoint "
                    "saved into another is noticed only when another change is",
                    jd.job,
                    _MAX_WATCHED,
                    extra=about(jd.job),
                )
            return
        with contextlib.suppress(OSError):
            self._watcher.watch(directory, _WATCHED)

    def _rescan(self, jd: JobDir) -> None:
        """Watch the directory and each checkpoint in it (at open, and after an overflow)."""
        self._watch(jd, jd.path)
        with jd.rights():
            names = _entries(jd.path, dirs=True)
        for name in names:
            self._watch(jd, os.path.join(jd.path, name))
        self._consider(jd)

    def _consider(self, jd: JobDir) -> None:
        """Land each checkpoint this node knows complete and has not described yet; copy
        again what could not be copied; then keep the newest complete one, write it to disk."""
        if jd.frozen:
            return
        with jd.rights():  # its user may have put links anywhere in it
            found = jd.found()
            with_metadata = {m.id for m in found if m.metadata and m.round >= jd.round}
            members = set(self._members(jd))
            for name in _entries(jd.path, dirs=True):
                if name in jd.busy or jd.round < 0 or os.path.join(jd.path, name) in jd.deleting:
                    continue  # being landed, no round yet, or pruned (its removal still runs)
                if name in jd.spoiled:
                    continue  # saved into again: never a mix of two saves
                if name in jd.claimed and name not in jd.manifests:
                    continue  # its workers tell when their files are whole (``saved``)
                own = jd.manifests.get(name)
                local_metadata = os.path.exists(os.path.join(jd.path, name, cp.METADATA))
                # one put in place here is an older round's save (unless the job saved
                # again under its name, and another node described that save)
                ours = name not in jd.placed or name in with_metadata
                if own is None and ours and (local_metadata or name in with_metadata):
                    jd.busy[name] = self._spawn(
                        "landing", jd.job, functools.partial(self._land, jd, name)
                    )
                elif (
                    own is not None
                    and self._to_copy(jd, own, members)
                    and self._buddy(jd) is not None
                ):
                    after = jd.retry.get(name, (0, 0.0))[1]
                    if time.monotonic() >= after:
                        jd.busy[name] = self._spawn(
                            "copying", jd.job, functools.partial(self._land, jd, name, again=True)
                        )
            # files a rank wrote that are not copied yet: landed before this node knew the
            # round's members, or their copy failed and its back-off has passed
            now = time.monotonic()
            uncopied = [
                name
                for name, own in jd.manifests.items()
                if own.kind == cp.FILE and name not in jd.busy
                if self._to_copy(jd, own, members)
                if now >= jd.retry.get(name, (0, 0.0))[1]
            ]
            if uncopied and self._buddy(jd) is not None:
                for name in uncopied:
                    jd.busy[name] = self._spawn(
                        "copying", jd.job, functools.partial(self._land_one, jd, name, again=True)
                    )
            self._prune(jd, found)
            self._write_back(jd, found)

    def _to_copy(self, jd: JobDir, own: cp.Manifest, members: set[str]) -> bool:
        """Whether this node's share ``own`` is to be copied (again): it never was, or its
        keeper has been out of the round (it left the job, or was lost) for REKEEP_AFTER.
        Otherwise the share would stay complete on paper with its only copy gone, and
        losing this node next would lose it."""
        keeper = own.copied_to
        if not keeper:
            return True
        if keeper in members and self._peers.alive(keeper):
            jd.keeper_gone.pop(own.id, None)
            return False
        now = time.monotonic()
        since = jd.keeper_gone.setdefault(own.id, now)
        if since == now:
            asyncio.get_running_loop().call_later(REKEEP_AFTER, self._consider_again, jd.job)
        return now - since >= REKEEP_AFTER

    def _consider_again(self, job: str) -> None:
        jd = self._jobs.get(job)
        if jd is not None:
            self._consider(jd)

    def _forget(self, jd: JobDir, name: str, *, was_landing: bool = False) -> None:
        """The script deleted a checkpoint, or renamed it away (a file written to a
        temporary name, then renamed: the temporary name is gone): it is no longer this
        node's to describe."""
        sending = jd.sending.get(name, set())
        jd.let_go(name)
        task = jd.busy.pop(name, None)
        if task is not None:
            task.cancel()
        writing = jd.writing.pop(name, None)
        if writing is not None:  # its files on disk would be of another save than its metadata
            writing.cancel()
        manifest = jd.manifests.pop(name, None)
        if manifest is not None:
            self._publish(jd)
        # its copy may have landed before the rename, on the node its manifest names or the
        # one a landing cut short was copying to (not always the buddy now: the round's
        # members may have changed meanwhile), or landed while its sender failed: it goes
        landing = task is not None or was_landing
        for keeper in sorted(self._keepers(jd, manifest, sending, landing)):
            self._spawn("dropping", jd.job, functools.partial(self._drop_copy, keeper, jd, name))

    def _keepers(
        self, jd: JobDir, manifest: cp.Manifest | None, sending: set[str], landing: bool
    ) -> set[str]:
        """Where copies of this node's share may be: the node its manifest names, each node
        a landing of it was sending to (``sending``), else the buddy, where it was landing."""
        keepers = set(sending)
        if manifest is not None and manifest.copied_to:
            keepers.add(manifest.copied_to)
        if not keepers and (manifest is not None or landing):
            buddy = self._buddy(jd)
            keepers.update([buddy] if buddy else [])
        return keepers

    async def _drop_copy(self, keeper: str, jd: JobDir, name: str) -> None:
        for attempt in range(_DROP_TRIES):
            try:
                await self._peers.drop(keeper, jd.job, name)
                return
            except Exception as exc:  # the keeper is busy, or gone: it drops it at the job's end
                if attempt + 1 == _DROP_TRIES:
                    log.warning(
                        "job %s: %s could not drop its copy of %s: %s",
                        jd.job,
                        keeper,
                        name,
                        exc,
                        extra=about(jd.job),
                    )
                    return
                await back_off(2.0**attempt)

    def _went_away(self, jd: JobDir, name: str) -> None:
        """``name`` was deleted or renamed while it landed: no news.  Forgotten by the task
        that found it gone (taken out of ``busy`` first: forgetting cancels a busy task)."""
        log.debug("job %s: %s went away while it landed", jd.job, name, extra=about(jd.job))
        jd.busy.pop(name, None)
        self._forget(jd, name, was_landing=True)

    # -- landing: describe, hash, copy ----------------------------------------------------------

    def _members(self, jd: JobDir) -> list[str]:
        """The nodes of the round this node's workers are in, by group rank (this node with
        them), as the job's record last said."""
        if jd.record is None:
            return [self.settings.node]
        members = [
            p.node
            for p in sorted(
                jd.record.parts.values(), key=lambda p: (p.group_rank is None, p.group_rank or 0)
            )
            if p.round == jd.round and p.state.active and p.node != "" and p.group_rank is not None
        ]
        if self.settings.node not in members:
            members.append(self.settings.node)
        return members

    def _buddy(self, jd: JobDir) -> str | None:
        """The node that keeps this node's copies: the next member of the round in another
        failure domain."""
        if jd.record is None:
            return None
        members = self._members(jd)
        domains = {node: self._peers.domain(node) for node in members}
        chosen = cp.buddy(self.settings.node, members, domains)
        return chosen if chosen is not None and self._peers.alive(chosen) else None

    async def _land(self, jd: JobDir, name: str, *, again: bool = False) -> None:
        with _running(jd.busy, name):
            try:
                if self._over_node_cap(jd, name):
                    return
                await self._describe(jd, name, again=again)
            except FileNotFoundError:
                self._went_away(jd, name)
                return
        self._consider(jd)

    def _over_node_cap(self, jd: JobDir, name: str) -> bool:
        """Whether this node holds more checkpoints than its cap for all jobs; then the
        checkpoint that just landed is deleted (the one before it stays in force)."""
        cap = self.settings.node_cap
        if not cap or name in jd.manifests:
            return False
        held = sum(_held_bytes(j) for j in self._jobs.values())
        if held <= cap:
            return False
        log.warning(
            "job %s: checkpoint %s refused: this node holds %d bytes of checkpoints, over "
            "its cap of %d (checkpoints.max_memory); the one before it stays in force",
            jd.job,
            name,
            held,
            cap,
            extra=about(jd.job),
        )
        with jd.rights():
            shutil.rmtree(os.path.join(jd.path, name), ignore_errors=True)
        return True

    def full(self, job: str) -> str:
        """Why the job's saves cannot fit here ("" they can): its directory is (nearly) full."""
        jd = self._jobs.get(job)
        if jd is None or not jd.cap:
            return ""
        try:
            info = os.statvfs(jd.path)
        except OSError:
            return ""
        free = info.f_bavail * info.f_frsize
        if free > max(64 * 1024, jd.cap // 100):
            return ""
        return (
            f"its checkpoint directory is full ({jd.cap} bytes: --checkpoint-memory, else "
            "checkpoints.job_memory or checkpoints.max_memory): a save did not fit, and the "
            "checkpoint before it stays in force"
        )

    async def _describe(
        self, jd: JobDir, name: str, kind: str = cp.DCP, *, again: bool = False
    ) -> None:
        """This node's share of checkpoint ``name`` is whole: hash it while streaming it to
        the buddy, then publish its manifest.  Whose share it is: what its workers reported
        (``saved``), else what an earlier description said, else this node's round now.
        ``again``: the share described before, copied again (its copy failed, or its keeper
        left): it keeps the time it was saved, which orders it among the job's checkpoints
        and a file's versions (else an old version re-copied would pass a newer one)."""
        round, world, ranks = _whose(jd, name)
        directory = os.path.join(jd.path, name) if kind == cp.DCP else jd.path
        with jd.rights():
            names = _entries(directory, files=True) if kind == cp.DCP else [name]
        started = self._clock()
        version = _stat_key(jd, name) if kind == cp.FILE else None
        hash_ = jd.as_user(_hash)
        if cp.METADATA in names and name not in jd.manifests:  # rank 0's node: tell at once
            facts = await asyncio.to_thread(hash_, os.path.join(directory, cp.METADATA))
            jd.manifests[name] = cp.Manifest(
                name,
                self.settings.node,
                round,
                world,
                ranks,
                {cp.METADATA: facts},
                started,
                described=False,
            )
            self._publish(jd)
        buddy = self._buddy(jd)
        files: dict[str, cp.FileFacts] = {}
        copied = buddy or ""
        if buddy is not None:
            jd.sending.setdefault(name, set()).add(buddy)
        for file in names:
            path = os.path.join(directory, file)
            if buddy is not None and copied:
                try:
                    with jd.rights():
                        source = _open_regular(path)
                    with source:
                        files[file] = await self._peers.send(buddy, jd.job, name, file, source)
                    continue
                except FileNotFoundError:  # it went away: the caller forgets it
                    raise
                except CheckpointsFull as exc:
                    log.warning(
                        "job %s: checkpoint %s: %s refused its copy of %s: %s",
                        jd.job,
                        name,
                        buddy,
                        file,
                        exc,
                        extra=about(jd.job),
                    )
                    copied = ""
                    jd.refused[name] = (
                        f"its copy to node {buddy} was refused there: the job's checkpoint "
                        f"memory on {buddy} is full (--checkpoint-memory, else "
                        "checkpoints.job_memory or checkpoints.max_memory): a node holds its "
                        "own share, the copy of another's and the one in flight"
                    )
                except Exception as exc:
                    log.warning(
                        "job %s: checkpoint %s: could not copy %s to %s: %s",
                        jd.job,
                        name,
                        file,
                        buddy,
                        exc,
                        extra=about(jd.job),
                    )
                    copied = ""
            files[file] = await asyncio.to_thread(hash_, path)
        done = self._clock()
        if buddy is not None and not copied:  # try again later, backing off, from _consider
            failed = jd.retry.get(name, (0, 0.0))[0] + 1
            pause = min(60.0, 2.0**failed)
            jd.retry[name] = (failed, time.monotonic() + pause)
            asyncio.get_running_loop().call_later(pause, self._consider_again, jd.job)
        else:
            jd.retry.pop(name, None)
            jd.refused.pop(name, None)
        sent = jd.sending.pop(name, set())
        # an earlier landing's copy that went elsewhere goes; not where this copy failed: its
        # drop, tried again while the keeper is unreachable, could come after the retry's copy
        for elsewhere in sorted(sent - {copied} if copied else ()):
            self._spawn("dropping", jd.job, functools.partial(self._drop_copy, elsewhere, jd, name))
        earlier = jd.manifests.get(name)
        saved = earlier.saved if again and earlier is not None else started
        jd.manifests[name] = cp.Manifest(
            name, self.settings.node, round, world, ranks, files, saved, copied, kind=kind
        )
        if version is not None and version == _stat_key(jd, name) and name in files:
            jd.known_files[name] = (version, files[name].sha256)  # unchanged while hashed
        self._metrics.checkpoint_saved(
            done - jd.first_seen.get(name, started), done - started if copied else None
        )
        self._publish(jd)

    def _land_file(self, jd: JobDir, name: str) -> None:
        """A file a rank wrote itself, closed: its own checkpoint."""
        if not cp.valid_name(name) or jd.round < 0 or jd.frozen:
            return
        known = jd.known_files.get(name)
        if known is not None and _stat_key(jd, name) == known[0]:
            return  # the version this node put in place (or described) itself: no news
        task = jd.busy.pop(name, None)
        if task is not None:
            task.cancel()  # a newer version came: describe that one
        jd.busy[name] = self._spawn("landing", jd.job, functools.partial(self._land_one, jd, name))

    async def _land_one(self, jd: JobDir, name: str, *, again: bool = False) -> None:
        with _running(jd.busy, name):
            try:
                await self._describe(jd, name, cp.FILE, again=again)
            except FileNotFoundError:
                self._went_away(jd, name)

    def _publish(self, jd: JobDir) -> None:
        kept = cp.kept(jd.manifests.values())
        self._post(ev.CheckpointsChanged(jd.job, tuple(m.to_json() for m in kept)))
        self._metrics.checkpoint_held(jd.job, _held_bytes(jd))
        _changed(jd)

    # -- keeping the newest, dropping the rest --------------------------------------------------

    def _prune(self, jd: JobDir, found: list[cp.Manifest]) -> None:
        """Checkpoints older than the newest complete one go, here, in the copies kept and in
        the byte ranges fetched for a reader."""
        _forget_fetched(jd, cp.latest_complete(found))
        local = _entries(jd.path, dirs=True)
        copies = {
            (owner, name)
            for owner in _entries(os.path.join(jd.path, COPIES), dirs=True)
            for name in _entries(os.path.join(jd.path, COPIES, owner), dirs=True)
        }
        fetched = _entries(os.path.join(jd.path, RANGES), dirs=True)
        old = cp.to_delete(local + [n for _, n in copies] + fetched, found, [*jd.busy, *jd.writing])
        self._prune_orphans(jd, found, copies)
        doomed = [
            path
            for path in (
                *(os.path.join(jd.path, name) for name in local),
                *(os.path.join(jd.path, COPIES, o, n) for o, n in copies),
                *(os.path.join(jd.path, RANGES, name) for name in fetched),
            )
            if os.path.basename(path) in old and path not in jd.deleting
        ]
        if not doomed:
            return
        gone = {os.path.basename(path) for path in doomed}
        jd.deleting.update(doomed)
        self._spawn("pruning", jd.job, functools.partial(self._remove, jd, doomed))
        for name in gone:  # nothing kept of a pruned checkpoint, its copy's back-off too
            jd.let_go(name)
        dropped = [jd.manifests.pop(name) for name in sorted(gone) if name in jd.manifests]
        if dropped:
            self._publish(jd)  # only when this node's own shares changed: no echo loop

    def _prune_orphans(
        self, jd: JobDir, found: list[cp.Manifest], copies: set[tuple[str, str]]
    ) -> None:
        """Copies no manifest names any more (their owner deleted them, and its drop never
        came) go once older than the newest complete checkpoint; files no sender sends any
        more first."""
        landing = self._still_landing(jd)
        landed = {}
        for owner, name in copies:
            with contextlib.suppress(OSError):  # its time: when its last file began or sealed
                landed[owner, name] = os.lstat(os.path.join(jd.path, COPIES, owner, name)).st_mtime
        doomed = [
            path
            for owner, name in cp.orphaned(landed, found, landing)
            if (path := os.path.join(jd.path, COPIES, owner, name)) not in jd.deleting
        ]
        if not doomed:
            return
        log.info(
            "job %s: deleting copies no manifest names, older than the newest complete "
            "checkpoint: %s",
            jd.job,
            ", ".join(sorted(os.path.relpath(p, os.path.join(jd.path, COPIES)) for p in doomed)),
            extra=about(jd.job),
        )
        jd.deleting.update(doomed)
        self._spawn("pruning", jd.job, functools.partial(self._remove, jd, doomed))

    def _still_landing(self, jd: JobDir) -> set[tuple[str, str]]:
        """The copies (owner, checkpoint) with a file landing here now; a file that got no
        chunk for ``_LANDING_IDLE`` is dropped, its partial file too."""
        now = time.monotonic()
        with self._landing:
            mine = [key for key in self._receiving if key[1] == jd.job]
            for key in mine:
                if now - self._receiving[key][2] < _LANDING_IDLE:
                    continue
                del self._receiving[key]
                owner, _, ckpt, name = key
                copy = _copy_path(jd.path, owner, ckpt, name)
                log.info(
                    "job %s: %s sent no more of %s/%s for %.0f s: its partial copy is dropped",
                    jd.job,
                    owner,
                    ckpt,
                    name,
                    _LANDING_IDLE,
                    extra=about(jd.job),
                )
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(_partial(copy))
                with contextlib.suppress(OSError):  # gone with it, unless other files landed
                    os.rmdir(os.path.dirname(copy))
            return {(key[0], key[2]) for key in self._receiving if key[1] == jd.job}

    async def _remove(self, jd: JobDir, paths: list[str]) -> None:
        try:
            await _remove_all(jd, paths)
        finally:
            jd.deleting.difference_update(paths)

    # -- the job's disk -------------------------------------------------------------------------

    def _write_back(self, jd: JobDir, found: list[cp.Manifest]) -> None:
        """Complete checkpoints go to ``--checkpoint-dir`` as the job's user: each node its
        data files; the node with DCP's metadata writes it last, once every node's files
        are there, so that a metadata file on disk means a whole checkpoint."""
        target = jd.spec.checkpoint_dir
        if not target:
            return
        for checkpoint in cp.checkpoints(found):
            own = jd.manifests.get(checkpoint.id)
            if not checkpoint.complete or own is None or own.on_disk:
                continue
            if checkpoint.id in jd.writing:
                continue
            others_done = all(
                m.on_disk for node, m in checkpoint.shares.items() if node != self.settings.node
            )
            if checkpoint.id in jd.data_on_disk and not (own.metadata and others_done):
                continue
            jd.writing[checkpoint.id] = self._spawn(
                "writing to disk",
                jd.job,
                functools.partial(self._to_disk, jd, checkpoint, others_done),
            )

    async def _to_disk(self, jd: JobDir, checkpoint: cp.Checkpoint, others_done: bool) -> None:
        ident, target = checkpoint.id, jd.spec.checkpoint_dir
        own = jd.manifests.get(ident)
        if own is None:  # pruned meanwhile: a newer one is complete
            jd.writing.pop(ident, None)
            return
        with _running(jd.writing, ident):
            before: list[str] = []
            if checkpoint.kind == cp.FILE:
                plan = [(os.path.join(jd.path, ident), os.path.join(target, ident))]
            else:
                source = os.path.join(jd.path, ident)
                data = [f for f in own.files if f != cp.METADATA]
                plan = []
                if ident not in jd.data_on_disk:
                    plan = [(os.path.join(source, f), os.path.join(target, ident, f)) for f in data]
                    # a save under a name already on disk: its old metadata goes first, so
                    # that the directory is never read as a mix of the two saves
                    before = [os.path.join(target, ident, cp.METADATA)]
                if own.metadata and others_done:
                    plan.append(
                        (
                            os.path.join(source, cp.METADATA),
                            os.path.join(target, ident, cp.METADATA),
                        )
                    )
            metadata_now = checkpoint.kind == cp.FILE or any(
                dst.endswith(cp.METADATA) for _, dst in plan
            )
            remove = []
            if metadata_now and checkpoint.kind == cp.DCP:
                whole = [*(i for i in jd.on_disk if i != ident), ident]
                keep = max(1, jd.spec.keep_checkpoints)
                remove = [os.path.join(target, old) for old in whole[:-keep]]
            failure = await _as_user(jd.spec, {"before": before, "copy": plan, "remove": remove})
            if failure:
                log.warning(
                    "job %s: checkpoint %s not written to %s: %s",
                    jd.job,
                    ident,
                    target,
                    failure,
                    extra=about(jd.job),
                )
                return
            jd.data_on_disk.add(ident)
            if ident not in jd.manifests:
                return
            if metadata_now or not own.metadata:
                if checkpoint.kind == cp.DCP and metadata_now:
                    jd.on_disk = [*[i for i in jd.on_disk if i != ident], ident][
                        -max(1, jd.spec.keep_checkpoints) :
                    ]
                jd.manifests[ident] = replace(jd.manifests[ident], on_disk=True)
                since = jd.first_seen.get(ident, jd.manifests[ident].saved)
                self._metrics.checkpoint_on_disk(self._clock() - since)
                self._publish(jd)
        self._consider(jd)

    # -- before a restarted round's workers read ----------------------------------------------

    async def prepare(
        self,
        job: str,
        record: JobRecord | None,
        members: tuple[str, ...] = (),
        checkpoint: cp.Holding | None = None,
    ) -> str:
        """Put the newest complete checkpoint (and every file a rank wrote itself) in place
        here and delete the DCP saves that were cut off.  What this node lacks is fetched
        from the round's ``members`` first: a holder left out of the round may be the node
        just lost, which the cluster may not know yet (a fetch from it would wait for the
        transfer's timeout).  ``checkpoint``: the newest one the round's members declared
        they hold, joining it, which every member restores (waiting, at most AGREE_WAIT,
        for the records that show it complete here; after that the job cannot go on: a
        member restoring another would have the ranks load different steps).  Returns ""
        or why the job cannot go on from any checkpoint."""
        jd = self._jobs.get(job)
        if jd is None:
            return ""
        self._warn_if_full(jd)
        buddy = self._buddy(jd)  # where the saves cancelled below were being copied to
        if record is not None:
            jd.record = record
        _freeze(jd)  # the workers are stopped: the saves landing are torn
        copying, jd.cut_short = jd.cut_short, set()
        chosen = None
        if checkpoint is not None:
            chosen = await self._agreed(jd, checkpoint)
            if chosen is None:
                return (
                    f"the round agreed to restore checkpoint {checkpoint.checkpoint} (saved in "
                    f"round {checkpoint.round}, the newest a member holds), and this node's "
                    f"records did not show it complete within {AGREE_WAIT:.0f} s: restoring "
                    "another here would have the ranks load different steps"
                )
        found = jd.found()
        with jd.rights():
            cut = cp.torn(_entries(jd.path, dirs=True), found, chosen)
        for name in cut:
            manifest = jd.manifests.pop(name, None)
            jd.claimed.pop(name, None)
            # its copy goes too: deleting it here tells no one (its manifest is gone first);
            # the buddy as it was before the record above (some of its files may be there)
            sending = jd.sending.pop(name, set())
            if name in copying and not sending and buddy:
                sending = {buddy}
            for keeper in sorted(self._keepers(jd, manifest, sending, name in copying)):
                if self._peers.alive(keeper):  # a lost keeper's copies went with it
                    self._spawn(
                        "dropping", jd.job, functools.partial(self._drop_copy, keeper, jd, name)
                    )
        doomed = [os.path.join(jd.path, name) for name in cut]
        jd.deleting.update(doomed)  # not landed again while they go (a record may come)
        await self._remove(jd, doomed)
        if cut:
            log.info(
                "job %s: deleted checkpoints cut off by the failure: %s",
                job,
                ", ".join(sorted(cut)),
                extra=about(job),
            )
            self._publish(jd)
        for each in cp.restored(found, chosen):
            failure = await self._put_in_place(jd, each, members)
            if failure:
                return failure
        return ""

    async def _agreed(self, jd: JobDir, holding: cp.Holding) -> cp.Checkpoint | None:
        """The checkpoint the round agreed on, once this node's records show it complete (a
        member that declared it saw it complete: the others' records come); None where they
        do not within AGREE_WAIT."""
        agreed = functools.partial(cp.agreed, holding=holding)
        if await _until(jd, lambda: agreed(jd.found()) is not None, AGREE_WAIT):
            return agreed(jd.found())
        return None

    async def _put_in_place(
        self, jd: JobDir, checkpoint: cp.Checkpoint, members: tuple[str, ...]
    ) -> str:
        directory = os.path.join(jd.path, checkpoint.id) if checkpoint.kind == cp.DCP else jd.path
        with jd.rights():
            have = _sizes(directory)
        lacking = cp.missing(checkpoint, have)
        if checkpoint.kind == cp.FILE:  # its name is every version's: the size tells none
            for name, facts in checkpoint.files().items():
                known = jd.known_files.get(name)
                if known != (_stat_key(jd, name), facts.sha256):
                    lacking[name] = facts
        elif lacking:
            jd.placed.add(checkpoint.id)  # other nodes' save: never described as this one's
        for name, facts in sorted(lacking.items()):
            dest = os.path.join(directory, name)
            failure = await self._obtain(jd, checkpoint, name, facts, dest, members)
            if failure:
                return failure
            if checkpoint.kind == cp.FILE:  # before its rename's event is read: no await since
                _note_version(jd, name, facts.sha256)
        if lacking:
            self._metrics.checkpoint_held(jd.job, _held_bytes(jd))
        return ""

    async def _obtain(
        self,
        jd: JobDir,
        checkpoint: cp.Checkpoint,
        name: str,
        facts: cp.FileFacts,
        dest: str,
        members: tuple[str, ...],
    ) -> str:
        """One file of ``checkpoint``: from this node's copies, from a node that holds it
        (the round's members first), or from the job's disk; checked against its manifest's
        size and SHA-256 each time."""
        owner = next(node for node, m in checkpoint.shares.items() if name in m.files)
        tried: list[str] = []
        for holder in cp.fetch_order(checkpoint.holders(name), self.settings.node, members):
            partial = _partial(dest)
            try:
                if holder == self.settings.node:
                    source = _copy_path(jd.path, owner, checkpoint.id, name)
                    with jd.rights():
                        here = os.path.lexists(source)
                    if not here:
                        tried.append(f"{holder}: not here")
                        continue
                    place: Callable[[str, str], cp.FileFacts] = _copy
                    if checkpoint.kind == cp.DCP:
                        place = functools.partial(_link, landed=facts.sha256)
                    got = await asyncio.to_thread(jd.as_user(place), source, partial)
                    where = "copy"
                elif self._peers.alive(holder):
                    with jd.rights():
                        os.makedirs(os.path.dirname(dest), exist_ok=True)
                        fd = _create(partial)
                    try:
                        fetched = await self._peers.fetch(
                            holder, jd.job, owner, checkpoint.id, name, fd, size=facts.size
                        )
                    finally:
                        os.close(fd)
                    assert fetched is not None  # the whole file: what was written, hashed
                    got, where = fetched, "memory" if holder == owner else "copy"
                else:
                    tried.append(f"{holder}: lost")
                    continue
                why = self._check_into_place(jd, partial, dest, facts, got)
                if why:
                    tried.append(f"{holder}: {why}")
                    continue
                self._metrics.checkpoint_restored(where, facts.size)
                return ""
            except Exception as exc:
                tried.append(f"{holder}: {exc}")
            finally:
                with jd.rights(), contextlib.suppress(FileNotFoundError):
                    os.unlink(partial)
        disk = jd.spec.checkpoint_dir
        if disk and checkpoint.on_disk:
            on_disk = (
                os.path.join(disk, checkpoint.id, name)
                if checkpoint.kind == cp.DCP
                else os.path.join(disk, name)
            )
            partial = _partial(dest)
            failure = await _as_user(jd.spec, {"copy": [[on_disk, partial]]})
            if not failure:
                try:
                    got = await asyncio.to_thread(jd.as_user(_hash), partial)
                except OSError as exc:
                    failure = str(exc)
            why = failure or self._check_into_place(jd, partial, dest, facts, got)
            with jd.rights(), contextlib.suppress(FileNotFoundError):
                os.unlink(partial)
            if not why:
                self._metrics.checkpoint_restored("disk", facts.size)
                return ""
            tried.append(f"disk {on_disk}: {why}")
        else:
            tried.append("not on disk" + ("" if disk else " (no --checkpoint-dir)"))
        return (
            f"checkpoint {checkpoint.id} (saved in round {checkpoint.round} by "
            f"{checkpoint.world} ranks) cannot be restored: its file {name}, written on "
            f"{owner}, is nowhere whole: {'; '.join(tried)}"
        )

    def _check_into_place(
        self, jd: JobDir, partial: str, dest: str, facts: cp.FileFacts, got: cp.FileFacts
    ) -> str:
        """Check a file (``got``: the size and SHA-256 of the bytes written to ``partial``)
        against its manifest, then put it in place (made with its user's rights: theirs)."""
        if got.size != facts.size:
            return f"refused: {got.size} bytes, its manifest says {facts.size} (truncated?)"
        if got.sha256 != facts.sha256:
            return "refused: its SHA-256 is not its manifest's (damaged or forged)"
        with jd.rights():
            os.chmod(partial, 0o600)
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            os.replace(partial, dest)
        return ""

    # -- what other nodes send and ask ------------------------------------------------------------

    def receive(
        self,
        peer: str,
        job: str,
        ckpt: str,
        name: str,
        offset: int,
        data: bytes,
        seal: cp.FileFacts | None,
    ) -> None:
        """A chunk of ``peer``'s file ``ckpt/name``, kept as a copy of its share (in order);
        with ``seal``, the last: the whole file's size and SHA-256, checked, then it is kept
        under its name.  Raises ValueError on anything else."""
        jd = self._jobs.get(job)
        if jd is None:
            raise ValueError(f"job {job} has no checkpoints here")
        if not (cp.valid_name(ckpt) and cp.valid_name(name) and cp.valid_name(peer)):
            raise ValueError("bad checkpoint, file or node name")
        with self._landing, jd.rights():  # the copies are kept in the job's directory, its user's
            if self._jobs.get(job) is not jd:  # closed meanwhile: its tmpfs is going
                raise ValueError(f"job {job} has no checkpoints here")
            directory = os.path.dirname(_copy_path(jd.path, peer, ckpt, name))
            partial = os.path.join(directory, f".{name}.partial")
            key = (peer, job, ckpt, name)
            if offset == 0:
                os.makedirs(directory, mode=0o700, exist_ok=True)
                self._receiving[key] = (hashlib.sha256(), 0, time.monotonic())
                mode = "wb"
            else:
                mode = "ab"
            digest, size, _ = self._receiving.get(key, (None, -1, 0.0))
            if digest is None or size != offset:
                self._receiving.pop(key, None)
                raise ValueError(f"{ckpt}/{name}: a chunk at {offset} out of order")
            with open(partial, mode, opener=_regular) as f:
                f.write(data)
            digest.update(data)
            self._receiving[key] = (digest, offset + len(data), time.monotonic())
            if seal is None:
                return
            del self._receiving[key]
            if offset + len(data) != seal.size or digest.hexdigest() != seal.sha256:
                os.unlink(partial)
                raise ValueError(f"{ckpt}/{name}: its size or SHA-256 is not what was sent")
            os.replace(partial, os.path.join(directory, name))

    def drop(self, peer: str, job: str, ckpt: str) -> None:
        """``peer`` deleted its checkpoint ``ckpt`` (or renamed it away): the copy kept here,
        whole or still landing, goes.  Raises ValueError on a bad name or an unknown job."""
        jd = self._jobs.get(job)
        if jd is None:
            raise ValueError(f"job {job} has no checkpoints here")
        if not (cp.valid_name(ckpt) and cp.valid_name(peer)):
            raise ValueError("bad checkpoint or node name")
        with self._landing:
            if self._jobs.get(job) is not jd:  # closed meanwhile
                raise ValueError(f"job {job} has no checkpoints here")
            for key in [k for k in self._receiving if k[:3] == (peer, job, ckpt)]:
                del self._receiving[key]
            with jd.rights():
                shutil.rmtree(os.path.dirname(_copy_path(jd.path, peer, ckpt, ckpt)), True)

    def read(self, job: str, owner: str, ckpt: str, name: str, offset: int, length: int) -> bytes:
        """Bytes of ``owner``'s file ``ckpt/name`` as this node holds it (its own, or a copy)."""
        path, jd = self._held(job, owner, ckpt, name)
        with jd.rights(), _open_regular(path) as f:
            f.seek(offset)
            return f.read(length)

    def size(self, job: str, owner: str, ckpt: str, name: str) -> int:
        path, jd = self._held(job, owner, ckpt, name)
        with jd.rights(), _open_regular(path) as f:
            return os.fstat(f.fileno()).st_size

    def _held(self, job: str, owner: str, ckpt: str, name: str) -> tuple[str, JobDir]:
        jd = self._jobs.get(job)
        if jd is None:
            raise ValueError(f"job {job} has no checkpoints here")
        if not all(cp.valid_name(n) for n in (ckpt, name, owner)):
            raise ValueError("bad checkpoint, file or node name")
        if owner != self.settings.node:
            return _copy_path(jd.path, owner, ckpt, name), jd
        if ckpt == name:
            return os.path.join(jd.path, name), jd
        return os.path.join(jd.path, ckpt, name), jd

    # -- what the job's workers ask (elasticd.elastic's reader) --------------------------------

    async def _serve_workers(self, jd: JobDir) -> None:
        """The job's socket in its directory (its user's alone, as the directory is): JSON
        lines, one answer each.  ``latest``: the newest complete checkpoint (its files and
        sizes, those already here); ``fetch``: byte ranges of its files this node lacks,
        put at their offsets into RANGES/<id>/<file> here (sparse), where the reader reads."""
        path = os.path.join(jd.path, TIER_SOCKET)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            with jd.rights():  # made by its user: theirs
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                listener.bind(path)
                os.chmod(path, 0o600)
        except BaseException:
            listener.close()
            raise
        jd.server = await asyncio.start_unix_server(
            functools.partial(self._worker, jd), sock=listener, limit=_MAX_REQUEST
        )
        async with jd.server:
            await jd.server.serve_forever()

    async def _worker(
        self, jd: JobDir, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        try:
            while line := await reader.readline():
                try:
                    request = json.loads(line)
                    answer = await self._answer_worker(jd, request)
                except (ValueError, KeyError, TypeError, OSError) as exc:
                    answer = {"ok": False, "error": str(exc)[:500]}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    async def _answer_worker(self, jd: JobDir, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "saving":
            self._saving(jd, request)
            return {"ok": True}
        if op == "saved":
            self._saved(jd, request)
            return {"ok": True}
        if op == "wait":
            complete = await self._wait(jd, request)
            refused = "" if complete else jd.refused.get(_checkpoint_name(request), "")
            return {"ok": True, "complete": complete} | ({"refused": refused} if refused else {})
        latest = cp.latest_complete(jd.found())
        if request.get("op") == "latest":
            if latest is None:
                return {"ok": True, "checkpoint": None}
            with jd.rights():
                here = _sizes(os.path.join(jd.path, latest.id))
            files = {name: f.size for name, f in latest.files().items()}
            return {
                "ok": True,
                "checkpoint": {
                    "id": latest.id,
                    "round": latest.round,
                    "world": latest.world,
                    "files": files,
                    "here": sorted(n for n, size in files.items() if here.get(n) == size),
                },
            }
        if request.get("op") != "fetch":
            raise ValueError(f"unknown op {request.get('op')!r}")
        ident, ranges = request["id"], request["ranges"]
        if latest is None or latest.id != ident:
            raise ValueError(f"{ident} is not the newest complete checkpoint")
        if not isinstance(ranges, list) or len(ranges) > _MAX_RANGES:
            raise ValueError("ranges must be a list of [file, offset, length]")
        wanted: dict[str, list[tuple[int, int]]] = {}
        facts_of = latest.files()
        for item in ranges:
            if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
                raise ValueError(f"no such range: {str(item)[:100]}")
            name, offset, length = item
            facts = facts_of.get(name)
            if (
                facts is None
                or not all(type(n) is int for n in (offset, length))
                or not (0 <= offset and 0 < length and offset + length <= facts.size)
            ):
                raise ValueError(f"no such range: {str(item)[:100]}")
            wanted.setdefault(name, []).append((offset, length))
        paths = {}
        for name, spans in wanted.items():
            if request.get("here_only") is True:  # no transfer: the reader reads these first
                held = self._held_here(jd, latest, name)
                if held is not None:
                    paths[name] = held
            else:
                paths[name] = await self._ranges(jd, latest, name, spans)
        return {"ok": True, "paths": paths}

    def _saving(self, jd: JobDir, request: Mapping[str, Any]) -> None:
        """A worker writes checkpoint ``id`` now: its share waits for the workers' reports."""
        ident = _checkpoint_name(request)
        with jd.rights():  # not a link's target: the job's user may put one there
            is_dir = os.path.isdir(os.path.join(jd.path, ident))
        if not is_dir:
            raise ValueError(f"{ident} is not a directory of the job's checkpoints")
        if ident in jd.manifests or ident in jd.busy or ident in jd.claimed:
            return
        pending = [name for name in jd.claimed if name not in jd.manifests]
        if len(pending) >= _MAX_CLAIMED:
            raise ValueError(f"{len(pending)} checkpoints are being saved already")
        jd.claimed[ident] = {}

    def _saved(self, jd: JobDir, request: Mapping[str, Any]) -> None:
        """A worker's files of checkpoint ``id`` are whole: once every worker of this node in
        that round told, the share is described as theirs (round, world, ranks)."""
        ident = _checkpoint_name(request)
        files = request.get("files")
        if not (isinstance(files, list) and 0 < len(files) <= cp.MAX_FILES):
            raise ValueError("files must list the files this worker wrote")
        if not all(isinstance(f, str) and cp.valid_name(f) for f in files):
            raise ValueError("bad file name")
        round, world, rank, local = (
            _count(request, "round"),
            _count(request, "world"),
            _count(request, "rank"),
            _count(request, "local_world"),
        )
        if not (0 < world and rank < world and 0 < local <= min(world, _MAX_LOCAL)):
            raise ValueError("rank, world or local_world out of range")
        with jd.rights():
            missing = [f for f in files if not os.path.isfile(os.path.join(jd.path, ident, f))]
        if missing:
            raise ValueError(f"{ident}/{missing[0]} is not there")
        if ident not in jd.claimed:
            self._saving(jd, request)
        reports = jd.claimed[ident]
        if rank not in reports and len(reports) >= local:
            raise ValueError(f"{ident}: more reports than the {local} workers of the node")
        report = Report(round, world, rank, local, tuple(files))
        if any(
            (r.round, r.world, r.local_world) != (round, world, local) for r in reports.values()
        ):
            raise ValueError(f"{ident}: reports of different rounds or worlds")
        reports[rank] = report
        if len(reports) < local or ident in jd.manifests or ident in jd.busy:
            return
        jd.first_seen.setdefault(ident, self._clock())
        jd.busy[ident] = self._spawn("landing", jd.job, functools.partial(self._land, jd, ident))

    async def _wait(self, jd: JobDir, request: Mapping[str, Any]) -> bool:
        """Whether checkpoint ``id`` is complete or a newer one is, once it is or after
        ``timeout`` seconds (at most 600)."""
        ident = _checkpoint_name(request)
        timeout = request.get("timeout", 0)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0:
            raise ValueError("timeout must be a number of seconds")
        if jd.waits >= _MAX_WAITS:
            raise ValueError(f"{jd.waits} waits of this job's workers already")
        jd.waits += 1
        try:
            return await self._wait_for(jd, ident, min(float(timeout), 600.0))
        finally:
            jd.waits -= 1

    async def _wait_for(self, jd: JobDir, ident: str, timeout: float) -> bool:
        await _until(
            jd,
            lambda: (
                _complete_or_newer(jd.found(), ident)
                or self._jobs.get(jd.job) is not jd
                or ident in jd.refused
            ),
            timeout,
        )
        return _complete_or_newer(jd.found(), ident)

    async def _ranges(
        self, jd: JobDir, checkpoint: cp.Checkpoint, name: str, spans: list[tuple[int, int]]
    ) -> str:
        """Where the reader finds ``spans`` of ``name``: the whole file here, or a sparse
        file they were fetched into from a node that holds it."""
        here = self._held_here(jd, checkpoint, name)
        if here is not None:
            return here
        owner = next(node for node, m in checkpoint.shares.items() if name in m.files)
        into = os.path.join(jd.path, RANGES, checkpoint.id, name)
        facts = checkpoint.files()[name]
        key = (checkpoint.id, name, facts.sha256)  # a name the job reused is another file
        have = jd.fetched.get(key, [])
        lacking = _subtract(spans, have)
        if lacking and jd.fetched_spans + len(lacking) > _MAX_FETCHED:
            # so many spans apart: the whole file's gaps now, and it is one span again
            lacking = _subtract([(0, facts.size)], have)
        if lacking:
            with jd.rights():  # made by its user: theirs
                os.makedirs(os.path.dirname(into), exist_ok=True)
                fd = _regular(into, os.O_WRONLY | os.O_CREAT)
            try:
                holder = await self._fetch_ranges(jd, checkpoint, owner, name, fd, lacking)
            finally:
                os.close(fd)
            before = jd.fetched.get(key, [])
            jd.fetched[key] = _merge([*before, *lacking])
            jd.fetched_spans += len(jd.fetched[key]) - len(before)
            self._metrics.checkpoint_restored(
                "memory" if holder == owner else "copy", sum(length for _, length in lacking)
            )
        return into

    def _held_here(self, jd: JobDir, checkpoint: cp.Checkpoint, name: str) -> str | None:
        """``name`` whole in this node's directory, or the copy kept here; None."""
        whole = os.path.join(jd.path, checkpoint.id, name)
        owner = next(node for node, m in checkpoint.shares.items() if name in m.files)
        copy = _copy_path(jd.path, owner, checkpoint.id, name)
        with jd.rights():
            if _sizes(os.path.dirname(whole)).get(name) == checkpoint.files()[name].size:
                return whole
            if os.path.exists(copy):
                return copy
        return None

    async def _fetch_ranges(
        self,
        jd: JobDir,
        checkpoint: cp.Checkpoint,
        owner: str,
        name: str,
        fd: int,
        lacking: list[tuple[int, int]],
    ) -> str:
        """Fetch ``lacking`` of ``name`` into ``fd`` from a node that holds it; which."""
        errors = []
        # the round's members first: a holder left out of it may be the node just lost,
        # which the cluster may not know yet (a fetch from it waits until it does)
        members = self._members(jd)
        for holder in cp.fetch_order(checkpoint.holders(name), self.settings.node, members):
            if holder == self.settings.node or not self._peers.alive(holder):
                continue
            try:
                await self._peers.fetch(holder, jd.job, owner, checkpoint.id, name, fd, lacking)
                return holder
            except Exception as exc:
                errors.append(f"{holder}: {exc}")
        raise OSError(f"no node holding {checkpoint.id}/{name} answers: {errors}")

    def holding(self, job: str) -> cp.Holding | None:
        """What this node holds of ``job``'s newest complete checkpoint (None: nothing)."""
        jd = self._jobs.get(job)
        return None if jd is None else cp.holding(jd.found(), self.settings.node)

    # -- what status shows ---------------------------------------------------------------------

    def held(self, job: str) -> dict[str, Any] | None:
        jd = self._jobs.get(job)
        if jd is None:
            return None
        return {"bytes": _held_bytes(jd), "cap": jd.cap, "memory": jd.mounted}


def _freeze(jd: JobDir) -> None:
    """Nothing lands or is pruned in ``jd`` until its next round; the landings running now
    are cut short (noted in ``cut_short``: their copies may have begun to land)."""
    jd.frozen = True
    jd.cut_short.update(jd.busy)
    for task in jd.busy.values():
        task.cancel()
    jd.busy.clear()


async def _until(jd: JobDir, done: Callable[[], bool], timeout: float) -> bool:
    """Whether ``done()`` holds, looked at again at each change of ``jd`` (``_changed``)
    for at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not done():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(jd.changed.wait(), left)
    return True


@contextlib.contextmanager
def _running(tasks: dict[str, asyncio.Future[None]], name: str) -> Iterator[None]:
    """A task of ``name`` in ``tasks`` (``jd.busy``: landing it; ``jd.writing``: writing it
    to disk): once it ends it leaves ``tasks``, unless it was cancelled.  Whoever cancels one
    takes it out first, and may have put a newer one there (a newer version of the file):
    popped by the cancelled one, the newer one would run untracked, and a rename could no
    longer stop it."""
    cancelled = False
    try:
        yield
    except asyncio.CancelledError:
        cancelled = True
        raise
    finally:
        if not cancelled:
            tasks.pop(name, None)


def _changed(jd: JobDir) -> None:
    """Wake the workers waiting for a checkpoint of ``jd`` to complete."""
    jd.changed.set()
    jd.changed = asyncio.Event()


def _whose(jd: JobDir, name: str) -> tuple[int, int, tuple[int, ...]]:
    """The round, world and ranks a share of checkpoint ``name`` belongs to."""
    reports = jd.claimed.get(name)
    if reports:
        first = next(iter(reports.values()))
        return first.round, first.world, tuple(sorted(reports))
    if name in jd.manifests:
        known = jd.manifests[name]
        return known.round, known.world, known.ranks
    return jd.round, jd.world, jd.ranks


def _complete_or_newer(found: list[cp.Manifest], ident: str) -> bool:
    ordered = cp.checkpoints(found)
    position = {c.id: i for i, c in enumerate(ordered)}
    done = [position[c.id] for c in ordered if c.complete and c.kind == cp.DCP]
    return bool(done) and ident in position and max(done) >= position[ident]


def _forget_fetched(jd: JobDir, latest: cp.Checkpoint | None) -> None:
    """Forget what was fetched of any file but the newest complete checkpoint's: a reader is
    given only those, and the others' ranges are pruned (or are a file the name was before)."""
    if not jd.fetched:
        return
    files = {} if latest is None else latest.files()
    jd.fetched = {
        key: spans
        for key, spans in jd.fetched.items()
        if latest is not None
        and key[0] == latest.id
        and key[1] in files
        and files[key[1]].sha256 == key[2]
    }
    jd.fetched_spans = sum(map(len, jd.fetched.values()))


def _checkpoint_name(request: Mapping[str, Any]) -> str:
    ident = request.get("id")
    if not (isinstance(ident, str) and cp.valid_name(ident) and ident != cp.METADATA):
        raise ValueError(f"bad checkpoint name {ident!r}")
    return ident


def _count(request: Mapping[str, Any], key: str) -> int:
    value = request.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        raise ValueError(f"{key} must be a count")
    return value


async def _then(work: Callable[[], Awaitable[None]], done: asyncio.Future[None]) -> None:
    try:
        await work()
    finally:
        if not done.done():
            done.set_result(None)


# -- files ----------------------------------------------------------------------------------


def _entries(directory: str, *, dirs: bool = False, files: bool = False) -> list[str]:
    """The checkpoint-like entries of ``directory``: not hidden (but DCP's .metadata), of the
    kind asked, valid names only."""
    try:
        with os.scandir(directory) as it:
            out = []
            for entry in it:
                if not cp.valid_name(entry.name) or (
                    entry.name.startswith(".") and entry.name != cp.METADATA
                ):
                    continue
                is_dir = entry.is_dir(follow_symlinks=False)
                if (dirs and is_dir) or (files and entry.is_file(follow_symlinks=False)):
                    out.append(entry.name)
            return sorted(out)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _merge(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (offset, length) sorted, those that overlap or touch made one: as many
    spans as there are gaps between them, however many came."""
    merged: list[list[int]] = []  # [start, end]
    for offset, length in sorted(spans):
        if length <= 0:
            continue
        if merged and offset <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], offset + length)
        else:
            merged.append([offset, offset + length])
    return [(start, end - start) for start, end in merged]


def _subtract(spans: list[tuple[int, int]], have: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The parts of ``spans`` (offset, length) that no span of ``have`` covers, merged and
    sorted.  ``have`` is sorted, as _merge leaves it: one pass over both, so that a worker's
    many small ranges cost the event loop no more than their number."""
    out = []
    first = 0  # the first span of ``have`` that may reach into the span looked at
    for offset, length in _merge(spans):
        start, end = offset, offset + length
        while first < len(have) and sum(have[first]) <= start:
            first += 1
        at = first
        while start < end and at < len(have) and have[at][0] < end:
            covered, size = have[at]
            if covered > start:
                out.append((start, covered - start))
            start = max(start, covered + size)
            at += 1
        if start < end:
            out.append((start, end - start))
    return out


def _copy_path(root: str, owner: str, ckpt: str, name: str) -> str:
    """Where a node keeps its copy of ``owner``'s file (a file checkpoint's id is its name)."""
    return os.path.join(root, COPIES, owner, ckpt, name)


def _dirs_under(path: str) -> list[str]:
    return [path, *(os.path.join(path, name) for name in _entries(path, dirs=True))]


def _stat_key(jd: JobDir, name: str) -> tuple[int, ...] | None:
    """What tells one version of the job's file ``name`` from another (a write changes its
    times, a rename over it its inode), or None where it is not a regular file."""
    with jd.rights(), contextlib.suppress(OSError):
        info = os.stat(os.path.join(jd.path, name), follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            return info.st_ino, info.st_mtime_ns, info.st_ctime_ns, info.st_size
    return None


def _note_version(jd: JobDir, name: str, sha256: str) -> None:
    """The job's file ``name``, as it is now, has this digest (this node put it in place)."""
    key = _stat_key(jd, name)
    if key is not None:
        jd.known_files[name] = (key, sha256)


def _sizes(directory: str) -> dict[str, int]:
    out = {}
    for name in _entries(directory, files=True):
        with contextlib.suppress(OSError):
            out[name] = os.stat(os.path.join(directory, name), follow_symlinks=False).st_size
    return out


def _held_bytes(jd: JobDir) -> int:
    """What the job's directory holds: its tmpfs's use (no walk through whatever the job put
    there), else the sizes of its files, looked at with its user's rights."""
    if jd.mounted:
        with contextlib.suppress(OSError):
            info = os.statvfs(jd.path)
            return (info.f_blocks - info.f_bfree) * info.f_frsize
    with jd.rights():
        return _size_of(jd.path)


def _size_of(path: str) -> int:
    total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _open_regular(path: str) -> BinaryIO:
    """A file of a job's directory, open for reading (``_regular``)."""
    return os.fdopen(_regular(path, os.O_RDONLY), "rb")


def _hash(path: str) -> cp.FileFacts:
    digest, size = hashlib.sha256(), 0
    with _open_regular(path) as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return cp.FileFacts(size, digest.hexdigest())


def _copy(source: str, destination: str) -> cp.FileFacts:
    """Copy a file; the size and SHA-256 of the bytes written."""
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    digest, size = hashlib.sha256(), 0
    with _open_regular(source) as src, open(destination, "wb", opener=_regular) as dst:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
            dst.write(chunk)
            size += len(chunk)
    return cp.FileFacts(size, digest.hexdigest())


def _link(source: str, destination: str, *, landed: str) -> cp.FileFacts:
    """A kept copy of a DCP file linked into place (no bytes copied, none held twice), else
    copied.  The copy was checked against its manifest when it landed (``landed``: its
    SHA-256 then), and since then only the job's user can have changed it, in their own
    job, so its bytes are not hashed again (134 MB: 0.11 s on the restart's path).  DCP
    writes a checkpoint's files once (one saved into again is no longer a checkpoint, and
    its copies go), unlike a rank's own ``torch.save`` files: those are copied."""
    os.makedirs(os.path.dirname(destination), exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(destination)
    try:
        os.link(source, destination, follow_symlinks=False)
        placed = os.lstat(destination)
    except OSError:
        return _copy(source, destination)
    if not stat.S_ISREG(placed.st_mode):  # the user swapped something else in
        os.unlink(destination)
        return _copy(source, destination)
    return cp.FileFacts(placed.st_size, landed)


def _create(path: str) -> int:
    """A file's descriptor, open for writing, emptied if it was there."""
    return _regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)


def _regular(path: str, flags: int) -> int:
    """A regular file of a job's directory, opened with ``flags`` (made 0600): not through a
    link, and not a FIFO, whose opening would wait for the other end (the job's user may
    swap either in; opened non-blocking, a FIFO fails at once)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a FIFO nobody reads
            raise OSError(f"{path} is not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path} is not a regular file")
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _partial(dest: str) -> str:
    return os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.partial")


async def _remove_all(jd: JobDir, paths: Iterable[str]) -> None:
    """Remove ``paths`` in ``jd``'s directory, with its user's rights."""

    def remove() -> None:
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    await asyncio.to_thread(jd.as_user(remove))


async def _as_user(spec: JobSpec, plan: Mapping[str, Any]) -> str:
    """Run the write-back helper as the job's user; "" or why it failed."""
    credentials: dict[str, Any] = {}
    if os.getuid() == 0:
        try:
            groups = os.getgrouplist(spec.user, spec.gid)
        except (KeyError, OSError):
            groups = [spec.gid]
        credentials = {"user": spec.uid, "group": spec.gid, "extra_groups": groups}
    # the job's own interpreter: its user can run it (the daemon's may sit where only root
    # may enter); writeback.py needs the standard library only
    python = spec.python or shutil.which("python3") or sys.executable
    try:
        process = await asyncio.create_subprocess_exec(
            python,
            "-I",
            writeback.__file__,
            json.dumps(plan),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
            **credentials,
        )
    except OSError as exc:
        return f"cannot run {python} as {spec.user}: {exc}"
    try:
        _, err = await process.communicate()
    except asyncio.CancelledError:  # the checkpoint went (saved into again): its copy stops
        process.kill()
        await process.wait()
        raise
    return "" if process.returncode == 0 else err.decode(errors="replace").strip()[-500:]


# -- the job's memory ------------------------------------------------------------------------


def remove_leftovers(root: str) -> list[str]:
    """What a daemon that died (SIGKILL) left in ``root``: each job's directory, unmounted
    and removed.  A node keeps no checkpoint across its daemon's restart: its jobs re-formed
    without it (their shares' copies are on other nodes), and a share it kept for another
    node is a copy that node's next checkpoint replaces; believing an old one here could
    restore a wrong step.  A ``root`` that is a link is not followed: a daemon made a
    directory there, so a link is somebody's, to a directory whose contents they want gone.
    Returns the jobs whose directories were removed."""
    if os.path.islink(root):
        log.warning("checkpoints: %s is a link, not a directory: nothing removed there", root)
        return []
    removed = []
    for name in _entries(root, dirs=True):
        path = os.path.join(root, name)
        if os.path.ismount(path):
            _unmount(path)
        shutil.rmtree(path, ignore_errors=True)
        removed.append(name)
    return removed


# -- the job's memory (mounts) -----------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)  # the libc this process runs with


def _mount_tmpfs(path: str, cap: int, uid: int, gid: int) -> bool:
    """A tmpfs of its own at ``path`` (root only): the cap is its size, the job's user owns
    it, and its large files are in huge pages where the kernel has them (``huge=within_size``:
    writing and mapping 640 MiB took a third less here).  False (a warning) where mounting is
    not allowed: a plain directory then."""
    if os.path.ismount(path):
        return True
    options = f"mode=0700,uid={uid},gid={gid}" + (f",size={cap}" if cap else "")
    failed = _mount(path, f"{options},huge=within_size")
    if failed == errno.EINVAL:  # a kernel without huge pages in tmpfs: small pages
        failed = _mount(path, options)
    if failed:
        log.warning(
            "checkpoints: cannot mount a tmpfs at %s (%s): a plain directory instead",
            path,
            os.strerror(failed),
        )
        return False
    return True


def _mount(path: str, options: str) -> int:
    """Mount a tmpfs at ``path`` with ``options``: 0, or the errno."""
    flags = _MS_NOSUID | _MS_NODEV
    done = _libc.mount(
        b"elasticd-checkpoints", os.fsencode(path), b"tmpfs", flags, options.encode()
    )
    return 0 if done == 0 else ctypes.get_errno()


def _unmount(path: str) -> None:
    if _libc.umount2(os.fsencode(path), _MNT_DETACH) != 0:
        log.warning("checkpoints: cannot unmount %s: %s", path, os.strerror(ctypes.get_errno()))


def is_private_dir(path: str, uid: int) -> bool:
    """Whether ``path`` is a directory only ``uid`` (and root) may enter."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == uid and not info.st_mode & 0o077
