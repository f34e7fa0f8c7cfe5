"""Rendezvous benchmark: elasticd's handler vs torch's DynamicRendezvousHandler.

Usage: python tests/bench/bench_rendezvous.py [--json] [--quick] [--sizes N,N,...]

Harness (identical for both handlers): one TCPStore server (ours, as a daemon hosts it, in a
child process: torch's blocking clients hold the GIL while they wait) and a
pool of N participant threads, each with its own pre-connected TCPStore client, so that no
connection is made while a clock runs. For each repetition every participant builds its
handler (fresh run id), waits on a barrier, records its arrival time and calls
``next_rendezvous``; with min = max = N the *formation latency* is the time from the last
arrival until the last participant returned. Torch's handler is
``DynamicRendezvousHandler.from_backend`` over ``C10dRendezvousBackend`` on the same store
(its own random 0-0.3 s first-round delay included, as a user would get it); its runs are
capped by their join timeout.

Each elasticd participant is a node as in a daemon: its own event loop thread, its own
TCPStoreClient (its own connections) and its keeper task.  Its times are taken on its
loop, where a daemon's agent awaits the handler: the hand-off from the participant thread
to the loop and back is the harness's, not the handler's.

Also measured for elasticd: formation with *one process per node*, as deployed (each daemon
is a process of its own; nodes in one process share one interpreter lock, which no cluster
does): each process has a TCPStoreClient, its handler and keeper on its own loop; once all
are ready and beating, one key releases them together; perf_counter is CLOCK_MONOTONIC, one
clock for every process.  And *re-rendezvous* (every member watches the round; one requests
the next round; time from the request until all rejoined) and *dead-member detection*
with the default keep-alive (1 s x 3): one member's keeper stops; time until every other
member's ``watch()`` fired.

A run that fails kills every process it started (so does Ctrl-C; a participant whose bench
is gone exits): a node that does not form within PROCESS_BOUND, or exit within EXIT_BOUND,
fails it, named with its stacks (SIGUSR1: faulthandler's thread dump, every asyncio task's).

``--json`` prints one JSON list of {"n", "elasticd_s", "torch_s", "ratio",
"elasticd_processes_s"} (medians of the formation latency; torch_s and ratio are null when
torch hit its cap).
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
os.environ.setdefault("RES_OPTIONS", "timeout:1 attempts:1")  # see elasticd.store.c10d
os.environ.setdefault(
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1"
)  # torch's rank 0 would host another store

import logging
import warnings

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # no NumPy needed here

logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
logging.getLogger("elasticd").setLevel(
    logging.ERROR
)  # the dead-member run logs a warning by design

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from blocking_rendezvous import BlockingRendezvous
from store_servers import ServerProcess

from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.keys import Keys
from elasticd.store.c10d import connect
from elasticd.store.signing import Signer

FULL = {
    "sizes": (2, 8, 32, 128),
    "elasticd_reps": 5,
    "process_reps": 3,
    "torch_reps": {2: 3, 8: 3, 32: 2, 128: 1},
    "torch_cap": 60.0,
}
QUICK = {
    "sizes": (2, 8),
    "elasticd_reps": 3,
    "process_reps": 2,
    "torch_reps": {2: 2, 8: 2},
    "torch_cap": 30.0,
}
SIGNER_KEY = b"bench-key-0123456789abcdef012345"
SIGNER = Signer(SIGNER_KEY, "bench")


class Harness:
    """A store server, an elasticd store and a pool of threads with a torch client each."""

    def __init__(self, max_n: int) -> None:
        self.server = ServerProcess()
        self.store = connect(self.server.endpoint, timeout=120.0)
        self.pool = ThreadPoolExecutor(max_workers=max_n)
        self._local = threading.local()
        self.simultaneously(max_n, self._warm, lambda _: None)  # every pool thread connects now

    def _warm(self, _: int) -> None:
        self.store.add("bench/warm", 1)
        self.torch_client()

    def torch_client(self):
        from torch.distributed import TCPStore

        if getattr(self._local, "client", None) is None:
            self._local.client = TCPStore(
                "127.0.0.1", self.server.port, None, False, timedelta(seconds=120), use_libuv=True
            )
        return self._local.client

    def simultaneously(
        self, n: int, prepare: Callable[[int], Any], act: Callable[[Any], Any]
    ) -> list[tuple]:
        """Run ``act(prepare(i))`` in n threads released together; (arrived, returned, result)."""
        barrier = threading.Barrier(n)

        def participant(i: int) -> tuple:
            prepared = prepare(i)
            barrier.wait()
            arrived = time.perf_counter()
            try:
                result = act(prepared)
            except Exception as err:  # a capped torch run
                result = err
            return arrived, time.perf_counter(), result

        return [f.result() for f in [self.pool.submit(participant, i) for i in range(n)]]

    def close(self) -> None:
        self.pool.shutdown(
            wait=False, cancel_futures=True
        )  # after Ctrl-C a thread may wait on for good
        self.store.close()
        self.server.close()


def formation_latency(timings: list[tuple]) -> float | None:
    if any(isinstance(result, Exception) for _, _, result in timings):
        return None
    return max(t[1] for t in timings) - max(t[0] for t in timings)


# -- elasticd ------------------------------------------------------------------------------


def elasticd_handlers(
    harness: Harness, n: int, run_id: str, **settings: Any
) -> list[BlockingRendezvous]:
    """One node each: its own event loop and TCPStoreClient (its own store connections), as in a
    daemon, with its keeper task running."""
    config = RendezvousSettings(run_id, n, n, **settings)
    handlers = [
        BlockingRendezvous(
            harness.store,
            SIGNER,
            config,
            f"node{i:03d}",
            "127.0.0.1",
            prefix=f"bench/rdzv/{run_id}",
        )
        for i in range(n)
    ]
    keys = Keys(f"bench/rdzv/{run_id}")
    for handler in handlers:  # every keeper is connected and beating before the clock starts
        harness.store.wait_for(keys.heartbeat(handler.node), 60.0)
    return handlers


def stop(handlers: list[BlockingRendezvous]) -> None:
    for handler in handlers:
        handler.shutdown()
    for handler in handlers:
        handler.shutdown(wait=True)


def elasticd_formation(
    harness: Harness, n: int, run_id: str, **settings: Any
) -> tuple[float, list, list]:
    handlers = elasticd_handlers(harness, n, run_id, **settings)
    timed = harness.simultaneously(
        n, lambda i: handlers[i], lambda h: h.timed("next_rendezvous", 1, 29500)
    )
    timings = [result for _, _, result in timed]  # (started, returned, info), on each node's loop
    return formation_latency(timings), handlers, [t[2] for t in timings]


def rerendezvous(harness: Harness, handlers: list[BlockingRendezvous], round: int) -> float:
    """Every member watches ``round`` and rejoins when it is superseded (on its own loop, as
    its agent would); the first requests the next round; until all rejoined."""
    rejoined = [h.when_superseded(round, "next_rendezvous", 1, 29500) for h in handlers]
    requested, _, _ = handlers[0].timed("request_next_round", round, "scale_up")
    return max(f.result(timeout=120)[1] for f in rejoined) - requested


def dead_member_detection(harness: Harness, n: int) -> float:
    """Default keep-alive (1 s x 3): one member's keeper stops; all others must hear of it."""
    _, handlers, infos = elasticd_formation(harness, n, f"dead-{n}")
    victim, others = handlers[-1], handlers[:-1]
    watches = [h.watch(infos[0].round, waiting=False) for h in others]
    silenced = time.perf_counter()
    victim.shutdown()
    for watch in watches:
        assert watch.result(timeout=60).reason == "node_lost"
    detected = time.perf_counter() - silenced
    stop(handlers)
    return detected


