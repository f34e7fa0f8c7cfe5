"""An in-process store with the same semantics as the c10d one, for tests: blocking
(MemoryStore) and as the coroutines of :class:`~elasticd.store.base.Store` (AsyncMemoryStore)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from elasticd.errors import StoreConnectionError
from elasticd.store.base import check_compare_value, junk_counter


class MemoryStore:
    """A dict behind a condition variable; ``wait_for`` wakes on the next write."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._listeners: set[Callable[[], None]] = set()

    def get(self, key: str) -> bytes | None:
        with self._changed:
            self._check_open()
            return self._data.get(key)

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._write(key, bytes(value))

    def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        check_compare_value(expected)
        with self._changed:
            self._check_open()
            current = self._data.get(key)
            if current in (expected, desired) or (
                expected is None and current == b""
            ):  # as TCPStore
                self._write(key, bytes(desired))
                return True, bytes(desired)
            return False, current

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            self._check_open()
            junk = junk_counter(key, self._data.get(key))
            if junk is not None:
                raise junk
            value = int(self._data.get(key, b"0")) + amount
            self._write(key, str(value).encode())
            return value

    def append(self, key: str, value: bytes) -> None:
        with self._changed:
            self._check_open()
            self._write(key, self._data.get(key, b"") + bytes(value))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._changed:
            self._check_open()
            return [self._data.get(key) for key in keys]

    def wait_for(self, key: str, timeout: float) -> bool:
        with self._changed:
            self._changed.wait_for(
                lambda: self._closed or key in self._data, timeout=max(timeout, 0.0)
            )
            self._check_open()
            return key in self._data

    def delete(self, key: str) -> bool:
        with self._changed:
            self._check_open()
            return self._data.pop(key, None) is not None

    def delete_under(self, prefixes: list[str]) -> int:
        with self._changed:
            self._check_open()
            doomed = [key for key in self._data if key.startswith(tuple(prefixes))]
            for key in doomed:
                del self._data[key]
            return len(doomed)

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix`` (tests use it to play a store that lost its data)."""
        with self._changed:
            return sorted(key for key in self._data if key.startswith(prefix))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._notify()

    def listen(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback()`` after every write and at close, in the writer's thread (it
        must not block); returns the function that stops it."""
        with self._changed:
            self._listeners.add(callback)
        return lambda: self._listeners.discard(callback)

    def _write(self, key: str, value: bytes) -> None:
        self._check_open()
        self._data[key] = value
        self._notify()

    def _notify(self) -> None:
        self._changed.notify_all()
        for callback in list(self._listeners):
            callback()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreConnectionError("the in-memory store is closed")


class AsyncMemoryStore:
    """A MemoryStore as the coroutines of Store, on any event loop; several loops may share
    one MemoryStore (one per node in the rendezvous tests).  Its operations never block, so
    they run on the caller's loop, each after a turn of it (as a network call would give one:
    a caller that retries in a loop must not starve the others); a wait is woken by the
    write it waits for.  ``close`` closes this view only: the MemoryStore is its owner's."""

    def __init__(self, backend: MemoryStore) -> None:
        self.backend = backend

    async def get(self, key: str) -> bytes | None:
        await asyncio.sleep(0)
        return self.backend.get(key)

    async def set(self, key: str, value: bytes) -> None:
        await asyncio.sleep(0)
        self.backend.set(key, value)

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        await asyncio.sleep(0)
        return self.backend.compare_set(key, expected, desired)

    async def add(self, key: str, amount: int) -> int:
        await asyncio.sleep(0)
        return self.backend.add(key, amount)

    async def append(self, key: str, value: bytes) -> None:
        await asyncio.sleep(0)
        self.backend.append(key, value)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        await asyncio.sleep(0)
        return self.backend.get_many(keys)

    async def delete(self, key: str) -> bool:
        await asyncio.sleep(0)
        return self.backend.delete(key)

    async def delete_under(self, prefixes: list[str]) -> int:
        await asyncio.sleep(0)
        return self.backend.delete_under(prefixes)

    async def wait_for(self, key: str, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        written = asyncio.Event()
        deadline = loop.time() + timeout

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(written.set)
            except RuntimeError:  # that loop is closed: nobody waits there
                pass

        stop = self.backend.listen(wake)
        try:
            while True:
                written.clear()
                if self.backend.wait_for(key, 0) or loop.time() >= deadline:  # a check: no wait
                    return self.backend.wait_for(key, 0)
                try:
                    async with asyncio.timeout_at(deadline):
                        await written.wait()
                except TimeoutError:
                    pass
        finally:
            stop()

    async def close(self) -> None:
        pass
