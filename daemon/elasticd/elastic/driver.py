"""``run``: the training function's loop over membership changes (Horovod's
``hvd.elastic.run``, for PyTorch)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

from . import runtime
from .errors import HostsUpdatedInterrupt

log = logging.getLogger(__name__)
T = TypeVar("T")


def run(func: Callable[..., T]) -> Callable[..., T]:
    """Wrap ``func(state, ...)``. On a membership change (HostsUpdatedInterrupt) or a broken
    process group: leave the group, take this worker's place in the next round from the
    local daemon, form the new group, ``restore()`` the last commit after a failure,
    ``sync()`` from rank 0, call the reset callbacks, and call ``func`` again. The process,
    its imports and its model stay (a sharded model is built anew by ``func``, and
    ``state.attach`` loads the commit into it). Outside an in-place job ``func`` is called
    once."""

    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> T:
        worker = runtime.current()
        if worker is None:
            return func(state, *args, **kwargs)
        why, error = ("start", "") if worker.round < 0 else ("", "")
        reset, skip_sync = False, False
        while True:
            try:
                if why:
                    if why == "interrupt":
                        state.flush()  # the last commit's write uses the group being left
                    worker.join(why, error)
                    if reset:
                        state.on_reset()
                if not skip_sync or state_reshards(state):
                    runtime.phase("sync-start", worker.round)
                    state.sync()
                    runtime.phase("sync-end", worker.round)
                worker.note_group_sockets()
                result = func(state, *args, **kwargs)
                state.flush()
                return result
            except HostsUpdatedInterrupt as exc:
                skip_sync, why, error = exc.skip_sync, "interrupt", ""
            except Exception as exc:
                if not worker.is_group_failure(exc):
                    raise
                log.warning(
                    "elasticd: the process group broke (%s); restoring the last commit", exc
                )
                state.restore()
                skip_sync, why, error = False, "failure", str(exc)
            reset = True

    return wrapper


def state_reshards(state: Any) -> bool:
    """Whether ``state`` must hear of every re-form, even one that adds no worker: a sharded
    model's sharding is the world's (TorchState.sharded)."""
    return bool(getattr(state, "sharded", False))
