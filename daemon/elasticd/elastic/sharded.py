"""A ``TorchState``'s commits when its model or optimizer is sharded (FSDP2's ``fully_shard``,
tensor parallel: DTensors).  Torch and the standard library only.

No rank holds a whole copy of such a state, and the shards a lost node held are gone with it;
a world of another size needs another sharding.  So each commit is a DCP checkpoint in the
job's checkpoint tier (``checkpoint.py``): each rank writes its shards into its node's
memory (that copy is all the training loop waits for), and the daemons copy each node's part
to another node in the background.  After a re-form the script builds its model for the new
world and hands it to ``TorchState.attach``, which loads the newest commit every rank can
get, resharded by DCP: from this node's memory, or fetched from the node that holds it.

The training loop waits only for the staging: DCP's stager copies the rank's tensors into
CPU buffers it keeps from one commit to the next (pinned where there is a GPU), and a thread
writes the staged copy into the tier (``dcp.save`` on a gloo group of its own, so that its
collectives never interleave with the training's).  A commit waits for the one before it to
be written and complete (copied to another node): at most one is in flight, so a node holds
its parts of the newest complete commit, the copies it keeps of another node's, one commit
in flight, and each rank's staging buffers.  A failure loses the steps since the newest
complete commit: the step in flight, and the commit before it when its write or copy had not
ended (one that takes longer than a step).  An error of a write (the tier refused it: over
the job's cap) is raised by the next commit, or by ``flush``.

Commits are named ``elastic-<round>-<n>``: in place, the round increases with every re-form,
so names never repeat and their order is the order of the saves.
"""

from __future__ import annotations

import atexit
import io
import logging
import os
import re
import shutil
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from . import checkpoint, collectives, runtime
from .broadcast import default_device, pack
from .errors import ElasticUsageError, GroupAborted

log = logging.getLogger(__name__)

COMPLETE_WAIT = 600.0  # seconds a commit waits for the one before it to be complete
_SLICE = 0.05  # seconds of one wait for completion: aborts are looked at in between
_LOAD_TRIES = 3
_NAME = re.compile(r"elastic-(\d+)-(\d+)")


@dataclass(frozen=True, order=True)
class CommitId:
    """A commit: the round it was made in, and its number in that round (from 1)."""

    round: int
    seq: int

    @property
    def name(self) -> str:
        return f"elastic-{self.round}-{self.seq}"

    @classmethod
    def parse(cls, name: str | None) -> CommitId | None:
        found = _NAME.fullmatch(name or "")
        return cls(int(found[1]), int(found[2])) if found else None

    def encode(self) -> int:
        """One int64 that orders as the commits do (all_reduce MAX agrees on the newest)."""
        return self.round << 32 | self.seq

    @classmethod
    def decode(cls, value: int) -> CommitId | None:
        return None if value < 0 else cls(value >> 32, value & 0xFFFFFFFF)


