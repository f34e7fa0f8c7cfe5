"""StoreCounter: a counter in the store that no keyless writer can freeze (see
docs/security.md, "The store").

Anyone who reaches the store may write anything to a counter.  An add over a value that is
no count fails (NotACounter: torch's server drops the connection of an add over one, etcd's
client refuses it), so one such value would stop whatever takes numbers from the counter
until someone wrote a number back.  Here the add that meets one writes back the highest
value its owner can justify (``justify(seen)``), compare-and-set against the junk it read:
the first repair wins, and a count written meanwhile is never overwritten; the refusal is
reported (counted, and logged once per interval).  An empty value is compared as a missing
one (TCPStore cannot tell them apart; etcd reads it as 0 and never gets here).  A count
below a number this node has seen taken (the store was reset, or anyone wrote a smaller
number) is moved past it before a new number is taken: one number taken twice would be two
things with one number.  An add in doubt (its connection lost and a count there after: junk
that another node repaired meanwhile, or the add applied) is made again: a number skipped
is a gap, which the change log's followers read past (a resync).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from elasticd.errors import AddInDoubt, NotACounter
from elasticd.store.base import Store
from elasticd.store.signing import Refused

REPAIRS = 3  # junk met again after this many repairs (someone writes it as fast): the add fails


class StoreCounter:
    """The counter at ``key``.  ``justify(seen)``: the value to write back over junk, at least
    ``seen`` (the highest number this node has seen taken: :meth:`saw`)."""

    def __init__(
        self, store: Store, key: str, justify: Callable[[int], Awaitable[int]], refused: Refused
    ) -> None:
        self._store = store
        self.key = key
        self._justify = justify
        self._refused = refused
        self.seen = 0

    def saw(self, number: int) -> None:
        """``number`` was taken (this node read or wrote what goes with it)."""
        self.seen = max(self.seen, number)

    async def read(self) -> int:
        return await self._add(0)

    async def take(self) -> int:
        """A new number, past every one this node has seen taken."""
        number = await self._add(1)
        if number <= self.seen:  # the counter went back: on past what was taken
            number = await self._add(self.seen - number + 1)
        self.saw(number)
        return number

    async def at_least(self, number: int) -> None:
        """Move the counter up to ``number``, taken before (later numbers come after it)."""
        self.saw(number)
        behind = number - await self.read()
        if behind > 0:
            await self._add(behind)

    async def _add(self, amount: int) -> int:
        for _ in range(REPAIRS):
            try:
                return await self._store.add(self.key, amount)
            except NotACounter as junk:
                await self._repair(junk)
            except AddInDoubt:
                pass
        return await self._store.add(self.key, amount)

    async def _repair(self, junk: NotACounter) -> None:
        value = await self._justify(self.seen)
        swapped, _ = await self._store.compare_set(self.key, junk.value or None, b"%d" % value)
        self._refused(
            self.key,
            f"{junk.shown} is no count; "
            f"{f'wrote back {value}' if swapped else 'it changed meanwhile'}",
        )
