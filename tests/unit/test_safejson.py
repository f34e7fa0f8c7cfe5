"""safejson.loads: every input is a value within bounds or Undecodable, nothing else."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elasticd.wire.safejson import MAX_DEPTH, Undecodable, loads

LIMIT = 1 << 20


@pytest.mark.parametrize(
    "raw, why",
    [
        (b"[" * 100000 + b"]" * 100000, "nested"),
        (b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1), "nested"),
        (b'{"a":' * 200 + b"1" + b"}" * 200, "nested"),
        (b"1e999", "out of range"),
        (b"-1e999", "out of range"),
        (b"NaN", "not a number"),
        (b"[Infinity]", "not a number"),
        (b"9" * 5000, "out of range"),
        (str(1 << 63).encode(), "out of range"),
        (b'"\xff\xfe"', "not UTF-8"),
        (b'"\\ud800"', "lone surrogate"),
        (b'{"\\udfff": 1}', "lone surrogate"),
        (b"", "not JSON"),
        (b"{", "not JSON"),
        (b"x" * (LIMIT + 1), "bytes, more than"),
    ],
)
def test_refused_with_a_reason(raw: bytes, why: str) -> None:
    with pytest.raises(Undecodable, match=why):
        loads(raw, max_bytes=LIMIT)


def test_depth_up_to_the_bound_is_accepted() -> None:
    deepest = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert loads(deepest, max_bytes=LIMIT) == json.loads(deepest)
    assert loads('{"a": [1]}', max_bytes=LIMIT, max_depth=2) == {"a": [1]}
    with pytest.raises(Undecodable):
        loads('{"a": [[1]]}', max_bytes=LIMIT, max_depth=2)


def test_the_text_scan_agrees_with_the_walk() -> None:
    """Many brackets (the scan counts them): brackets in strings do not nest, a surrogate
    pair passes, a lone one or one given in a str is refused, deep nesting among siblings
    is found."""
    wide = [{"a": [i], "s": "[[[{{{" * 20} for i in range(100)]
    assert loads(json.dumps(wide), max_bytes=LIMIT, max_depth=3) == wide
    assert loads(json.dumps([wide, "\U0001f600"]), max_bytes=LIMIT, max_depth=4)[1] == "\U0001f600"
    for bad in (
        json.dumps([wide, "\ud800"]),
        '["\ud800"' + ",[]" * 100 + "]",
        json.dumps(wide)[:-1] + "," + "[" * 5 + "]" * 5 + "]",
    ):
        with pytest.raises(Undecodable):
            loads(bad, max_bytes=LIMIT, max_depth=4)


def test_ordinary_records_decode_as_json_does() -> None:
    doc = {"v": 2, "ver": 1732500000000000, "body": {"x": [1, 2.5, None, True, "é"]}, "mac": "ab"}
    raw = json.dumps(doc).encode()
    assert loads(raw, max_bytes=LIMIT) == doc
    assert loads(bytearray(raw), max_bytes=LIMIT) == doc
    assert loads(raw.decode(), max_bytes=LIMIT) == doc
    assert loads(str(-(1 << 63)).encode(), max_bytes=LIMIT) == -(1 << 63)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=30,
)


@given(json_values)
def test_what_json_writes_comes_back(value: object) -> None:
    raw = json.dumps(value).encode()
    try:
        assert loads(raw, max_bytes=LIMIT) == value
    except Undecodable as exc:  # only nesting or a lone surrogate in st.text() may refuse it
        assert "nested" in str(exc) or "surrogate" in str(exc)


@settings(max_examples=500)
@given(
    st.binary(max_size=512)
    | st.text(max_size=256).map(lambda t: t.encode("utf-8", "surrogatepass"))
)
def test_any_bytes_are_a_value_or_undecodable(raw: bytes) -> None:
    try:
        value = loads(raw, max_bytes=LIMIT)
    except Undecodable:
        return
    json.dumps(value, allow_nan=False).encode()  # what came back can be re-encoded


@settings(max_examples=200)
@given(st.integers(1, 5000), st.sampled_from(["[", '{"k":', '[{"a":']))
def test_any_nesting_is_bounded(depth: int, opener: str) -> None:
    closer = {"[": "]", '{"k":': "}", '[{"a":': "}]"}[opener]
    raw = opener * depth + "0" + closer * depth
    levels = depth * (2 if opener == '[{"a":' else 1)
    if levels <= MAX_DEPTH:
        assert loads(raw, max_bytes=LIMIT) is not None
    else:
        with pytest.raises(Undecodable, match="nested"):
            loads(raw, max_bytes=LIMIT)
