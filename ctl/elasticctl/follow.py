"""Following a job as torchrun shows one: the workers' output on this console as they write
it (stdout to stdout, stderr to stderr, plain or with torchrun's tee prefix), a copy under
``--log-dir``, and at the end the job's outcome.  The console gets the workers' bytes as
they wrote them, as torchrun's inherited console does: the job is the caller's own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TextIO

from elasticctl.client import Client
from elasticctl.torchrun import Output

Doc = Mapping[str, Any]
TAIL_LINES = 20
ENDED = frozenset({"SUCCEEDED", "FAILED", "CANCELLED"})


class RankPlaces:
    """A rank's local rank in a round, learnt from the job's documents: asked for each rank
    of a round not known yet (ranks and local ranks change from round to round).  A node's
    part of a round can reach the answering daemon after that node's workers' output does
    (output comes straight from the node, parts through the store): a rank not in the
    answer is asked for again, every ``pause`` s for up to ``patience`` s, before its
    global rank stands in."""

    def __init__(
        self,
        status: Callable[[], Doc],
        patience: float = 3.0,
        pause: float = 0.1,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self._status = status
        self._places: dict[tuple[int, int], int] = {}
        self._asked: set[tuple[int, int]] = set()
        self._patience, self._pause, self._sleep = patience, pause, sleep

    def local_rank(self, attempt: int | None, rank: int | None) -> int | None:
        if rank is None or attempt is None:
            return None
        key = (attempt, rank)
        if key not in self._places and key not in self._asked:
            self._asked.add(key)
            for _ in range(max(1, round(self._patience / self._pause))):
                if self.learn(self._status()) or key in self._places or rank < 0:
                    break
                self._sleep(self._pause)
        return self._places.get(key, rank)

    def learn(self, job: Doc) -> bool:
        """Take the places in ``job``; whether it has ended (nothing more will come)."""
        round_ = job.get("round")
        for worker in job.get("workers") or []:
            if round_ is not None and worker.get("rank") is not None:
                self._places[(round_, worker["rank"])] = worker.get("local_rank", worker["rank"])
        return job.get("state") in ENDED


class Console:
    """Where each output line goes, by the plan (torchrun's --redirects, --tee,
    --local-ranks-filter and --log-dir).  A line comes without its newline."""

    def __init__(
        self, job_id: str, plan: Output, places: RankPlaces, out: TextIO, err: TextIO
    ) -> None:
        self._job_id, self._plan, self._places = job_id, plan, places
        self._streams = {"out": out, "err": err}
        self._copies: dict[tuple[int, int, str], TextIO] = {}

    def write(self, line: Doc) -> None:
        stream, text = line.get("stream", "out"), str(line.get("text", "")) + "\n"
        rank, attempt = line.get("rank"), line.get("attempt")
        if self._plan.log_dir and rank is not None and attempt is not None:
            self._copy(attempt, rank, stream).write(text)
        local_rank = self._places.local_rank(attempt, rank)
        if rank is not None and local_rank is not None:  # else a line of no rank: plain
            shown = self._plan.shown(stream, local_rank)
            if shown is None:
                return
            if shown == "prefixed":
                text = self._plan.prefix(rank, local_rank) + text
        self._streams["err" if stream == "err" else "out"].write(text)

    def flush(self) -> None:
        for handle in (*self._streams.values(), *self._copies.values()):
            handle.flush()

    def close(self) -> None:
        for handle in self._copies.values():
            handle.close()
        self._copies.clear()

    def _copy(self, attempt: int, rank: int, stream: str) -> TextIO:
        """torchrun's layout: <log dir>/<run>/attempt_<n>/<rank>/{stdout,stderr}.log (a
        directory per global rank: the local rank on a one-node job, as torchrun names it)."""
        key = (attempt, rank, stream)
        if key not in self._copies:
            directory = os.path.join(
                self._plan.log_dir or ".", self._job_id, f"attempt_{attempt}", str(rank)
            )
            os.makedirs(directory, exist_ok=True)
            name = "stderr.log" if stream == "err" else "stdout.log"
            self._copies[key] = open(
                os.path.join(directory, name), "a", encoding="utf-8", errors="surrogateescape"
            )
        return self._copies[key]


def stream_output(
    connect: Callable[[], Client], job_id: str, console: Console, local: bool = False
) -> None:
    """Show the job's output until it ends (the daemon ends the stream then); ``local``:
    only the workers' of the daemon's own node, as each node's torchrun shows its own."""
    request = {"job": job_id, "follow": True, **({"local": True} if local else {})}
    with connect() as daemon:
        for result in daemon.stream("logs", request):
            for line in _lines(result):
                console.write(line)
            console.flush()


def stderr_tail(connect: Callable[[], Client], job: Doc, lines: int = TAIL_LINES) -> list[str]:
    """The last lines the failing rank wrote to stderr in the job's last round."""
    error = job.get("error") or {}
    if error.get("rank") is None or job.get("round") is None:
        return []
    request = {"job": job["id"], "rank": error["rank"], "attempt": job["round"]}
    tail: list[str] = []
    with connect() as daemon:
        for result in daemon.stream("logs", request):
            tail.extend(
                str(line.get("text", "")).rstrip("\n")
                for line in _lines(result)
                if line.get("stream") == "err"
            )
            del tail[:-lines]
    return tail


def _lines(result: Any) -> Iterable[Doc]:
    return (result.get("lines") if isinstance(result, Mapping) else result) or []
