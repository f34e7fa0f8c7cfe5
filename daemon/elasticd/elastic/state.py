"""The training state that survives membership changes (Horovod elastic's State classes).

The training loop calls ``commit()`` every few steps. When the membership changes, the
runtime re-forms the process group, calls ``on_reset()``, and then ``sync()`` so that
newcomers get rank 0's state. When a member died mid-step, it calls ``restore()`` first:
the step in progress is lost, everything up to the last commit is kept.
"""

from __future__ import annotations

import copy
import os
import sys
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import collectives, runtime
from .broadcast import broadcast_into, broadcast_structure, default_device, encode
from .errors import ElasticUsageError

# ``sharded`` and ``checkpoint`` bring DCP: 0.3 s of CPU at a worker's start (0.9 s before
# the script's first optimizer imports DTensor) that a replicated model never uses. They are
# imported where a sharded model first needs them.
if TYPE_CHECKING:
    from .checkpoint import Tier
    from .sharded import ShardedCommits

ROOT = 0  # the rank whose state the others take on sync


class State:
    """The base: reset callbacks and ``commit``; subclasses say what is saved and synced."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], None]]) -> None:
        """Call ``callbacks`` after every re-formed process group (to rebuild DDP, scale
        the learning rate to the new world size...), after the ones registered before."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in list(self._reset_callbacks):
            callback()

    def commit(self) -> None:
        """Save, then raise HostsUpdatedInterrupt if the membership changed. Saving first
        makes the step that just ended the one that survives the change."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        runtime.check_host_updates()  # looked up at call time: the runtime may be replaced

    def flush(self) -> None:
        """Wait until the last commit is saved (``run`` calls it before the group is left
        for a new round and when the function returns)."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Named values as attributes (``state.epoch``, ``state.epoch = 3``).

    ``save`` keeps a deep copy in memory (tensors cloned), so that mutating a value in
    place after a commit does not change what ``restore`` brings back. Only the names
    given to the constructor (and any that a sync brings) are saved and synced. Synced
    values must be None, bool, int, float, str, tensors, or lists, tuples and dicts of
    them: they travel as JSON and raw tensor bytes, never as pickle."""

    def __init__(self, **attrs: Any) -> None:
        super().__init__()
        for name in attrs:
            self._check_name(name)
        self._attr_names = list(attrs)
        for name, value in attrs.items():
            setattr(self, name, value)
        self.save()  # a restore before any commit goes back to the constructor's values

    def _check_name(self, name: str) -> None:
        if name.startswith("_") or hasattr(type(self), name):
            raise ValueError(
                f"{name!r} cannot be a state attribute: it is private or "
                f"a member of {type(self).__name__}"
            )

    def _values(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self._attr_names}

    def save(self) -> None:
        self._saved_attrs = _snapshot(self._values())

    def saved(self, name: str) -> Any:
        """The value of ``name`` as the last save kept it (a restore brings it back)."""
        return self._saved_attrs[name]

    def restore(self) -> None:
        """Put the saved values back, as copies: the saved ones stay as they were."""
        self._set_values(_snapshot(self._saved_attrs))

    def sync(self) -> None:
        """Take rank 0's values, then save them (a restore goes back to the synced state).
        Without a process group there is nobody to sync with: only check and save."""
        if dist.is_available() and dist.is_initialized():
            self._broadcast_from_root()
        else:
            self._check_broadcastable()
        self.save()

    def _broadcast_from_root(self) -> None:
        self._set_values(broadcast_structure(self._values(), root=ROOT, name="state"))

    def _check_broadcastable(self) -> None:
        """The TypeError a real sync would raise, in a single process too."""
        encode(self._values(), name="state")

    def _set_values(self, values: dict[str, Any]) -> None:
        for name, value in values.items():
            if name not in self._attr_names:
                self._check_name(name)
                self._attr_names.append(name)
            setattr(self, name, value)


class TorchState(ObjectState):
    """An ObjectState that also keeps a model's and an optimizer's state dicts.

    A replicated model (plain, DDP): ``save`` keeps detached clones on the same devices;
    ``restore`` loads them back; ``sync`` broadcasts rank 0's parameters and buffers into
    each rank's own tensors, and rank 0's optimizer state dict, which the others load (a
    newcomer's fresh optimizer has no state: after the load it has rank 0's, step counts
    included).

    A sharded model (FSDP2, tensor parallel: its parameters are DTensors) in an elasticd job:
    ``save`` writes this rank's shards, the optimizer's and the attributes as a checkpoint in
    the job's checkpoint tier (``sharded.py``). After a re-form the group is new and so must
    be the sharding: ``restore`` and ``sync`` let the old model go, and the ``run`` function
    builds one for the new world and calls ``attach(model, optimizer)``, which loads the
    newest commit into it, resharded. Outside elasticd (no tier) a sharded model is kept as
    clones, as a replicated one is."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **attrs: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self._commits: ShardedCommits | None = None  # set once the model is sharded
        self._stale = False  # the model is an earlier round's: attach() a new one
        self._saved_model: Any = None
        self._saved_optimizer: Any = None
        self._constructed = False
        super().__init__(**attrs)
        self._constructed = True

    @property
    def last_commit(self) -> str | None:
        """The name of the commit this state last wrote or loaded in the checkpoint tier
        (a sharded model in an elasticd job), else None."""
        last = self._commits.last if self._commits is not None else None
        return None if last is None else last.name

    @property
    def commit_timings(self) -> dict[str, float]:
        """The last commit to the checkpoint tier's seconds: ``waited`` for the commit before
        it to be written and complete, ``staged`` into kept buffers (the rest is written in
        the background; empty for a replicated model)."""
        return dict(self._commits.timings) if self._commits is not None else {}

    @property
    def sharded(self) -> bool:
        """Whether commits go to the checkpoint tier (a sharded model in an elasticd job)."""
        return self._commits is not None

    def attach(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
    ) -> bool:
        """Make ``model`` and ``optimizer`` (built for this round's world: its device mesh,
        ``fully_shard``) the state's, and load the last commit into them: for a sharded
        model, the newest commit every rank can get, resharded by DCP to this world, its
        attributes with it; for a replicated one, this rank's copy of the last commit. Call
        it in the ``run`` function, on every rank, after building them. Returns whether a
        commit was loaded (False: none yet, the model is as built)."""
        self.model, self.optimizer, self._stale = model, optimizer, False
        tier = _served_tier() if holds_dtensors(model, optimizer) else None
        if tier is not None:
            if self._commits is None:
                self._commits = _commits_in(tier)
            worker = runtime.current()
            round = worker.round if worker is not None else -1
            runtime.phase("load-start", round)
            attrs = self._commits.load(model, optimizer) if _grouped() else None
            runtime.phase("load-end", round)
            if attrs is None:
                if _grouped():
                    ObjectState._broadcast_from_root(self)  # the first round: rank 0's values
                ObjectState.save(self)
                return False
            self._set_values(attrs)
            ObjectState.save(self)
            return True
        if self._saved_model is None:
            return False
        model.load_state_dict(self._saved_model)
        if optimizer is not None and self._saved_optimizer is not None:
            optimizer.load_state_dict(_snapshot(self._saved_optimizer))
        return True

    def load_from(self, checkpoint_id: str | os.PathLike[str]) -> None:
        """Load a commit from a directory (the copy of one that the daemon wrote to the job's
        ``--checkpoint-dir``) into the attached model and optimizer, resharded to them, and
        its attributes: a new job can start where another one's commits left off. A
        collective when distributed."""
        if self.model is None:
            raise ElasticUsageError("attach(model, optimizer) first: load_from loads into them")
        from .sharded import load_commit

        self._set_values(load_commit(self.model, self.optimizer, checkpoint_id))
        ObjectState.save(self)

    def save(self) -> None:
        super().save()
        if not self._constructed:
            if not holds_dtensors(self.model, self.optimizer):
                self._keep_copies()
            return
        if self._stale:
            raise ElasticUsageError(
                "elasticd: this state's model belongs to an earlier round's process group; "
                "build the sharded model anew in the elastic.run function and give it to "
                "state.attach(model, optimizer) before the first commit"
            )
        if self._commits is None and holds_dtensors(self.model, self.optimizer):
            tier = _served_tier()
            if tier is not None and _grouped():
                self._commits = _commits_in(tier)
        if self._commits is not None and self.model is not None:
            self._commits.save(self.model, self.optimizer, self._values())
            return
        self._keep_copies()

    def flush(self) -> None:
        """Wait until the last commit is written into the tier (a sharded model's commits
        are written in the background; its error, if it failed, is raised here)."""
        if self._commits is not None:
            self._commits.flush()

    def _keep_copies(self) -> None:
        self._saved_model = None if self.model is None else _snapshot(self.model.state_dict())
        self._saved_optimizer = (
            None if self.optimizer is None else _snapshot(self.optimizer.state_dict())
        )

    def restore(self) -> None:
        """Load what the last save kept (a model or optimizer given since is left as it is)."""
        super().restore()
        if self._commits is not None:
            self._commits.failed()
            self._let_go()
            return
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)  # copies into the model's tensors
        if self.optimizer is not None and self._saved_optimizer is not None:
            # load_state_dict keeps the given tensors (step, exp_avg...) and steps them in
            # place later: hand it a copy, or the next step would change the saved state.
            self.optimizer.load_state_dict(_snapshot(self._saved_optimizer))

    def sync(self) -> None:
        """Replicated: rank 0's state to every rank. Sharded: the model is let go (its group
        is gone); ``attach`` loads the commit, attributes included, into the next one. The
        ranks agree first (one all_reduce): a newcomer, which has no model yet, does what
        the others do."""
        if _any_rank(self._commits is not None):
            self._let_go()
            return
        super().sync()

    def _let_go(self) -> None:
        self.model = self.optimizer = None
        self._stale = True

    def _broadcast_from_root(self) -> None:
        if self.model is not None:
            for tensor in self.model.state_dict().values():  # views of parameters and buffers
                broadcast_into(tensor, root=ROOT)
        if self.optimizer is not None:
            self._broadcast_optimizer(self.optimizer)
        super()._broadcast_from_root()

    def _broadcast_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        is_root = dist.get_rank() == ROOT
        state_dict = broadcast_structure(
            optimizer.state_dict() if is_root else None, root=ROOT, name="optimizer"
        )
        if not is_root:
            optimizer.load_state_dict(state_dict)  # its tensors are fresh: no aliasing

    def _check_broadcastable(self) -> None:
        super()._check_broadcastable()
        if self.optimizer is not None:  # a custom optimizer's state may not be broadcastable
            encode(self.optimizer.state_dict(), name="optimizer")


