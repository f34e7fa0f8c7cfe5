"""The master ports a node offers (shell/effectors.py's MasterPorts): kept from everyone but
the store that is to listen there, for a while, then let go.  Real sockets on loopback and a
real TCPStore."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest
import torch.distributed as dist

from elasticd.shell.effectors import MasterPorts


def plain_bind(port: int, address: str = "127.0.0.1") -> None:
    with socket.socket() as sock:
        sock.bind((address, port))


def test_a_picked_port_is_kept_from_other_binds_and_the_store_listens_there() -> None:
    ports = MasterPorts()
    try:
        port = ports.pick("127.0.0.1")
        for address in ("127.0.0.1", "127.0.0.2"):  # the node's, and any other (a peer port)
            with pytest.raises(OSError) as taken:
                plain_bind(port, address)  # as a bind that is not the store's would
            assert taken.value.errno == errno.EADDRINUSE
        store = dist.TCPStore(
            "127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30)
        )  # rank 0's, which binds with SO_REUSEADDR
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=datetime.timedelta(seconds=30))
        store.set("k", "v")
        assert client.get("k") == b"v"
        del client, store
    finally:
        ports.close()


def test_a_port_is_let_go_once_held_for_its_time() -> None:
    now = [0.0]
    ports = MasterPorts(hold=60.0, clock=lambda: now[0])
    try:
        first = ports.pick("127.0.0.1")
        now[0] = 30.0
        second = ports.pick("127.0.0.1")
        assert ports.held == [first, second] and first != second
        now[0] = 61.0
        third = ports.pick("127.0.0.1")  # a pick lets go of those held long enough
        assert ports.held == [second, third]
        plain_bind(first)  # free again
    finally:
        ports.close()
    assert ports.held == []
    plain_bind(second)
