"""AsyncStore: any blocking StoreBackend (the in-memory store, torch's TCPStore client) as
the coroutines of :class:`~elasticd.store.base.Store`.  The daemon speaks to its TCPStore
without threads (:mod:`elasticd.store.tcpstore`); this adapter is for the rest.

Every operation runs on a thread; the threads are few and long-lived, each with its own
connection (a TCPStore client is not shared between threads):

- ``quick`` threads take every operation but waits, each queued on the least busy one;
- a wait (``wait_for``) blocks on purpose and gets a thread of its own, at most ``waits`` of
  them at once (a further wait queues for one; its own timeout still counts from its call).
  A wait whose caller gave up (a lost race, a cancelled task) ends within ``_WAIT_SLICE``
  (TCPStore cannot cancel one), and only then is its thread free for the next.

Each operation has a deadline seen from the event loop: the store timeout (a wait: its own
timeout plus that).  A call on a connection that went silent (a partition) can block far
longer than the backend's own timeout; past the deadline the caller gets StoreTimeout and
the thread is given up and replaced.  ``close`` gives up every call still awaited (a wait
ends at its next slice) and returns once no thread is left in the backend: a thread that
returned into a finalizing interpreter would abort the process.  A thread still in a call
after ``_CLOSE_GRACE`` is stuck on a silent store, and only then the backend's ``abort``
ends it (it shuts down every connection of the process to that store: all of them are as
silent).
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Any, Callable

from elasticd.errors import StoreConnectionError, StoreTimeout
from elasticd.store.base import StoreBackend

_CLOSE_GRACE = 2.0  # seconds threads get to finish their calls at close, before an abort
_WAIT_SLICE = 1.0  # seconds a wait blocks in the backend before it checks that it is still awaited


class _Lane:
    """One thread running queued calls in order."""

    def __init__(self, name: str) -> None:
        self.queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=_serve, args=(self.queue,), name=name, daemon=True)
        self.thread.start()
        self.busy = False  # a wait lane: its call has not returned yet (seen from the loop)
        self.given_up = False

    def put(self, future: asyncio.Future[Any], fn: Callable[..., Any], args: tuple,
            done: Callable[[], None] | None = None) -> None:
        """Run ``fn(*args)`` for ``future``; ``done`` is called on the loop once it returned."""
        self.queue.put((future, fn, args, done))

    def stop(self) -> None:
        self.queue.put(None)


def _serve(work: queue.SimpleQueue[Any]) -> None:
    """Run each call and hand its result to the caller's loop (one wake-up of the loop per
    call).  A call whose caller gave up before it started is skipped."""
    while (item := work.get()) is not None:
        future, fn, args, done = item
        loop = future.get_loop()
        if future.done():
            outcome = None
        else:
            try:
                outcome = (fn(*args), None)
            except BaseException as exc:
                outcome = (None, exc)
        try:
            if outcome is not None:
                loop.call_soon_threadsafe(_settle, future, *outcome)
            if done is not None:
                loop.call_soon_threadsafe(done)
        except RuntimeError:
            pass  # the loop is closed: nobody waits


def _settle(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(result)
    else:
        future.set_exception(exc)


def _wait(backend: StoreBackend, key: str, timeout: float, future: asyncio.Future[Any]) -> bool:
    """The blocking side of ``wait_for``, in slices: it ends soon once nobody awaits it."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        found = backend.wait_for(key, max(0.0, min(left, _WAIT_SLICE)))
        if found or left <= _WAIT_SLICE or future.done():
            return found


