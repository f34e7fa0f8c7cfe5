"""The crowd of bench_scale.py: many simulated daemons in one process, and what the bench's
probe node shares with them (the node factory, the counting store, the stores).

    python scale_crowd.py --backend c10d --endpoint HOST:PORT --cluster NAME \
        --first I --count K --total N [--interval S] [--connections C]

A simulated node is a real ``NodeService(NodeRegistry(...))`` running its duties exactly as
app.py builds them, with a realistic record and no workers.  The nodes of one process share
one store client (a small pool of connections: thousands of nodes, few descriptors), each
through a :class:`CountingStore` of its own that counts its calls, the keys they touch
and the bytes of keys and values sent and received.

The bench drives a crowd with JSON lines on stdin and reads one JSON line of answer per
command on stdout (commands: start, stats, mark, kill, halt, rdzv_setup, rdzv_go,
rdzv_stop, exit).  EOF on stdin, or the death of the bench (PR_SET_PDEATHSIG), ends it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import cProfile
import ctypes
import json
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elasticd import __version__
from elasticd.cluster.registry import NodeRecord, NodeRegistry
from elasticd.cluster.service import NodeDuties, NodeService, Watcher
from elasticd.core.liveness import KeepAlive
from elasticd.core.model import NodeInfo
from elasticd.errors import ElasticdError
from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.rendezvous.state import Decoded
from elasticd.shell.publisher import StoreReset
from elasticd.store.keyspace import Keyspace
from elasticd.store.signing import Signer

SIGNER_KEY = b"bench-scale-0123456789abcdef0123"  # 32 bytes, fixed: every process signs alike
PEER_KEY = "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"  # a CURVE public key's length (Z85)


# -- processes -----------------------------------------------------------------------------


def raise_nofile() -> int:
    """The soft limit of open files raised to the hard one; the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def die_with_parent() -> None:
    """SIGKILL when the process that started this one dies (Linux; nothing elsewhere)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


# -- stores --------------------------------------------------------------------------------


async def open_store(
    backend: str,
    endpoint: str,
    *,
    timeout: float = 30.0,
    connections: int = 4,
    waits: int = 64,
    connect_timeout: float = 30.0,
) -> Any:
    """A connected store client of ``backend`` ("c10d": a TCPStoreClient; "etcd": an
    EtcdStore over the comma-separated endpoints)."""
    if backend == "c10d":
        from elasticd.store.tcpstore import TCPStoreClient

        store = TCPStoreClient(endpoint, timeout=timeout, connections=connections, waits=waits)
    elif backend == "etcd":
        from elasticd.store.etcd import EtcdStore  # written alongside this bench: may be missing

        store = EtcdStore(endpoint.split(","), timeout=timeout)
    else:
        raise ValueError(f"unknown backend {backend!r}")
    await store.connect(connect_timeout)
    return store


class Counts:
    """One node's store traffic: calls (round trips), requests (keys touched: what the
    server serves) and bytes of keys and values sent and received."""

    __slots__ = ("calls", "ops", "received", "sent")

    def __init__(self) -> None:
        self.calls = self.ops = self.sent = self.received = 0

    def add(self, calls: int, ops: int, sent: int, received: int) -> None:
        self.calls += calls
        self.ops += ops
        self.sent += sent
        self.received += received

    def snapshot(self) -> tuple[int, int, int, int]:
        return self.calls, self.ops, self.sent, self.received


def _size(value: bytes | None) -> int:
    return len(value) if value else 0


def _key_size(key: str) -> int:
    return len(key.encode()) + 1  # TCPStore's clients add "/" in front


def key_kind(key: str) -> str:
    """What a key holds, for a breakdown of the traffic: record, hb, feed/entry, state, ..."""
    parts = key.split("/")
    last = parts[-1]
    if "feed" in parts:
        return "feed/" + (last if last in ("head", "snapshot") else "entry")
    if "rev" in parts:
        return "rev"
    if "exit" in parts:
        return "exit"
    if len(parts) >= 2 and parts[-2] == "hb":
        return "hb"
    return last if not last.startswith("node") else "?"


class Kinds:
    """Requests and bytes by kind of key (see key_kind)."""

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()

    def add(self, key: str, moved: int) -> None:
        kind = key_kind(key)
        self.ops[kind] += 1
        self.bytes[kind] += moved

    def doc(self) -> dict[str, list[int]]:
        return {kind: [self.ops[kind], self.bytes[kind]] for kind in self.ops}


class CountingStore:
    """A Store that counts every call of one node on a client it may share with others
    (and, given ``kinds``, its requests and bytes by kind of key)."""

    def __init__(self, store: Any, counts: Counts, kinds: Kinds | None = None) -> None:
        self._store = store
        self.counts = counts
        self.kinds = kinds

    def _one(self, key: str, sent: int, received: int) -> None:
        self.counts.add(1, 1, sent, received)
        if self.kinds is not None:
            self.kinds.add(key, sent + received)

    async def get(self, key: str) -> bytes | None:
        value = await self._store.get(key)
        self._one(key, _key_size(key), _size(value))
        return value

    async def set(self, key: str, value: bytes) -> None:
        await self._store.set(key, value)
        self._one(key, _key_size(key) + len(value), 0)

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        swapped, current = await self._store.compare_set(key, expected, desired)
        self._one(key, _key_size(key) + _size(expected) + len(desired), _size(current))
        return swapped, current

    async def add(self, key: str, amount: int) -> int:
        value = await self._store.add(key, amount)
        self._one(key, _key_size(key) + 8, 8)
        return value

    async def append(self, key: str, value: bytes) -> None:
        await self._store.append(key, value)
        self._one(key, _key_size(key) + len(value), 0)

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        values = await self._store.get_many(keys)
        self.counts.add(1, len(keys), sum(map(_key_size, keys)), sum(map(_size, values)))
        if self.kinds is not None:
            for key, value in zip(keys, values):
                self.kinds.add(key, _key_size(key) + _size(value))
        return values

    async def wait_for(self, key: str, timeout: float) -> bool:
        found = await self._store.wait_for(key, timeout)
        self._one(key, _key_size(key), 0)
        return found

    async def delete(self, key: str) -> bool:
        existed = await self._store.delete(key)
        self._one(key, _key_size(key), 0)
        return existed

    async def delete_under(self, prefixes: list[str]) -> int:
        deleted = await self._store.delete_under(prefixes)
        self.counts.add(1, len(prefixes), sum(map(_key_size, prefixes)), 0)
        return deleted

    async def close(self) -> None:  # the client is shared: its owner closes it
        pass

    def __getattr__(self, name: str) -> Any:
        """An operation this wrapper does not know yet (a store method added since): passed
        through and counted as one call, its bytes unknown."""
        attr = getattr(self._store, name)
        if not asyncio.iscoroutinefunction(attr):
            return attr

        async def counted(*args: Any, **kwargs: Any) -> Any:
            result = await attr(*args, **kwargs)
            self.counts.add(1, 1, 0, 0)
            return result

        return counted


# -- nodes ---------------------------------------------------------------------------------


def node_name(index: int) -> str:
    return f"node{index:05d}"


def node_record(index: int) -> NodeRecord:
    """A realistic record: 8 slots, 8 GPUs, labels, a peer endpoint and key (~520 bytes sealed)."""
    address = f"10.{1 + index // 65536}.{index // 256 % 256}.{index % 256}"
    info = NodeInfo(
        node_name(index),
        address,
        8,
        tuple(str(g) for g in range(8)),
        {"zone": f"zone-{index % 4}", "rack": f"r{index // 32:03d}", "gpu": "h100"},
        __version__,
        False,
        time.time(),
    )
    return NodeRecord(info, peer_endpoint=f"tcp://{address}:29402", peer_key=PEER_KEY)


def _republished(event: object) -> None:
    """The node shell's queue: no jobs, so a reset store has nothing to publish again."""
    if isinstance(event, StoreReset):
        event.done.set_result(None)


