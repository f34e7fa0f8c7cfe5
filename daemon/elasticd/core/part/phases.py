"""A part's phases and the moves between them (the part's StateTable)."""

from __future__ import annotations

import enum

from elasticd.core.tables import StateTable


class Phase(enum.StrEnum):
    STARTING = "starting"  # made; its first instructions not given yet
    WARMING = "warming"  # in place: workers run, not all asked for a place yet
    JOINING = "joining"  # a join of the job's round runs
    PREPARING = "preparing"  # the checkpoint the workers will read is put in place here
    RUNNING = "running"  # workers up; the round is watched
    PROBING = "probing"  # workers failed: are members' daemons gone?
    STOPPING = "stopping"  # workers are being stopped; ``then`` says what follows
    REQUESTING = "requesting"  # a new round was asked for
    BARRIER = "barrier"  # at the exit barrier, waiting for the other members
    FINISHING = "finishing"  # the job's outcome is being written
    LEAVING = "leaving"  # telling the rendezvous that this node leaves
    CLOSING = "closing"  # the part's effectors are being closed: nothing more to do


# A part looks at the job's end and at its own leaving whenever it is about to join or
# watch a round: from wherever it goes on to the next round, it may end or leave instead.
_NEXT = (Phase.JOINING, Phase.WARMING, Phase.LEAVING, Phase.FINISHING, Phase.CLOSING)
PART_PHASES = StateTable(
    "a part's phase",
    {
        Phase.STARTING: _NEXT,
        Phase.WARMING: (Phase.REQUESTING, *_NEXT),  # REQUESTING: a warm-up failed
        Phase.JOINING: (Phase.RUNNING, Phase.PREPARING, *_NEXT),
        Phase.PREPARING: (Phase.RUNNING, *_NEXT),
        Phase.RUNNING: (Phase.PROBING, Phase.STOPPING, Phase.REQUESTING, *_NEXT),
        Phase.PROBING: (Phase.RUNNING, Phase.STOPPING, Phase.REQUESTING, *_NEXT),
        Phase.STOPPING: (Phase.REQUESTING, Phase.BARRIER, *_NEXT),
        Phase.REQUESTING: _NEXT,
        Phase.BARRIER: _NEXT,
        Phase.FINISHING: (Phase.CLOSING,),
        Phase.LEAVING: (Phase.CLOSING,),
        Phase.CLOSING: (),
    },
)
