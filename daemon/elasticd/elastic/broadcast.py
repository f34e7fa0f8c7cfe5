"""Broadcast a nested structure holding tensors from one rank to the others, without pickle.

The root sends a JSON skeleton in which every tensor is a placeholder (index, shape, dtype,
device type), then the bytes of each tensor. Unlike pickle, JSON cannot run code on the
receiver. The skeleton is tagged so that what plain JSON loses survives: int dict keys
(optimizer state dicts), tuples, NaN and infinities, strings with lone surrogates.

Accepted: None, bool, int, float, str, list, tuple, dict (keys: None, bool, int, float,
str) and dense tensors. Dict subclasses arrive as dict and torch.Size as tuple; anything
else is a TypeError naming its path.
"""

from __future__ import annotations

import ctypes
import json
import math
import re
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from . import collectives

FORMAT_VERSION = 1
PACKED = b"elasticd-pack 1\n"  # the first bytes of a packed value (``pack``)
_KEY_TYPES = (type(None), bool, int, float, str)
# JSON reads the escapes of two lone surrogates as one astral character: such strings
# travel as code points instead.
_SURROGATE = re.compile("[\ud800-\udfff]")
# Names a skeleton may give as a dtype; a table, so no name from the wire reaches getattr.
_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in vars(torch).values()
    if isinstance(dtype, torch.dtype)
}


def encode(obj: Any, name: str = "obj") -> tuple[bytes, list[torch.Tensor]]:
    """The skeleton of ``obj`` (ASCII JSON) and its tensors, in placeholder order.
    ``name`` starts the paths in error messages (``state.foo[2]``)."""
    tensors: list[torch.Tensor] = []
    value = _encode_value(obj, name, tensors, set())
    return _dump({"version": FORMAT_VERSION, "value": value}), tensors


def decode(data: bytes, tensors: Sequence[torch.Tensor]) -> Any:
    """The structure ``encode`` saw, with ``tensors`` put in place of its placeholders."""
    return _rebuild(_parse(data)["value"], tensors)


def pack(obj: Any, name: str = "obj") -> bytes:
    """``obj`` as bytes, for a file rather than a broadcast: a magic line, the skeleton's
    length (8 bytes, little-endian), the skeleton, then each tensor's raw bytes in
    placeholder order (moved to the CPU)."""
    data, tensors = encode(obj, name)
    parts = [PACKED, len(data).to_bytes(8, "little"), data]
    for tensor in tensors:
        parts.append(raw_bytes(_sendable(tensor, torch.device("cpu"))))
    return b"".join(parts)


def unpack(data: bytes | bytearray | memoryview) -> Any:
    """What ``pack`` was given, its tensors on the CPU (fresh: they share nothing with
    ``data``).  ValueError when ``data`` is not whole or not a pack."""
    view = memoryview(data)
    start = len(PACKED)
    if bytes(view[:start]) != PACKED or len(view) < start + 8:
        raise ValueError("not a packed value")
    length = int.from_bytes(view[start : start + 8], "little")
    cursor = start + 8 + length
    if cursor > len(view):
        raise ValueError("a packed value cut short")
    skeleton = _parse(bytes(view[start + 8 : cursor]))
    placeholders = sorted(_placeholders(skeleton["value"]), key=lambda node: node["tensor"])
    if [node["tensor"] for node in placeholders] != list(range(len(placeholders))):
        raise ValueError("the packed skeleton's tensor indices are not 0..n-1")
    tensors = []
    for node in placeholders:
        dtype = _dtype(node["dtype"])
        shape = [int(n) for n in node["shape"]]
        count = math.prod(shape)
        size = count * dtype.itemsize
        if cursor + size > len(view):
            raise ValueError("a packed value cut short")
        raw = bytearray(view[cursor : cursor + size])
        cursor += size
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        tensors.append(flat.view(dtype).reshape(shape))
    if cursor != len(view):
        raise ValueError("bytes after a packed value")
    return _rebuild(skeleton["value"], tensors)


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A contiguous CPU tensor's bytes (a copy)."""
    return bytes(raw_view(tensor))


def raw_view(tensor: torch.Tensor) -> memoryview:
    """A contiguous CPU tensor's memory as bytes, without a copy (numpy is not a dependency:
    ctypes gives the buffer).  The tensor must outlive the view."""
    if not (tensor.device.type == "cpu" and tensor.is_contiguous()):
        raise ValueError("raw_view needs a contiguous CPU tensor")
    size = tensor.numel() * tensor.element_size()
    if not size:
        return memoryview(b"")
    return memoryview((ctypes.c_ubyte * size).from_address(tensor.data_ptr())).cast("B")


