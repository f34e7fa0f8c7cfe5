"""How a daemon tells that a store endpoint is its own, and which of its addresses peers use."""

import psutil
import pytest

from elasticd.app import is_local, route_address


def _an_interface_address() -> str | None:
    for entries in psutil.net_if_addrs().values():
        for entry in entries:
            if entry.family.name == "AF_INET" and not entry.address.startswith("127."):
                return entry.address
    return None


@pytest.mark.parametrize("host, local", [
    ("127.0.0.1", True), ("127.0.1.1", True),  # all of 127/8 is this host (Debian names it 127.0.1.1)
    ("localhost", True), ("::1", True),
    ("192.0.2.1", False),  # TEST-NET-1: nobody's
    ("no-such-host.invalid", False),
])
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
