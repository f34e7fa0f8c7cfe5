"""The head of a rendezvous: a tiny signed record of the state's version, rewritten by
every writer of the state after its revision key.  A keeper reads it at each duty, in the
one batch with its neighbours' heartbeats and the join counter, and reads the state (about
80 bytes per node of its round) only when the head says that it moved: O(1) bytes a duty
instead of O(N).  (Not the revision keys: TCPStore's read of a missing key wakes whoever
waits for it.)

Signed for its key like every record: a forged head does not open (a missing or refused
one makes the keeper read the state, as before the head existed).  An older head written
back (or a writer's head that lands after the next writer's) can hide a change from a
keeper that did not see it: every :data:`FULL_EVERY` duties a keeper reads the state
whatever the head says, so nothing written to the store keeps a keeper on an old state
for longer (and a keeper that follows a watched round waits on the revision keys, as
before).  Here too what
the keeper makes of the heartbeats read in that batch (:func:`beat_counts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from elasticd.core.liveness import Beat
from elasticd.rendezvous.state import RendezvousState
from elasticd.store.signing import Freshness, Refused, Signer, open_version

FULL_EVERY = 8  # duties: a keeper reads the state at least this often


def seal_head(signer: Signer, key: str, state: RendezvousState) -> bytes:
    return signer.seal(key, {"round": state.round}, version=state.version)


def head_version(signer: Signer, key: str, raw: bytes | None, refused: Refused) -> int | None:
    """The state version a head read as ``raw`` names; None when there is none or it is
    refused (reported to ``refused``)."""
    opened = open_version(signer, key, raw, refused)
    return None if opened is None else opened.version


def state_moved(known: int | None, head: int | None, duty: int) -> bool:
    """Whether a keeper that holds version ``known`` of the state (None: none) reads it
    again: the head names a newer one or none, or this duty is one of every
    :data:`FULL_EVERY`."""
    return known is None or head is None or head > known or duty % FULL_EVERY == 0


def beat_counts(
    signer: Signer,
    keys: Mapping[str, str],
    values: Sequence[bytes | None],
    beats: Mapping[str, Beat],
    refused: Refused,
    fresh: Freshness,
) -> dict[str, int | None]:
    """Each node's heartbeat version (``keys``: node -> its heartbeat's key, in the order
    of ``values``, as read); a refused one counts as not moved (None: there is none)."""
    counts = {}
    for (node, key), raw in zip(keys.items(), values):
        opened = open_version(signer, key, raw, refused, fresh)
        previous = beats.get(node)
        counts[node] = opened.version if opened else (previous.count if previous and raw else None)
    return counts