class ShardedCommits:
    """The commits of one TorchState in the job's tier (see the module's docstring)."""

    def __init__(self, tier: checkpoint.Tier) -> None:
        self.tier = tier
        self.last: CommitId | None = None  # the newest commit this process wrote or loaded
        self.trusted = True  # False after a failure: ``last`` may be torn
        self.pending: CommitId | None = None  # written, not yet known complete
        self.writing: Future[Any] | None = None  # ``pending`` being written by a thread
        self.cleaned = -1  # the round whose older entries were deleted
        self.timings: dict[str, float] = {}  # the last commit's: waited, staged (seconds)
        self._stager: DefaultStager | None = None
        self._group: Any = None  # the gloo group the writes' collectives use
        self._group_round = -1  # the round it belongs to
        atexit.register(self._flush_at_exit)

    # -- commit ---------------------------------------------------------------------------

    def save(self, model: torch.nn.Module, optimizer: Any, attrs: dict[str, Any]) -> CommitId:
        """This rank's shards, the optimizer's and ``attrs`` as the next commit (a collective:
        every rank commits at the same step).  Waits first for the commit before it, then
        stages this one and writes it in the background."""
        started = time.monotonic()
        self._settle()
        waited = time.monotonic()
        ident = self._next()
        state = _state_dict(model, optimizer, attrs)
        group = self._writers_group()
        staged = self._stage(state)
        writer = checkpoint.TierWriter(ident.name, tier=self.tier, place=checkpoint.Place.here())
        planner = checkpoint.TierSavePlanner()
        self.writing = checkpoint.in_background(
            lambda: dcp.save(staged, storage_writer=writer, planner=planner, process_group=group),
            "elasticd-commit",
        )
        self.last, self.trusted, self.pending = ident, True, ident
        self.timings = {"waited": waited - started, "staged": time.monotonic() - waited}
        return ident

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of ``state`` in the stager's kept CPU buffers (DCP's ``DefaultStager``:
        a buffer per source storage, reused while that storage lives)."""
        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=torch.cuda.is_available(),
                use_shared_memory=False,
                use_async_staging=False,
                use_non_blocking_copy=False,
            )
            self._stager = DefaultStager(options)
        staged = self._stager.stage(state)
        assert isinstance(staged, dict)
        return staged

    def _writers_group(self) -> Any:
        """The gloo group of this round's writes (made on every rank at the round's first
        commit, a collective like the commit; its sockets join those an abort shuts
        down)."""
        round = _round()
        if self._group is None or self._group_round != round:
            self._group, self._group_round = dist.new_group(backend="gloo"), round
            self._drop_stager()  # the round's model is new: so are the buffers it needs
            worker = runtime.current()
            if worker is not None:
                worker.note_group_sockets()
        return self._group

    def _next(self) -> CommitId:
        round = _round()
        if self.last is not None and self.last.round >= round:
            return CommitId(self.last.round, self.last.seq + 1)
        return CommitId(round, 1)

    def _settle(self) -> None:
        """Wait until the pending commit is written and complete (``COMPLETE_WAIT`` at
        most: then it is given up, and the daemons keep trying to copy it); its write's
        error, if any, is raised here."""
        self.flush()
        if self.pending is None:
            return
        if not self._complete(self.pending, COMPLETE_WAIT):
            log.warning(
                "elasticd: commit %s was not complete after %.0f s; committing the next one",
                self.pending.name,
                COMPLETE_WAIT,
            )
        else:  # it is complete, or a newer one is: a commit, or the script's own save?
            _commit_or_refuse(self.tier.latest())
            self._clean(self.pending)
        self.pending = None

    def flush(self, timeout: float | None = None) -> None:
        """Wait until the commit being written is in the tier (not its copy: ``_settle``);
        GroupAborted when the daemon says a member is gone meanwhile.  A write that failed
        makes ``last`` untrusted and raises its error; TimeoutError after ``timeout``."""
        writing, worker = self.writing, runtime.current()
        deadline = None if timeout is None else time.monotonic() + timeout
        while writing is not None:
            if worker is not None and worker.aborted:
                raise GroupAborted("a member of the job is gone")
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the last commit's write took over {timeout:.0f} s")
            try:
                writing.result(timeout=_SLICE)
            except FutureTimeout:
                continue
            except BaseException:
                self.writing, self.pending, self.trusted = None, None, False
                raise
            self.writing = None
            return

    def _flush_at_exit(self) -> None:
        """At exit, the last commit is written before the interpreter goes (its write is a
        daemon thread), or ``COMPLETE_WAIT`` s have passed (a peer that froze mid-write);
        an error is logged: there is no caller left to raise it to."""
        try:
            self.flush(COMPLETE_WAIT)
        except BaseException as exc:
            log.warning("elasticd: the last commit was not written (%s)", exc)

    def _complete(self, ident: CommitId, timeout: float) -> bool:
        """Wait for ``ident`` to be complete in this node's tier; GroupAborted when the
        daemon says a member is gone meanwhile (the wait would be for a lost node's copy)."""
        deadline = time.monotonic() + timeout
        worker = runtime.current()
        while True:
            if worker is not None and worker.aborted:
                raise GroupAborted("a member of the job is gone")
            left = deadline - time.monotonic()
            if self.tier.wait(ident.name, max(0.0, min(_SLICE, left))):
                return True
            if left <= 0:
                return False

    def _clean(self, complete: CommitId) -> None:
        """Once a commit of a round is complete: delete this node's entries of commits of
        earlier rounds (the daemon prunes those it knows; a save cut off by a failure it
        never described).  Each rank deletes; they may race, harmlessly."""
        if complete.round <= self.cleaned:
            return
        self.cleaned = complete.round
        for entry in os.scandir(self.tier.directory):
            found = CommitId.parse(entry.name)
            if found is not None and found.round < complete.round and entry.is_dir():
                shutil.rmtree(entry.path, ignore_errors=True)

    # -- after a re-form ---------------------------------------------------------------------

    def failed(self) -> None:
        """The group broke: the last commit may be torn (a rank died while saving it, or its
        copy did not end), so it is no longer this rank's proposal.  Its write is left to
        fail on the broken group; the next round stages into buffers of its own."""
        self.trusted = False
        self.pending = self.writing = None
        self._drop_stager()

    def _drop_stager(self) -> None:
        """Let the staging buffers go now: torch's stager is a reference cycle (its copy
        functions close over it) holding a copy of every tensor it staged, so dropped
        unclosed it kept one copy of the rank's state per re-form until a full collection
        (48 MiB a round in a 16 MiB model with AdamW; pinned memory on a GPU host).  A write
        still running holds its own references to the tensors it writes."""
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def load(self, model: torch.nn.Module, optimizer: Any) -> dict[str, Any] | None:
        """Load the newest commit that every rank can get into ``model`` and ``optimizer``
        (built for this round's world), resharded; its attributes, or None when there is no
        commit at all.  A collective."""
        self.flush()
        for attempt in range(_LOAD_TRIES):
            agreed = self._agree()
            if agreed is None:
                return None
            loaded = None
            try:
                if not self._complete(agreed, COMPLETE_WAIT):
                    raise checkpoint.TierError(f"{agreed.name} did not complete")
                loaded = load_commit(model, optimizer, agreed.name, self.tier)
            except (OSError, ValueError, checkpoint.TierError, dcp.CheckpointException) as exc:
                # DCP gathers every rank's error of a distributed load into one
                # CheckpointException (a BaseException), raised on every rank
                log.warning("elasticd: loading %s failed (%s)", agreed.name, exc)
            if _everyone(loaded is not None):
                assert loaded is not None
                self.last, self.trusted, self.pending = agreed, True, None
                return loaded
            log.warning("elasticd: a rank could not load %s (try %d)", agreed.name, attempt + 1)
            # every rank is here: none proposes its own last commit again (its copy refused,
            # say, it never completes), so the next try takes the newest its node knows
            # complete instead of waiting for the same one again
            self.trusted = False
        raise RuntimeError(f"the ranks could not load a commit in {_LOAD_TRIES} tries")

    def _agree(self) -> CommitId | None:
        """The newest commit any rank vouches for: its own last one (unless a failure may have
        torn it), or the newest its node knows complete."""
        found = self.tier.latest()
        try:
            known, foreign = _commit_or_refuse(found), 0
        except ElasticUsageError:  # raised by every rank at once, none left in a collective
            known, foreign = None, 1
        own = self.last if self.trusted else None
        mine = max((c for c in (own, known) if c is not None), default=None)
        value = torch.tensor([mine.encode() if mine else -1, foreign], device=default_device())
        collectives.all_reduce(value, op=dist.ReduceOp.MAX)
        if int(value[1].item()):
            raise _saved_beside(str(found["id"]) if foreign and found else "")
        return CommitId.decode(int(value[0].item()))


def _commit_or_refuse(found: dict[str, Any] | None) -> CommitId | None:
    """The tier's newest complete checkpoint (``Tier.latest``) as a commit, or None; refused
    when it is a DCP checkpoint the script saved into the tier itself."""
    if found is None:
        return None
    ident = CommitId.parse(str(found["id"]))
    if ident is None:
        raise _saved_beside(str(found["id"]))
    return ident


def _saved_beside(name: str) -> ElasticUsageError:
    """The tier keeps only the newest complete checkpoint: a script's own DCP saves beside its
    commits delete them (and they it), and after a failure the ranks would find no commit to
    load and start the state over."""
    what = f"{name}, a DCP checkpoint" if name else "a DCP checkpoint"
    return ElasticUsageError(
        f"elasticd: the job's checkpoint tier holds {what} the script saved there itself, "
        "beside this state's commits; the tier keeps only the newest complete checkpoint, "
        "so one deletes the other.  Save the script's own checkpoints to another directory "
        "(the daemon copies every commit to --checkpoint-dir, which state.load_from reads)"
    )


def _round() -> int:
    worker = runtime.current()
    if worker is not None and worker.round >= 0:
        return worker.round
    value = os.environ.get(checkpoint.ROUND_ENV, "")
    return int(value) if value.isdigit() else 0


def _state_dict(model: torch.nn.Module, optimizer: Any, attrs: Any) -> dict[str, Any]:
    """What a commit holds: the model's and the optimizer's state dicts (DCP's, keyed by
    parameter names, so that they reshard) and the attributes, packed as one value."""
    state: dict[str, Any]
    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        state = {"model": model_sd, "optim": optim_sd}
    state["attrs"] = attrs if isinstance(attrs, io.BytesIO) else io.BytesIO(pack(attrs, "state"))
    return state


def load_commit(
    model: torch.nn.Module,
    optimizer: Any,
    checkpoint_id: str | os.PathLike[str],
    tier: checkpoint.Tier | None = None,
) -> dict[str, Any]:
    """Load a commit (a name in the tier, or a directory: the copy the daemon wrote to the
    job's --checkpoint-dir) into ``model`` and ``optimizer``, resharded to them; its
    attributes.  A collective when distributed."""
    reader = checkpoint.TierReader(checkpoint_id, tier=tier)
    if optimizer is not None:
        try:
            metadata = reader.read_metadata()
        except (OSError, ValueError, checkpoint.TierError):
            # left to DCP's load, which reads it again inside its collectives: a rank that
            # raised here alone would leave the others waiting in them
            pass
        else:
            give_state_to_load(model, optimizer, metadata)
    state = _state_dict(model, optimizer, io.BytesIO())
    checkpoint.load(state, checkpoint_id, tier=tier, reader=reader)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
    attrs = state["attrs"]
    if not isinstance(attrs, dict):
        raise ValueError(f"{checkpoint_id}: its attributes are not a dict")
    return attrs


def give_state_to_load(model: torch.nn.Module, optimizer: Any, metadata: Metadata) -> bool:
    """Give a fresh optimizer (no state, no gradients) the state entries a checkpoint holds,
    uninitialized, for DCP to load into; False, and nothing done, where any entry is neither
    shaped like its parameter nor a scalar (DCP's ``get_state_dict`` then makes the state
    itself).  That is a step on zero gradients: a pass to zero the gradients, one to make
    each state, one to update the parameters, 0.5-0.7 s a rank at 251.7M parameters on two
    cores, all of it overwritten by the load."""
    if optimizer.state or any(
        p.grad is not None for group in optimizer.param_groups for p in group["params"]
    ):
        return False
    stored: dict[str, dict[str, Any]] = {}  # parameter name -> state field -> its entry
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith("optim.state."):
            name, _, field = key.removeprefix("optim.state.").rpartition(".")
            stored.setdefault(name, {})[field] = entry
    in_optimizer = {p for group in optimizer.param_groups for p in group["params"]}
    made: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
    for name, param in model.named_parameters():
        if param not in in_optimizer:
            continue
        for field, entry in stored.get(name, {}).items():
            if not isinstance(entry, TensorStorageMetadata):
                return False
            dtype = entry.properties.dtype
            if tuple(entry.size) == tuple(param.shape):
                made.setdefault(param, {})[field] = torch.empty_like(param, dtype=dtype)
            elif len(entry.size) == 0:
                made.setdefault(param, {})[field] = torch.zeros((), dtype=dtype)
            else:
                return False
    for owner, fields in made.items():
        optimizer.state[owner] = fields
    return bool(made)


def _everyone(ok: bool) -> bool:
    flag = torch.tensor([1 if ok else 0], device=default_device())
    collectives.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
