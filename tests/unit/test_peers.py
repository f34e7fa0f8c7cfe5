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
