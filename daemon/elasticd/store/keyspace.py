"""Where each kind of record lives in the cluster's store: every key of a cluster is under
``elasticd/<cluster>/``, so that several clusters can share one store."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keyspace:
    cluster: str

    @property
    def root(self) -> str:
        return f"elasticd/{self.cluster}"

    @property
    def jobs(self) -> str:
        """The job board (jobs/board.py)."""
        return f"{self.root}/jobs"

    @property
    def nodes(self) -> str:
        """Node records, heartbeats and drain requests (cluster/registry.py)."""
        return f"{self.root}/nodes"

    @property
    def schedule(self) -> str:
        """The cluster's schedule, written by its allocator (cluster/scheduler.py)."""
        return f"{self.root}/schedule"

    @property
    def epoch(self) -> str:
        """Set by the store's host: it changes when the store was reset."""
        return f"{self.root}/epoch"

    @property
    def ping(self) -> str:
        """A key a daemon writes at start to see that the store answers and takes writes."""
        return f"{self.root}/ping"

    def rendezvous(self, job_id: str) -> str:
        """One job's rendezvous (rendezvous/handler.py)."""
        return f"{self.root}/rdzv/{job_id}"