def holds_dtensors(model: torch.nn.Module | None, optimizer: Any = None) -> bool:
    """Whether a model's parameters or buffers, or an optimizer's state, are DTensors. None
    exists until something imported ``torch.distributed.tensor``: this imports nothing."""
    dtensors = sys.modules.get("torch.distributed.tensor")
    if dtensors is None:
        return False
    kind = dtensors.DTensor
    if model is not None:
        if any(isinstance(p, kind) for p in model.parameters()):
            return True
        if any(isinstance(b, kind) for b in model.buffers()):
            return True
    if optimizer is not None:
        for per_param in optimizer.state.values():
            if any(isinstance(v, kind) for v in per_param.values()):
                return True
    return False


def _served_tier() -> Tier | None:
    """The job's checkpoint tier where a daemon serves one, else None."""
    from .checkpoint import Tier

    tier = Tier.from_env()
    return tier if tier is not None and tier.served else None


def _commits_in(tier: Tier) -> ShardedCommits:
    from .sharded import ShardedCommits

    return ShardedCommits(tier)


def _grouped() -> bool:
    return dist.is_available() and dist.is_initialized()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank (this one alone without a process group)."""
    if not _grouped():
        return flag
    value = torch.tensor([int(flag)], device=default_device())
    collectives.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def _snapshot(value: Any) -> Any:
    """A deep copy whose tensors are detached clones on the same device (a tensor that
    required grad still does). Dicts keep their type and attributes, such as the
    ``_metadata`` of a module's state dict, which ``load_state_dict`` reads."""
    if isinstance(value, torch.Tensor):
        clone = value.detach().clone()
        return clone.requires_grad_() if value.requires_grad else clone
    if isinstance(value, dict):
        copied = copy.copy(value)
        for key, item in value.items():
            copied[key] = _snapshot(item)
        return copied
    if type(value) in (list, tuple):
        return type(value)(_snapshot(item) for item in value)
    return copy.deepcopy(value)
