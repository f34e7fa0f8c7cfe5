"""The store keys of one rendezvous, all under its ``prefix``::

state                   the signed RendezvousState (compare-and-set only)
head                    the state's version, signed: what keepers read (rendezvous/head.py)
rev/<v>                 set when version v was written; waiters block on the next one
hb/<node>               signed heartbeat: its version goes up at every beat
round/<r>/joins         the round's join counter (add): how many numbers were taken
round/<r>/join/<n>      the n-th record of round r's join log, signed (written once)
round/<r>/exit/<node>   a member's signed arrival at the exit barrier of round r
"""

from __future__ import annotations


class Keys:
    """The store keys of one rendezvous."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix.rstrip("/")
        self.state = f"{self.prefix}/state"
        self.head = f"{self.prefix}/head"

    def rev(self, version: int) -> str:
        return f"{self.prefix}/rev/{version}"

    def heartbeat(self, node: str) -> str:
        return f"{self.prefix}/hb/{node}"

    def joins(self, round: int) -> str:
        return f"{self.prefix}/round/{round}/joins"

    def join(self, round: int, number: int) -> str:
        return f"{self.prefix}/round/{round}/join/{number}"

    def exit_arrived(self, round: int, node: str) -> str:
        return f"{self.prefix}/round/{round}/exit/{node}"
