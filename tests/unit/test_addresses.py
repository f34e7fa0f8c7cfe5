"""How a daemon tells that a store endpoint is its own, and which of its addresses peers use."""

import psutil
import pytest

from elasticd import config
from elasticd.cluster.hosting import hosts_store, is_local, route_address


def _an_interface_address() -> str | None:
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family.name == "AF_INET" and not entry.address.startswith("127."):
                return entry.address
    return None


@pytest.mark.parametrize(
    "host, local",
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),  # all of 127/8 is this host (Debian names it 127.0.1.1)
        ("localhost", True),
        ("::1", True),
        ("192.0.2.1", False),  # TEST-NET-1: nobody's
        ("no-such-host.invalid", False),
    ],
)
def test_is_local(host, local):
    assert is_local(host) is local


def test_an_interface_address_is_local():
    address = _an_interface_address()
    if address is None:
        pytest.skip("no non-loopback IPv4 interface")
    assert is_local(address)


def test_route_address():
    assert route_address("127.0.0.1") == "127.0.0.1"
    assert route_address("no-such-host.invalid") == "127.0.0.1"  # logged: set node.address
    address = _an_interface_address()
    if address is not None:
        assert route_address(address) == address


@pytest.mark.parametrize(
    "store, host, address, hosts",
    [
        # store.host = auto, node.address set: the address decides (two daemons on one host)
        ("127.0.0.1:29400", "auto", "127.0.0.1", True),
        ("127.0.0.1:29400", "auto", "127.0.0.2", False),
        ("localhost:29400", "auto", "127.0.0.1", True),
        (
            "192.0.2.1:29400",
            "auto",
            "192.0.2.1",
            True,
        ),  # not an address of this host, but ours by config
        ("[::1]:29400", "auto", "::1", True),
        ("no-such-host.invalid:29400", "auto", "127.0.0.1", False),
        # node.address unset: any address of this host
        ("127.0.0.1:29400", "auto", "", True),
        ("127.0.0.2:29400", "auto", "", True),
        ("192.0.2.1:29400", "auto", "", False),
        # said outright: as said
        ("127.0.0.1:29400", True, "127.0.0.2", True),
        ("127.0.0.1:29400", False, "127.0.0.1", False),
    ],
)
def test_which_daemon_hosts_the_store(store, host, address, hosts):
    settings = config.load(
        None, {"store.endpoint": store, "store.host": host, "node.address": address}
    )
    assert hosts_store(settings) is hosts


def test_with_etcd_no_daemon_hosts_the_store():
    settings = config.load(
        None,
        {
            "store.backend": "etcd",
            "store.endpoints": ["127.0.0.1:2379"],
            "store.host": True,
            "node.address": "127.0.0.1",
        },
    )
    assert hosts_store(settings) is False
