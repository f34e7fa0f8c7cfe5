"""Host discovery (Horovod's ``--host-discovery-script``), pure: what a discovery script
printed, and whether it lists this node.

The script prints one node a line, ``host`` or ``host:slots`` (``[v6 address]:slots`` for an
IPv6 address with slots); blank lines and lines starting with ``#`` are skipped.  Every
daemon runs the script itself (``cluster.HostDiscovery``) and applies the list to itself
only: it is listed when its node name or its address is a host of the list, and then
``slots``, if given, is its slot count.  A node that is not listed takes no new job and
leaves its jobs through a clean new round, like a drained one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elasticd.wire.numbers import is_whole

MAX_OUTPUT = 1 << 20  # bytes of output a run may print (more: the run failed)
MAX_SLOTS = 1_000_000


@dataclass(frozen=True)
class Listing:
    """Whether the script lists this node, and the slots it gives it (None: its own count)."""

    listed: bool
    slots: int | None = None


EVERYONE = Listing(True)  # no discovery script: every node may take work


def parse_hosts(output: str) -> dict[str, int | None]:
    """The hosts a discovery script printed, in order, with their slots (None: not given);
    ValueError naming the first line that is not ``host[:slots]``.  A host listed twice
    keeps its first line."""
    hosts: dict[str, int | None] = {}
    for number, raw in enumerate(output.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            host, slots = _host_slots(line)
        except ValueError as exc:
            raise ValueError(f"line {number} ({line[:80]!r}): {exc}") from None
        hosts.setdefault(host, slots)
    return hosts


def _host_slots(line: str) -> tuple[str, int | None]:
    if line.startswith("["):  # [v6 address] or [v6 address]:slots
        host, bracket, rest = line[1:].partition("]")
        if not bracket or (rest and not rest.startswith(":")):
            raise ValueError("an IPv6 address is written [address] or [address]:slots")
        slots = rest[1:] if rest else None
    elif line.count(":") == 1:
        host, slots = line.split(":")
    else:  # a bare name, or an IPv6 address without slots
        host, slots = line, None
    if not host or not host.isprintable() or any(c.isspace() for c in host):
        raise ValueError("not host[:slots]")
    if slots is None:
        return host, None
    if not is_whole(slots) or not 1 <= int(slots) <= MAX_SLOTS:
        raise ValueError(f"slots must be a whole number from 1 to {MAX_SLOTS}")
    return host, int(slots)


def listing(hosts: Mapping[str, int | None], names: Iterable[str]) -> Listing:
    """This node's listing: the first of its ``names`` (node name, address) that the hosts
    list, with that line's slots."""
    for name in names:
        if name and name in hosts:
            return Listing(True, hosts[name])
    return Listing(False)
