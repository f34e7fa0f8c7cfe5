"""An in-process store with the same semantics as the c10d one, for tests and standalone use."""

from __future__ import annotations

import threading

from elasticd.errors import StoreConnectionError
from elasticd.store.base import check_compare_value


class MemoryStore:
    """A dict behind a condition variable; ``wait_for`` wakes on the next write."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._closed = False
        self._aborts = 0  # bumped by abort(): waits in progress end

    def get(self, key: str) -> bytes | None:
        with self._changed:
            self._check_open()
            return self._data.get(key)

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._write(key, bytes(value))

    def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        check_compare_value(expected)
        with self._changed:
            self._check_open()
            current = self._data.get(key)
            if current == expected or current == desired:
                self._write(key, bytes(desired))
                return True, bytes(desired)
            return False, current

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            self._check_open()
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
            aborts = self._aborts
            self._changed.wait_for(lambda: self._closed or key in self._data or self._aborts != aborts,
                                   timeout=max(timeout, 0.0))
            self._check_open()
            return key in self._data

    def delete(self, key: str) -> bool:
        with self._changed:
            self._check_open()
            return self._data.pop(key, None) is not None

    def keys(self, prefix: str = "") -> list[str]:
        """The keys under ``prefix`` (tests use it to play a store that lost its data)."""
        with self._changed:
            return sorted(key for key in self._data if key.startswith(prefix))

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def abort(self) -> None:
        """End the waits in progress now (they return as if timed out)."""
        with self._changed:
            self._aborts += 1
            self._changed.notify_all()

    def _write(self, key: str, value: bytes) -> None:
        self._check_open()
        self._data[key] = value
        self._changed.notify_all()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreConnectionError("the in-memory store is closed")
