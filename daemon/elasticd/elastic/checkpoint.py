"""The job's checkpoint tier, from a worker: a DCP ``StorageWriter`` and ``StorageReader``
backed by the daemons.  Torch and the standard library only.

Every worker of an elasticd job gets ``ELASTICD_CHECKPOINT_DIR``, a directory in its node's
memory that the daemon copies to another node (docs/in-place.md, "Sharded models"); its
socket (``.tier.sock``) says which checkpoint is the newest complete one and fetches byte
ranges of files this node lacks.  ``save`` and ``load`` are ``dcp.save`` and ``dcp.load``
with this module's writer, reader and planners::

    from elasticd.elastic import checkpoint
    checkpoint.save({"model": model_sd, "optim": optim_sd}, f"step_{step}")
    ...
    found = checkpoint.latest()                  # the newest complete one, or None
    checkpoint.load(state, found)                # resharded by DCP to this world

A checkpoint is DCP's layout: a directory, one data file per rank (``__<rank>_0.distcp``)
and ``.metadata``, written last by rank 0.  Unlike DCP's ``FileSystemWriter``, a tensor is
stored as its raw bytes (row-major, 64-byte aligned) and the metadata is JSON: a rank that
needs some rows of another rank's shard reads just those bytes (from this node's memory, or
fetched from whichever node holds them), nothing is pickled, and nothing read is unpickled
(non-tensor values, such as an optimizer's ``param_groups``, are JSON with raw tensors:
``broadcast.pack``).  DCP's ``FileSystemReader`` cannot read it; ``TierReader`` reads it
from the tier and from any directory (the copy the daemon writes to ``--checkpoint-dir``).

Writing to the tier directory is writing to memory: that copy is the staging, and the only
time the training loop is blocked.  The daemon then hashes the files and copies them to
another node, and to disk if asked, in the background.  In an ``--in-place`` job each rank
tells the daemon which round and world its files belong to (``saved``): a survivor may save
for its old round after its node was placed in a new one.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import io
import itertools
import json
import math
import mmap
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from . import pages
from .broadcast import pack, raw_view, unpack
from .errors import TierError

T = TypeVar("T")

TIER_ENV = "ELASTICD_CHECKPOINT_DIR"
ROUND_ENV = "ELASTICD_ROUND"
TIER_SOCKET = ".tier.sock"
METADATA = ".metadata"
FORMAT = "elasticd-dcp 1"
SUFFIX = ".distcp"
_ALIGN = 64  # bytes: where each item starts in a data file
_MAX_LINE = 1 << 24  # bytes of one answer from the tier
_MAX_METADATA = 1 << 30
_MAX_RANGES = 65536  # byte ranges one fetch may ask for (the daemon's bound)
# dtypes by name: a table, so that no name read from a file reaches getattr
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}


# -- the socket -------------------------------------------------------------------------------


class Tier:
    """The job's checkpoint directory on this node and its daemon's socket (JSON lines, one
    answer per request; one connection, kept)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.path.abspath(os.fspath(directory))
        self.socket_path = os.path.join(self.directory, TIER_SOCKET)
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._reader: io.BufferedReader | None = None
        self._interrupted = False

    @classmethod
    def from_env(cls) -> Tier | None:
        """This job's tier (``ELASTICD_CHECKPOINT_DIR``), or None outside elasticd."""
        directory = os.environ.get(TIER_ENV, "")
        return cls(directory) if directory and os.path.isdir(directory) else None

    @property
    def served(self) -> bool:
        """Whether the daemon serves this directory's socket."""
        return os.path.exists(self.socket_path)

    def ask(self, request: Mapping[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        """One request, its answer; TierError when the daemon refuses or does not answer."""
        line = json.dumps(request).encode() + b"\n"
        with self._lock:
            try:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                    self._sock.connect(self.socket_path)
                    self._reader = self._sock.makefile("rb")
                if self._interrupted:  # after the connect: ``interrupt`` shuts down what it finds
                    raise OSError(errno.ECANCELED, "interrupted")
                assert self._reader is not None
                self._sock.settimeout(timeout)
                self._sock.sendall(line)
                answer = self._reader.readline(_MAX_LINE)
            except OSError as exc:
                self._close()
                raise TierError(f"the checkpoint tier at {self.socket_path}: {exc}") from exc
            if not answer.endswith(b"\n"):
                self._close()
                raise TierError(f"the checkpoint tier at {self.socket_path} closed the connection")
        doc = json.loads(answer)
        if not doc.get("ok"):
            raise TierError(str(doc.get("error", "refused")))
        return doc

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
        self._sock = self._reader = None

    def close(self) -> None:
        with self._lock:
            self._close()

    def interrupt(self) -> None:
        """End the request another thread waits on (it raises TierError), and any after it:
        its socket is shut down, without the lock that thread holds."""
        self._interrupted = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def latest(self) -> dict[str, Any] | None:
        """The newest complete checkpoint (``id``, ``round``, ``world``, ``files``: name ->
        size, ``here``: the files whole in this node's directory), or None."""
        return self.ask({"op": "latest"})["checkpoint"]

    def wait(self, ident: str, timeout: float) -> bool:
        """Whether checkpoint ``ident`` is complete (written by every rank and copied to
        another node), or a newer one is; waits up to ``timeout`` seconds for it.  OSError
        (ENOSPC) where it cannot be: the node that keeps its copy refused it, full."""
        answer = self.ask({"op": "wait", "id": ident, "timeout": timeout}, timeout + 30.0)
        if answer.get("refused"):
            raise OSError(
                errno.ENOSPC, f"checkpoint {ident} cannot be complete: {answer['refused']}"
            )
        return bool(answer["complete"])

    def fetch(
        self, ident: str, ranges: list[tuple[str, int, int]], *, here_only: bool = False
    ) -> dict[str, str]:
        """Where to read ``ranges`` (file, offset, length) of the newest complete checkpoint
        ``ident`` from, at the same offsets: file -> a path (fetched now when not here).
        ``here_only``: only the files this node holds (its own, the copies it keeps): no
        transfer, and the others left out."""
        paths: dict[str, str] = {}
        for start in range(0, len(ranges), _MAX_RANGES):
            batch = [list(r) for r in ranges[start : start + _MAX_RANGES]]
            request = {"op": "fetch", "id": ident, "ranges": batch}
            answer = self.ask(request | ({"here_only": True} if here_only else {}), 600.0)
            paths.update({str(k): str(v) for k, v in answer["paths"].items()})
        return paths

    def saving(self, ident: str) -> None:
        """This worker writes checkpoint ``ident`` now: its daemon waits for ``saved``."""
        self.ask({"op": "saving", "id": ident})

    def saved(self, ident: str, files: Iterable[str], place: Place) -> None:
        """This worker's files of ``ident`` are whole; ``place``: its rank in which round."""
        self.ask(
            {
                "op": "saved",
                "id": ident,
                "files": sorted(files),
                "round": place.round,
                "world": place.world,
                "rank": place.rank,
                "local_world": place.local_world,
            }
        )


@dataclass(frozen=True)
class Place:
    """A worker's place in an in-place round: what its daemon needs to describe a save."""

    round: int
    world: int
    rank: int
    local_world: int

    @classmethod
    def here(cls, process_group: dist.ProcessGroup | None = None) -> Place | None:
        """This worker's, from its round's environment; None outside an in-place job."""
        round = os.environ.get(ROUND_ENV, "")
        if not round.lstrip("-").isdigit() or int(round) < 0:
            return None
        distributed = dist.is_available() and dist.is_initialized()
        world = dist.get_world_size(process_group) if distributed else 1
        rank = dist.get_rank() if distributed else 0
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        return cls(int(round), world, rank, local)


def resolve(checkpoint_id: str | os.PathLike[str], tier: Tier | None) -> str:
    """A checkpoint's directory: a bare name is an entry of the tier's directory."""
    path = os.fspath(checkpoint_id)
    if tier is not None and os.sep not in path:
        return os.path.join(tier.directory, path)
    return os.path.abspath(path)


def latest(tier: Tier | None = None) -> str | None:
    """The name of the job's newest complete checkpoint in its tier (None: none, or no tier)."""
    tier = tier if tier is not None else Tier.from_env()
    if tier is None or not tier.served:
        return None
    found = tier.latest()
    return None if found is None else str(found["id"])


# -- what is stored where ---------------------------------------------------------------------


@dataclass(frozen=True)
class Stored:
    """Where an item's bytes are: its file in the checkpoint, their offset and length; a
    tensor's dtype and shape (the chunk as saved, row-major)."""

    file: str
    offset: int
    length: int
    dtype: str = ""
    shape: tuple[int, ...] = ()

    def rows(self, item: ReadItem) -> tuple[int, int, tuple[int, ...]]:
        """The bytes ``item`` needs of this chunk (offset, length) and their shape: whole
        rows along the first dimension, from its first row to its last (narrowed along the
        others after reading)."""
        itemsize = _dtype(self.dtype).itemsize
        if not self.shape:
            return self.offset, itemsize, ()
        row = math.prod(self.shape[1:]) * itemsize
        first, count = int(item.storage_offsets[0]), int(item.lengths[0])
        return self.offset + first * row, count * row, (count, *self.shape[1:])


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} in a checkpoint's metadata")
    return _DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# -- planners: non-tensor values as JSON, never pickle --------------------------------------------


class TierSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, except that a non-tensor value is packed (JSON, its
    tensors raw) rather than ``torch.save``d; a ``BytesIO`` is written as it is."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        if write_item.type == WriteItemType.BYTE_IO and not isinstance(object, io.BytesIO):
            return io.BytesIO(pack(object, name=write_item.index.fqn))
        return object


class TierLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor values as ``TierSavePlanner`` wrote
    them (DCP's own, ``torch.save``d, only with ``weights_only``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        data = value.getvalue()
        try:
            obj = unpack(data)
        except ValueError:
            value.seek(0)
            obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            _set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def _set_element(root: dict[str, Any], path: tuple[Any, ...], value: Any) -> None:
    """``root[path[0]][path[1]]... = value`` (DCP's flattening paths: dict keys, list
    indices), the containers made where missing."""
    node: Any = root
    for key, following in itertools.pairwise(path):
        if isinstance(node, list):
            while len(node) <= key:
                node.append(None)
            if node[key] is None:
                node[key] = [] if isinstance(following, int) else {}
        elif key not in node:
            node[key] = [] if isinstance(following, int) else {}
        node = node[key]
    last = path[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


# -- the writer ---------------------------------------------------------------------------------


class TierWriter(StorageWriter):
    """DCP's storage writer into the tier (``FileSystemWriter``-like): one data file per rank,
    each tensor's raw bytes, then JSON metadata from rank 0.  ``checkpoint_id``: a name in
    the job's tier directory (``"step_40"``), or a path anywhere; ``place``: the worker's
    place as the save began (a writer run on another thread while the worker moves to a new
    round must not read the new round's environment), else read as the save sets up."""

    def __init__(
        self,
        checkpoint_id: str | os.PathLike[str] | None = None,
        *,
        tier: Tier | None = None,
        place: Place | None = None,
    ) -> None:
        super().__init__()
        self.tier = tier if tier is not None else Tier.from_env()
        self.place = place
        self.path = ""
        self.rank = 0
        self.coordinator = True
        self.save_id = uuid.uuid4().hex
        self._place: Place | None = None
        self._own = ""
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = resolve(checkpoint_id, self.tier)
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.coordinator = is_coordinator
        self.rank = int(kwargs.get("rank") or 0)
        self._place = self._in_tier()

    def _in_tier(self) -> Place | None:
        """This worker's place when the daemon is to be told what it saves (in place only)."""
        if self.tier is None or os.path.dirname(self.path) != self.tier.directory:
            return None
        place = self.place if self.place is not None else Place.here()
        return place if place is not None and self.tier.served else None

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        if not self.path:
            raise ValueError("TierWriter: no checkpoint_id")
        os.makedirs(self.path, exist_ok=True)
        if self._place is not None:
            assert self.tier is not None
            self.tier.saving(self.name)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [
            dataclasses.replace(plan, storage_data=f"__{index}_0{SUFFIX}")
            for index, plan in enumerate(plans)
        ]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self._own = str(plan.storage_data)
        results = _write_file(os.path.join(self.path, self._own), self._own, plan.items, planner)
        if not self.coordinator:
            self._tell_saved([self._own])
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Rank 0, once every rank wrote: the metadata, last (its appearance means whole)."""
        stored = {result.index: result.storage_data for rank in results for result in rank}
        doc = _metadata_doc(metadata, stored)
        temporary = os.path.join(self.path, f"{METADATA}.tmp")
        with open(temporary, "w") as f:
            json.dump(doc, f, separators=(",", ":"))
        os.replace(temporary, os.path.join(self.path, METADATA))
        self._tell_saved([self._own, METADATA] if self._own else [METADATA])

    def _tell_saved(self, files: list[str]) -> None:
        if self._place is not None:
            assert self.tier is not None
            self.tier.saved(self.name, files, self._place)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _write_file(
    path: str, name: str, items: list[WriteItem], planner: SavePlanner
) -> list[WriteResult]:
    """This rank's items into one file: non-tensor values first, then each tensor's raw
    bytes, each at a 64-byte boundary."""
    ordered = sorted(items, key=lambda item: item.type != WriteItemType.BYTE_IO)
    results = []
    with open(path, "wb", buffering=0) as f:
        offset = 0
        for item in ordered:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                assert isinstance(data, io.BytesIO)
                shape: tuple[int, ...] = ()
                view, dtype = data.getbuffer(), ""
            else:
                tensor = _cpu_contiguous(data)
                view = raw_view(tensor)
                dtype, shape = _dtype_name(tensor.dtype), tuple(tensor.shape)
            pad = -offset % _ALIGN
            if pad:
                _write_all(f, memoryview(bytes(pad)))
                offset += pad
            _write_all(f, view)
            length = len(view)
            del view
            stored = Stored(name, offset, length, dtype, shape)
            results.append(WriteResult(index=item.index, size_in_bytes=length, storage_data=stored))
            offset += length
    return results


def _cpu_contiguous(data: Any) -> torch.Tensor:
    tensor = data.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.to("cpu")
    if tensor.is_conj() or tensor.is_neg():
        tensor = tensor.resolve_conj().resolve_neg()
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _write_all(f: Any, view: memoryview) -> None:
    while len(view):
        written = f.write(view)
        view = view[written:]


def _metadata_doc(metadata: Metadata, stored: Mapping[MetadataIndex, Stored]) -> dict[str, Any]:
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            chunks = []
            for chunk in entry.chunks:
                where = stored.get(MetadataIndex(fqn, chunk.offsets))
                if where is None:
                    continue
                chunks.append(
                    [list(chunk.offsets), list(chunk.sizes), where.file, where.offset, where.length]
                )
            tensors[fqn] = {
                "dtype": _dtype_name(entry.properties.dtype),
                "size": list(entry.size),
                "requires_grad": bool(entry.properties.requires_grad),
                "chunks": chunks,
            }
        else:
            where = stored[MetadataIndex(fqn)]
            values[fqn] = [where.file, where.offset, where.length]
    mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {
        str(key): list(path)
        for key, path in mappings.items()
        if all(isinstance(part, (str, int)) for part in path)
    }
    return {"format": FORMAT, "tensors": tensors, "values": values, "paths": paths}


def in_background(work: Callable[[], T], name: str) -> concurrent.futures.Future[T]:
    """``work()`` on a daemon thread: one blocked on a dead peer never holds the exit."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def body() -> None:
        try:
            future.set_result(work())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=body, daemon=True, name=name).start()
    return future


# -- the reader ----------------------------------------------------------------------------------

# one item of a load plan: the item, where it is stored, the byte range read, the rows' shape
_Read = tuple[ReadItem, Stored, int, int, tuple[int, ...]]


class TierReader(StorageReader):
    """DCP's storage reader of what ``TierWriter`` wrote: this node's files read in place
    (mapped), and the byte ranges of files that are not here fetched through the tier's
    socket from whichever node holds them (the writer's node, or its copy's).  Works on any
    directory too (a copy on disk): then every file must be there."""

    def __init__(
        self, checkpoint_id: str | os.PathLike[str] | None = None, *, tier: Tier | None = None
    ) -> None:
        super().__init__()
        self.tier = tier if tier is not None else Tier.from_env()
        self.path = ""
        self.load_id = uuid.uuid4().hex
        self.storage_data: dict[MetadataIndex, Stored] = {}
        self.read = 0  # bytes this rank's plan read (its ranges only)
        self.fetched: dict[str, int] = {}  # file -> bytes fetched from other nodes
        self._metadata: tuple[str, Metadata] | None = None  # the path's, once read
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id is not None:
            self.path = resolve(checkpoint_id, self.tier)
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, read once per reader: a caller that looked at it
        before the load (``sharded.load_commit``) and DCP's load share one read, which may
        be a fetch from another node."""
        if kwargs.get("rank") is not None:
            raise FileNotFoundError("a tier checkpoint has no rank-local metadata")
        if self._metadata is None or self._metadata[0] != self.path:
            self._metadata = (self.path, self._read_metadata())
        metadata = self._metadata[1]
        metadata.storage_meta = StorageMeta(checkpoint_id=self.path, load_id=self.load_id)
        return metadata

    def _read_metadata(self) -> Metadata:
        path = os.path.join(self.path, METADATA)
        if not os.path.exists(path):
            size = self._size_in_tier(METADATA)
            path = self._paths({METADATA: [(0, size)]})[METADATA]
        with open(path, "rb") as f:
            raw = f.read(_MAX_METADATA + 1)
        if len(raw) > _MAX_METADATA:
            raise ValueError(f"{self.path}: its metadata is over {_MAX_METADATA} bytes")
        return _metadata_from(json.loads(raw), self.path)

    def _size_in_tier(self, name: str) -> int:
        found = self._tier().latest()
        if found is None or found["id"] != self.name or name not in found["files"]:
            raise FileNotFoundError(
                f"{self.path}: not here, and not the tier's newest complete checkpoint"
            )
        return int(found["files"][name])

    def _tier(self) -> Tier:
        if (
            self.tier is None
            or os.path.dirname(self.path) != self.tier.directory
            or not self.tier.served
        ):
            raise FileNotFoundError(f"{self.path}: files missing, and no checkpoint tier serves it")
        return self.tier

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        reads: list[_Read] = []
        wanted: dict[str, list[tuple[int, int]]] = {}
        for item in plan.items:
            stored = self.storage_data[item.storage_index]
            if item.type == LoadItemType.BYTE_IO:
                no_shape: tuple[int, ...] = ()
                offset, length, shape = stored.offset, stored.length, no_shape
            else:
                offset, length, shape = stored.rows(item)
            reads.append((item, stored, offset, length, shape))
            self.read += length
            if length:
                wanted.setdefault(stored.file, []).append((offset, length))
        paths, fetching = self._here_then_fetched(wanted)
        # what is here is read first, while the rest comes over the network
        here: list[_Read] = []
        rest: list[_Read] = []
        for read in reads:
            (here if not read[3] or read[1].file in paths else rest).append(read)
        maps: dict[str, mmap.mmap] = {}
        try:
            self._read_into(planner, here, paths, maps)
            if fetching is not None:
                paths.update(fetching.result())
                fetching = None
            self._read_into(planner, rest, paths, maps)
        finally:
            if fetching is not None:  # a read here failed: the fetch is of no use now
                fetching.give_up()
            if maps:  # unmapping a gigabyte takes tens of ms: a thread does it, the load goes on
                in_background(lambda: _unmap(maps.values()), "elasticd-unmap")
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _read_into(
        self,
        planner: LoadPlanner,
        reads: list[_Read],
        paths: Mapping[str, str],
        maps: dict[str, mmap.mmap],
    ) -> None:
        for item, stored, offset, length, shape in reads:
            if length and stored.file not in maps:
                maps[stored.file] = _map(paths[stored.file])
            if item.type == LoadItemType.BYTE_IO:
                data = maps[stored.file][offset : offset + length] if length else b""
                planner.load_bytes(item, io.BytesIO(data))
                continue
            target = planner.resolve_tensor(item).detach()
            if length:
                pages.huge_pages_for(target)
                pages.populate(maps[stored.file], offset, length)
                source = _view(maps[stored.file], offset, length, stored.dtype, shape)
                for dim in range(1, len(shape)):
                    source = source.narrow(
                        dim, int(item.storage_offsets[dim]), int(item.lengths[dim])
                    )
                if target.shape != source.shape:
                    raise ValueError(
                        f"{item.storage_index.fqn}: read {tuple(source.shape)}, "
                        f"the plan wants {tuple(target.shape)}"
                    )
                target.copy_(source)
                del source
            planner.commit_tensor(item, target)

    def _here_then_fetched(
        self, wanted: Mapping[str, list[tuple[int, int]]]
    ) -> tuple[dict[str, str], _Fetching | None]:
        """The wanted files this node holds (in this directory, or the copies its daemon
        keeps of other nodes'), and the fetch of the others' ranges from the nodes that hold
        them, begun on a thread of its own: the reader copies what is here meanwhile."""
        paths = {f: os.path.join(self.path, f) for f in wanted}
        paths = {f: path for f, path in paths.items() if os.path.exists(path)}
        ranges = [
            (file, offset, length)
            for file, spans in wanted.items()
            if file not in paths
            for offset, length in _merged(spans)
        ]
        if not ranges:
            return paths, None
        tier = self._tier()
        paths.update(tier.fetch(self.name, ranges, here_only=True))
        lacking = [r for r in ranges if r[0] not in paths]
        for file, _, length in lacking:
            self.fetched[file] = self.fetched.get(file, 0) + length
        if not lacking:
            return paths, None
        return paths, _Fetching.begin(tier, self.name, lacking)

    def _paths(self, wanted: Mapping[str, list[tuple[int, int]]]) -> dict[str, str]:
        """Each wanted file's path: here, else fetched (its ranges) through the tier."""
        paths, fetching = self._here_then_fetched(wanted)
        return paths if fetching is None else paths | fetching.result()

    @property
    def checkpoint_id(self) -> str:
        return self.path

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


@dataclass(frozen=True)
class _Fetching:
    """Byte ranges being fetched on a thread, over a connection to the daemon of their own:
    the script's own ``Tier`` stays free meanwhile (a reader that failed here falls back to
    another commit through it), and shutting that connection down ends a fetch given up,
    which would otherwise hold its thread up to the fetch's 600 s."""

    tier: Tier
    future: concurrent.futures.Future[dict[str, str]]

    @classmethod
    def begin(cls, tier: Tier, ident: str, ranges: list[tuple[str, int, int]]) -> _Fetching:
        own = Tier(tier.directory)
        return cls(own, in_background(lambda: own.fetch(ident, ranges), "elasticd-fetch"))

    def result(self) -> dict[str, str]:
        try:
            return self.future.result()
        finally:
            self.tier.close()

    def give_up(self) -> None:
        self.tier.interrupt()
        self.future.add_done_callback(lambda _: self.tier.close())


def _merged(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges with the overlapping and touching ones joined, in order."""
    out: list[list[int]] = []
    for offset, length in sorted(spans):
        if out and offset <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], offset + length - out[-1][0])
        else:
            out.append([offset, length])
    return [(a, b) for a, b in out]


def _unmap(maps: Iterable[mmap.mmap]) -> None:
    for mapped in maps:
        try:
            mapped.close()
        except BufferError:  # a view still refers to it: the collector closes it
            pass


def _map(path: str) -> mmap.mmap:
    """A private, writable mapping of a file (copy on write: reading copies nothing), so
    that tensors can view it without a warning about read-only memory."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        return mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else mmap.mmap(-1, 1)


def _view(
    mapped: mmap.mmap, offset: int, length: int, dtype: str, shape: tuple[int, ...]
) -> torch.Tensor:
    if offset + length > len(mapped):
        raise ValueError(f"a checkpoint file is {len(mapped)} bytes, cut before {offset + length}")
    flat = torch.frombuffer(mapped, dtype=torch.uint8, count=length, offset=offset)
    return flat.view(_dtype(dtype)).reshape(shape)


def _metadata_from(doc: Any, where: str) -> Metadata:
    """DCP's Metadata from what ``_metadata_doc`` wrote (checked as it is read)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{where}: not an elasticd checkpoint ({FORMAT})")
    entries: dict[str, Any] = {}
    stored: dict[MetadataIndex, Stored] = {}
    for fqn, tensor in doc["tensors"].items():
        dtype = _dtype(tensor["dtype"])
        chunks = []
        for index, (offsets, sizes, file, offset, length) in enumerate(tensor["chunks"]):
            _check_file(file, where)
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
            if length != math.prod(sizes) * dtype.itemsize:
                raise ValueError(f"{where}: {fqn}'s chunk {offsets} holds {length} bytes")
            stored[MetadataIndex(fqn, offsets, index)] = Stored(
                file, int(offset), int(length), tensor["dtype"], tuple(int(n) for n in sizes)
            )
        properties = TensorProperties(dtype=dtype, requires_grad=bool(tensor["requires_grad"]))
        entries[fqn] = TensorStorageMetadata(properties, torch.Size(tensor["size"]), chunks)
    for fqn, (file, offset, length) in doc["values"].items():
        _check_file(file, where)
        entries[fqn] = BytesStorageMetadata()
        stored[MetadataIndex(fqn)] = Stored(file, int(offset), int(length))
    paths = {key: tuple(path) for key, path in doc.get("paths", {}).items()}
    return Metadata(state_dict_metadata=entries, planner_data=paths, storage_data=stored)


def _check_file(name: Any, where: str) -> None:
    if not (isinstance(name, str) and name and os.sep not in name and not name.startswith(".")):
        raise ValueError(f"{where}: a data file named {name!r}")


# -- the short way ---------------------------------------------------------------------------------


def save(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    tier: Tier | None = None,
) -> Metadata:
    """``dcp.save`` into the tier (``checkpoint_id``: a name there, or a path)."""
    return dcp.save(
        state_dict,
        storage_writer=TierWriter(checkpoint_id, tier=tier),
        planner=TierSavePlanner(),
        process_group=process_group,
    )


def load(
    state_dict: dict[str, Any],
    checkpoint_id: str | os.PathLike[str],
    *,
    process_group: dist.ProcessGroup | None = None,
    tier: Tier | None = None,
    reader: TierReader | None = None,
) -> TierReader:
    """``dcp.load`` from the tier (or a path), resharded to ``state_dict``'s tensors; the
    reader (``reader``: one made for ``checkpoint_id`` that may have read its metadata
    already), which counts what it fetched from other nodes (``fetched``)."""
    if reader is None:
        reader = TierReader(checkpoint_id, tier=tier)
    dcp.load(
        state_dict, storage_reader=reader, planner=TierLoadPlanner(), process_group=process_group
    )
    return reader
