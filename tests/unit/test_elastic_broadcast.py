"""elasticd.elastic.broadcast's wire format: encode/decode without a process group (the
broadcast itself is exercised by the multi-process tests in test_elastic_state.py)."""

from __future__ import annotations

import collections
import json
import math

import pytest
import torch

from elasticd.elastic.broadcast import decode, encode


def round_trip(obj):
    data, tensors = encode(obj)
    return decode(data, tensors)


def assert_same(actual, expected):
    """Equal, and of the same types all the way down (int vs str keys, tuple vs list)."""
    assert type(actual) is type(expected)
    if isinstance(expected, torch.Tensor):
        assert actual.dtype == expected.dtype and actual.shape == expected.shape
        assert torch.equal(actual, expected)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for key in expected:
            assert_same(actual[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for item, expected_item in zip(actual, expected, strict=True):
            assert_same(item, expected_item)
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(actual)
    else:
        assert actual == expected


@pytest.mark.parametrize(
    "obj",
    [
        None,
        True,
        False,
        0,
        -5,
        2**80,
        1.5,
        -0.0,
        1e-300,
        "",
        "h\u00e9llo \U0001f600",
        "\ud800",
        "\ud83d\ude00",
        {"\udfff": "lone surrogate key"},
        [],
        (),
        {},
        [1, [2, [3]]],
        (1, (2,), [3, (4,)]),
        ([],),
        {0: "int key", "0": "str key", 1.5: "float key", True: "bool key", None: "none key"},
        {
            "state": {0: {"step": 3}, 1: {}},
            "param_groups": [{"betas": (0.9, 0.999), "params": [0, 1]}],
        },
        [float("inf"), float("-inf"), {"nan": float("nan")}, (float("nan"),)],
    ],
)
def test_plain_values_round_trip(obj):
    assert_same(round_trip(obj), obj)


@pytest.mark.parametrize(
    "tensor",
    [
        torch.randn(3, 4),
        torch.tensor(2.5),
        torch.tensor(7),
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
        torch.empty(0),
        torch.empty(2, 0, 3),
        torch.tensor([1, -2], dtype=torch.int8),
        torch.arange(4, dtype=torch.uint8),
        torch.linspace(0, 1, 7, dtype=torch.float64),
        torch.tensor([1 + 2j]),
        torch.ones(2, dtype=torch.float16),
        torch.tensor([float("nan"), float("inf")]),
    ],
)
def test_tensors_are_placeholders(tensor):
    data, tensors = encode({"t": tensor})
    assert len(tensors) == 1 and tensors[0] is tensor
    placeholder = json.loads(data)["value"]["dict"][0][1]
    assert placeholder == {
        "tensor": 0,
        "shape": list(tensor.shape),
        "dtype": str(tensor.dtype).removeprefix("torch."),
        "device": "cpu",
    }
    back = decode(data, tensors)["t"]
    assert back.dtype == tensor.dtype and back.shape == tensor.shape
    assert torch.equal(back.nan_to_num(), tensor.nan_to_num())


def test_optimizer_state_dict_round_trips():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    state_dict = optimizer.state_dict()
    data, tensors = encode(state_dict)
    assert len(tensors) == 6  # step, exp_avg, exp_avg_sq for weight and bias
    assert_same(decode(data, [tensor.clone() for tensor in tensors]), state_dict)


def test_tensor_order_and_sharing():
    shared = torch.ones(2)
    data, tensors = encode({"b": [shared, torch.zeros(1)], "a": (shared,)})
    assert [tensor.shape for tensor in tensors] == [(2,), (1,), (2,)]
    back = decode(data, tensors)
    assert back["b"][0] is tensors[0] and back["a"][0] is tensors[2]


def test_skeleton_is_strict_ascii_json():
    data, _ = encode({"nan": float("nan"), "text": "\u00e9", 3: (None,)})
    data.decode("ascii")
    json.loads(data, parse_constant=lambda name: pytest.fail(f"non-standard JSON {name}"))


def test_dict_subclasses_and_size_arrive_as_plain():
    ordered = collections.OrderedDict([("b", 1), ("a", torch.Size([2, 3]))])
    back = round_trip(ordered)
    assert type(back) is dict and list(back) == ["b", "a"]
    assert type(back["a"]) is tuple and back["a"] == (2, 3)


@pytest.mark.parametrize(
    "obj, path",
    [
        ({"foo": [1, 2, object()]}, "state.foo[2]"),
        ({"foo": {3: {1.5}}}, "state.foo[3]"),
        ({"a b": b"bytes"}, "state['a b']"),
        ([(1, 2, collections.namedtuple("Point", "x y")(1, 2))], "state[0][2]"),
        ({"sparse": torch.eye(2).to_sparse()}, "state.sparse"),
        ({(1, 2): "tuple key"}, "state"),
        ({"e": __import__("enum").IntEnum("E", "A").A}, "state.e"),
    ],
)
def test_unsupported_values_name_their_path(obj, path):
    with pytest.raises(TypeError) as raised:
        encode(obj, name="state")
    assert str(raised.value).startswith(f"{path}: cannot broadcast")


def test_cycles_are_refused():
    loop: list = [1]
    loop.append({"again": loop})
    with pytest.raises(TypeError, match=r"^obj\[1\]\.again: the structure contains itself"):
        encode(loop)


def test_repeated_but_acyclic_containers_are_fine():
    inner = [1, 2]
    assert round_trip([inner, inner, {"x": inner}]) == [[1, 2], [1, 2], {"x": [1, 2]}]


def test_decode_checks_the_tensors_against_the_skeleton():
    data, _tensors = encode([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match="float32"):
        decode(data, [torch.zeros(3, 2)])
    with pytest.raises(ValueError, match="int64"):
        decode(data, [torch.zeros(2, 3, dtype=torch.int64)])


@pytest.mark.parametrize(
    "data, error",
    [
        (b'{"version": 2, "value": 1}', ValueError),
        (b'{"version": 1, "value": {"pickle": "x"}}', ValueError),
        (
            b'{"version": 1, "value": {"tensor": 0, "shape": [], "dtype": "_dynamo", "device": "cpu"}}',
            ValueError,
        ),
        (b'{"version": 1, "error": "state.x: nope"}', TypeError),
    ],
)
def test_decode_refuses_what_encode_does_not_write(data, error):
    with pytest.raises(error):
        decode(data, [torch.zeros(())])
