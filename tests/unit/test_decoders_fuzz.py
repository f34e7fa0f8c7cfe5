"""Every decoder of a value someone else wrote, fuzzed (docs/security.md, "The store"): deep nesting, huge and
non-finite numbers, bytes that are not UTF-8, lone surrogates, wrong types, and valid
values with one part replaced.  Each decoder returns a valid value or raises its module's
refusal, nothing else:

    Signer.open (a store record, and the body of an encrypted one) ... TamperedRecord
    rendezvous.state.decode / decode_announcement (a record's body) .. RendezvousStateError
    open_or_refuse (a record opened and parsed by a board or node parser) .. None, refused
    workerlink.decode (a line from a worker) .......................... Malformed
    protocol.decode_request / decode_reply (a control or peer frame) .. ProtocolError
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from elasticd.cluster.registry import NodeRecord
from elasticd.core.records import Outcome, Part
from elasticd.errors import RendezvousStateError, TamperedRecord
from elasticd.jobs.board import JobBoard
from elasticd.rendezvous.state import (
    Announcement,
    Participant,
    RendezvousState,
    decode,
    decode_announcement,
    encode,
    encode_announcement,
)
from elasticd.shell import workerlink
from elasticd.store.signing import MAX_RECORD, Signer, canonical_json, open_or_refuse
from elasticd.wire import protocol

SIGNER = Signer(b"k" * 32, "c")
KEY = "elasticd/c/rdzv/j-1/state"
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# -- what an attacker writes -----------------------------------------------------------------------

DEEP = b"[" * 100000 + b"]" * 100000

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


def dumps(value: Any) -> bytes:
    """JSON as Python writes it: NaN, Infinity, 1e309-sized integers and lone surrogates
    included (surrogatepass: the bytes an attacker can send)."""
    return json.dumps(value, ensure_ascii=False).encode("utf-8", "surrogatepass")


poison_tokens = st.sampled_from(
    [
        b"1e999",
        b"-1e999",
        b"NaN",
        b"Infinity",
        b"9" * 5000,
        b"9" * 25,
        b'"\\ud800"',
        b'"\xff\xfe"',
        b"[" * 3000 + b"]" * 3000,
        b'{"a":' * 200 + b"1" + b"}" * 200,
        b"",
        b"{",
        b"\x00",
    ]
)


@st.composite
def poisoned(draw: st.DrawFn, doc: Any) -> bytes:
    """``doc`` (a valid document) as JSON with one of its values replaced by a poison
    token or a value of another type."""
    raw = dumps(doc)
    marker = "__POISON__"
    paths = list(_paths(doc))
    path = draw(st.sampled_from(paths)) if paths else ()
    target = _replace(doc, path, marker)
    token = draw(poison_tokens | values.map(dumps))
    return dumps(target).replace(json.dumps(marker).encode(), token, 1) if paths else raw


def _paths(doc: Any, prefix: tuple = ()) -> Any:
    if isinstance(doc, dict):
        for key, value in doc.items():
            yield prefix + (key,)
            yield from _paths(value, prefix + (key,))
    elif isinstance(doc, list):
        for i, value in enumerate(doc):
            yield prefix + (i,)
            yield from _paths(value, prefix + (i,))


def _replace(doc: Any, path: tuple, new: Any) -> Any:
    if not path:
        return new
    copy = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[path[0]] = _replace(doc[path[0]], path[1:], new)
    return copy


anything = (
    st.binary(max_size=300)
    | values.map(dumps)
    | poison_tokens
    | st.text(max_size=100).map(lambda t: t.encode("utf-8", "surrogatepass"))
)


def reencodable(value: Any) -> None:
    """What a decoder let through can be encoded again (a MAC, a reply, a log line)."""
    json.dumps(value, allow_nan=False).encode()


# -- Signer.open -------------------------------------------------------------------------------------

STATE = RendezvousState(
    version=3,
    round=1,
    complete=True,
    reason="failure",
    restarts_used=1,
    participants={"a": Participant("10.0.0.1", 2, 29500)},
    order=("a",),
    folded=2,
)
SEALED = SIGNER.seal(KEY, encode(STATE), version=3)
SECRET = SIGNER.seal(KEY, encode(STATE), version=3, secret=True)

envelopes = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([2, 1, "2", 2.0, None, True]),
        "ver": values,
        "body": values,
        "mac": st.text(max_size=70) | values,
        "enc": st.text(max_size=40) | values,
    },
).map(dumps)


def open_checked(raw: bytes) -> None:
    try:
        opened = SIGNER.open(KEY, raw)
    except TamperedRecord:
        return
    assert type(opened.version) is int and opened.version >= 0
    reencodable(opened.body)
    canonical_json(opened.body)


@FUZZ
@given(anything | envelopes | poisoned(json.loads(SEALED)) | poisoned(json.loads(SECRET)))
@example(DEEP)
@example(b'{"v":2,"ver":1,"body":' + DEEP + b',"mac":"00"}')
@example(b'{"v":2,"ver":1,"body":1e999,"mac":"00"}')
@example(b'{"v":2,"ver":1,"enc":[1,{"a":null}]}')
@example(b'{"v":2,"ver":1,"enc":"AAAA"}')
@example(b'{"v":2,"ver":1,"body":{},"mac":"\xc3\xa9"}')  # compare_digest raised TypeError on it
def test_signer_open_gives_a_record_or_tampered(raw: bytes) -> None:
    open_checked(raw)


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=8), st.integers(0, len(SEALED) - 1), st.booleans())
def test_a_sealed_record_changed_anywhere_is_refused(noise: bytes, at: int, secret: bool) -> None:
    raw = SECRET if secret else SEALED
    changed = raw[:at] + noise + raw[at + len(noise) :]
    if changed == raw:
        return
    try:
        opened = SIGNER.open(KEY, changed)
    except TamperedRecord:
        return
    # a change JSON does not see (whitespace, key order, an escape) may open: to the same record
    assert opened.body == encode(STATE) and opened.version == 3


def test_a_record_past_the_bound_is_refused_unread() -> None:
    with pytest.raises(TamperedRecord, match="bytes, more than"):
        SIGNER.open(KEY, b" " * (MAX_RECORD + 1))


# -- the rendezvous codec, on its own and behind the signer -------------------------------------------


def decode_checked(body: Any, decoder: Any = decode) -> None:
    try:
        decoded = decoder(body)
    except RendezvousStateError:
        return
    assert isinstance(decoded, (RendezvousState, Announcement))


ANNOUNCEMENT = encode_announcement(Announcement("b", Participant("10.0.0.2", 4, 0)))


@FUZZ
@given(
    values
    | poisoned(encode(STATE)).map(lambda raw: _loads_or(raw))
    | poisoned(ANNOUNCEMENT).map(lambda raw: _loads_or(raw))
)
def test_rendezvous_decode_gives_a_state_or_refuses(body: Any) -> None:
    decode_checked(body)
    decode_checked(body, decode_announcement)


def _loads_or(raw: bytes) -> Any:
    """What Signer.open could hand a decoder: the body as Python's json reads it (NaN and
    huge integers included: the decoder must not depend on the signer's bounds)."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return raw.decode("utf-8", "replace")


