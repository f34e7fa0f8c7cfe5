"""The store backend protocol that the rendezvous and the cluster registry are written against.

Every backend object may be used from any thread. Failures surface as
:class:`~elasticd.errors.StoreConnectionError` or :class:`~elasticd.errors.StoreTimeout`,
never as a backend library's own exception.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from elasticd.errors import AddInDoubt, NotACounter, StoreConnectionError


@runtime_checkable
class StoreBackend(Protocol):
    def get(self, key: str) -> bytes | None:
        """The value, or None when the key is missing. Never blocks for the store timeout."""

    def set(self, key: str, value: bytes) -> None: ...

    def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        """Write ``desired`` if the key holds ``expected`` (None: the key must not exist).

        Returns ``(swapped, value now in the store)``. ``swapped`` is True whenever the store
        now holds ``desired``: a key that already held ``desired`` counts as swapped (TCPStore
        cannot tell the two apart). Values compared here must be non-empty.
        """

    def add(self, key: str, amount: int) -> int:
        """Add to a counter (created at 0) and return the new value; ``add(key, 0)`` reads it.
        NotACounter (a StoreError) when the key holds no count."""

    def append(self, key: str, value: bytes) -> None:
        """Append atomically to the key's value (created empty)."""

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """Like :meth:`get` for several keys, in one round trip where the backend can."""

    def wait_for(self, key: str, timeout: float) -> bool:
        """Block until the key exists (True) or ``timeout`` seconds passed (False)."""

    def delete(self, key: str) -> bool:
        """Delete the key; True if it existed."""

    def delete_under(self, prefixes: list[str]) -> int:
        """Delete every key that starts with one of ``prefixes`` (none a prefix of another);
        returns how many."""

    def close(self) -> None:
        """Release the connection; later calls raise StoreConnectionError."""


def counter_value(raw: bytes) -> int | None:
    """A counter's value as the store holds it (ASCII decimal, as TCPStore writes it); None
    when it is no plain non-negative count of an int64 (anyone who reaches the store may write
    one)."""
    return int(raw) if raw.isdigit() and len(raw) < 19 else None


def junk_counter(key: str, held: bytes | None) -> NotACounter | None:
    """The error for a counter key that holds ``held`` (None: nothing): NotACounter when that
    is no count, else None."""
    return None if held is None or counter_value(held) is not None else NotACounter(key, held)


def lost_add(key: str, amount: int, held: bytes | None, lost: StoreConnectionError) -> int:
    """The answer to an add of ``amount`` to ``key`` whose connection was ``lost``, from what
    the key holds on a new connection: TCPStore's server drops the connection of an add over
    a value that is no count, as a lost connection does.  NotACounter where it holds no
    count; where it holds one, that count for an add of 0 (a read: applied or not, it is an
    answer of the call's time), else AddInDoubt; both raised from ``lost``."""
    junk = junk_counter(key, held)
    if junk is not None:
        raise junk from lost
    if amount == 0:
        return 0 if held is None else int(held)
    now = "holds a count" if held is not None else "is missing"
    raise AddInDoubt(f"lost the connection of an add to {key}, which {now} now") from lost


def check_compare_value(expected: bytes | None) -> None:
    if expected == b"":
        raise ValueError(
            "compare_set cannot compare against an empty value; use None for 'missing'"
        )


class Store(Protocol):
    """The same operations as coroutines, for the event loop: what the daemon's parts are
    written against.  :class:`~elasticd.store.tcpstore.TCPStoreClient` speaks to a TCPStore
    without threads; :class:`~elasticd.store.memory.AsyncMemoryStore` is the in-memory one
    of the tests."""

    async def get(self, key: str) -> bytes | None: ...

    async def set(self, key: str, value: bytes) -> None: ...

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]: ...

    async def add(self, key: str, amount: int) -> int: ...

    async def append(self, key: str, value: bytes) -> None: ...

    async def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    async def wait_for(self, key: str, timeout: float) -> bool: ...

    async def delete(self, key: str) -> bool: ...

    async def delete_under(self, prefixes: list[str]) -> int: ...

    async def close(self) -> None: ...
