"""JobBoard: the cluster's job table in the store, and a change log to follow it.

Keys under ``elasticd/<cluster>/jobs/``::

    seq                 counter: submit order
    by_seq/<n>          job id of the n-th submitted job
    spec/<id>           signed {"seq", "spec"}
    part/<id>/<node>    signed Part: that node's share of the job
    outcome/<id>        signed Outcome, written once (compare-and-set: first writer wins)
    log                 counter of changes
    log/<n>             the n-th change: "spec/<id>", "part/<id>/<node>" or "outcome/<id>"

A daemon follows the log by waiting for ``log/<n+1>`` (one store round trip of latency, no
polling).  Every value is signed; a record whose MAC fails is refused and counted.  Store
I/O is awaited on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from typing import Awaitable, Callable, Iterable

from .errors import ElasticdError, StoreError
from .jobs import JobRegistry
from .records import Outcome, Part
from .keyspace import Keyspace
from .model import IllegalTransition, JobSpec
from .store.base import Store
from .store.signing import Refused, Signer, open_or_refuse

log = logging.getLogger(__name__)

_KEEP_LOG = 4096
_FOLLOW_TIMEOUT = 1.0  # seconds a follow waits for the next change before it looks again
_BATCH = 64
_ENTRY = re.compile(r"^(spec|outcome)/([\w.-]+)$|^part/([\w.-]+)/([\w.-]+)$")


@dataclass(frozen=True)
class Change:
    kind: str                    # "spec", "part" or "outcome"
    job_id: str
    value: object                # (seq, JobSpec) | Part | Outcome


class BoardReset(ElasticdError):
    """The store lost the board (its host restarted): resynchronise and republish."""

    code = "store_reset"


class JobBoard:
    def __init__(self, store: Store, signer: Signer, cluster: str,
                 on_refused: Refused | None = None) -> None:
        self._store = store
        self._signer = signer
        self._prefix = Keyspace(cluster).jobs
        self.refused: Refused = on_refused or (lambda key, why: None)
        self._indexed: set[tuple[str, str]] = set()

    def _key(self, suffix: str) -> str:
        return f"{self._prefix}/{suffix}"

    # -- writes ---------------------------------------------------------------------------

    async def next_seq(self) -> int:
        """The submit order of a new job (publish it with this seq)."""
        return await self._store.add(self._key("seq"), 1)

    async def publish_spec(self, spec: JobSpec, seq: int | None = None) -> int:
        """Publish a job; returns its submit order.  Republishing (into a store that was reset)
        keeps the given ``seq`` and moves the counter past it, so later jobs come after."""
        if seq is None:
            seq = await self._store.add(self._key("seq"), 1)
        else:
            behind = seq - await self._store.add(self._key("seq"), 0)
            if behind > 0:
                await self._store.add(self._key("seq"), behind)
        await self._store.set(self._key(f"spec/{spec.id}"),
                        self._signer.seal({"seq": seq, "spec": spec.to_json()}))
        await self._store.set(self._key(f"by_seq/{seq}"), spec.id.encode())
        await self._append(f"spec/{spec.id}")
        return seq

    async def publish_part(self, job_id: str, part: Part) -> None:
        if (job_id, part.node) not in self._indexed:  # so that a snapshot finds every part
            await self._store.append(self._key(f"part_nodes/{job_id}"), f"{part.node}\n".encode())
            self._indexed.add((job_id, part.node))
        await self._store.set(self._key(f"part/{job_id}/{part.node}"), self._signer.seal(part.to_json()))
        await self._append(f"part/{job_id}/{part.node}")

    def forget_index(self) -> None:
        """After a store reset this node's parts must be indexed again."""
        self._indexed = set()

    async def publish_outcome(self, job_id: str, outcome: Outcome) -> Outcome:
        """Write the outcome unless one exists; returns the one that is now final."""
        key = self._key(f"outcome/{job_id}")
        swapped, current = await self._store.compare_set(key, None, self._signer.seal(outcome.to_json()))
        if swapped:
            await self._append(f"outcome/{job_id}")
            return outcome
        return Outcome.from_json(self._signer.open(current or b""))

    async def _append(self, entry: str) -> None:
        n = await self._store.add(self._key("log"), 1)
        await self._store.set(self._key(f"log/{n}"), entry.encode())
        if n > _KEEP_LOG:
            await self._store.delete(self._key(f"log/{n - _KEEP_LOG}"))

    # -- reads ----------------------------------------------------------------------------

    async def head(self) -> int:
        return await self._store.add(self._key("log"), 0)

    async def snapshot(self) -> tuple[int, list[Change]]:
        """Every job with its outcome and parts; and the log position to follow from."""
        position = await self.head()
        count = await self._store.add(self._key("seq"), 0)
        raw_ids = await self._store.get_many([self._key(f"by_seq/{n}") for n in range(1, count + 1)])
        return position, await self._read(await self._entries(sorted({r.decode() for r in raw_ids if r})))

    async def read_job(self, job_id: str) -> list[Change]:
        """One job's spec, outcome and parts, read now."""
        return await self._read(await self._entries([job_id]))

    async def _entries(self, job_ids: list[str]) -> list[str]:
        """The entries of these jobs' spec, outcome and every part (one round trip)."""
        raws = await self._store.get_many([self._key(f"part_nodes/{job_id}") for job_id in job_ids])
        entries = []
        for job_id, raw in zip(job_ids, raws):
            nodes = dict.fromkeys(n for n in (raw or b"").decode(errors="replace").split("\n") if n)
            entries += [f"spec/{job_id}", f"outcome/{job_id}", *(f"part/{job_id}/{n}" for n in nodes)]
        return entries

    async def follow(self, position: int, timeout: float) -> tuple[int, list[Change]]:
        """Wait up to ``timeout`` for changes after ``position``; returns the new position.

        Raises BoardReset when the log went backwards (the store host restarted).  An entry
        that never appears while later ones do (a writer died between its two steps) is
        skipped after one timeout.
        """
        if not await self._store.wait_for(self._key(f"log/{position + 1}"), timeout):
            head = await self.head()
            if head < position:
                raise BoardReset(f"change log went back from {position} to {head}")
            if head > position + 1 and await self._store.get(self._key(f"log/{position + 1}")) is None:
                log.warning("change %d never appeared; skipping it", position + 1)
                return position + 1, []
            return position, []
        keys = [self._key(f"log/{n}") for n in range(position + 1, position + 1 + _BATCH)]
        entries = []
        for raw in await self._store.get_many(keys):
            if raw is None:
                break
            entries.append(raw.decode(errors="replace"))
        return position + len(entries), await self._read(entries)

    async def _read(self, entries: list[str]) -> list[Change]:
        wanted = list(dict.fromkeys(e for e in entries if _ENTRY.match(e)))
        values = await self._store.get_many([self._key(e) for e in wanted])
        changes = (open_or_refuse(self._signer, self._key(entry), raw,
                                  lambda body, entry=entry: self._parse(entry, body), self.refused)
                   for entry, raw in zip(wanted, values))
        return [change for change in changes if change is not None]

    @staticmethod
    def _parse(entry: str, body: object) -> Change:
        kind, _, rest = entry.partition("/")
        if not isinstance(body, dict):
            raise ValueError("record is not an object")
        if kind == "spec":
            return Change(kind, rest, (int(body["seq"]), JobSpec.from_json(body["spec"])))
        if kind == "outcome":
            return Change(kind, rest, Outcome.from_json(body))
        job_id = rest.partition("/")[0]
        return Change(kind, job_id, Part.from_json(body))


