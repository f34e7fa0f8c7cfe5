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
