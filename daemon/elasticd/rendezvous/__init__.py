"""One job's rendezvous (docs/architecture.md, "The store"): torchelastic's dynamic rendezvous semantics on a store,
event-driven, signed, with stable ranks. ``state`` holds the data and its codec, ``ops`` the
pure decisions, ``handler`` the executor that applies them. The package exports the pure
tier only, which the node core imports; the executor is ``elasticd.rendezvous.handler``."""

from elasticd.rendezvous.state import (
    CHARGED,
    EventKind,
    Member,
    NextRound,
    Reason,
    RendezvousInfo,
    RendezvousSettings,
    RoundEvent,
    may_restart,
)

__all__ = [
    "CHARGED",
    "EventKind",
    "Member",
    "NextRound",
    "Reason",
    "RendezvousInfo",
    "RendezvousSettings",
    "RoundEvent",
    "may_restart",
]
