"""The ElasticdError tree. Each class has a stable ``code`` that travels on the wire
(control replies, job records) so clients can branch on it without parsing messages."""

from __future__ import annotations


class ElasticdError(Exception):
    code = "internal"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)

    @property
    def message(self) -> str:
        return str(self)


class ConfigError(ElasticdError):
    """A configuration key or value is invalid."""

    code = "config"

    def __init__(self, key: str, message: str) -> None:
        self.key = key
        super().__init__(f"config key '{key}': {message}")


class NotFound(ElasticdError):
    """No such object."""

    code = "not_found"


class PermissionDenied(ElasticdError):
    """The caller may not do this."""

    code = "permission_denied"


class InvalidSpec(ElasticdError):
    """The job specification is invalid."""

    code = "invalid_spec"


class Conflict(ElasticdError):
    """The object is not in a state that allows this."""

    code = "conflict"


class LimitExceeded(ElasticdError):
    """A request over one of the daemon's limits (the message names the config key)."""

    code = "limit_exceeded"


class TooLarge(ElasticdError):
    """A reply too large for the control protocol."""

    code = "too_large"


class StoreError(ElasticdError):
    """The store failed."""

    code = "store"


class StoreConnectionError(StoreError):
    """The store cannot be reached."""

    code = "store_unreachable"


class StoreTimeout(StoreError):
    """A store operation timed out."""

    code = "store_timeout"


class NotACounter(StoreError):
    """A store key that should hold a counter holds something else (anyone who reaches the
    store may write one): ``value`` is what it holds, for a compare-and-set that repairs it."""

    code = "store_not_a_counter"

    def __init__(self, key: str, value: bytes) -> None:
        self.key, self.value = key, value
        self.shown = repr(value[:40]) + (
            f" and {len(value) - 40} more bytes" if len(value) > 40 else ""
        )
        super().__init__(f"store key {key} holds {self.shown}, not a counter")


class AddInDoubt(StoreConnectionError):
    """An add whose connection was lost while the store still answers, the key holding a
    count: the add may have been applied (a lost connection), or refused over junk that
    someone replaced with a count meanwhile (TCPStore's server drops the connection of an
    add over junk).  Adding again is safe only where a number skipped is."""

    code = "store_add_in_doubt"


class TamperedRecord(StoreError):
    """A store record does not open: no or a wrong MAC, sealed for another key, or older
    than one seen before."""

    code = "tampered_record"


class RendezvousError(ElasticdError):
    """The rendezvous failed."""

    code = "rendezvous"


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed."""

    code = "rendezvous_closed"


class RendezvousTimeoutError(RendezvousError):
    """The rendezvous did not complete in time."""

    code = "rendezvous_timeout"


class RendezvousStateError(RendezvousError):
    """The rendezvous state in the store is unreadable or tampered with."""

    code = "rendezvous_state"


class RendezvousGone(RendezvousError):
    """The state of a job that already ran is missing or refused, and this node never saw it:
    it does not start the job again (that is for a node that holds the state to restore)."""

    code = "rendezvous_gone"


class CheckpointsFull(ElasticdError):
    """A node refused to keep a checkpoint's file: the job's checkpoint memory there is full
    (its cap)."""

    code = "checkpoints_full"
