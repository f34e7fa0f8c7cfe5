"""Where the cluster's store is: whether this daemon hosts it (a TCPStore server here, and
the firewall rule that only this daemon's user may reach its port from this host), and this
node's address on the route to it."""

from __future__ import annotations

import ipaddress
import logging
import os
import socket

import psutil

from elasticd import config as config_mod
from elasticd.config import DaemonConfig
from elasticd.core.containment import parse_memory
from elasticd.endpoint import join_endpoint, split_endpoint
from elasticd.errors import ConfigError
from elasticd.store.firewall import StoreFirewall
from elasticd.store.tcpserver import TCPStoreServer

log = logging.getLogger(__name__)


def host_store(config: DaemonConfig) -> tuple[TCPStoreServer | None, str]:
    """Host the cluster's store here when this node is its host: (the server, or None; the
    store's endpoint)."""
    if hosts_store(config):
        limit = parse_memory(config.store.max_memory, psutil.virtual_memory().total)
        server = TCPStoreServer(config.store_host, config.store_port, max_bytes=limit)
        return server, join_endpoint(config.store_host, server.port)
    endpoint = config.store.endpoint
    if config.store.host == config_mod.AUTO:
        log.info(
            "the store at %s is another node's (store.host = auto, and %s); connecting",
            endpoint,
            f"node.address is {config.node.address}"
            if config.node.address
            else "its host is none of this host's addresses",
        )
    return None, endpoint


def store_firewall(config: DaemonConfig, endpoint: str, *, hosted: bool) -> StoreFirewall | None:
    """Only this daemon's user may reach the store's port from this host (firewall.py)."""
    host, port = split_endpoint(endpoint)
    address = None
    if not hosted:
        try:
            address = str(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][4][0])
        except OSError as exc:
            raise ConfigError("store.endpoint", f"cannot resolve {host}: {exc}") from exc
    return StoreFirewall.setup(
        config.store.firewall,
        cluster=config.cluster.name,
        node=config.node_name,
        port=port,
        uid=os.getuid(),
        store_address=address,
    )


def hosts_store(config: DaemonConfig) -> bool:
    """Whether this daemon hosts the cluster's TCPStore.  ``store.host = auto``: when the
    endpoint's host resolves to node.address (so that of several daemons on one host, each
    with its own address, one hosts it); without node.address, when it is this host's."""
    if config.etcd:
        return False
    setting = config.store.host
    if setting != config_mod.AUTO:
        return bool(setting)
    if config.node.address:
        return bool(addresses(config.store_host) & addresses(config.node.address))
    return is_local(config.store_host)


def addresses(host: str) -> set[str]:
    """The addresses ``host`` (a name or an address) resolves to; none if it does not."""
    try:
        return {str(info[4][0]).split("%")[0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return set()


def is_local(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this host: loopback, or an interface's."""
    mine = {e.address.split("%")[0] for entries in psutil.net_if_addrs().values() for e in entries}
    return any(ipaddress.ip_address(a).is_loopback or a in mine for a in addresses(host))


def route_address(host: str) -> str:
    """This host's address on the route to ``host`` (the store): what the other nodes, which
    reach the same store, can use to reach this node.  No packet is sent."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)
            return probe.getsockname()[0]
    except OSError:
        log.warning(
            "no route to the store host %s: this node's address is 127.0.0.1 (set node.address)",
            host,
        )
        return "127.0.0.1"
