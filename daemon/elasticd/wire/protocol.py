"""The control protocol between ``elasticctl`` and ``elasticd``.

A stdlib-only leaf: the CLI imports this module (and with it ``safejson``, the bounded
decoder every frame goes through) and nothing else from the daemon.

The transport is a Unix stream socket; each frame is a 4-byte big-endian length and then
that many bytes of UTF-8 JSON, one object.  Request::

    {"v": 1, "id": "…", "op": "status", "args": {"job": "j-7f3a21"}}

Reply (one, or several with the same id for a stream, the last one ``{"end": true}``)::

    {"v": 1, "id": "…", "ok": true, "result": …}
    {"v": 1, "id": "…", "ok": false, "error": {"code": "not_found", "message": "…"}}
    {"v": 1, "id": "…", "ok": true, "end": true}
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from elasticd.wire import safejson
from elasticd.wire.numbers import check_time, is_whole, whole

VERSION = 1
MAX_FRAME = 4 * 1024 * 1024  # a request
MAX_REPLY = 256 * 1024 * 1024  # a reply (a `list` of many jobs is larger than any request)
HEADER = struct.Struct(">I")

# op -> {arg: allowed python types}; every arg is optional unless listed in REQUIRED.
OPS: dict[str, dict[str, tuple[type, ...]]] = {
    "version": {},
    "submit": {
        "argv": (list,),
        "kind": (str,),
        "python": (str,),
        "workdir": (str,),
        "env": (dict,),
        "nnodes": (str, int),
        "nproc_per_node": (str, int),
        "max_restarts": (int,),
        "name": (str,),
        "nodes": (list,),
        "exclude": (list,),
        "join_timeout": (int, float),
        "last_call_timeout": (int, float),
        "exit_barrier_timeout": (int, float),
        "in_place": (bool,),
        "rejoin_timeout": (int, float),
        "hang_timeout": (int, float),
        "spares": (int,),
        "role": (str,),
        "master_port": (int,),
        "priority": (int,),
        "account": (str,),
        "preemptible": (bool,),
        "nnodes_step": (int,),
        "checkpoint_dir": (str,),
        "keep_checkpoints": (int,),
        "checkpoint_memory": (int,),
        "warm_restart": (bool,),
        "wait": (bool,),
    },
    "list": {"all": (bool,)},
    "status": {"job": (str,), "debug": (bool,)},
    "logs": {
        "job": (str,),
        "rank": (int,),
        "follow": (bool,),
        "attempt": (int,),
        "local": (bool,),  # this node's workers' output only (elasticrun's private daemons)
    },
    "cancel": {"job": (str,)},
    "wait": {"job": (str,)},
    "nodes": {"watch": (bool,)},
    "drain": {"node": (str,)},
    "undrain": {"node": (str,), "gpu": (int,)},
    "queue": {},
    "usage": {"user": (str,), "account": (str,), "since": (int, float), "until": (int, float)},
}
REQUIRED: dict[str, tuple[str, ...]] = {
    "submit": ("argv",),
    "status": ("job",),
    "logs": ("job",),
    "cancel": ("job",),
    "wait": ("job",),
    "drain": ("node",),
    "undrain": ("node",),
}
# Args whose values are checked beyond their type: (op, arg) -> check(value, arg's name).
CHECKED: dict[tuple[str, str], Callable[[Any, str], object]] = {
    ("usage", "since"): check_time,
    ("usage", "until"): check_time,
}
STREAMING_OPS = frozenset(
    {"logs", "wait", "list"}
)  # and "submit" with args.wait, "nodes" with args.watch
LIST_BATCH = 256 * 1024  # bytes of rows in one reply of the `list` stream (some 600 jobs)

# Error codes a client can branch on (the daemon's ElasticdError.code values).
E_BAD_REQUEST = "bad_request"
E_UNKNOWN_OP = "unknown_op"
E_TOO_LARGE = "too_large"
E_NOT_FOUND = "not_found"
E_PERMISSION = "permission_denied"
E_INVALID_SPEC = "invalid_spec"
E_INTERNAL = "internal"
E_TOO_MANY = "too_many_connections"
E_LIMIT = "limit_exceeded"  # a submit over a cap of the daemon's (the message names its key)


GPU = "gpu"  # nproc_per_node: one worker per GPU the job gets on a node
CPU = "cpu"  # one worker per CPU of the node (torchrun: os.cpu_count())
AUTO = "auto"  # one per GPU on a node with GPUs, else one per CPU
NPROC_WORDS = (GPU, CPU, AUTO)


def parse_nnodes(value: str | int) -> tuple[int, int]:
    """``"2"`` or 2 -> (2, 2); ``"2:4"`` -> (2, 4), as torchrun's ``--nnodes``; ValueError
    naming what is wrong otherwise (digits 0-9 only: no ``1_0``, no other script's digits)."""
    if isinstance(value, int) and not isinstance(value, bool):
        pair = (value, value)
    else:
        low, sep, high = str(value).partition(":")
        try:
            pair = (whole(low), whole(high)) if sep else (whole(low), whole(low))
        except ValueError:
            raise ValueError(
                f"nnodes must be N or MIN:MAX (whole numbers, digits 0-9), got {value!r}"
            ) from None
    if not 1 <= pair[0] <= pair[1]:
        raise ValueError(f"nnodes must be N or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return pair


def parse_nproc(value: str | int) -> int | str:
    """A positive worker count (an int or its digits), or one of torchrun's words ``gpu``,
    ``cpu``, ``auto`` (each node resolves it for itself); ValueError otherwise."""
    if value in NPROC_WORDS:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    if isinstance(value, str) and is_whole(value) and whole(value) >= 1:
        return whole(value)
    raise ValueError(
        f"nproc_per_node must be one of N, {', '.join(NPROC_WORDS)} "
        f"(N a positive integer), got {value!r}"
    )


class ProtocolError(Exception):
    """A frame that does not follow the protocol; ``code`` is the wire error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Request:
    id: str
    op: str
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def streaming(self) -> bool:
        return (
            self.op in STREAMING_OPS
            or (self.op == "submit" and bool(self.args.get("wait")))
            or (self.op == "nodes" and bool(self.args.get("watch")))
        )


def encode_request(req: Request) -> bytes:
    """Raises UnicodeEncodeError for text that is not valid Unicode (e.g. a command-line
    argument that was not UTF-8): better refused by the client than changed."""
    return json.dumps(
        {"v": VERSION, "id": req.id, "op": req.op, "args": req.args},
        separators=(",", ":"),
        ensure_ascii=False,
    ).encode()


def decode_request(frame: bytes) -> Request:
    """Parse and type-check one request frame; raises ProtocolError naming what is wrong.

    The id is recovered first so that even a bad request gets a reply the client can match.
    """
    if len(frame) > MAX_FRAME:
        raise ProtocolError(E_TOO_LARGE, f"frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    doc = _load(frame, MAX_FRAME)
    if not isinstance(doc, dict):
        raise ProtocolError(E_BAD_REQUEST, "request must be a JSON object")
    if doc.get("v") != VERSION:
        raise ProtocolError(E_BAD_REQUEST, f"unsupported protocol version {doc.get('v')!r}")
    rid, op, args = doc.get("id"), doc.get("op"), doc.get("args", {})
    if not isinstance(rid, str) or not rid:
        raise ProtocolError(E_BAD_REQUEST, "'id' must be a non-empty string")
    if not isinstance(op, str):
        raise ProtocolError(E_BAD_REQUEST, "'op' must be a string")
    if op not in OPS:
        raise ProtocolError(E_UNKNOWN_OP, f"unknown op {op!r}")
    if not isinstance(args, dict):
        raise ProtocolError(E_BAD_REQUEST, "'args' must be an object")
    _check_args(op, args)
    return Request(rid, op, args)


_ID_NEAR_START = re.compile(rb'"id"\s*:\s*"([^"\\]{1,128})"')


def request_id(frame: bytes) -> str:
    """Best-effort id of a frame that failed to decode ("" when there is none).

    An oversized frame is not parsed: its id is looked for near the start, where
    encode_request puts it.
    """
    if len(frame) > MAX_FRAME:
        return id_near_start(frame)
    try:
        doc = safejson.loads(frame, max_bytes=MAX_FRAME)
    except safejson.Undecodable:
        return ""
    rid = doc.get("id") if isinstance(doc, dict) else None
    return rid if isinstance(rid, str) else ""


def id_near_start(frame: bytes) -> str:
    """The id of a frame too large to parse, if encode_request put it near the start."""
    match = _ID_NEAR_START.search(frame[:1024])
    return match.group(1).decode(errors="replace") if match else ""


def _check_args(op: str, args: dict[str, Any]) -> None:
    schema = OPS[op]
    for name, value in args.items():
        if name not in schema:
            raise ProtocolError(E_BAD_REQUEST, f"{op}: unknown argument {name!r}")
        allowed = schema[name]
        if isinstance(value, bool) and bool not in allowed:
            raise ProtocolError(E_BAD_REQUEST, f"{op}: {name!r} must be {_names(allowed)}")
        if not isinstance(value, allowed):
            raise ProtocolError(E_BAD_REQUEST, f"{op}: {name!r} must be {_names(allowed)}")
        check = CHECKED.get((op, name))
        if check is not None:
            try:
                check(value, name)
            except ValueError as exc:
                raise ProtocolError(E_BAD_REQUEST, f"{op}: {exc}") from None
    for name in REQUIRED.get(op, ()):
        if name not in args:
            raise ProtocolError(E_BAD_REQUEST, f"{op}: missing argument {name!r}")


def _names(types: tuple[type, ...]) -> str:
    words = {
        str: "a string",
        int: "an integer",
        float: "a number",
        bool: "a boolean",
        list: "a list",
        dict: "an object",
    }
    return " or ".join(words[t] for t in types)


def ok(rid: str, result: Any) -> bytes:
    return _dump({"v": VERSION, "id": rid, "ok": True, "result": result})


def end(rid: str) -> bytes:
    return _dump({"v": VERSION, "id": rid, "ok": True, "end": True})


def error(rid: str, code: str, message: str) -> bytes:
    return _dump(
        {"v": VERSION, "id": rid, "ok": False, "error": {"code": code, "message": message}}
    )


@dataclass(frozen=True)
class Reply:
    id: str
    ok: bool
    result: Any = None
    end: bool = False
    code: str = ""
    message: str = ""


def decode_reply(frame: bytes) -> Reply:
    """One reply frame; ProtocolError (bad_request) for anything that is not a reply."""
    doc = _load(frame, MAX_REPLY)
    if not isinstance(doc, dict) or doc.get("v") != VERSION or not isinstance(doc.get("id"), str):
        raise ProtocolError(E_BAD_REQUEST, "malformed reply from daemon")
    if doc.get("ok"):
        return Reply(doc["id"], True, doc.get("result"), bool(doc.get("end")))
    err = doc.get("error")
    err = err if isinstance(err, dict) else {}
    return Reply(
        doc["id"], False, code=str(err.get("code", E_INTERNAL)), message=str(err.get("message", ""))
    )


def batches(docs: Iterable[Any], max_bytes: int) -> Iterator[list[Any]]:
    """``docs`` in lists of about ``max_bytes`` of JSON each at most (a document larger than
    that goes alone in its list), taken from ``docs`` as each list is asked for; at least
    one list, empty when ``docs`` is."""
    batch: list[Any] = []
    size = 0
    for doc in docs:
        doc_size = len(_dump(doc))
        if batch and size + doc_size > max_bytes:
            yield batch
            batch, size = [], 0
        batch.append(doc)
        size += doc_size + 1
    yield batch


def _dump(doc: Any) -> bytes:
    # A lone surrogate cannot be UTF-8: it becomes "?" rather than failing the whole reply
    # (requests carrying one are refused; this guards text that came from elsewhere).  A
    # number JSON has no word for (NaN, infinity) becomes null: a reply is always what
    # the client's bounded decoder reads.
    try:
        text = json.dumps(doc, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except ValueError:
        text = json.dumps(_finite(doc), separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode(errors="replace")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _load(frame: bytes, limit: int) -> Any:
    """JSON within bounds (safejson: no NaN, Infinity or 1e309, no integer past 64 bits, no
    lone surrogate ("\\ud800"), nested at most 64 deep); ProtocolError otherwise."""
    try:
        return safejson.loads(frame, max_bytes=limit)
    except safejson.Undecodable as exc:
        raise ProtocolError(E_BAD_REQUEST, f"invalid JSON: {exc}") from None


# -- framing ---------------------------------------------------------------------------------


def framed(payload: bytes) -> bytes:
    """One frame on the wire: its length, then the payload."""
    return HEADER.pack(len(payload)) + payload


class FrameReader:
    """Turns bytes received from a stream into whole frames (for a blocking client)."""

    def __init__(self, limit: int = MAX_REPLY) -> None:
        self._limit = limit
        self._buffer = bytearray()

    def feed(self, data: bytes) -> Iterator[bytes]:
        self._buffer += data
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if size > self._limit:
                raise ProtocolError(E_TOO_LARGE, f"a frame of {size} bytes exceeds {self._limit}")
            if len(self._buffer) < HEADER.size + size:
                return
            payload = bytes(self._buffer[HEADER.size : HEADER.size + size])
            del self._buffer[: HEADER.size + size]
            yield payload