PARTICIPANT = r"""
import asyncio, faulthandler, json, os, signal, sys, threading, time
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous import RendezvousSettings
from elasticd.store.signing import Signer
from elasticd.store.tcpstore import TCPStoreClient

endpoint, node, run_id, n, key = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
prefix = f"bench/proc/{run_id}"

def orphaned():
    while os.read(0, 4096):  # the raw fd: a buffered stdin's lock would hold up the exit
        pass
    os._exit(70)  # EOF: the bench is gone (killed, or Ctrl-C): so is this node

def dump():
    for task in asyncio.all_tasks():
        print(f"task {task.get_name()} (cancelling {task.cancelling()}): {task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    print("end of dump", file=sys.stderr, flush=True)

async def main():
    threading.Thread(target=orphaned, daemon=True).start()
    # SIGUSR1, from the bench before it kills a node that hangs: every thread's stack at once
    # (faulthandler), then every task's from the loop (if the loop still turns)
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    faulthandler.register(signal.SIGUSR1, all_threads=True, chain=True)
    store = TCPStoreClient(endpoint)
    await store.connect(60)
    handler = RendezvousHandler(store, Signer(bytes.fromhex(key), "bench"), RendezvousSettings(run_id, n, n),
                                node, "127.0.0.1", prefix=prefix)
    keeper = asyncio.create_task(handler.keep())
    await store.wait_for(f"{prefix}/hb/{node}", 60)
    await store.add(f"{prefix}/ready", 1)
    await store.wait_for(f"{prefix}/go", 120)
    started = time.perf_counter()
    await handler.next_rendezvous(1, 29500)
    print(json.dumps([started, time.perf_counter()]), flush=True)
    await store.wait_for(f"{prefix}/end", 120)
    keeper.cancel()
    await store.close()  # while the keeper ends (its sweeper may be deleting): as a daemon that stops

asyncio.run(main())
"""
PROCESS_BOUND = 120.0  # seconds for every node to start, then to form (a loaded 2-core host, N=128)
EXIT_BOUND = 30.0  # seconds for every node to exit once told to (it cancels its keeper: a moment)
DUMP_WAIT = 3.0  # seconds a hung node gets to print its stacks


