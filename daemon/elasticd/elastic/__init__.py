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

A sharded model (FSDP2, tensor parallel) is built in the ``run`` function for each round's
world and given to ``state.attach(model, optimizer)``, which loads the last commit into it
from the job's checkpoint tier, resharded (examples/fsdp_elastic_train.py).
"""

from .driver import run
from .errors import ElasticUsageError, GroupAborted, HostsUpdatedInterrupt
from .parallel import BatchShare, MeshError, World, batch_share, device_mesh, world
from .runtime import check_host_updates, init, progress
from .state import ObjectState, State, TorchState

__all__ = [
    "BatchShare",
    "ElasticUsageError",
    "GroupAborted",
    "HostsUpdatedInterrupt",
    "MeshError",
    "ObjectState",
    "State",
    "TorchState",
    "World",
    "batch_share",
    "check_host_updates",
    "device_mesh",
    "init",
    "progress",
    "run",
    "world",
]