@FUZZ
@given(values)
def test_a_sealed_body_of_any_shape_is_a_state_or_a_refusal(body: Any) -> None:
    """The signer lets through only bodies it could seal: these are decoded or refused."""
    try:
        raw = SIGNER.seal(KEY, body, version=1)
    except ValueError:  # NaN, infinity: nothing seals them
        return
    refused: list[str] = []
    opened = open_or_refuse(SIGNER, KEY, raw, decode, lambda key, why: refused.append(why))
    assert (opened is None) == bool(refused)


# -- the board's and the node registry's parsers, behind open_or_refuse -------------------------------

PART = {"node": "n1", "state": "RUNNING", "round": 1, "ranks": [0], "workers": [], "updated": 1.0}


@FUZZ
@given(values | poisoned(PART).map(_loads_or))
@example({"info": {"name": "n1", "address": "a", "slots": [1], "gpus": {"x": []}}})
@example({"state": "SUCCEEDED", "ended": [], "exit_code": {}, "message": None})
def test_board_and_node_parsers_refuse_what_they_cannot_read(body: Any) -> None:
    try:
        raw = SIGNER.seal(KEY, body, version=1)
    except ValueError:
        return
    for parse in (
        NodeRecord.from_json,
        Outcome.from_json,
        Part.from_json,
        lambda b: JobBoard._parse("spec/j-1", b),
        lambda b: JobBoard._parse("part/j-1/n1", b),
    ):
        refused: list[str] = []
        parsed = open_or_refuse(SIGNER, KEY, raw, parse, lambda key, why: refused.append(why))
        assert (parsed is None) == bool(refused), (parsed, refused)