class BoardFollower:
    """Keeps the registry in step with the board: a snapshot (at start, and after the store
    lost its data), then the change log, waiting for each next change in the store."""

    def __init__(self, board: JobBoard, registry: JobRegistry, node: str, *,
                 on_store: Callable[[bool], None] = lambda up: None) -> None:
        self._board = board
        self._registry = registry
        self._node = node
        self._on_store = on_store
        self._position = 0

    async def resync(self) -> None:
        self._position, changes = await self._board.snapshot()
        self.apply(changes)

    async def run(self) -> None:
        """Follow the log until cancelled; a store that does not answer is retried after a
        back-off of one follow period."""
        while True:
            try:
                self._position, changes = await self._board.follow(self._position, _FOLLOW_TIMEOUT)
            except BoardReset as exc:
                log.warning("%s; resynchronising", exc)
                await self._retrying(self.resync)
                continue
            except StoreError as exc:
                log.warning("store unreachable while following the board: %s", exc)
                self._on_store(False)
                await asyncio.sleep(_FOLLOW_TIMEOUT)  # a back-off
                continue
            self._on_store(True)
            self.apply(changes)

    async def _retrying(self, step: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                return await step()
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

    def _apply(self, change: Change) -> None:
        if change.kind == "spec":
            seq, spec = change.value
            self._registry.add(spec, seq)
        elif change.kind == "part":
            if change.value.node != self._node:  # this node's parts are its agents' to write
                self._registry.set_part(change.job_id, change.value)
        elif change.kind == "outcome":
            self._registry.set_outcome(change.job_id, change.value)
