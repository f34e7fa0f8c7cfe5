"""The stores a job's rounds form their groups in, served by the daemon: real servers on
loopback, real connections."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
from hostwide import free_port

from elasticd.errors import StoreConnectionError
from elasticd.shell.roundstore import RoundStores


def listens(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=5).close()
    except ConnectionRefusedError:
        return False
    return True


@pytest.fixture
def stores():
    made: list[RoundStores] = []

    def make(address: str = "127.0.0.1") -> RoundStores:
        made.append(RoundStores(address, max_bytes=1 << 20))
        return made[-1]

    yield make
    for each in made:
        each.close()


def test_an_offer_listens_before_the_round_forms_and_torchs_client_uses_it(stores):
    from torch.distributed import TCPStore

    here = stores()
    port = free_port()
    here.offer([port])
    assert here.ports == [port] and listens("127.0.0.1", port)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client.set("k", "v")
    assert client.get("k") == b"v"


def test_the_first_node_keeps_its_store_and_the_others_close_theirs(stores):
    first, other = stores("127.0.0.1"), stores("127.0.0.2")
    port = free_port()
    first.offer([port])
    other.offer([port])  # each on its own address: nodes sharing a host, one --master-port
    first.formed(0, port, first=True)
    other.formed(0, port, first=False)
    assert first.ports == [port] and other.ports == []
    assert listens("127.0.0.1", port) and not listens("127.0.0.2", port)


def test_the_round_before_stays_until_the_round_after_forms(stores):
    here = stores()
    ports = [free_port() for _ in range(3)]
    for round, port in enumerate(ports):
        here.offer([port])
        here.formed(round, port, first=True)
    assert here.ports == ports[1:]  # round 1 still, for survivors not re-formed yet
    assert not listens("127.0.0.1", ports[0])
    here.offer([free_port()])
    here.formed(3, 1, first=False)  # another node is round 3's first: round 2's stays
    assert here.ports == ports[2:]


def test_in_place_a_fixed_port_alternates_so_the_survivors_keep_their_store(stores):
    """``--master-port P --in-place``: round 1's survivors stay in its group while round 2
    forms, so round 2's store goes to P + 1; round 3's back to P (round 1 is over)."""
    from torch.distributed import TCPStore

    here = stores()
    port = free_port(2)
    both = (port, port + 1)
    assert here.offer(both) == port
    here.formed(1, port, first=True)
    survivor = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    survivor.set("round", "1")
    assert here.offer(both) == port + 1  # round 2 joins: round 1's store stays
    assert survivor.get("round") == b"1" and survivor.add("commits", 1) == 1
    here.formed(2, port + 1, first=True)
    assert here.ports == [port, port + 1]
    assert here.offer(both) == port  # round 3: round 1's store goes, round 2's stays
    assert here.ports == [port + 1, port]
    here.formed(3, port, first=True)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert not client.check(["round"]), "round 3's store is fresh"


def test_in_place_where_the_port_after_is_taken_the_rounds_port_serves_as_before(stores):
    """Another job's ``--master-port P + 1`` on this node: the next round's store takes P
    (the round before's gives way, as it did before there were two), not a failed job."""
    here = stores()
    port = free_port(2)
    here.offer([port, port + 1])
    here.formed(1, port, first=True)
    taken = socket.socket()
    taken.bind(("127.0.0.1", port + 1))
    taken.listen()
    try:
        assert here.offer([port, port + 1]) == port
        assert here.ports == [port] and listens("127.0.0.1", port)
    finally:
        taken.close()


def test_an_offer_that_formed_no_round_closes_at_the_next(stores):
    here = stores()
    dropped, taken = free_port(), free_port()
    here.offer([dropped])  # the join timed out
    here.offer([taken])
    assert here.ports == [taken] and not listens("127.0.0.1", dropped)


def test_a_fixed_port_is_fresh_each_round(stores):
    from torch.distributed import TCPStore

    here = stores()
    port = free_port()
    here.offer([port])
    here.formed(0, port, first=True)
    TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10)).set("old", "1")
    here.offer([port])  # the next round, the same port: the old round's keys are gone
    here.formed(1, port, first=True)
    client = TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    assert not client.check(["old"])
    assert here.ports == [port]


def test_an_address_not_on_this_host_serves_on_every_address(stores):
    here = stores("192.0.2.7")  # TEST-NET-1: a NAT's address, say
    port = free_port()
    here.offer([port])
    assert listens("127.0.0.1", port)


def test_a_name_for_the_nodes_address_serves_on_every_address(stores):
    """A name may resolve here to a loopback address (Debian's ``127.0.1.1 hostname``), where
    the other nodes cannot reach it."""
    here = stores("localhost")
    port = free_port()
    here.offer([port])
    assert listens("127.0.0.2", port)


def test_a_first_node_offering_another_port_serves_the_rounds(stores):
    """The rendezvous kept this node's record as it was, with the port of an earlier join:
    the round's store is there, and its offer is not."""
    here = stores()
    earlier, now = free_port(), free_port()
    here.offer([now])
    here.formed(3, earlier, first=True)
    assert here.ports == [earlier]
    assert listens("127.0.0.1", earlier) and not listens("127.0.0.1", now)


def test_a_port_another_program_holds_is_refused(stores):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    here = stores()
    with pytest.raises(StoreConnectionError, match="cannot host the store"):
        here.offer([port])  # joining anyway, its workers might meet in the other's store
    assert here.ports == []
    with pytest.raises(StoreConnectionError, match="cannot host the store"):
        here.formed(0, port, first=True)  # a round at that port, this node first
    taken.close()
    assert here.ports == []


def test_close_closes_every_store(stores):
    here = stores()
    ports = [free_port(), free_port()]
    here.offer([ports[0]])
    here.formed(0, ports[0], first=True)
    here.offer([ports[1]])
    here.close()
    assert here.ports == [] and not any(listens("127.0.0.1", p) for p in ports)


def test_a_part_that_fails_to_close_something_still_closes_its_stores(stores):
    """A step of the part's close that raised (its workers' channel, say) left its round's
    store listening as long as the daemon ran: a fixed --master-port stayed taken."""
    import asyncio
    from types import SimpleNamespace

    from elasticd.shell.effectors import PartEffectors

    class Link:
        async def close(self) -> None:
            raise OSError("unlink failed")

    here = stores()
    port = free_port()
    here.offer([port])
    part = PartEffectors(
        shared=SimpleNamespace(tier=None),  # type: ignore[arg-type]
        spec=None,  # type: ignore[arg-type]
        nproc=1,
        rdzv=SimpleNamespace(shutdown=lambda: None),  # type: ignore[arg-type]
        cgroup=None,
        link=Link(),  # type: ignore[arg-type]
        stores=here,
    )
    with pytest.raises(OSError, match="unlink failed"):
        asyncio.run(part.close())
    assert here.ports == [] and not listens("127.0.0.1", port)