@dataclass
class Ticks:
    """Heartbeat duties of some nodes: (began, seconds, CPU seconds of this process meanwhile)
    of each that ended, apart for the duties of a node that was the cluster's observer
    (``NodeRegistry.observing``; a registry without one has none), and those that are on
    now (node -> when it began).  The CPU is the duty's own only where its loop runs
    nothing else."""

    done: list[tuple[float, float, float]] = field(default_factory=list)
    observer: list[tuple[float, float, float]] = field(default_factory=list)
    running: dict[str, float] = field(default_factory=dict)

    def timed(self, registry: NodeRegistry) -> None:
        """Time every ``registry.tick`` (the heartbeat duty that NodeService runs)."""
        inner, name = registry.tick, registry.name

        async def tick(*args: Any, **kwargs: Any) -> Any:
            began, cpu = time.monotonic(), time.process_time()
            self.running[name] = began
            try:
                return await inner(*args, **kwargs)
            finally:
                self.running.pop(name, None)
                observing = bool(getattr(registry, "observing", False))
                (self.observer if observing else self.done).append(
                    (began, time.monotonic() - began, time.process_time() - cpu)
                )

        registry.tick = tick  # type: ignore[method-assign]

    def clear(self) -> None:
        self.done.clear()
        self.observer.clear()

    def overdue(self, now: float, interval: float) -> list[float]:
        """How long each duty that is on now and began more than ``interval`` ago has run."""
        return [now - began for began in self.running.values() if now - began > interval]


