"""What the training loop sees when the job's membership changes (torch + stdlib only)."""

from __future__ import annotations


class HostsUpdatedInterrupt(RuntimeError):
    """The daemon announced a membership change and every rank agreed to act on it at this
    step. ``skip_sync``: no worker joined, so the survivors' states are already equal."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the job's membership changed")
        self.skip_sync = skip_sync


class GroupAborted(RuntimeError):
    """The daemon said a member is gone: this worker's process group was aborted, and the
    step in progress is lost (``run`` restores the last commit)."""


class ElasticUsageError(Exception):
    """The script used this library in a way that cannot work (a commit of a model built
    for an earlier round, a load before ``attach``).  Not a RuntimeError, whose text decides
    whether a group broke: a message that names the process group made such a mistake a
    group failure, and the job re-formed and failed the same way for good."""


class TierError(RuntimeError):
    """The job's checkpoint tier refused a request, or its daemon did not answer.  Never a
    broken group by itself: its text ("timed out", "connection reset") is the daemon
    socket's, not a collective's."""