class Hung(RuntimeError):
    """Nodes did not do what they had to within the bound: which, and where each one was."""


class Participants:
    """The processes of one formation, one node each (``with``: every one of them is killed
    on the way out, whatever happened: a failure, a hang, Ctrl-C).  Each one's stderr goes
    to a file of its own; SIGUSR1 makes it print its stacks there."""

    def __init__(self, endpoint: str, n: int, run_id: str, directory: str) -> None:
        self.names = [f"node{i:03d}" for i in range(n)]
        self.errs = [os.path.join(directory, f"{run_id}-{name}.err") for name in self.names]
        self.procs: list[subprocess.Popen] = []
        self._argv = [endpoint, run_id, str(n), SIGNER_KEY.hex()]

    def __enter__(self) -> Participants:
        try:
            for name, err in zip(self.names, self.errs):
                with open(err, "wb") as sink:
                    self.procs.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                "-c",
                                PARTICIPANT,
                                self._argv[0],
                                name,
                                *self._argv[1:],
                            ],
                            stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE,
                            stderr=sink,
                        )
                    )
        except BaseException:  # Ctrl-C among the starts: the ones started go too
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()

    def lines(self, timeout: float) -> list[str]:
        """One line from each node's stdout, within ``timeout`` seconds in all."""
        got: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as waiting:
            for i, proc in enumerate(self.procs):
                waiting.register(proc.stdout, selectors.EVENT_READ, i)
            while len(got) < len(self.procs):
                left = deadline - time.monotonic()
                ready = waiting.select(max(left, 0.0)) if left > 0 else []
                if not ready:
                    missing = [i for i in range(len(self.procs)) if i not in got]
                    raise Hung(
                        f"{len(missing)} of {len(self.procs)} nodes did not form within "
                        f"{timeout:g}s\n" + self.report(missing)
                    )
                for key, _ in ready:
                    got[key.data] = key.fileobj.readline()
                    waiting.unregister(key.fileobj)
                    if not got[key.data]:
                        raise Hung(
                            f"{self.names[key.data]} ended before it formed\n"
                            + self.report([key.data])
                        )
        return [got[i] for i in range(len(self.procs))]

    def wait(self, timeout: float) -> None:
        """Until every node exited (0), within ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                pass
        stuck = [i for i, proc in enumerate(self.procs) if proc.poll() is None]
        if stuck:
            raise Hung(
                f"{len(stuck)} of {len(self.procs)} nodes did not exit within {timeout:g}s "
                f"of the end\n" + self.report(stuck)
            )
        failed = [i for i, proc in enumerate(self.procs) if proc.returncode != 0]
        if failed:
            raise Hung(f"{len(failed)} nodes exited with an error\n" + self.report(failed))

    def report(self, indices: list[int]) -> str:
        """Each node's name, pid and stderr; a node still running prints its stacks first."""
        running = [i for i in indices if self.procs[i].poll() is None]
        for i in running:
            self.procs[i].send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + DUMP_WAIT
        while (
            running
            and time.monotonic() < deadline
            and not all(b"end of dump" in _read(self.errs[i]) for i in running)
        ):
            time.sleep(0.1)
        return "\n".join(
            f"--- {self.names[i]} (pid {self.procs[i].pid}, "
            f"{'running' if self.procs[i].poll() is None else f'exit {self.procs[i].returncode}'}):\n"
            + _read(self.errs[i]).decode(errors="replace")[-20000:]
            for i in indices
        )


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def process_formation(harness: Harness, n: int, run_id: str) -> float:
    """Formation with one process per node (see the module docstring).  A node that does not
    form, or does not exit once told to, fails the run (Hung, with its stacks); every
    process is gone when this returns or raises."""
    prefix = f"bench/proc/{run_id}"
    with (
        tempfile.TemporaryDirectory(prefix="bench-rdzv-") as directory,
        Participants(harness.server.endpoint, n, run_id, directory) as nodes,
    ):
        deadline = time.monotonic() + PROCESS_BOUND
        while harness.store.add(f"{prefix}/ready", 0) < n:
            if time.monotonic() > deadline:
                ready = harness.store.add(f"{prefix}/ready", 0)
                raise Hung(f"{ready} of {n} nodes started within {PROCESS_BOUND:g}s")
            harness.store.wait_for(f"{prefix}/never", 0.05)  # a short pause between counts
        harness.store.set(f"{prefix}/go", b"1")
        try:
            timings = [tuple(json.loads(line)) + (None,) for line in nodes.lines(PROCESS_BOUND)]
        finally:
            harness.store.set(f"{prefix}/end", b"1")
        nodes.wait(EXIT_BOUND)
    return formation_latency(timings)


