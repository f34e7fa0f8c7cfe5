"""JobBoard: the cluster's job table in the store, and a change log to follow it.

Keys under ``elasticd/<cluster>/jobs/``::

    seq                 counter: submit order
    index               the pieces of the job index: sealed lines, appended ("piece": one
                        per INDEX_SPAN seqs; a store written before the pieces also lists
                        its jobs here, "name")
    index/<n>           the ids of the jobs whose seq // INDEX_SPAN is n: sealed lines,
                        appended (a key of one piece stays far below etcd's request limit)
    spec/<id>           {"seq", "spec"}, encrypted: a job's environment is nobody else's;
                        once the job ended, version 1 adds its "outcome" (so that deleting
                        the outcome alone does not make the job look new)
    part/<id>/<node>    Part, encrypted: that node's share of the job (versioned; its
                        workers, its hang's cause, its checkpoints are the owner's)
    parts/<id>          the nodes that wrote a part of the job: sealed lines, appended
    outcome/<id>        Outcome, encrypted (its error's text is the owner's), written once
                        (compare-and-set: first writer wins)
    log                 counter of changes
    log/<n>             the n-th change, signed: "spec/<id>", "part/<id>/<node>" or "outcome/<id>"

A daemon follows the log by waiting for ``log/<n+1>`` (one store round trip of latency, no
polling).  Anyone can end that wait (write the key, or on TCPStore read it while it is
missing): a wake with no entry behind it, or with a refused one at a number nobody took yet
(junk written ahead of the log: the writer who takes that number overwrites it), is no news
and backs the follower off (``aio.BackOff``, doubling up to a follow period, reset by an
entry).  Every record is sealed for its key; one that does not open is refused and
counted.  The counters and the log are not trusted to be complete: an entry that is
missing while later ones exist, refused, or a counter that went back, makes the follower
read every job again from the signed records (at most once per ``_RESYNC_PAUSE``).  A
counter that holds no count is written back (store/counter.py) by the first daemon that
needs it: ``seq`` past every seq that daemon has seen, with room for submits it has not read
yet (a seq too high costs nothing, one taken twice is two jobs with one number); ``log`` to
the last valid entry it finds from the last one it read or wrote on, and no further (a
number skipped costs every follower a read of the whole board; one taken twice would
overwrite an entry that followers behind have not read).  A new number is never one this
daemon has seen taken.  An
outcome that does not open holds its job: it is reported, never placed again, and a valid
outcome (a cancel) may replace it.  A snapshot also reads the jobs and parts that the
follower knows of, whatever the indexes say.  Store I/O is awaited on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from elasticd.aio import BackOff
from elasticd.core.model import IllegalTransition, JobSpec
from elasticd.core.records import Outcome, Part
from elasticd.errors import Conflict, ElasticdError, NotACounter, StoreError, TamperedRecord
from elasticd.faults import Faults, Throttle, held_back
from elasticd.jobs.registry import JobRegistry
from elasticd.store.base import Store
from elasticd.store.counter import StoreCounter
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import (
    Freshness,
    Refused,
    SignedLines,
    Signer,
    VersionClock,
    canonical_json,
    open_or_refuse,
)
from elasticd.wire.numbers import json_int

log = logging.getLogger(__name__)

_KEEP_LOG = 4096
_FOLLOW_TIMEOUT = 1.0  # seconds a follow waits for the next change before it looks again
_RESYNC_PAUSE = 5.0  # seconds between two reads of the whole board that a broken log asks for
_UNREACHABLE_LOG = 10.0  # seconds between two lines that say the store is still unreachable
_OUTCOME_TRIES = 3  # an outcome that does not open is replaced; a store that keeps garbling it wins
_BATCH = 64
_SEQ_ROOM = 1024  # seqs written back past the highest seen: submits elsewhere not read here yet
_ENTRY = re.compile(r"^(spec|outcome)/([\w.-]+)$|^part/([\w.-]+)/([\w.-]+)$")
_NAME = re.compile(r"^[\w.-]+$")
_PIECE = re.compile(r"^index/[0-9]{1,19}$")  # any int64 seq // INDEX_SPAN
# An outcome's JSON at most: sealed (a third more), and again in the spec record at the
# job's end, it stays far below etcd's 1.5 MiB a request.
OUTCOME_BYTES = 256 * 1024
_CUT = "[elasticd: earlier characters cut to fit the store]\n"
_KEPT_TEXT = 256  # characters of a message or traceback never cut (nor, forgotten, dropped)
# Jobs a piece of the index lists: about 32 kB, which each submit writes again (on etcd).
INDEX_SPAN = 256
JOB_ID = re.compile(r"^j-[0-9a-f]{6,12}$")


def new_job_id(length: int = 6) -> str:
    """A random id in JOB_ID's form, of ``length`` hex digits (even): short, for people to
    type.  Not unique by itself: a submit takes one that no job in the store ever had
    (JobBoard.ever_had), longer ones once the short ones are mostly taken."""
    return f"j-{secrets.token_hex(length // 2)}"


@dataclass(frozen=True)
class Change:
    kind: str  # "spec", "part", "outcome" or "held"
    job_id: str
    value: Any  # by kind: (seq, JobSpec, Outcome | None) | Part | Outcome | str (why held)


class BoardReset(ElasticdError):
    """The change log cannot be followed from here (its counter went back: the store's host
    restarted; an entry is missing or refused): read the whole board again."""

    code = "store_reset"


class IdTaken(Conflict):
    """Another node published a job under this id since it was drawn."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"job id {job_id} was taken by another submit meanwhile")


