"""host:port: the one parser and printer of endpoints."""

import pytest

from elasticd.config import DaemonConfig, StoreConfig
from elasticd.endpoint import join_endpoint, split_endpoint


@pytest.mark.parametrize(
    "endpoint, parsed",
    [
        ("10.0.0.1:29400", ("10.0.0.1", 29400)),
        ("[::1]:80", ("::1", 80)),
        ("host.example:1", ("host.example", 1)),
        ("tcp://[fe80::1]:29401", ("fe80::1", 29401)),
        ("tcp://10.0.0.2:0", ("10.0.0.2", 0)),
    ],
)
def test_split(endpoint, parsed):
    assert split_endpoint(endpoint) == parsed
    assert split_endpoint(join_endpoint(*parsed)) == parsed


@pytest.mark.parametrize(
    "endpoint", ["nohost", "host:", ":80", "host:port", "::1:80", "h:70000", "[::1]"]
)
def test_garbage_is_refused(endpoint):
    with pytest.raises(ValueError):
        split_endpoint(endpoint)


def test_an_ipv6_store_endpoint_in_the_config():
    config = DaemonConfig(store=StoreConfig(endpoint="[::1]:29400"))
    assert (config.store_host, config.store_port) == ("::1", 29400)