class AsyncStore:
    """The StoreBackend operations as coroutines (see the module docstring)."""

    def __init__(self, backend: StoreBackend, *, timeout: float = 30.0, quick: int = 4,
                 waits: int = 64, name: str = "store") -> None:
        self.backend = backend
        self.timeout = timeout
        self._name = name
        self._quick = [_Lane(f"{name}-{i}") for i in range(quick)]
        self._waiters: set[_Lane] = set()
        self._idle_waiters = [self._new_waiter()]  # the first wait starts no thread
        self._wait_slots = asyncio.Semaphore(waits)
        self._given_up: list[threading.Thread] = []
        self._awaited: set[asyncio.Future[Any]] = set()
        self._closed = False

    # -- the StoreBackend operations ------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        return await self._call(self.backend.get, key)

    async def set(self, key: str, value: bytes) -> None:
        await self._call(self.backend.set, key, value)

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        return await self._call(self.backend.compare_set, key, expected, desired)

    async def add(self, key: str, amount: int) -> int:
        return await self._call(self.backend.add, key, amount)

    async def append(self, key: str, value: bytes) -> None:
        await self._call(self.backend.append, key, value)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        return await self._call(self.backend.get_many, keys) if keys else []

    async def delete(self, key: str) -> bool:
        return await self._call(self.backend.delete, key)

    async def wait_for(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` seconds."""
        started = time.monotonic()
        await self._wait_slots.acquire()  # released once the lane's call returned (_waited)
        lane = self._idle_waiters.pop() if self._idle_waiters else self._new_waiter()
        lane.busy = True
        left = max(0.0, timeout - (time.monotonic() - started))
        future = asyncio.get_running_loop().create_future()
        try:
            return await self._on(lane, future, _wait, self.backend, key, left, future,
                                  deadline=left + self.timeout, done=lambda: self._waited(lane))
        except StoreTimeout:
            if lane.busy:  # stuck: given up, never reused
                lane.given_up = True
                self._waiters.discard(lane)
                lane.stop()
                self._given_up.append(lane.thread)
                self._wait_slots.release()
            raise

    # -- threads --------------------------------------------------------------------------

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        index = min(range(len(self._quick)), key=lambda i: self._quick[i].queue.qsize())
        future = asyncio.get_running_loop().create_future()
        try:
            return await self._on(self._quick[index], future, fn, *args, deadline=self.timeout)
        except StoreTimeout:
            self._quick[index] = self._replace(self._quick[index], f"{self._name}-{index}")
            raise

    async def _on(self, lane: _Lane, future: asyncio.Future[Any], fn: Callable[..., Any], *args: Any,
                  deadline: float, done: Callable[[], None] | None = None) -> Any:
        if self._closed:
            if done is not None:
                done()
            raise StoreConnectionError("the store connection is closed")
        lane.put(future, fn, args, done)
        self._awaited.add(future)
        try:
            async with asyncio.timeout(deadline):  # not wait_for: see elasticd.aio
                return await future
        except TimeoutError:
            raise StoreTimeout(f"{getattr(fn, '__name__', 'a store call')} did not return "
                               f"within {deadline:g} s") from None
        finally:
            future.cancel()  # a call not started yet is skipped; a wait ends at its next slice
            self._awaited.discard(future)

    def _waited(self, lane: _Lane) -> None:
        """A wait lane's call returned: its slot and the lane are free again."""
        lane.busy = False
        if lane.given_up:
            return
        self._wait_slots.release()
        if not self._closed:
            self._idle_waiters.append(lane)

    def _new_waiter(self) -> _Lane:
        lane = _Lane(f"{self._name}-wait-{len(self._waiters) + 1}")
        self._waiters.add(lane)
        return lane

    def _replace(self, stuck: _Lane, name: str) -> _Lane:
        """A fresh lane takes the stuck one's queued calls; the stuck thread ends if its call
        ever returns."""
        fresh = _Lane(name)
        while True:
            try:
                item = stuck.queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                fresh.queue.put(item)
        stuck.stop()
        self._given_up.append(stuck.thread)
        return fresh

    async def close(self) -> None:
        """Stop every thread and close the backend (see the module docstring)."""
        if self._closed:
            return
        self._closed = True
        for future in self._awaited:
            future.cancel()
        lanes = self._quick + list(self._waiters)
        for lane in lanes:
            lane.stop()
        await asyncio.to_thread(_close, [lane.thread for lane in lanes] + self._given_up, self.backend)


def _close(threads: list[threading.Thread], backend: StoreBackend) -> None:
    """Let the threads finish their calls (nobody awaits them any more), abort the ones
    stuck on a silent store, close the backend."""
    _join(threads, _CLOSE_GRACE)
    abort = getattr(backend, "abort", None)
    if abort is not None and any(thread.is_alive() for thread in threads):
        abort()
        _join(threads, _CLOSE_GRACE)
    backend.close()


def _join(threads: list[threading.Thread], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