# -- the worker channel ------------------------------------------------------------------------------

HELLO = {"op": "hello", "slot": 1}
READY = {"op": "ready", "round": 2, "why": "failure", "error": "boom"}


@FUZZ
@given(anything | poisoned(HELLO) | poisoned(READY))
@example(b"[" * 5000 + b"\n")
@example(b'{"op": "hello", "slot": ' + b"9" * 5000 + b"}\n")
@example(b'{"op": "ready", "round": 1e999, "why": "start"}\n')
def test_a_worker_line_is_a_message_or_malformed(line: bytes) -> None:
    try:
        message = workerlink.decode(line)
    except workerlink.Malformed:
        return
    if isinstance(message, workerlink.Hello):
        assert type(message.slot) is int and message.slot >= 0
    else:
        assert isinstance(message, workerlink.Ready) and type(message.after) is int
        assert message.why in ("start", "interrupt", "failure") and len(message.error) <= 2000
        message.error.encode()


def test_the_worker_messages_decode() -> None:
    assert workerlink.decode(dumps(HELLO) + b"\n") == workerlink.Hello(1)
    assert workerlink.decode(dumps(READY)) == workerlink.Ready(-1, 2, "failure", "boom")
    assert workerlink.decode(dumps({**READY, "error": "x" * 5000})).error == "x" * 2000


# -- the control protocol ----------------------------------------------------------------------------

REQUEST = {
    "v": 1,
    "id": "r1",
    "op": "submit",
    "args": {
        "argv": ["t.py", "--lr", "0.1"],
        "env": {"A": "1"},
        "nnodes": "1:2",
        "join_timeout": 30.5,
        "wait": True,
    },
}
REPLY = {"v": 1, "id": "r1", "ok": False, "error": {"code": "not_found", "message": "no job"}}


@FUZZ
@given(anything | poisoned(REQUEST))
@example(DEEP)
@example(b'{"v":1,"id":"a","op":"submit","args":{"argv":["x"],"join_timeout":1e309}}')
@example(b'{"v":1,"id":"\\udc80","op":"list","args":{}}')
def test_a_request_is_a_request_or_a_protocol_error(frame: bytes) -> None:
    try:
        request = protocol.decode_request(frame)
    except protocol.ProtocolError as exc:
        assert exc.code in (protocol.E_BAD_REQUEST, protocol.E_UNKNOWN_OP, protocol.E_TOO_LARGE)
        str(exc).encode()  # the error reply can carry its message
        assert isinstance(protocol.request_id(frame), str)
        return
    assert request.op in protocol.OPS and isinstance(request.args, dict) and request.id
    reencodable(request.args)


@FUZZ
@given(
    anything | poisoned(REPLY) | poisoned({"v": 1, "id": "r", "ok": True, "result": [{"a": 1.5}]})
)
@example(b'{"v":1,"id":"r","ok":false,"error":[1]}')
@example(b'{"v":1,"id":"r","ok":false,"error":"x"}')
def test_a_reply_is_a_reply_or_a_protocol_error(frame: bytes) -> None:
    try:
        reply = protocol.decode_reply(frame)
    except protocol.ProtocolError as exc:
        assert exc.code == protocol.E_BAD_REQUEST
        return
    assert (
        isinstance(reply.id, str) and isinstance(reply.code, str) and isinstance(reply.message, str)
    )
    reencodable(reply.result)


def test_a_reply_with_a_number_json_has_no_word_for_is_still_json() -> None:
    """The daemon writes null for NaN and infinity: the client's bounded decoder reads it."""
    frame = protocol.ok("r", {"cpu": float("nan"), "peak": [float("inf"), 1.5]})
    assert protocol.decode_reply(frame).result == {"cpu": None, "peak": [None, 1.5]}
