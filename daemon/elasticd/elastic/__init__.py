"""elasticd.elastic: in-place elastic training for scripts run by elasticd.

Needs only torch and the standard library: elasticd puts a directory that holds just this
package on every worker's PYTHONPATH. Usage (see examples/elastic_train.py)::

    from elasticd import elastic
    elastic.init("gloo")
    state = elastic.TorchState(model, optimizer, epoch=0, batch=0)

    @elastic.run
    def train(state):
        ...  # build DDP here or in a reset callback; state.commit() every few batches

    train(state)
"""

from .driver import run
from .errors import GroupAborted, HostsUpdatedInterrupt
from .runtime import check_host_updates, init, progress
from .state import ObjectState, State, TorchState

__all__ = [
    "GroupAborted",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "check_host_updates",
    "init",
    "progress",
    "run",
]