class SimNode:
    """One simulated daemon: its registry and heartbeat loop, no workers."""

    def __init__(
        self,
        index: int,
        store: Any,
        signer: Signer,
        cluster: str,
        endpoint: str,
        keep_alive: KeepAlive,
        ticks: Ticks,
        on_tick: Callable[[], None] = lambda: None,
        kinds: Kinds | None = None,
    ) -> None:
        self.index, self.name = index, node_name(index)
        self.counts = Counts()
        self.store = CountingStore(store, self.counts, kinds)
        self.registry = NodeRegistry(
            self.store,
            signer,
            cluster,
            self.name,
            keep_alive=keep_alive,
            endpoint=endpoint,
            on_refused=self._refused,
        )
        ticks.timed(self.registry)
        self.service = NodeService(self.registry, interval=keep_alive.interval)
        self.record = node_record(index)
        self.stop = asyncio.Event()
        self.store_errors = 0
        self.refused = 0
        self.last_problem = ""
        self.task: asyncio.Task | None = None
        self._on_tick = on_tick

    def _refused(self, key: str, why: str) -> None:
        self.refused += 1
        self.last_problem = f"refused {key}: {why}"

    def _on_store(self, ok: bool, problem: str) -> None:
        if not ok:
            self.store_errors += 1
            self.last_problem = problem

    def duties(self) -> NodeDuties:
        return NodeDuties(
            local_record=lambda: self.record,
            post=_republished,
            watcher=Watcher(store=self._on_store, tick=self._on_tick),
        )

    def start(self, at: float) -> None:
        self.task = asyncio.create_task(self._run(at), name=self.name)

    async def _run(self, at: float) -> None:
        await asyncio.sleep(max(at - time.monotonic(), 0.0))
        await self.service.run(self.stop, self.duties())

    async def kill(self) -> float:
        """Stop at once (no more heartbeats); when, by the monotonic clock."""
        killed = time.monotonic()
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        return killed


