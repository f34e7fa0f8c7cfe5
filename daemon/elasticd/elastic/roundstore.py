"""A round's TCPStore, opened by a thread as soon as the worker hears its place.

``env://`` would open it only when the group forms, and a client that comes before the
host listens (a newcomer is placed while the survivors still train) is held by TCPStore's
own retry, which backs off to ~0.5 s on this machine, and every rank then waits for it in
gloo's rendezvous. Here the host (rank 0) listens at once, each client polls the port
every 5 ms and connects as soon as it listens, and a survivor does both while its old
group still trains: when the group is switched at the next commit, its store is there.
Torch and the standard library only.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Callable

import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

from .errors import GroupAborted

_POLL = 0.005  # seconds between a client's looks at the host's port
Sockets = dict[int, int]  # fd -> inode


class RoundStore:
    """The store of ``round`` (its env: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE), being
    opened on a thread; ``sockets`` lists the fds that this opened (``fds()`` before and
    after), which an abort shuts down like the group's own."""

    def __init__(self, round: int, env: dict[str, str], backend: str,
                 stop: Callable[[], bool], fds: Callable[[], Sockets]) -> None:
        self.round = round
        self.endpoint = (env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", ""))
        self.sockets: Sockets = {}
        self._env, self._backend, self._fds = env, backend, fds
        self._stop = stop
        self._cancelled = False
        self.started = False
        self._store: dist.Store | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()

    def start(self) -> RoundStore:
        self.started = True
        threading.Thread(target=self._open, name=f"elasticd-store-{self.round}", daemon=True).start()
        return self

    def cancel(self) -> None:
        """Give up: a newer round replaces this one (a store already open is dropped)."""
        self._cancelled = True

    def take(self) -> dist.Store:
        """The store, once open (as ``init_process_group`` wraps an ``env://`` one); raises
        what opening it raised (GroupAborted when the round was aborted meanwhile)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._store is not None
        return dist.PrefixStore("default_pg", self._store)

    def _open(self) -> None:
        try:
            before = self._fds()
            self._store = open_store(self._env, self._backend, lambda: self._cancelled or self._stop())
            self.sockets = {fd: ino for fd, ino in self._fds().items() if before.get(fd) != ino}
        except BaseException as error:  # handed to take()
            self._error = error
        finally:
            self._done.set()


def open_store(env: dict[str, str], backend: str, stop: Callable[[], bool]) -> dist.Store:
    """The TCPStore that ``env://`` opens for ``env`` (rank 0 hosts it; the same timeout),
    a client connecting only once the host's port listens (see the module's docstring).
    Raises GroupAborted once ``stop()`` says so, or when the port never listened within
    the store's timeout."""
    addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    rank, size = int(env["RANK"]), int(env["WORLD_SIZE"])
    timeout = default_pg_nccl_timeout if backend == "nccl" else default_pg_timeout
    if rank != 0:
        _wait_listening(addr, port, stop, time.monotonic() + timeout.total_seconds())
    return dist.TCPStore(addr, port, size, rank == 0, timeout=timeout, wait_for_workers=False,
                         multi_tenant=True, use_libuv=True)


def _wait_listening(addr: str, port: int, stop: Callable[[], bool], deadline: float) -> None:
    """Return once ``addr:port`` accepts a connection (the one look is closed at once)."""
    while True:
        if stop():
            raise GroupAborted("the round was aborted before its store opened")
        try:
            socket.create_connection((addr, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise GroupAborted(f"the round's store at {addr}:{port} never listened") from None
            time.sleep(_POLL)
