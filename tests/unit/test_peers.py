"""Telling a dead node from a node whose peer port is merely silent (peers.probe/judged_lost)."""

import asyncio
import socket
import time

import pytest

from elasticd.cluster.peers import PeerLinks, Probe, judged_lost, probe


@pytest.mark.parametrize(
    "answer, heard_meanwhile, lost",
    [
        (Probe.UP, False, False),
        (Probe.UP, True, False),
        (Probe.REFUSED, False, True),
        (Probe.REFUSED, True, True),  # nothing listens: the daemon died
        (Probe.SILENT, False, True),  # a partition or a host gone: it stopped beating too
        (
            Probe.SILENT,
            True,
            False,
        ),  # a firewall dropping the port: it still beats, the failure is real
    ],
)
def test_judged_lost(answer, heard_meanwhile, lost):
    assert judged_lost(answer, heard_meanwhile) is lost


@pytest.fixture
def silent_endpoint():
    """A port whose SYNs are dropped, as a firewall would: a listener with a full accept queue."""
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(0)
        port = listening.getsockname()[1]
        queued = [socket.socket() for _ in range(3)]
        for sock in queued:
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", port))
        yield f"tcp://127.0.0.1:{port}"
        for sock in queued:
            sock.close()


def test_probe_on_real_sockets(silent_endpoint):
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, not listening: the kernel answers with a reset
        up = f"tcp://127.0.0.1:{listening.getsockname()[1]}"
        refused = f"tcp://127.0.0.1:{closed.getsockname()[1]}"
        assert asyncio.run(probe(up, 5.0)) is Probe.UP
        assert asyncio.run(probe(refused, 5.0)) is Probe.REFUSED
    assert asyncio.run(probe(silent_endpoint, 0.3)) is Probe.SILENT


class _Record:
    def __init__(self, endpoint):
        self.peer_endpoint = endpoint


@pytest.mark.parametrize("heard, expected", [(False, ["n2"]), (True, [])])
def test_a_silent_node_that_still_beats_is_not_lost(silent_endpoint, heard, expected):
    """A worker failure is not free because a firewall drops the peer port of a living node:
    its heartbeat is read before the probe and again one interval after it was sent."""

    class Nodes:
        interval = 0.5
        reads: list[float] = []

        async def record(self, name):
            return _Record(silent_endpoint)

        def alive(self, name):
            return True

        async def beats(self, names):
            self.reads.append(time.monotonic())
            return {name: 7 + (len(self.reads) - 1) * heard for name in names}

    nodes = Nodes()
    links = PeerLinks(client=None, nodes=nodes)
    assert asyncio.run(links.unreachable(["n2"], 0.3)) == expected
    assert len(nodes.reads) == 2 and nodes.reads[1] - nodes.reads[0] >= nodes.interval


@pytest.mark.parametrize(
    "damage",
    [
        b"",
        b"[" * 100000,
        b'{"public": 1, "secret": []}',
        b"\xff" * 80,
        b'{"public": "short", "secret": "short"}',
    ],
)
def test_a_damaged_peer_key_file_is_moved_aside_and_a_new_pair_made(tmp_path, damage):
    from elasticd.cluster.peers import load_or_create_keys

    path = tmp_path / "peer.key"
    made = load_or_create_keys(str(path))
    assert load_or_create_keys(str(path)) == made  # read back as written
    path.write_bytes(damage)
    fresh = load_or_create_keys(str(path))
    assert len(fresh.public) == len(fresh.secret) == 40 and fresh != made
    assert load_or_create_keys(str(path)) == fresh and path.stat().st_mode & 0o777 == 0o600
    (aside,) = tmp_path.glob("peer.key.corrupt-*")
    assert aside.read_bytes() == damage  # kept for a look


def test_a_probe_cancelled_before_it_started_leaves_no_coroutine_unawaited(tmp_path):
    """Failure notices that come faster than a probe starts: the core cancels each probe at
    the next notice, before its task took a step.  The probe's coroutine is closed with its
    task, not left for the garbage collector to warn that it was never awaited."""
    import gc
    import types
    import warnings

    from elasticd.core import instructions as do
    from elasticd.core.node import NodeCore, NodeSettings
    from elasticd.core.placement import Resources
    from elasticd.jobs.history import History
    from elasticd.jobs.registry import JobRegistry
    from elasticd.shell.node import NodeShell

    class Nodes:
        interval = 1.0

        async def record(self, name):
            return None

        def alive(self, name):
            return True

        async def beats(self, names):
            return {}

    links = PeerLinks(client=None, nodes=Nodes())
    core = NodeCore(NodeSettings("n1", Resources(2, ()), dead_after=3.0, judge_users=False))
    shell = NodeShell(
        core,
        effectors=types.SimpleNamespace(probe=links),
        board=None,
        follower=None,
        registry=JobRegistry(History(str(tmp_path / "history.db"))),
        metrics=None,
    )

    async def scenario() -> None:
        async with asyncio.TaskGroup() as tasks:
            shell._tasks = tasks
            shell._parts["j-000001"] = types.SimpleNamespace(ops={})
            for op in range(20):  # each notice: a new probe, the one before cancelled at once
                shell._execute(do.Probe("j-000001", op, ("n2",), 1.0))
                shell._execute(do.Cancel("j-000001", op))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        asyncio.run(scenario())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [
        str(w.message) for w in caught
    ]