# -- torch ---------------------------------------------------------------------------------


def torch_formation(harness: Harness, n: int, run_id: str, cap: float) -> float | None:
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
        DynamicRendezvousHandler,
        RendezvousTimeout,
    )

    def prepare(_: int):
        store = harness.torch_client()
        return DynamicRendezvousHandler.from_backend(
            run_id,
            store,
            C10dRendezvousBackend(store, run_id),
            n,
            n,
            local_addr="127.0.0.1",
            timeout=RendezvousTimeout(join=timedelta(seconds=cap)),
        )

    handlers: list = []

    def act(handler):
        handlers.append(handler)
        return handler.next_rendezvous()

    timings = harness.simultaneously(n, prepare, act)
    for handler in handlers:
        try:
            handler.shutdown()
        except Exception:
            pass
    return formation_latency(timings)


# -- report --------------------------------------------------------------------------------


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def measure(profile: dict, progress: Callable[[str], None]) -> tuple[list[dict], dict]:
    harness = Harness(max(profile["sizes"]))
    rows, extra = [], {"rerendezvous_s": {}, "detection_s": {}, "processes_s": {}}
    try:
        for n in profile["sizes"]:
            ours, again = [], []
            for rep in range(profile["elasticd_reps"]):
                latency, handlers, infos = elasticd_formation(harness, n, f"e{n}-{rep}")
                ours.append(latency)
                again.append(rerendezvous(harness, handlers, infos[0].round))
                stop(handlers)
            progress(f"n={n}: elasticd {median(ours):.4f}s")
            apart = [
                process_formation(harness, n, f"p{n}-{rep}")
                for rep in range(profile["process_reps"])
            ]
            extra["processes_s"][n] = median(apart)
            progress(f"n={n}: elasticd, one process per node {median(apart):.4f}s")
            theirs = [
                torch_formation(harness, n, f"t{n}-{rep}", profile["torch_cap"])
                for rep in range(profile["torch_reps"].get(n, 1))
            ]
            torch_median = median(theirs)
            progress(
                f"n={n}: torch "
                + (
                    f"{torch_median:.4f}s"
                    if torch_median is not None
                    else f"none within {profile['torch_cap']:g}s"
                )
            )
            elasticd_s, torch_s = median(ours), median(theirs)
            rows.append(
                {
                    "n": n,
                    "elasticd_s": round(elasticd_s, 4),
                    "torch_s": None if torch_s is None else round(torch_s, 4),
                    "ratio": None if torch_s is None else round(torch_s / elasticd_s, 1),
                    "elasticd_processes_s": round(median(apart), 4),
                }
            )
            extra["rerendezvous_s"][n] = median(again)
            extra["detection_s"][n] = dead_member_detection(harness, n)
            progress(
                f"n={n}: re-rendezvous {median(again):.4f}s, detection {extra['detection_s'][n]:.2f}s"
            )
    finally:
        harness.close()
    return rows, extra


