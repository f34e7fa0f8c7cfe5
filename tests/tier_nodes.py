"""One other node as ``elasticd.cluster.tierlink.TierLinks`` sees it (``NodeRecords``): the
node a test or a bench serves a tier as, at an endpoint with a CURVE key, always alive."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Record:
    tier_endpoint: str
    peer_key: str


class OneNode:
    def __init__(self, record: Record) -> None:
        self._record = record

    async def record(self, name: str) -> Record:
        return self._record

    def alive(self, name: str) -> bool:
        return True

    def sighted(self, name: str) -> None:
        return None