def broadcast_structure(
    obj: Any,
    root: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    name: str = "obj",
) -> Any:
    """``obj`` of rank ``root`` (a rank of ``group``), on every rank of ``group``.

    The root gets its own ``obj`` back; the other ranks ignore theirs and get a copy
    whose tensors are on ``device`` (default: ``default_device(group)``), except the
    tensors the root held on the CPU (Adam's ``step``), which stay on the CPU. If the
    root cannot encode ``obj``, every rank raises TypeError rather than wait forever."""
    device = torch.device(device) if device is not None else default_device(group)
    source = root if group is None else dist.get_global_rank(group, root)
    if dist.get_rank(group) == root:
        return _send_structure(obj, source, group, device, name)
    return _receive_structure(source, group, device, root)


def broadcast_into(
    tensor: torch.Tensor,
    root: int = 0,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Overwrite ``tensor`` in place with rank ``root``'s tensor of the same shape and dtype
    (a model's parameters and buffers: their shapes are known on every rank)."""
    device = torch.device(device) if device is not None else default_device(group)
    source = root if group is None else dist.get_global_rank(group, root)
    if _usable_in_place(tensor, device):
        _broadcast_bytes_of(tensor, source, group)
        return
    buffer = _sendable(tensor, device)
    _broadcast_bytes_of(buffer, source, group)
    if dist.get_rank(group) != root:
        with torch.no_grad():
            tensor.copy_(buffer)


def default_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The current CUDA device for NCCL, which moves only CUDA tensors; the CPU otherwise.
    (Only the gloo path is exercised by the tests here: they run without a GPU.)"""
    if dist.get_backend(group) == dist.Backend.NCCL:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# --- encoding ---------------------------------------------------------------------------


def _dump(skeleton: dict[str, Any]) -> bytes:
    return json.dumps(skeleton, allow_nan=False, separators=(",", ":")).encode("ascii")


def _encode_value(obj: Any, path: str, tensors: list[torch.Tensor], open_ids: set[int]) -> Any:
    if isinstance(obj, torch.Tensor):
        return _placeholder(obj, path, tensors)
    if type(obj) is str:
        if obj.isascii() or not _SURROGATE.search(obj):
            return obj
        return {"chars": [ord(char) for char in obj]}
    if obj is None or type(obj) in (bool, int):
        return obj
    if type(obj) is float:
        return obj if math.isfinite(obj) else {"float": repr(obj)}
    if isinstance(obj, dict) or type(obj) in (list, tuple, torch.Size):
        return _encode_container(obj, path, tensors, open_ids)
    raise TypeError(
        f"{path}: cannot broadcast a value of type {type(obj).__qualname__} (only "
        "None, bool, int, float, str, list, tuple, dict and tensors)"
    )


def _encode_container(obj: Any, path: str, tensors: list[torch.Tensor], open_ids: set[int]) -> Any:
    if id(obj) in open_ids:  # a cycle would otherwise end in RecursionError
        raise TypeError(f"{path}: the structure contains itself")
    open_ids.add(id(obj))
    if isinstance(obj, dict):
        encoded: Any = {
            "dict": [
                [
                    _encode_key(key, path),
                    _encode_value(value, _key_path(path, key), tensors, open_ids),
                ]
                for key, value in obj.items()
            ]
        }
    else:
        items = [
            _encode_value(item, f"{path}[{index}]", tensors, open_ids)
            for index, item in enumerate(obj)
        ]
        encoded = items if type(obj) is list else {"tuple": items}
    open_ids.discard(id(obj))
    return encoded


def _encode_key(key: Any, path: str) -> Any:
    if type(key) not in _KEY_TYPES:
        raise TypeError(
            f"{path}: cannot broadcast the dict key {key!r} of type "
            f"{type(key).__qualname__} (only None, bool, int, float, str)"
        )
    return _encode_value(key, path, [], set())


def _key_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if isinstance(key, str) and key.isidentifier() else f"{path}[{key!r}]"


def _placeholder(tensor: torch.Tensor, path: str, tensors: list[torch.Tensor]) -> dict[str, Any]:
    if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
        raise TypeError(
            f"{path}: cannot broadcast a {tensor.layout} tensor "
            f"(quantized: {tensor.is_quantized}); only dense tensors"
        )
    tensors.append(tensor)
    return {
        "tensor": len(tensors) - 1,
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": tensor.device.type,
    }


# --- decoding ---------------------------------------------------------------------------


def _parse(data: bytes) -> dict[str, Any]:
    skeleton = json.loads(data)
    if not isinstance(skeleton, dict) or skeleton.get("version") != FORMAT_VERSION:
        raise ValueError(f"not a version {FORMAT_VERSION} broadcast skeleton")
    if "error" in skeleton:
        raise TypeError(skeleton["error"])
    return skeleton


def _rebuild(node: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(node, list):
        return [_rebuild(item, tensors) for item in node]
    if not isinstance(node, dict):
        return node
    if "dict" in node:
        return {_rebuild(key, tensors): _rebuild(value, tensors) for key, value in node["dict"]}
    if "tuple" in node:
        return tuple(_rebuild(item, tensors) for item in node["tuple"])
    if "float" in node:
        return float(node["float"])
    if "chars" in node:
        return "".join(map(chr, node["chars"]))
    if "tensor" in node:
        return _matching_tensor(node, tensors)
    raise ValueError(f"unknown node in a broadcast skeleton: {sorted(node)}")


def _matching_tensor(placeholder: dict[str, Any], tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    tensor = tensors[placeholder["tensor"]]
    if list(tensor.shape) != placeholder["shape"] or tensor.dtype != _dtype(placeholder["dtype"]):
        raise ValueError(
            f"tensor {placeholder['tensor']} is {tensor.dtype}{list(tensor.shape)}, "
            f"the skeleton says {placeholder['dtype']}{placeholder['shape']}"
        )
    return tensor


def _dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype in a broadcast skeleton: {name!r}")
    return _DTYPES[name]


def _placeholders(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, list):
        for item in node:
            yield from _placeholders(item)
    elif isinstance(node, dict):
        if "tensor" in node:
            yield node
        for child in node["dict"] if "dict" in node else node.get("tuple", []):
            yield from _placeholders(child)


# --- the wire ---------------------------------------------------------------------------


def _send_structure(
    obj: Any, source: int, group: dist.ProcessGroup | None, device: torch.device, name: str
) -> Any:
    try:
        data, tensors = encode(obj, name)
    except Exception as error:  # tell the others, who would otherwise wait for bytes
        message = str(error) if isinstance(error, TypeError) else f"{type(error).__name__}: {error}"
        _send_bytes(_dump({"version": FORMAT_VERSION, "error": message}), source, group, device)
        raise
    _send_bytes(data, source, group, device)
    for tensor in tensors:
        _broadcast_bytes_of(_sendable(tensor, device), source, group)
    return obj


def _receive_structure(
    source: int, group: dist.ProcessGroup | None, device: torch.device, root: int
) -> Any:
    try:
        skeleton = _parse(_receive_bytes(source, group, device))
    except TypeError as error:
        raise TypeError(f"rank {root} could not broadcast: {error}") from None
    placeholders = sorted(_placeholders(skeleton["value"]), key=lambda node: node["tensor"])
    if [node["tensor"] for node in placeholders] != list(range(len(placeholders))):
        raise ValueError("the broadcast skeleton's tensor indices are not 0..n-1")
    tensors = [_receive_tensor(node, source, group, device) for node in placeholders]
    return _rebuild(skeleton["value"], tensors)


def _receive_tensor(
    placeholder: dict[str, Any], source: int, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor:
    tensor = torch.empty(placeholder["shape"], dtype=_dtype(placeholder["dtype"]), device=device)
    _broadcast_bytes_of(tensor, source, group)
    return tensor.cpu() if placeholder["device"] == "cpu" else tensor


def _send_bytes(
    data: bytes, source: int, group: dist.ProcessGroup | None, device: torch.device
) -> None:
    collectives.broadcast(
        torch.tensor([len(data)], dtype=torch.int64, device=device), source, group=group
    )
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    collectives.broadcast(payload, source, group=group)


def _receive_bytes(source: int, group: dist.ProcessGroup | None, device: torch.device) -> bytes:
    length = torch.empty(1, dtype=torch.int64, device=device)
    collectives.broadcast(length, source, group=group)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    collectives.broadcast(payload, source, group=group)
    return bytes(payload.cpu().tolist())  # no .numpy(): numpy is not a dependency


def _sendable(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A contiguous, materialized tensor on ``device`` with ``tensor``'s values."""
    return tensor.detach().to(device).resolve_conj().resolve_neg().contiguous()


def _usable_in_place(tensor: torch.Tensor, device: torch.device) -> bool:
    return (
        tensor.device == device
        and tensor.is_contiguous()
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def _broadcast_bytes_of(tensor: torch.Tensor, source: int, group: dist.ProcessGroup | None) -> None:
    """Broadcast a contiguous tensor as raw bytes: no backend dtype gaps (bool, bfloat16,
    complex all travel as uint8), and an empty tensor costs no collective at all (every
    rank knows its shape)."""
    if tensor.numel():
        collectives.broadcast(tensor.reshape(-1).view(torch.uint8), source, group=group)