# -- the crowd -----------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Crowd:
    def __init__(self, args: argparse.Namespace, store: Any) -> None:
        self.args = args
        self.store = store  # shared by every node of this process
        self.signer = Signer(SIGNER_KEY, args.cluster)
        self.keep_alive = KeepAlive(args.interval)
        self.ticks = Ticks()
        self.kinds = Kinds()
        self.nodes = {
            i: SimNode(
                i,
                store,
                self.signer,
                args.cluster,
                args.endpoint,
                self.keep_alive,
                self.ticks,
                kinds=self.kinds,
            )
            for i in range(args.first, args.first + args.count)
        }
        self.marked = time.monotonic()
        self.base = {i: node.counts.snapshot() for i, node in self.nodes.items()}
        self.rdzv: list[tuple[RendezvousHandler, asyncio.Task, Any]] = []
        self.rdzv_counts = Counts()
        self.rdzv_kinds = Kinds()

    async def handle(self, msg: dict[str, Any]) -> dict[str, Any]:
        command = msg["cmd"]
        if command == "start":  # node i starts at t0 + i/N of the stagger; node 0 at "first"
            for i, node in self.nodes.items():
                node.start(
                    msg["first"] if i == 0 else msg["t0"] + msg["stagger"] * i / self.args.total
                )
            return {"started": len(self.nodes)}
        if command == "mark":
            self.marked = time.monotonic()
            self.ticks.clear()
            self.kinds.ops.clear()
            self.kinds.bytes.clear()
            self.base = {i: node.counts.snapshot() for i, node in self.nodes.items()}
            return {"marked": self.marked}
        if command == "stats":
            return self.stats()
        if command == "kill":
            return {"killed_at": await self.nodes[msg["index"]].kill()}
        if command == "halt":
            return {"halted": await self.halt()}
        if command == "rdzv_setup":
            await self.rdzv_setup(msg)
            return {"ready": len(self.rdzv)}
        if command == "rdzv_go":
            return await self.rdzv_go(msg)
        if command == "rdzv_stop":
            await self.rdzv_stop()
            return {"stopped": True}
        raise ValueError(f"unknown command {command!r}")

    def stats(self) -> dict[str, Any]:
        now = time.monotonic()
        totals = [0, 0, 0, 0]
        per_node_ops = []
        for i, node in self.nodes.items():
            delta = [a - b for a, b in zip(node.counts.snapshot(), self.base[i])]
            per_node_ops.append(delta[1])
            totals = [t + d for t, d in zip(totals, delta)]
        live = [n for n in self.nodes.values() if n.task is not None and not n.task.done()]
        durations = [d for began, d, _ in self.ticks.done if began >= self.marked]
        observer = [
            [round(d, 6), round(c, 6)]
            for began, d, c in self.ticks.observer
            if began >= self.marked
        ]
        cpu = [round(c, 6) for began, _, c in self.ticks.done if began >= self.marked]
        problems = collections.Counter(
            n.last_problem for n in self.nodes.values() if n.last_problem
        )
        return {
            "nodes": len(self.nodes),
            "live": len(live),
            "elapsed": now - self.marked,
            "registered": sum(n.service.registered.is_set() for n in self.nodes.values()),
            "calls": totals[0],
            "ops": totals[1],
            "sent": totals[2],
            "received": totals[3],
            "max_node_ops": max(per_node_ops, default=0),
            "ticks": [round(d, 6) for d in durations],
            "observer_ticks": observer,
            "cpu": cpu
            if len(self.nodes) <= 2
            else [],  # a duty's own CPU only where few nodes share the loop
            "kinds": self.kinds.doc(),
            "observers": [
                n.name for n in self.nodes.values() if getattr(n.registry, "observing", False)
            ],
            "overdue": [round(d, 3) for d in self.ticks.overdue(now, self.keep_alive.interval)],
            "store_errors": sum(n.store_errors for n in self.nodes.values()),
            "refused": sum(n.refused for n in self.nodes.values()),
            "problems": problems.most_common(3),
        }

    async def halt(self) -> int:
        """Every node stops (the registry phase is over); their memory goes."""
        tasks = [n.task for n in self.nodes.values() if n.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        halted = len(tasks)
        self.nodes.clear()
        self.ticks = Ticks()
        return halted

    async def rdzv_setup(self, msg: dict[str, Any]) -> None:
        """One rendezvous handler per node of this process, each with a store client of its
        own (a daemon's connections) and its keeper running; returns once every keeper beat."""
        settings = RendezvousSettings(
            msg["run_id"],
            msg["n"],
            msg["n"],
            join_timeout=msg["join_timeout"],
            keep_alive_interval=self.keep_alive.interval,
            keep_alive_max_attempt=self.keep_alive.attempts,
        )
        prefix = Keyspace(self.args.cluster).rendezvous(msg["job"])
        keys = Keys(prefix)
        indices = range(self.args.first, self.args.first + self.args.count)
        clients: list[Any] = []
        for batch in range(
            0, len(indices), 64
        ):  # connect a few at a time: the server's accept queue
            clients += await asyncio.gather(
                *(
                    open_store(self.args.backend, self.args.endpoint, connections=2, waits=2)
                    for _ in indices[batch : batch + 64]
                )
            )
        decoded = Decoded()  # the states opened: once per change for every node of this process
        for i, client in zip(indices, clients):
            handler = RendezvousHandler(
                CountingStore(client, self.rdzv_counts, self.rdzv_kinds),
                self.signer,
                settings,
                node_name(i),
                node_record(i).info.address,
                prefix=prefix,
                decoded=decoded,
            )
            self.rdzv.append((handler, asyncio.create_task(handler.keep()), client))
        for handler, _, _ in self.rdzv:
            if not await self.store.wait_for(keys.heartbeat(handler.node), 60.0):
                raise RuntimeError(f"the keeper of {handler.node} did not beat within 60 s")

    async def rdzv_go(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Every handler calls next_rendezvous at ``at`` (monotonic); when each returned."""
        await asyncio.sleep(max(msg["at"] - time.monotonic(), 0.0))
        before = self.rdzv_counts.snapshot()
        self.rdzv_kinds.ops.clear()  # what the keepers did before the release is not the rendezvous's
        self.rdzv_kinds.bytes.clear()

        async def join(handler: RendezvousHandler) -> float:
            await handler.next_rendezvous(8, 29500)
            return time.monotonic()

        profile = cProfile.Profile() if self.args.profile else None
        if profile is not None:
            profile.enable()
        tasks = [asyncio.create_task(join(h)) for h, _, _ in self.rdzv]
        try:
            async with asyncio.timeout(msg["bound"]):
                results = await asyncio.gather(*tasks, return_exceptions=True)
        except TimeoutError:
            results = [
                t.result()
                if t.done() and not t.cancelled() and t.exception() is None
                else (
                    t.exception() if t.done() and not t.cancelled() else TimeoutError("no answer")
                )
                for t in tasks
            ]
        if profile is not None:
            profile.disable()
            profile.dump_stats(self.args.profile)
        returned = [r for r in results if isinstance(r, float)]
        errors = collections.Counter(
            f"{type(r).__name__}: {r}"[:200] for r in results if not isinstance(r, float)
        )
        delta = [a - b for a, b in zip(self.rdzv_counts.snapshot(), before)]
        return {
            "returned": returned,
            "errors": errors.most_common(3),
            "failed": sum(errors.values()),
            "calls": delta[0],
            "ops": delta[1],
            "bytes": delta[2] + delta[3],
            "kinds": self.rdzv_kinds.doc(),
        }

    async def rdzv_stop(self) -> None:
        for handler, keeper, _ in self.rdzv:
            handler.shutdown()
            keeper.cancel()
        await asyncio.gather(*(keeper for _, keeper, _ in self.rdzv), return_exceptions=True)
        for _, _, client in self.rdzv:
            await client.close()
        self.rdzv.clear()

    async def close(self) -> None:
        await self.halt()
        await self.rdzv_stop()


async def _stdin() -> asyncio.StreamReader:
    reader = asyncio.StreamReader(limit=1 << 24)
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def _send(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc) + "\n")
    sys.stdout.flush()


async def serve(args: argparse.Namespace) -> None:
    store = await open_store(args.backend, args.endpoint, connections=args.connections, waits=256)
    crowd = Crowd(args, store)
    commands = await _stdin()
    _send({"ready": len(crowd.nodes), "pid": os.getpid(), "nofile": raise_nofile()})
    try:
        while line := await commands.readline():
            msg = json.loads(line)
            if msg["cmd"] == "exit":
                break
            try:
                _send(await crowd.handle(msg))
            except (ElasticdError, RuntimeError, ValueError, KeyError, OSError) as exc:
                _send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        await crowd.close()
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description="a crowd of simulated daemons (bench_scale.py)")
    parser.add_argument("--backend", choices=("c10d", "etcd"), required=True)
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--cluster", required=True)
    parser.add_argument("--first", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--interval", type=float, default=KeepAlive.interval)
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--profile", help="cProfile the rendezvous into this file")
    args = parser.parse_args()
    die_with_parent()
    raise_nofile()
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    logging.getLogger("elasticd.rendezvous").setLevel(
        logging.WARNING
    )  # dropped nodes, restored states
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
