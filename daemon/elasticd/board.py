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
polling).  Every value is signed; a record whose MAC fails is refused and counted.  All
methods block on the store: call them from a thread.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from .errors import ElasticdError
from .jobs import Outcome, Part
from .keyspace import Keyspace
from .model import JobSpec
from .store import StoreBackend
from .store.signing import Refused, Signer, open_or_refuse

log = logging.getLogger(__name__)

_KEEP_LOG = 4096
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
    def __init__(self, store: StoreBackend, signer: Signer, cluster: str,
                 on_refused: Refused | None = None) -> None:
        self._store = store
        self._signer = signer
        self._prefix = Keyspace(cluster).jobs
        self.refused: Refused = on_refused or (lambda key, why: None)
        self._indexed: set[tuple[str, str]] = set()

    def _key(self, suffix: str) -> str:
        return f"{self._prefix}/{suffix}"

    # -- writes ---------------------------------------------------------------------------

    def next_seq(self) -> int:
        """The submit order of a new job (publish it with this seq)."""
        return self._store.add(self._key("seq"), 1)

    def publish_spec(self, spec: JobSpec, seq: int | None = None) -> int:
        """Publish a job; returns its submit order.  Republishing (into a store that was reset)
        keeps the given ``seq`` and moves the counter past it, so later jobs come after."""
        if seq is None:
            seq = self._store.add(self._key("seq"), 1)
        else:
            behind = seq - self._store.add(self._key("seq"), 0)
            if behind > 0:
                self._store.add(self._key("seq"), behind)
        self._store.set(self._key(f"spec/{spec.id}"),
                        self._signer.seal({"seq": seq, "spec": spec.to_json()}))
        self._store.set(self._key(f"by_seq/{seq}"), spec.id.encode())
        self._append(f"spec/{spec.id}")
        return seq

    def publish_part(self, job_id: str, part: Part) -> None:
        if (job_id, part.node) not in self._indexed:  # so that a snapshot finds every part
            self._store.append(self._key(f"part_nodes/{job_id}"), f"{part.node}\n".encode())
            self._indexed.add((job_id, part.node))
        self._store.set(self._key(f"part/{job_id}/{part.node}"), self._signer.seal(part.to_json()))
        self._append(f"part/{job_id}/{part.node}")

    def forget_index(self) -> None:
        """After a store reset this node's parts must be indexed again."""
        self._indexed = set()

    def publish_outcome(self, job_id: str, outcome: Outcome) -> Outcome:
        """Write the outcome unless one exists; returns the one that is now final."""
        key = self._key(f"outcome/{job_id}")
        swapped, current = self._store.compare_set(key, None, self._signer.seal(outcome.to_json()))
        if swapped:
            self._append(f"outcome/{job_id}")
            return outcome
        return Outcome.from_json(self._signer.open(current or b""))

    def _append(self, entry: str) -> None:
        n = self._store.add(self._key("log"), 1)
        self._store.set(self._key(f"log/{n}"), entry.encode())
        if n > _KEEP_LOG:
            self._store.delete(self._key(f"log/{n - _KEEP_LOG}"))

    # -- reads ----------------------------------------------------------------------------

    def head(self) -> int:
        return self._store.add(self._key("log"), 0)

    def snapshot(self) -> tuple[int, list[Change]]:
        """Every job with its outcome and parts; and the log position to follow from."""
        position = self.head()
        count = self._store.add(self._key("seq"), 0)
        raw_ids = self._store.get_many([self._key(f"by_seq/{n}") for n in range(1, count + 1)])
        ids = sorted({raw.decode() for raw in raw_ids if raw})
        return position, self._read([entry for i in ids for entry in self._job_entries(i)])

    def read_job(self, job_id: str) -> list[Change]:
        """One job's spec, outcome and parts, read now."""
        return self._read(self._job_entries(job_id))

    def _job_entries(self, job_id: str) -> list[str]:
        raw = self._store.get(self._key(f"part_nodes/{job_id}")) or b""
        nodes = dict.fromkeys(n for n in raw.decode(errors="replace").split("\n") if n)
        return [f"spec/{job_id}", f"outcome/{job_id}", *(f"part/{job_id}/{n}" for n in nodes)]

    def follow(self, position: int, timeout: float) -> tuple[int, list[Change]]:
        """Wait up to ``timeout`` for changes after ``position``; returns the new position.

        Raises BoardReset when the log went backwards (the store host restarted).  An entry
        that never appears while later ones do (a writer died between its two steps) is
        skipped after one timeout.
        """
        if not self._store.wait_for(self._key(f"log/{position + 1}"), timeout):
            head = self.head()
            if head < position:
                raise BoardReset(f"change log went back from {position} to {head}")
            if head > position + 1 and self._store.get(self._key(f"log/{position + 1}")) is None:
                log.warning("change %d never appeared; skipping it", position + 1)
                return position + 1, []
            return position, []
        keys = [self._key(f"log/{n}") for n in range(position + 1, position + 1 + _BATCH)]
        entries = []
        for raw in self._store.get_many(keys):
            if raw is None:
                break
            entries.append(raw.decode(errors="replace"))
        return position + len(entries), self._read(entries)

    def _read(self, entries: list[str]) -> list[Change]:
        wanted = list(dict.fromkeys(e for e in entries if _ENTRY.match(e)))
        values = self._store.get_many([self._key(e) for e in wanted])
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