def _entry(body: object) -> str:
    if not isinstance(body, str) or not _ENTRY.match(body):
        raise ValueError(f"not a change: {body!r}")
    return body


def _unheard(key: str, why: str) -> None:
    """A refusal not reported here: the follower reports it when it reads the entry."""


def _seals_outcome(body: object) -> bool:
    """Whether a spec record is the one written at its job's end (it carries the outcome)."""
    return isinstance(body, dict) and bool(body.get("outcome"))


def fitted(outcome: Outcome, most: int = OUTCOME_BYTES) -> Outcome:
    """``outcome`` with its error's traceback, then its messages, cut to their ends (where
    the error is) until its JSON takes at most ``most`` bytes."""
    for _ in range(64):
        if len(canonical_json(outcome.to_json())) <= most:
            break
        error = outcome.error
        if error is not None and len(error.traceback) > _KEPT_TEXT:
            outcome = replace(outcome, error=replace(error, traceback=_halved(error.traceback)))
        elif error is not None and len(error.message) > _KEPT_TEXT:
            outcome = replace(outcome, error=replace(error, message=_halved(error.message)))
        elif len(outcome.message) > _KEPT_TEXT:
            outcome = replace(outcome, message=_halved(outcome.message))
        else:
            break
    return outcome


def _halved(text: str) -> str:
    """The end of ``text``, half of it (a mark of an earlier cut goes with its start)."""
    return _CUT + text[-(len(text) // 2) :]


def _index_line(body: object) -> tuple[str, str]:
    """A line of the index's key: ("piece", "index/<n>"), or ("name", a job id) as written
    before the index had pieces."""
    piece = body.get("piece") if isinstance(body, dict) else None
    if piece is None:
        return "name", _name(body)
    if not isinstance(piece, str) or not _PIECE.match(piece):
        raise ValueError(f"not a piece of the index: {piece!r}")
    return "piece", piece


def _piece_order(piece: str) -> int:
    return int(piece.partition("/")[2])


def _name(body: object) -> str:
    name = body.get("name") if isinstance(body, dict) else None
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"not a name: {name!r}")
    return name


class JobBoard:
    def __init__(
        self, store: Store, signer: Signer, cluster: str, on_refused: Refused | None = None
    ) -> None:
        self._store = store
        self._signer = signer
        self._keyspace = Keyspace(cluster)
        self._prefix = self._keyspace.jobs
        self.refused: Refused = on_refused or (lambda key, why: None)
        self._indexed: set[tuple[str, str]] = set()
        self._versions = VersionClock()
        self._fresh = Freshness()  # parts: an older one written back is refused
        self._seq = StoreCounter(store, self._key("seq"), self._seq_end, self.refused)
        self._log = StoreCounter(store, self._key("log"), self._log_end, self.refused)
        self.quiet = BackOff(longest=_FOLLOW_TIMEOUT)  # follows that woke for naught

    def _key(self, suffix: str) -> str:
        return f"{self._prefix}/{suffix}"

    def _seal(self, suffix: str, body: object, *, version: int = 0, secret: bool = False) -> bytes:
        return self._signer.seal(self._key(suffix), body, version=version, secret=secret)

    def _line(self, suffix: str, name: str, kind: str = "name") -> bytes:
        return self._seal(suffix, {kind: name}) + b"\n"

    # -- writes ---------------------------------------------------------------------------

    async def next_seq(self) -> int:
        """The submit order of a new job (publish it with this seq)."""
        return await self._seq.take()

    async def publish_spec(
        self, spec: JobSpec, seq: int | None = None, *, new: bool = False
    ) -> int:
        """Publish a job; returns its submit order.  Republishing (into a store that was reset)
        keeps the given ``seq`` and moves the counter past it, so later jobs come after.
        ``new``: only where no record is at the job's id yet (IdTaken otherwise: two submits
        on two nodes drew the same id; the check before the draw was a read)."""
        if seq is None:
            seq = await self._seq.take()
        else:
            await self._seq.at_least(seq)
        key = self._key(f"spec/{spec.id}")
        sealed = self._seal(f"spec/{spec.id}", {"seq": seq, "spec": spec.to_json()}, secret=True)
        if new:
            swapped, _ = await self._store.compare_set(key, None, sealed)
            if not swapped:
                raise IdTaken(spec.id)
        else:
            await self._store.set(key, sealed)
        piece = f"index/{seq // INDEX_SPAN}"
        await self._store.append(self._key(piece), self._line(piece, spec.id))
        await self._list(piece)  # after its line: see forget()
        await self._append(f"spec/{spec.id}")
        return seq

    async def _list(self, piece: str) -> None:
        """Name ``piece`` in the index, unless it is there."""
        if piece not in (await self._index_lines(_unheard))[0]:
            await self._store.append(self._key("index"), self._line("index", piece, "piece"))

    async def publish_ended(self, spec: JobSpec, seq: int, outcome: Outcome) -> None:
        """Seal the job's outcome into its spec record too (version 1, after the first)."""
        suffix = f"spec/{spec.id}"
        await self._store.set(
            self._key(suffix),
            self._seal(
                suffix,
                {"seq": seq, "spec": spec.to_json(), "outcome": outcome.to_json()},
                version=1,
                secret=True,
            ),
        )

    async def publish_part(self, job_id: str, part: Part) -> None:
        if (job_id, part.node) not in self._indexed:  # so that a snapshot finds every part
            await self._store.append(
                self._key(f"parts/{job_id}"), self._line(f"parts/{job_id}", part.node)
            )
            self._indexed.add((job_id, part.node))
        suffix = f"part/{job_id}/{part.node}"
        await self._store.set(
            self._key(suffix),
            self._seal(suffix, part.to_json(), version=self._versions.next(), secret=True),
        )
        await self._append(suffix)

    def forget_index(self) -> None:
        """After a store reset this node's parts must be indexed again."""
        self._indexed = set()

    async def publish_outcome(self, job_id: str, outcome: Outcome) -> Outcome:
        """Write the outcome (fitted) unless a valid one exists; returns the one that is
        now final.  One that does not open (tampered with) is replaced."""
        suffix = f"outcome/{job_id}"
        outcome = fitted(outcome)  # error text from users' code: far past what etcd takes
        # encrypted: an error's message and traceback are shown to the job's owner only
        key = self._key(suffix)
        sealed = self._seal(suffix, outcome.to_json(), version=1, secret=True)
        expected = None
        for _ in range(_OUTCOME_TRIES):
            swapped, current = await self._store.compare_set(key, expected, sealed)
            if swapped:
                await self._append(suffix)
                return outcome
            final = open_or_refuse(self._signer, key, current, Outcome.from_json, self.refused)
            if final is not None:
                return final
            expected = current  # refused: replace exactly those bytes
        raise TamperedRecord(
            f"{key} was overwritten {_OUTCOME_TRIES} times while this node wrote it"
        )

    async def _append(self, entry: str) -> None:
        n = await self._log.take()
        await self._store.set(self._key(f"log/{n}"), self._seal(f"log/{n}", entry))
        if n > _KEEP_LOG:
            await self._store.delete(self._key(f"log/{n - _KEEP_LOG}"))

    async def ever_had(self, job_id: str) -> bool:
        """Whether the store holds a record of a job with this id: its spec, or the outcome
        that stays after retention forgot the job.  A new job under such an id would be
        read with that outcome, ended before it ran."""
        held = await self._store.get_many(
            [self._key(f"spec/{job_id}"), self._key(f"outcome/{job_id}")]
        )
        return any(raw is not None for raw in held)

    # -- retention --------------------------------------------------------------------------

    async def ended_jobs(self) -> dict[str, Outcome]:
        """The indexed jobs whose outcome is written (and opens): id -> outcome."""
        ids = await self._index_ids(_unheard)
        keys = [self._key(f"outcome/{job_id}") for job_id in ids]
        ended: dict[str, Outcome] = {}
        for job_id, key, raw in zip(ids, keys, await self._store.get_many(keys)):
            outcome = open_or_refuse(self._signer, key, raw, Outcome.from_json, _unheard)
            if outcome is not None:
                ended[job_id] = outcome
        return ended

    async def forget(self, job_ids: list[str]) -> list[str]:
        """Delete these ended jobs' records (parts, spec), then their index lines and their
        rendezvous keys; the jobs forgotten.  A job is forgotten only while its spec record
        is gone or is the one that seals its outcome (version 1): a spec without one is an
        open job (a spec written back), whose records stay.  The outcomes stay, a few
        hundred bytes each: a spec record written back (anyone who reaches the store may
        have kept its bytes) is read with its outcome, and so never runs again.  Followers
        that hold a job keep it (their history); a snapshot no longer reads it.

        The index is rewritten by compare-and-set, so that a job published meanwhile keeps
        its line.  A piece left empty is unlisted (its key stays: nothing deletes a key only
        while it is empty on every store), then read again and listed again if a line came
        meanwhile; a publisher appends its line first and lists the piece after: whichever
        of the two reads last sees the other's write, and the piece stays listed."""
        specs = await self._store.get_many([self._key(f"spec/{job_id}") for job_id in job_ids])
        forgotten = [
            job_id
            for job_id, raw in zip(job_ids, specs)
            if raw is None
            or open_or_refuse(
                self._signer, self._key(f"spec/{job_id}"), raw, _seals_outcome, _unheard
            )
        ]
        if not forgotten:
            return []
        records = [e for e in await self._entries(forgotten) if not e.startswith("outcome/")]
        for suffix in [*records, *(f"parts/{job_id}" for job_id in forgotten)]:
            await self._store.delete(self._key(suffix))
        await self._shrink_outcomes(forgotten)
        gone = set(forgotten)
        pieces, _ = await self._index_lines(_unheard)
        emptied = {
            piece
            for piece in pieces
            if not await self._drop_lines(piece, _name, lambda name: name in gone)
        }
        dropped = gone | emptied  # job ids listed in the index itself (an older store), pieces
        await self._drop_lines("index", _index_line, lambda line: line[1] in dropped)
        for piece in sorted(emptied, key=_piece_order):
            if await self._store.get(self._key(piece)):
                await self._list(piece)
        await self._forget_rendezvous(forgotten)
        return forgotten

    async def _shrink_outcomes(self, job_ids: list[str]) -> None:
        """What stays of a forgotten job's outcome: how and when it ended, the start of its
        message ("cancelled by alice"), not its error (a failed job's traceback, up to
        64 KiB, would stay in the store forever)."""
        keys = [self._key(f"outcome/{job_id}") for job_id in job_ids]
        for job_id, key, raw in zip(job_ids, keys, await self._store.get_many(keys)):
            outcome = open_or_refuse(self._signer, key, raw, Outcome.from_json, _unheard)
            if raw is None or outcome is None:
                continue
            kept = replace(outcome, message=outcome.message[:_KEPT_TEXT], error=None)
            if kept == outcome:
                continue
            sealed = self._seal(f"outcome/{job_id}", kept.to_json(), version=1, secret=True)
            await self._store.compare_set(key, raw, sealed)  # lost to a change: kept whole

    async def _forget_rendezvous(self, job_ids: list[str]) -> None:
        """Delete the jobs' rendezvous keys, or say why they stay (on TCPStore this lists
        every key of the store, which a store full of junk can make fail)."""
        try:
            await self._store.delete_under([f"{self._keyspace.rendezvous(j)}/" for j in job_ids])
        except StoreError as exc:
            log.warning("retention: the rendezvous keys of %d jobs stay: %s", len(job_ids), exc)

    async def _drop_lines(
        self, suffix: str, parse: Callable[[Any], Any], dropped: Callable[[Any], bool]
    ) -> bytes:
        """Rewrite the lines at ``suffix`` without those ``dropped`` says of what ``parse``
        made of them (a line that does not open stays), by compare-and-set, so that a line
        appended meanwhile stays; what is left."""
        key = self._key(suffix)

        def gone(line: bytes) -> bool:
            opened = open_or_refuse(self._signer, key, line.rstrip(b"\n"), parse, _unheard)
            return opened is not None and dropped(opened)

        for _ in range(_OUTCOME_TRIES):
            raw = await self._store.get(key)
            if raw is None:
                return b""
            kept = b"".join(line for line in raw.splitlines(keepends=True) if not gone(line))
            if kept == raw:
                return kept
            swapped, _ = await self._store.compare_set(key, raw, kept)
            if swapped:
                return kept
        raise StoreError(
            f"{key} changed {_OUTCOME_TRIES} times while this node rewrote it "
            f"(the jobs' records are gone; their lines go at the next pass)"
        )

    # -- reads ----------------------------------------------------------------------------

    async def head(self) -> int:
        return await self._log.read()

    async def _seq_end(self, seen: int) -> int:
        return seen + _SEQ_ROOM

    async def _log_end(self, seen: int) -> int:
        """The last valid entry of the change log from ``seen`` on, a batch at a time while
        batches bring some (bounded: what lies past ``_KEEP_LOG`` entries is not looked for)."""
        end = seen
        for _ in range(_KEEP_LOG // _BATCH):
            numbers = range(end + 1, end + 1 + _BATCH)
            keys = [self._key(f"log/{n}") for n in numbers]
            found = [
                n
                for n, key, raw in zip(numbers, keys, await self._store.get_many(keys))
                if open_or_refuse(self._signer, key, raw, _entry, _unheard) is not None
            ]
            if not found:
                break
            end = found[-1]
        return end

    async def snapshot(
        self, known: Mapping[str, Iterable[str]] | None = None
    ) -> tuple[int, list[Change]]:
        """Every job with its outcome and parts; and the log position to follow from.
        ``known``: jobs, with the nodes of their parts, that the caller knows already: read
        too, whatever the indexes say (anyone who reaches the store can overwrite an index)."""
        known = known or {}
        position = await self.head()
        self._log.saw(position)
        ids = dict.fromkeys([*await self._index_ids(self.refused), *known])
        return position, await self._read(await self._entries(list(ids), known))

    async def _index_lines(self, refused: Refused) -> tuple[list[str], list[str]]:
        """The pieces the index lists, in seq order, and the job ids it lists itself (a store
        written before the pieces).  A line that does not open is told to ``refused``."""
        index = SignedLines(self._signer, self._key("index"), _index_line, refused)
        lines = [line for line in index.fold(await self._store.get(index.key)) if line]
        pieces = sorted({n for kind, n in lines if kind == "piece"}, key=_piece_order)
        return pieces, [n for kind, n in lines if kind == "name"]

    async def _index_ids(self, refused: Refused) -> list[str]:
        """The job ids the index lists, each once, in submit order (a line that does not
        open is told to ``refused`` and skipped)."""
        pieces, ids = await self._index_lines(refused)
        raws = await self._store.get_many([self._key(piece) for piece in pieces])
        for piece, raw in zip(pieces, raws):
            lines = SignedLines(self._signer, self._key(piece), _name, refused)
            ids += [i for i in lines.fold(raw) if i]
        return list(dict.fromkeys(ids))

    async def read_job(self, job_id: str) -> list[Change]:
        """One job's spec, outcome and parts, read now."""
        return await self._read(await self._entries([job_id]))

    async def _entries(
        self, job_ids: list[str], known: Mapping[str, Iterable[str]] | None = None
    ) -> list[str]:
        """The entries of these jobs' spec, outcome and every part (one round trip)."""
        raws = await self._store.get_many([self._key(f"parts/{job_id}") for job_id in job_ids])
        entries = []
        for job_id, raw in zip(job_ids, raws):
            lines = SignedLines(self._signer, self._key(f"parts/{job_id}"), _name, self.refused)
            nodes = dict.fromkeys(
                [*(n for n in lines.fold(raw) if n), *(known or {}).get(job_id, ())]
            )
            entries += [
                f"spec/{job_id}",
                f"outcome/{job_id}",
                *(f"part/{job_id}/{n}" for n in nodes),
            ]
        return entries

    async def follow(self, position: int, timeout: float) -> tuple[int, list[Change]]:
        """Wait up to ``timeout`` for changes after ``position``; returns the new position.

        Raises BoardReset when the log cannot be followed from ``position``: it went
        backwards, or the next entry is refused (its number taken), or missing while later
        ones exist (its writer died between its two steps, or someone bumped the counter).
        A wake with nothing to read pauses (``quiet``) before it returns.
        """
        if not await self._store.wait_for(self._key(f"log/{position + 1}"), timeout):
            head = await self.head()
            if head < position:
                raise BoardReset(f"change log went back from {position} to {head}")
            if (
                head > position + 1
                and await self._store.get(self._key(f"log/{position + 1}")) is None
            ):
                raise BoardReset(f"change {position + 1} is missing and the log is at {head}")
            return position, []
        keys = [self._key(f"log/{n}") for n in range(position + 1, position + 1 + _BATCH)]
        entries: list[str] = []
        for key, raw in zip(keys, await self._store.get_many(keys)):
            if raw is None:
                break
            entry = open_or_refuse(self._signer, key, raw, _entry, self.refused)
            if entry is None:
                if not entries and await self.head() > position:
                    raise BoardReset(f"change {position + 1} was refused")
                break
            entries.append(entry)
        if not entries:  # woken for naught: missing, or junk where no change was written yet
            await self.quiet.pause(timeout)
            return position, []
        self.quiet.reset()
        self._log.saw(position + len(entries))
        return position + len(entries), await self._read(entries)

    async def _read(self, entries: list[str]) -> list[Change]:
        wanted = list(dict.fromkeys(e for e in entries if _ENTRY.match(e)))
        # a spec is read with its outcome: a spec record written back over a job that ended
        # (its spec deleted by retention, its bytes kept by whoever reaches the store) reads
        # as ended
        outcomes = [f"outcome/{e[len('spec/') :]}" for e in wanted if e.startswith("spec/")]
        wanted += [e for e in outcomes if e not in wanted]
        values = await self._store.get_many([self._key(e) for e in wanted])
        changes = []
        for entry, raw in zip(wanted, values):
            why: list[str] = []

            def refused(key: str, reason: str) -> None:
                why.append(reason)  # noqa: B023 (called within this iteration)
                self.refused(key, reason)

            change = open_or_refuse(
                self._signer,
                self._key(entry),
                raw,
                functools.partial(self._parse, entry),
                refused,
                self._fresh if not entry.startswith("outcome/") else None,
            )
            if change is not None:
                changes.append(change)
                if change.kind == "spec":
                    self._seq.saw(change.value[0])
            elif why and entry.startswith("outcome/"):
                changes.append(
                    Change(
                        "held", entry.partition("/")[2], f"its outcome record was refused: {why[0]}"
                    )
                )
        return changes

    @staticmethod
    def _parse(entry: str, body: object) -> Change:
        kind, _, rest = entry.partition("/")
        if not isinstance(body, dict):
            raise ValueError("record is not an object")
        if kind == "spec":
            spec = JobSpec.from_json(body["spec"])
            if spec.id != rest:
                raise ValueError(f"the spec is job {spec.id}'s")
            ended = Outcome.from_json(body["outcome"]) if body.get("outcome") else None
            return Change(kind, rest, (json_int(body["seq"], "seq"), spec, ended))
        if kind == "outcome":
            return Change(kind, rest, Outcome.from_json(body))
        job_id, _, node = rest.partition("/")
        part = Part.from_json(body)
        if part.node != node:
            raise ValueError(f"the part is node {part.node}'s")
        return Change(kind, job_id, part)


class BoardFollower:
    """Keeps the registry in step with the board: a snapshot (at start, and after the store
    lost its data), then the change log, waiting for each next change in the store."""

    def __init__(
        self,
        board: JobBoard,
        registry: JobRegistry,
        node: str,
        *,
        on_store: Callable[[bool], None] = lambda up: None,
        faults: Faults | None = None,
    ) -> None:
        self._board = board
        self._registry = registry
        self._node = node
        self._on_store = on_store
        self._faults = faults or Faults()
        self._resets = Throttle()  # a log kept broken (a forged next entry) is read again every 5 s
        self._unreachable = Throttle(_UNREACHABLE_LOG)  # tried again every second while it lasts
        self._position = 0
        self._resynced = -_RESYNC_PAUSE  # when the board was last read whole (monotonic)

    async def resync(self) -> None:
        self._resynced = time.monotonic()
        known = {r.id: list(r.parts) for r in self._registry.jobs() if r.outcome is None}
        self._position, changes = await self._board.snapshot(known)
        self.apply(changes)

    async def run(self) -> None:
        """Follow the log until cancelled; a store that does not answer, or a step that
        failed unexpectedly, is retried after a back-off of one follow period."""
        while True:
            async with self._faults.contained("board_follower", _FOLLOW_TIMEOUT):
                await self._step()

    async def _step(self) -> None:
        try:
            self._position, changes = await self._board.follow(self._position, _FOLLOW_TIMEOUT)
        except BoardReset as exc:
            if (held := self._resets.check("reset", time.monotonic())) is not None:
                log.warning("%s; reading the whole board again%s", exc, held_back(held))
            pause = self._resynced + _RESYNC_PAUSE - time.monotonic()
            if pause > 0:  # a log broken again and again costs one read per pause
                await asyncio.sleep(pause)  # a back-off
            await self._retrying(self.resync)
            return
        except NotACounter:  # junk written again as fast as it was repaired: reported as refused
            await asyncio.sleep(_FOLLOW_TIMEOUT)  # a back-off
            return
        except StoreError as exc:
            if (held := self._unreachable.check("store", time.monotonic())) is not None:
                log.warning(
                    "store unreachable while following the board: %s%s", exc, held_back(held)
                )
            self._on_store(False)
            await asyncio.sleep(_FOLLOW_TIMEOUT)  # a back-off
            return
        self._on_store(True)
        self.apply(changes)

    async def _retrying(self, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                return await step()
            except NotACounter:
                pass  # reported as refused
            except StoreError as exc:
                log.warning("store unreachable while resynchronising the board: %s", exc)
            await asyncio.sleep(_FOLLOW_TIMEOUT)  # a back-off

    async def fetch(self, job_id: str) -> None:
        """Read one job now, ahead of the log (a job submitted elsewhere a moment ago)."""
        self.apply(await self._board.read_job(job_id))

    def apply(self, changes: Iterable[Change]) -> None:
        for change in changes:
            try:
                self._apply(change)
            except IllegalTransition as exc:  # the record stays as it was
                log.warning("job %s: ignored a change from the board: %s", change.job_id, exc)
            except Exception:  # one change must not cost the others, nor the follower
                self._faults.report("board_changes", f"job {change.job_id}")

    def _apply(self, change: Change) -> None:
        if change.kind == "spec":
            seq, spec, ended = change.value
            if (
                ended is not None
                and self._registry.find(spec.id) is None
                and self._registry.expired(ended)
            ):
                return  # forgotten here by retention (the observer deletes it from the store too)
            self._registry.add(spec, seq)
            if ended is not None:
                self._registry.set_outcome(change.job_id, ended)
        elif change.kind == "part":
            if change.value.node != self._node:  # this node's parts are its agents' to write
                self._registry.set_part(change.job_id, change.value)
        elif change.kind == "outcome":
            self._registry.set_outcome(change.job_id, change.value)
        elif change.kind == "held":
            self._registry.hold(change.job_id, change.value)
