"""A rendezvous handler driven from plain threads, as the rendezvous tests, their participant
processes and bench_rendezvous do.

Each BlockingRendezvous is one node: its own event loop in a thread of its own (as in a
daemon), its own store client (a TCPStoreClient to a TCPStore's endpoint, as in a daemon;
an AsyncMemoryStore over a shared MemoryStore), and its keeper task running.
Its methods block the calling thread until the handler's coroutine is done; ``watch``
returns a concurrent Future.  ``is_closed`` and ``num_nodes_waiting`` read the state straight
from the backend: the daemon never needs them, the tests do.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from collections.abc import Awaitable
from typing import Any

from elasticd.rendezvous import RendezvousInfo, RendezvousSettings, RoundEvent
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.ops import num_waiting
from elasticd.rendezvous.state import RendezvousState, decode
from elasticd.store.base import Store, StoreBackend
from elasticd.store.c10d import C10dStore
from elasticd.store.memory import AsyncMemoryStore, MemoryStore
from elasticd.store.signing import Signer
from elasticd.store.tcpstore import TCPStoreClient


def _client(store: StoreBackend) -> Store:
    """This node's own client of the store the nodes share."""
    if isinstance(store, C10dStore):
        return TCPStoreClient(store.endpoint, timeout=store.timeout)
    if isinstance(store, MemoryStore):
        return AsyncMemoryStore(store)
    raise TypeError(f"no async client for {type(store).__name__}")


class BlockingRendezvous:
    def __init__(
        self,
        store: StoreBackend,
        signer: Signer,
        settings: RendezvousSettings,
        node: str,
        addr: str,
        **kwargs: Any,
    ) -> None:
        self._backend, self._signer, self._prefix = store, signer, kwargs["prefix"]
        self.settings = settings
        self.node = node
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"node-{node}", daemon=True
        )
        self._thread.start()

        async def build() -> None:
            self.store = _client(store)
            self.handler = RendezvousHandler(self.store, signer, settings, node, addr, **kwargs)
            self._keeper = asyncio.create_task(self.handler.keep())

        self._call(build())
        self._stopping: concurrent.futures.Future[None] | None = None

    def _call(self, coro: Awaitable[Any], timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def timed(self, method: str, *args: Any) -> tuple[float, float, Any]:
        """(started, returned, result) of a handler method, both times taken on this node's
        loop (perf_counter): as a daemon's agent sees it, without the hand-off from the
        calling thread to the loop and back."""

        async def run() -> tuple[float, float, Any]:
            started = time.perf_counter()
            result = await getattr(self.handler, method)(*args)
            return started, time.perf_counter(), result

        return self._call(run())

    def when_superseded(self, round: int, method: str, *args: Any) -> concurrent.futures.Future:
        """Once ``round`` is superseded, ``timed(method, *args)`` on this node's loop, as a
        daemon's agent rejoins: the watch and the call stay on the loop."""

        async def run() -> tuple[float, float, Any]:
            await self.handler.watch(round)
            started = time.perf_counter()
            result = await getattr(self.handler, method)(*args)
            return started, time.perf_counter(), result

        return asyncio.run_coroutine_threadsafe(run(), self._loop)

    def next_rendezvous(self, nproc: int, master_port: int) -> RendezvousInfo:
        return self._call(self.handler.next_rendezvous(nproc, master_port))

    def request_next_round(self, round: int, reason: Any, lost: tuple[str, ...] = ()) -> Any:
        return self._call(self.handler.request_next_round(round, reason, lost))

    def leave(self, reason: Any = "drain") -> None:
        self._call(self.handler.leave(reason))

    def set_closed(self) -> None:
        self._call(self.handler.set_closed())

    def watch(self, round: int, *, waiting: bool = True) -> concurrent.futures.Future[RoundEvent]:
        if self._stopping is not None:  # as the handler's own watch() after shutdown
            cancelled: concurrent.futures.Future[RoundEvent] = concurrent.futures.Future()
            cancelled.cancel()
            return cancelled

        async def watching() -> RoundEvent:
            return await self.handler.watch(round, waiting=waiting)

        return asyncio.run_coroutine_threadsafe(watching(), self._loop)

    def exit_barrier_arrive(self, info: RendezvousInfo) -> None:
        self._call(self.handler.exit_barrier_arrive(info))

    def exit_barrier_wait(self, info: RendezvousInfo, timeout: float) -> bool:
        return self._call(self.handler.exit_barrier_wait(info, timeout))

    def exit_barrier_progress(self, info: RendezvousInfo) -> tuple[int, int]:
        return self._call(self.handler.exit_barrier_progress(info))

    def is_closed(self) -> bool:
        return self._state().closed

    def num_nodes_waiting(self) -> int:
        return num_waiting(self._state(), self.settings)

    def _state(self) -> Any:
        key = Keys(self._prefix).state
        raw = self._backend.get(key)
        return decode(self._signer.open(key, raw).body) if raw is not None else RendezvousState()

    def shutdown(self, wait: bool = False) -> None:
        """Stop the node: its keeper ends (no more heartbeats), pending joins and watches end.
        ``wait``: until its loop and store threads are gone."""
        if self._stopping is None:
            self._stopping = asyncio.run_coroutine_threadsafe(self._stop(), self._loop)
        if wait and self._thread.is_alive():
            self._stopping.result(30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(30)

    async def _stop(self) -> None:
        self.handler.shutdown()
        self._keeper.cancel()
        await asyncio.wait([self._keeper])
        pending = asyncio.all_tasks() - {asyncio.current_task()}
        if pending:  # a join in progress ends by itself at its next step, closed
            _, stuck = await asyncio.wait(pending, timeout=self.settings.keep_alive_interval + 1)
            for task in stuck:
                task.cancel()
        await self.store.close()
