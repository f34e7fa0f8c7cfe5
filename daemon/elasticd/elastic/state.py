"""The training state that survives membership changes (Horovod elastic's State classes).

The training loop calls ``commit()`` every few steps. When the membership changes, the
runtime re-forms the process group, calls ``on_reset()``, and then ``sync()`` so that
newcomers get rank 0's state. When a member died mid-step, it calls ``restore()`` first:
the step in progress is lost, everything up to the last commit is kept.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import runtime
from .broadcast import broadcast_into, broadcast_structure, encode

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

    ``save`` keeps detached clones on the same devices; ``restore`` loads them back;
    ``sync`` broadcasts rank 0's parameters and buffers into each rank's own tensors, and
    rank 0's optimizer state dict, which the others load (a newcomer's fresh optimizer has
    no state: after the load it has rank 0's, step counts included)."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **attrs: Any,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        super().__init__(**attrs)

    def save(self) -> None:
        super().save()
        self._saved_model = None if self.model is None else _snapshot(self.model.state_dict())
        self._saved_optimizer = (
            None if self.optimizer is None else _snapshot(self.optimizer.state_dict())
        )

    def restore(self) -> None:
        """Load what the last save kept (a model or optimizer given since is left as it is)."""
        super().restore()
        if self.model is not None and self._saved_model is not None:
            self.model.load_state_dict(self._saved_model)  # copies into the model's tensors
        if self.optimizer is not None and self._saved_optimizer is not None:
            # load_state_dict keeps the given tensors (step, exp_avg...) and steps them in
            # place later: hand it a copy, or the next step would change the saved state.
            self.optimizer.load_state_dict(_snapshot(self._saved_optimizer))

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
