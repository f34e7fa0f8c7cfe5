"""This node's reading of a round's join log.

The join log costs O(new entries) a read, and O(N) in all for N joiners: a read is the
state and the counter, in one round trip; the entries (only the numbers not read yet, a
batch at a time while batches bring records: ``JoinLog``, ``ops.log_window``) are read by
the node whose entry is the newest, by every node once the counter stood still for
``dead_after``, and by any node before a write that folds them (``ops.reads_log``);
meanwhile a node's own entry stands for itself.  A number taken but not written yet is read again (the
newest waits for its key once).  A node whose own entry a full read has not reached within
an interval (numbers an attacker took by bumping the counter lie before it) writes it again
under a number read as missing (``ops.claim``), as when the counter is not a count.  The
writer of the state that ends a round's joining deletes the counter and the entries it
knows of (a task beside its keeper: never in the way of a heartbeat).
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.ops import LOG_BATCH, View, log_upper, log_window, reads_log
from elasticd.rendezvous.state import (
    Announcement,
    RendezvousSettings,
    RendezvousState,
    decode_announcement,
    encode_announcement,
)
from elasticd.store.base import Store
from elasticd.store.signing import Refused, Signer, open_or_refuse


@dataclass(frozen=True)
class OwnEntry:
    """This node's own newest entry in a join log."""

    round: int
    number: int
    at: float  # when it was written (this node's clock)
    record: Announcement


class JoinLog:
    """This node's reading of the open round's join log (a new round starts a new one): the
    entries read, by number (a refused one as None), and this node's own newest entry."""

    def __init__(
        self, signer: Signer, keys: Keys, refused: Refused, settings: RendezvousSettings
    ) -> None:
        self._signer, self._keys, self._refused, self._settings = signer, keys, refused, settings
        self.mine: OwnEntry | None = None
        self._start(-1, 0.0)

    def _start(self, round: int, now: float) -> None:
        self.round = round
        self.records: dict[int, Announcement | None] = {}
        self.count: int | None = 0
        self.since = now  # the counter moved
        self.low = 1  # lowest unread
        self.top = 0  # highest record
        self.missing: list[int] = []  # read as missing
        self.full = False  # the last fetch read the entries
        self.waited = 0  # the hole waited on last

    async def fetch(
        self,
        store: Store,
        state: RendezvousState,
        count: int | None,
        now: float,
        full: bool = False,
    ) -> None:
        """Read the numbers not read yet up to the counter (``count``; None: not a count), a
        batch at a time while batches bring records: when ``full`` or ``ops.reads_log``."""
        if state.round != self.round or (count is not None and count < self.top):
            if (
                state.round == self.round
            ):  # the counter went back (a store reset): so did this node's entry
                self.mine = None
            self._start(state.round, now)
        if count != self.count:
            self.count, self.since = count, now
        self.full = full or reads_log(
            self._own(state.round), count, self.since, now, self._settings
        )
        upper = log_upper(count, self.top) if self.full else 0
        self.low = max(self.low, state.folded + 1)
        while numbers := log_window(self.records, self.low, upper):
            values = await store.get_many([self._keys.join(self.round, n) for n in numbers])
            if not self._fold(numbers, values):
                return

    def _fold(self, numbers: list[int], values: list[bytes | None]) -> int:
        """Open the entries read; how many are records."""
        self.missing = [n for n, raw in zip(numbers, values) if raw is None]
        opened = 0
        for n, raw in zip(numbers, values):
            if raw is not None:
                record = open_or_refuse(
                    self._signer,
                    self._keys.join(self.round, n),
                    raw,
                    decode_announcement,
                    self._refused,
                )
                self.records[n] = record
                if record is not None:
                    self.top, opened = max(self.top, n), opened + 1
        while self.low in self.records:
            self.low += 1
        return opened

    def view(self, state: RendezvousState) -> View:
        """The records past ``state.folded``, with this node's own entry where it was not
        read (as written); ``pending`` when a full read did not reach it, or refused it.  A
        write folds to the highest record read, and past this node's own entry when that
        lies within reach (not beyond a bumped counter)."""
        fresh = sorted(n for n in self.records if n > state.folded)
        announced = tuple(r for r in (self.records[n] for n in fresh) if r is not None)
        own, pending = self._own(state.round), None
        if self.mine is not None and own > state.folded and self.records.get(own) is None:
            if self.full or own in self.records:
                pending = self.mine.at
            else:
                announced += (self.mine.record,)
        return View(
            announced=announced,
            log_end=self._end(state.round, state.folded),
            pending=pending,
            whole=self.full,
        )

    def hole(self) -> int | None:
        """A number below the counter that a full read found taken but not written yet, once."""
        if not self.full or self.count is None or self.low > self.count or self.low == self.waited:
            return None
        self.waited = self.low
        return self.low

    def _own(self, round: int) -> int:
        return self.mine.number if self.mine is not None and self.mine.round == round else 0

    def _end(self, round: int, folded: int) -> int:
        top = self.top if round == self.round else 0
        own = self._own(round)
        return max(folded, top, own if own <= top + LOG_BATCH else 0)

    def known(self, round: int, folded: int) -> list[int]:
        """The numbers of ``round``'s entries this node knows of (to delete once its joining
        ended): never more than the records read and its own entry account for."""
        return list(range(1, self._end(round, folded) + 1))

    def entry(self, round: int, number: int, announcement: Announcement) -> tuple[str, bytes]:
        key = self._keys.join(round, number)
        return key, self._signer.seal(key, encode_announcement(announcement))