def table(rows: list[dict], extra: dict, profile: dict) -> str:
    cap = profile["torch_cap"]
    lines = [
        "formation latency, min = max = N, nodes as threads of one process over one TCPStore (medians)",
        f"{'N':>5} {'elasticd':>11} {'torch':>11} {'ratio':>8} {'re-rdzv':>10} {'dead->seen':>11} "
        f"{'elasticd, 1 process/node':>25}",
    ]
    for row in rows:
        torch_s = f"{row['torch_s']:.4f}s" if row["torch_s"] is not None else f">{cap:g}s"
        ratio = f"{row['ratio']:.1f}x" if row["ratio"] is not None else "-"
        lines.append(
            f"{row['n']:>5} {row['elasticd_s']:>10.4f}s {torch_s:>11} {ratio:>8} "
            f"{extra['rerendezvous_s'][row['n']]:>9.4f}s {extra['detection_s'][row['n']]:>10.2f}s "
            f"{extra['processes_s'][row['n']]:>24.4f}s"
        )
    lines.append(
        "re-rdzv: one member requests the next round -> all rejoined (elasticd); "
        "dead->seen: keep-alive 1 s x 3, a member goes silent -> every other member's watch() fired"
    )
    return "\n".join(lines)


def sizes(text: str) -> tuple[int, ...]:
    values = tuple(int(n) for n in text.split(","))
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"not a list of node counts: {text!r}")
    return values


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--json", action="store_true", help="print one JSON list of formation medians"
    )
    parser.add_argument("--quick", action="store_true", help="N = 2, 8 only, fewer repetitions")
    parser.add_argument(
        "--sizes",
        type=sizes,
        metavar="N,N,...",
        help=f"the node counts (default {','.join(map(str, FULL['sizes']))}; "
        f"--quick: {','.join(map(str, QUICK['sizes']))})",
    )
    args = parser.parse_args()
    profile = QUICK if args.quick else FULL
    if args.sizes:
        profile = {**profile, "sizes": args.sizes}
    progress = (
        (lambda line: print(line, file=sys.stderr, flush=True))
        if not args.json
        else (lambda line: None)
    )
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill cleans up as Ctrl-C does
    try:
        rows, extra = measure(profile, progress)
    except Hung as exc:  # every process it started is gone already
        print(f"bench_rendezvous: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            "bench_rendezvous: interrupted (every process it started was killed)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(130)  # the harness's threads may still wait on a rendezvous: nothing joins them
    print(json.dumps(rows) if args.json else table(rows, extra, profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
