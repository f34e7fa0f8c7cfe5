"""torch's blocking TCPStore client, as a StoreBackend: for tests and tools (the daemon uses
:mod:`elasticd.store.tcpstore`, and hosts the store with :mod:`elasticd.store.tcpserver`).

Facts about torch's client that shape this module:

- ``get`` of a missing key blocks for the whole store timeout, so :meth:`C10dStore.get` is a
  ``compare_set(key, SENTINEL, SENTINEL)``: on a missing key TCPStore answers with the
  expected value without writing it; on a present key it answers with the value.
- A client shared by several threads collapses under load: each thread gets its own client.
- After a failed request a client's connection may be out of step with the server, so the
  thread's client is dropped and the next call reconnects.
- It holds the GIL while it waits for an answer: a server on a thread of the same process
  (ours is Python) would never answer.  Tests host the store in a child process.
- Every new connection makes it do a reverse DNS lookup of the peer (for its logs). With a
  resolver that drops packets a connect can stall for the resolver timeout;
  ``RES_OPTIONS="timeout:1 attempts:1"`` bounds that.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

from elasticd.endpoint import split_endpoint
from elasticd.errors import StoreConnectionError, StoreTimeout
from elasticd.store.base import check_compare_value, lost_add
from elasticd.store.tcpstore import MISSING as _MISSING  # the same sentinel on both clients

_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 2.0


def _tcp_client(host: str, port: int, *, timeout: float):
    from torch.distributed import TCPStore  # torch is heavy: imported when a client is made

    return TCPStore(
        host, port, None, False, timedelta(seconds=timeout), wait_for_workers=False, use_libuv=True
    )


def connect(endpoint: str, *, timeout: float = 30.0, connect_timeout: float = 60.0) -> C10dStore:
    """Connect to the store at ``host:port``, retrying with capped back-off (0.05 s .. 2 s).

    Raises StoreConnectionError naming the endpoint when it did not answer within
    ``connect_timeout`` seconds. ``timeout`` bounds each later request.
    """
    store = C10dStore(endpoint, timeout=timeout)
    store._attach(store._open_client(connect_timeout))
    return store


class C10dStore:
    """A :class:`~elasticd.store.base.StoreBackend` over TCPStore, one client per thread."""

    def __init__(self, endpoint: str, *, timeout: float = 30.0) -> None:
        self.endpoint = endpoint
        self.timeout = timeout
        self._host, self._port = split_endpoint(endpoint)
        self._local = threading.local()
        self._closed = False

    # -- StoreBackend ------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        with self._client() as client:
            value = client.compare_set(key, _MISSING, _MISSING)
        return None if value == _MISSING else value

    def set(self, key: str, value: bytes) -> None:
        with self._client() as client:
            client.set(key, value)

    def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        check_compare_value(expected)
        if expected == desired:  # TCPStore's answer would be ambiguous; a no-op swap is a read
            current = self.get(key)
            return current == desired, current
        with self._client() as client:
            value = client.compare_set(key, expected or b"", desired)
        if value == desired:
            return True, value
        if (
            expected is not None and value == expected
        ):  # TCPStore echoes `expected` on a missing key
            return False, None
        return False, value

    def add(self, key: str, amount: int) -> int:
        """NotACounter when the key holds no count (the server drops the connection of an
        add over one: see TCPStoreClient.add)."""
        try:
            with self._client() as client:
                return client.add(key, amount)
        except StoreConnectionError as lost:
            # a store that is gone fails this read too
            return lost_add(key, amount, self.get(key), lost)

    def append(self, key: str, value: bytes) -> None:
        with self._client() as client:
            client.append(key, value)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """One ``multi_get`` when all keys exist (checked first: it would block on a missing one)."""
        if not keys:
            return []
        with self._client() as client:
            everything_there = client.check(keys)
            if everything_there:
                return list(client.multi_get(keys))
        return [self.get(key) for key in keys]

    def wait_for(self, key: str, timeout: float) -> bool:
        from torch.distributed import DistStoreError

        with self._client() as client:
            if timeout <= 0:
                return client.check([key])
            try:
                client.wait([key], timedelta(seconds=timeout))
            except DistStoreError:  # the wait timed out; the connection stays usable
                return False
            return True

    def delete(self, key: str) -> bool:
        with self._client() as client:
            return client.delete_key(key)

    def delete_under(self, prefixes: list[str]) -> int:
        """TCPStore has no range: its whole key list, then a delete each."""
        if not prefixes:
            return 0
        with self._client() as client:
            doomed = [key for key in client.list_keys() if key.startswith(tuple(prefixes))]
            return sum(client.delete_key(key) for key in doomed)

    def close(self) -> None:
        self._closed = True
        self._local = threading.local()  # the clients go with the old thread-local map

    # -- clients -------------------------------------------------------------------------

    @contextmanager
    def _client(self) -> Iterator:
        """This thread's client, with torch's errors mapped to ours.

        A client that failed a request is dropped; the next call reconnects.
        """
        if self._closed:
            raise StoreConnectionError(f"the store client for {self.endpoint} is closed")
        local = self._local
        client = getattr(local, "client", None)
        if client is None:
            client = local.client = self._open_client(self.timeout)
        try:
            yield client
        except RuntimeError as err:  # torch.distributed.DistError and friends
            local.client = None
            raise self._mapped(err) from err

    def _mapped(self, err: RuntimeError) -> Exception:
        from torch.distributed import DistStoreError

        if isinstance(err, DistStoreError):
            return StoreTimeout(f"store {self.endpoint}: {err}")
        return StoreConnectionError(f"lost the store at {self.endpoint}: {err}")

    def _attach(self, client) -> None:
        self._local.client = client

    def _open_client(self, budget: float):
        """A new TCPStore client, retrying until ``budget`` seconds have passed.

        A plain socket probes the endpoint first: TCPStore's own connect loop overshoots short
        timeouts and logs a C++ stack trace for every refused attempt.
        """
        deadline = time.monotonic() + budget
        backoff = _FIRST_BACKOFF
        while True:
            remaining = deadline - time.monotonic()
            try:
                self._probe(min(remaining, 1.0))
                client = _tcp_client(self._host, self._port, timeout=max(remaining, 0.1))
                client.set_timeout(timedelta(seconds=self.timeout))
                return client
            except (OSError, RuntimeError) as err:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreConnectionError(
                        f"the store at {self.endpoint} did not answer within {budget:g}s: {err}"
                    ) from err
                time.sleep(min(backoff, remaining))
                backoff = min(backoff * 2, _MAX_BACKOFF)

    def _probe(self, timeout: float) -> None:
        if timeout <= 0:
            raise TimeoutError("no time left")
        socket.create_connection((self._host, self._port), timeout=timeout).close()
