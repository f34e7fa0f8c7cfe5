"""A job on this node (a *part*): its machine and the policies it runs.

- ``phases.py``: the part's phases and PART_PHASES, the moves between them;
- ``pool.py``: an in-place part's slots (SLOT_STATES) and the worker groups built from them,
  pure data and pure functions;
- ``port.py``: what the policies may read and do of a part (a Protocol);
- ``inplace.py``: the in-place policy (``--in-place``): survivors keep their processes;
- ``spares.py``: which hot spares a part gives back to its node, and the node's plan for it;
- ``machine.py``: ``PartCore``, the machine, and PART_EVENTS, its one event table.

Arrows point down that list: the machine imports the policies, the policies import the
port, nothing imports the machine but this package.
"""

from elasticd.core.part.machine import PART_EVENTS, Go, PartCore, PartSettings
from elasticd.core.part.phases import PART_PHASES, Phase
from elasticd.core.part.pool import SLOT_STATES, Pool, SlotState

__all__ = [
    "PART_EVENTS",
    "PART_PHASES",
    "SLOT_STATES",
    "Go",
    "PartCore",
    "PartSettings",
    "Phase",
    "Pool",
    "SlotState",
]
