"""safejson.loads: every input is a value within bounds or Undecodable, nothing else."""

from __future__ import annotations

import gc
import json
import sys

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


@pytest.mark.parametrize(
    "text, why",
    [
        pytest.param('"' + "[" * 100000, "not JSON", id="an unterminated string nests nothing"),
        pytest.param('"\\"' + "[" * 100000, "not JSON", id="an escaped quote does not end it"),
        pytest.param(
            '["\\\\"' + ",[" * 100, "nested", id="an escaped backslash leaves the quote closing"
        ),
        pytest.param('"\\' * 100000, "not JSON", id="backslashes and quotes that never close"),
        pytest.param('"' * 100001 + "[" * 100, "not JSON", id="an odd quote left open"),
        pytest.param("[1]" + "[" * 100, "not JSON", id="after the value ended"),
        pytest.param("]" * 100 + "[" * 100, "not JSON", id="before any value began"),
    ],
)
def test_the_nesting_is_judged_before_parsing_as_a_parser_would_read_it(
    text: str, why: str
) -> None:
    """The text is scanned before the parser runs, so that it never recurses deeper than the
    bound (near Python's recursion limit, a finalizer that runs meanwhile fails)."""
    with pytest.raises(Undecodable, match=why):
        loads(text, max_bytes=LIMIT)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    return 0


@settings(max_examples=1000)
@given(st.text(alphabet='[]{}"\\:,1 a', max_size=40))
def test_the_scan_before_parsing_refuses_no_value_within_the_bound(text: str) -> None:
    """Whatever JSON decodes within the depth comes back; all else is refused."""
    try:
        expected = json.loads(text)
    except ValueError:
        with pytest.raises(Undecodable):
            loads(text, max_bytes=LIMIT, max_depth=3)
        return
    if _depth(expected) <= 3:
        assert loads(text, max_bytes=LIMIT, max_depth=3) == expected
    else:
        with pytest.raises(Undecodable, match="nested"):
            loads(text, max_bytes=LIMIT, max_depth=3)


def test_a_finalizer_that_runs_while_a_deep_text_is_refused_does_not_fail(monkeypatch) -> None:
    """The garbage collector may run a finalizer anywhere; were the parser handed a text
    nested thousands deep, one that ran near Python's recursion limit would fail (CI: three
    at once failed a test here).  Collections are made to fall at every depth to ~1,000."""
    failed: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: failed.append(repr(u.exc_value)))

    def nest(levels: int) -> int:
        return 0 if levels == 0 else nest(levels - 1)

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            nest(30)

    text = "[" * 5000 + "]" * 5000
    before = gc.get_threshold()
    try:
        for threshold in range(850, 1000, 5):
            gc.collect()
            for _ in range(5):
                Cycle()
            gc.set_threshold(threshold)
            with pytest.raises(Undecodable, match="nested"):
                loads(text, max_bytes=LIMIT)
    finally:
        gc.set_threshold(*before)
        gc.collect()
    assert failed == []
