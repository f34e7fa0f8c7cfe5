"""A process whose output a test reads as it comes (``Launched``), and the lines of any byte
stream read so (``Lines``): a test waits for a line (``wait_line``) instead of sleeping.
Used by the launcher tests (tests/system/user_nodes.py, tests/integration/
test_elasticrun_without_daemon.py, tests/chaos/test_private_daemons_attacked.py)."""

from __future__ import annotations

import re
import signal
import subprocess
import threading
import time

import psutil


class Lines:
    """The lines of a byte stream (a pipe, a FIFO), read by a thread as they come."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str | None] = []
        self._changed = threading.Condition()
        self.reader = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self.reader.start()

    def _read(self, stream: object) -> None:
        for raw in stream:  # type: ignore[attr-defined]
            with self._changed:
                self.lines.append(raw.decode(errors="replace").rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self.lines.append(None)  # the end of the stream
            self._changed.notify_all()

    def text(self) -> str:
        with self._changed:
            return "\n".join(line for line in self.lines if line is not None)

    def mark(self) -> int:
        with self._changed:
            return len(self.lines)

    def wait_line(self, pattern: str, timeout: float = 120.0, after: int = 0) -> re.Match[str]:
        """The first line from line ``after`` on that matches ``pattern``, waiting for it."""
        wanted = re.compile(pattern)
        deadline = time.monotonic() + timeout
        seen = after
        with self._changed:
            while True:
                for line in self.lines[seen:]:
                    if line is None:
                        raise AssertionError(f"the stream ended without {pattern!r}")
                    if match := wanted.search(line):
                        return match
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no {pattern!r} in {timeout:g} s")
                self._changed.wait(left)


class Launched:
    """A process started with ``argv``; its stdout and stderr read as they come.  ``name``
    says which in its story (a test host, a node)."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: str, name: str = "") -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
        )
        self.started = time.monotonic()
        self.streams = {"out": Lines(self.proc.stdout), "err": Lines(self.proc.stderr)}

    def text(self, stream: str = "out") -> str:
        return self.streams[stream].text()

    def mark(self, stream: str = "out") -> int:
        """Where ``stream`` is now: wait_line(..., after=mark) looks at later lines only."""
        return self.streams[stream].mark()

    def wait_line(
        self, pattern: str, stream: str = "out", timeout: float = 120.0, after: int = 0
    ) -> re.Match[str]:
        """The first line of ``stream`` (from line ``after`` on) that matches ``pattern`` (a
        regex), waiting for it; AssertionError when the stream ended or ``timeout`` passed
        first."""
        try:
            return self.streams[stream].wait_line(pattern, timeout, after)
        except AssertionError as exc:
            raise AssertionError(self.story(str(exc))) from None

    def wait(self, timeout: float = 120.0) -> int:
        """Its exit status, once it ended and its output is read (AssertionError after
        ``timeout``: it is killed then)."""
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.dump_stacks()
            self.kill_tree()
            raise AssertionError(self.story(f"still running after {timeout:g} s")) from None
        for lines in self.streams.values():
            lines.reader.join(30)
        return code

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def dump_stacks(self) -> None:
        """Where it and what it started are stuck, for the story of a hang: with
        PYTHONFAULTHANDLER in its environment, each Python process prints its threads'
        stacks to its stderr on SIGABRT, then ends (the private daemons it started write to
        its stderr too)."""
        if not self.env.get("PYTHONFAULTHANDLER"):
            return
        self._signal_tree(signal.SIGABRT, wait=10)
        for lines in self.streams.values():
            lines.reader.join(5)

    def kill_tree(self) -> list[int]:
        """SIGKILL to it and everything it started (a host gone); their pids."""
        return self._signal_tree(signal.SIGKILL, wait=30)

    def _signal_tree(self, sig: int, wait: float) -> list[int]:
        """``sig`` to it and everything it started, then up to ``wait`` s for them to end."""
        procs = [*self.descendants()]
        try:
            procs.insert(0, psutil.Process(self.proc.pid))
        except psutil.NoSuchProcess:
            pass
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=wait)
        return [proc.pid for proc in procs]

    def story(self, why: str) -> str:
        return (
            f"{self.name}: {why}\n--- stdout ---\n{self.text('out')[-3000:]}\n"
            f"--- stderr ---\n{self.text('err')[-12000:]}"
        )
