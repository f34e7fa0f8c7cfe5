"""Running a helper program (the discovery script) so that nothing it starts outlives it.

The program runs in a process group of its own (a new session).  Its leader's exit is seen
through a pidfd *without reaping it*: while the leader is an unreaped zombie its pid, which
is the group's id, cannot be given to anyone else, so the SIGKILL that ends the run reaches
the program's group and nobody else's.  The whole group is killed when the leader exits
(a child it left in the background dies with it), when the run takes too long and when it
prints too much; then the leader is reaped.  A process that left the group (``setsid``)
is beyond a process group's reach: under systemd, the unit's cgroup holds it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

_CHUNK = 65536
_DRAIN = 1.0  # seconds for the pipes to close once the group is killed


@dataclass(frozen=True)
class Finished:
    """How a run ended: the leader's status (Popen's returncode), its stdout (None: more
    than the limit) and the tail of its stderr."""

    returncode: int
    out: bytes | None
    err: bytes


class _Pipe:
    """One of the program's pipes, read on the event loop; ``limit`` None keeps a tail."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        fd: int,
        limit: int | None,
        tail: int,
        on_overflow: Callable[[], None],
    ) -> None:
        self.data: bytearray | None = bytearray()
        self.closed = loop.create_future()
        self._loop, self._fd, self._limit, self._tail = loop, fd, limit, tail
        self._on_overflow = on_overflow
        os.set_blocking(fd, False)
        loop.add_reader(fd, self._read)

    def _read(self) -> None:
        try:
            chunk = os.read(self._fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.close()
        elif self.data is not None:
            self.data += chunk
            if self._limit is None:
                del self.data[: -self._tail]
            elif len(self.data) > self._limit:
                self.data = None
                self._on_overflow()

    def close(self) -> None:
        if not self.closed.done():
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self.closed.set_result(None)


class GroupRun:
    """One run of a program in its own process group (see the module's docstring)."""

    def __init__(self, argv: list[str], *, limit: int, tail: int) -> None:
        self._loop = asyncio.get_running_loop()
        self._proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
        )
        self._pidfd = os.pidfd_open(self._proc.pid)
        self.exited = self._loop.create_future()
        self._loop.add_reader(self._pidfd, self._on_exit)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._out = _Pipe(self._loop, os.dup(self._proc.stdout.fileno()), limit, tail, self.kill)
        self._err = _Pipe(self._loop, os.dup(self._proc.stderr.fileno()), None, tail, self.kill)
        self._proc.stdout.close()
        self._proc.stderr.close()
        self._reaped = False

    def _on_exit(self) -> None:
        """The leader exited: seen, not reaped (WNOWAIT)."""
        status = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if status is not None:
            self._loop.remove_reader(self._pidfd)
            if not self.exited.done():
                self.exited.set_result(None)

    def kill(self) -> None:
        """SIGKILL to the whole group; the leader is not reaped yet, so the group is ours."""
        if not self._reaped:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def result(self) -> Finished:
        """Wait for the leader's exit, end the group, read what is left, reap the leader."""
        await asyncio.shield(self.exited)  # a timeout must not cancel it: close() awaits it
        self.kill()
        await asyncio.wait([self._out.closed, self._err.closed], timeout=_DRAIN)
        return Finished(
            self._reap(),
            None if self._out.data is None else bytes(self._out.data),
            bytes(self._err.data or b""),
        )

    async def close(self) -> None:
        """End the run whatever its state (idempotent): kill the group, reap the leader."""
        self.kill()
        try:
            if not self._reaped:
                await asyncio.shield(self.exited)
        finally:  # cancelled again meanwhile: the SIGKILLed leader is reaped all the same
            self._reap()
            self._out.close()
            self._err.close()

    def _reap(self) -> int:
        if not self._reaped:
            status = os.waitid(os.P_PIDFD, self._pidfd, os.WEXITED)
            assert status is not None  # (None only with WNOHANG)
            self._reaped = True
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            code = status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
            self._proc.returncode = code
        return self._proc.returncode


async def run(argv: list[str], *, timeout: float, limit: int, tail: int) -> Finished:
    """Run ``argv`` (no shell, stdin closed) in its own process group; every process of the
    group is killed and the leader reaped before this returns.  OSError: it could not be
    started; TimeoutError: it took longer than ``timeout`` seconds."""
    group = GroupRun(argv, limit=limit, tail=tail)
    try:
        async with asyncio.timeout(timeout):
            return await group.result()
    finally:
        await group.close()
