"""The store each round of a job forms its process group in, served by this node's daemon.

torchrun's agent hosts the TCPStore its workers meet in (``TORCHELASTIC_USE_AGENT_STORE=True``).
Hosted by rank 0's worker instead, the store listens only once that worker has started and
reached ``init_process_group``; a rank that gets there first is refused, and torch's client
backs off for half a second or more before it tries again.  After a warm restart every rank
gets there within milliseconds of the others, so half the restarts paid it.

So every node that joins a round serves a fresh store at the master port it offers, before
the round forms: whichever node the round puts first, its store listens before any worker of
the round starts.  Once the round formed the other nodes close theirs.  The store of the
round before stays until the round after it forms (survivors in place stay in the old group
until their next commit, and NCCL makes communicators through the store when they are first
used).  So under a fixed ``--master-port P`` an in-place node first in two rounds running
serves the second at P + 1 (``model.master_ports``), and the third at P again (P + 1 taken:
P, the round before giving way).  A store is fresh each round (torch's clients add no prefix per attempt) and
bounded (``MAX_BYTES``): as with torch's, anyone who reaches the port can talk to it, but
cannot make the daemon hold more than that.
"""

from __future__ import annotations

import errno
import ipaddress
import logging
from collections.abc import Sequence

from elasticd.errors import StoreConnectionError
from elasticd.store.tcpserver import TCPStoreServer

log = logging.getLogger(__name__)

MAX_BYTES = 64 * 1024 * 1024  # keys and values a round's store holds


class RoundStores:
    """One job's round stores on this node (see the module's docstring)."""

    def __init__(self, address: str, *, max_bytes: int = MAX_BYTES) -> None:
        self._address = address
        self._max_bytes = max_bytes
        self._offered: TCPStoreServer | None = None  # the join in flight's
        self._hosting: list[tuple[int, TCPStoreServer]] = []  # (round, its store) where first

    @property
    def ports(self) -> list[int]:
        """The ports served now (the rounds hosted, then the offer)."""
        servers = [server for _, server in self._hosting]
        return [server.port for server in [*servers, *([self._offered] if self._offered else [])]]

    def offer(self, ports: Sequence[int]) -> int:
        """A join offers the first of ``ports`` that the newest round hosted here does not
        serve (its survivors may still be in its group), else, where those are taken, the
        newest round's port (its store gives way, as it did before there were two): a fresh
        store listens there, and that port is returned.  An earlier offer that formed no
        round closes, and so does a hosted store on the port offered (``--master-port``: the
        same port every round, or two in place; survivors still in the round two back lose
        its store, as they do when the round after the next forms under free ports).
        Raises StoreConnectionError where every port is taken (another program, or another
        job's ``--master-port``): joining anyway, this node's workers might meet in that
        one."""
        self._shut(self._offered)
        self._offered = None
        newest = self._hosting[-1][1].port if self._hosting else None
        *others, last = [p for p in ports if p != newest] + [p for p in ports if p == newest]
        for port in others:
            try:
                self._offered = self._fresh(port)
                return port
            except StoreConnectionError as exc:
                log.warning("%s; the round's store takes %d instead", exc, last)
        self._offered = self._fresh(last)
        return last

    def formed(self, round: int, port: int, first: bool) -> None:
        """Round ``round`` formed with this node, its store at ``port`` on its first node:
        this node keeps its offer if it is that node, else closes it; of the stores of
        earlier rounds, it keeps the one of the round just before.  The first node whose
        offer is not at ``port`` (a node the rendezvous kept as it was, with the port of an
        earlier join) serves a fresh store there.  Raises StoreConnectionError where that
        port is taken."""
        offered, self._offered = self._offered, None
        if first and (offered is None or offered.port != port):
            self._shut(offered)
            offered = self._fresh(port)
        if offered is not None and first:
            self._hosting.append((round, offered))
        else:
            self._shut(offered)
        for kept in [h for h in self._hosting if h[0] < round - 1]:
            self._hosting.remove(kept)
            self._shut(kept[1])

    def _fresh(self, port: int) -> TCPStoreServer:
        """A fresh store at ``port``, where an earlier round's hosted here closes first."""
        for stale in [h for h in self._hosting if h[1].port == port]:
            self._hosting.remove(stale)
            self._shut(stale[1])
        return self._serve(port)

    def _serve(self, port: int) -> TCPStoreServer:
        """A store at ``port`` on the node's address (so that nodes sharing a host may each
        serve the same ``--master-port``), else on every address, as TCPStore binds, where
        the node's address is not this host's (a NAT's, a container's) or is a name (which
        may resolve here to a loopback address: Debian's ``127.0.1.1 hostname``)."""
        try:
            ipaddress.ip_address(self._address)
        except ValueError:
            return self._anywhere(port)
        try:
            return TCPStoreServer(self._address, port, max_bytes=self._max_bytes)
        except StoreConnectionError as exc:
            if getattr(exc.__cause__, "errno", None) != errno.EADDRNOTAVAIL:
                raise
        return self._anywhere(port)

    def _anywhere(self, port: int) -> TCPStoreServer:
        anywhere = "::" if ":" in self._address else "0.0.0.0"
        return TCPStoreServer(anywhere, port, max_bytes=self._max_bytes)

    def close(self) -> None:
        for server in [*(server for _, server in self._hosting), self._offered]:
            self._shut(server)
        self._hosting, self._offered = [], None

    @staticmethod
    def _shut(server: TCPStoreServer | None) -> None:
        if server is not None:
            server.close()
