"""The control protocol codec: every malformed frame named, ids recovered for replies."""

import json
import os

import pytest

from elasticd.wire import paths
from elasticd.wire import protocol as p


def frame(**doc):
    return json.dumps(doc).encode()


def test_round_trip():
    req = p.Request(
        "r1",
        "submit",
        {
            "argv": ["t.py"],
            "nproc_per_node": "gpu",
            "wait": True,
            "role": "trainer",
            "master_port": 29500,
        },
    )
    assert p.decode_request(p.encode_request(req)) == req
    assert req.streaming and not p.Request("r", "submit", {"argv": ["a"]}).streaming
    assert p.Request("r", "logs", {"job": "j"}).streaming


@pytest.mark.parametrize(
    "raw, code, words",
    [
        (b"{", "bad_request", "invalid JSON"),
        (b"\xff\xfe", "bad_request", "invalid JSON"),
        (b"[" * 100000 + b"]" * 100000, "bad_request", "invalid JSON"),
        (b"3", "bad_request", "JSON object"),
        (frame(v=2, id="a", op="version"), "bad_request", "version"),
        (frame(v=1, op="version"), "bad_request", "'id'"),
        (frame(v=1, id="", op="version"), "bad_request", "'id'"),
        (frame(v=1, id="a", op=5), "bad_request", "'op'"),
        (frame(v=1, id="a", op="nuke"), "unknown_op", "nuke"),
        (frame(v=1, id="a", op="list", args=[]), "bad_request", "'args'"),
        (frame(v=1, id="a", op="list", args={"al": True}), "bad_request", "unknown argument"),
        (frame(v=1, id="a", op="list", args={"all": 1}), "bad_request", "a boolean"),
        (
            frame(v=1, id="a", op="logs", args={"job": "j", "rank": True}),
            "bad_request",
            "an integer",
        ),
        (frame(v=1, id="a", op="submit", args={"argv": "t.py"}), "bad_request", "a list"),
        (frame(v=1, id="a", op="submit", args={}), "bad_request", "missing argument 'argv'"),
        (
            frame(v=1, id="a", op="submit", args={"argv": ["t"], "role": 1}),
            "bad_request",
            "'role' must be a string",
        ),
        (
            frame(v=1, id="a", op="submit", args={"argv": ["t"], "master_port": "1"}),
            "bad_request",
            "'master_port' must be an integer",
        ),
        (frame(v=1, id="a", op="status"), "bad_request", "missing argument 'job'"),
    ],
)
def test_malformed(raw, code, words):
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(raw)
    assert info.value.code == code and words in str(info.value)


def test_too_large_keeps_its_id():
    raw = p.encode_request(p.Request("big", "status", {"job": "x" * (p.MAX_FRAME + 1)}))
    with pytest.raises(p.ProtocolError) as info:
        p.decode_request(raw)
    assert info.value.code == "too_large"
    assert p.request_id(raw) == "big"


@pytest.mark.parametrize(
    "raw, rid", [(frame(id="q", op=1), "q"), (b"{", ""), (frame(id=3), ""), (b"[]", "")]
)
def test_request_id_best_effort(raw, rid):
    assert p.request_id(raw) == rid


def test_replies():
    assert p.decode_reply(p.ok("a", {"x": 1})) == p.Reply("a", True, {"x": 1})
    assert p.decode_reply(p.end("a")) == p.Reply("a", True, None, True)
    assert p.decode_reply(p.error("a", "not_found", "no job")) == p.Reply(
        "a", False, code="not_found", message="no job"
    )
    with pytest.raises(p.ProtocolError):
        p.decode_reply(b'{"v":1}')


def test_default_socket(monkeypatch, tmp_path):
    monkeypatch.setenv("ELASTICD_SOCKET", "/x.sock")
    assert paths.default_socket_path() == "/x.sock"
    monkeypatch.delenv("ELASTICD_SOCKET")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert paths.default_runtime_dir(1000) == f"{tmp_path}/elasticd"
    assert paths.default_runtime_dir(0) == "/run/elasticd"


def test_a_socket_in_a_directory_that_others_own_or_can_write_is_never_chosen(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("ELASTICD_SOCKET", raising=False)
    own_dir = tmp_path / "elasticd"
    own_dir.mkdir(mode=0o700)
    (own_dir / paths.SOCKET_NAME).touch()
    monkeypatch.setattr(paths, "default_runtime_dir", lambda uid=None: str(own_dir))
    system = os.path.join("/run/elasticd", paths.SOCKET_NAME)
    assert paths.default_socket_path() == str(own_dir / paths.SOCKET_NAME)
    own_dir.chmod(0o777)  # anyone could have swapped the socket
    assert paths.default_socket_path() == system
    if os.getuid() == 0:
        own_dir.chmod(0o700)
        os.chown(own_dir, 65534, 65534)  # created first by somebody else
        assert paths.default_socket_path() == system


@pytest.mark.parametrize(
    "value, out", [(1, 1), ("12", 12), ("gpu", "gpu"), ("cpu", "cpu"), ("auto", "auto")]
)
def test_parse_nproc_takes_torchruns_words(value, out):
    assert p.parse_nproc(value) == out


@pytest.mark.parametrize(
    "value", ["xpu", "mps", "", "0", 0, "1.5", "\u0663"]
)  # \u0663: an Arabic-Indic 3
def test_parse_nproc_names_the_accepted_values(value):
    with pytest.raises(
        ValueError, match=r"must be one of N, gpu, cpu, auto \(N a positive integer\), got"
    ):
        p.parse_nproc(value)


@pytest.mark.parametrize(
    "sizes, max_bytes, want",
    [
        ([], 100, [[]]),  # always one reply, empty when there is nothing
        ([10, 10, 10], 100, [[0, 1, 2]]),
        ([40, 40, 40], 100, [[0, 1], [2]]),
        ([500, 10, 10], 100, [[0], [1, 2]]),  # one larger than a batch goes alone
        ([10, 500, 10], 100, [[0], [1], [2]]),
    ],
)
def test_batches(sizes, max_bytes, want):
    docs = [
        {"i": i, "pad": "x" * (size - len(json.dumps({"i": i, "pad": ""}, separators=(",", ":"))))}
        for i, size in enumerate(sizes)
    ]
    got = [[doc["i"] for doc in batch] for batch in p.batches(iter(docs), max_bytes)]
    assert got == want


def test_batches_take_their_documents_as_each_is_asked_for():
    taken = []

    def docs():
        for i in range(10):
            taken.append(i)
            yield {"i": i}

    batches = p.batches(docs(), 20)  # two small documents a batch
    assert next(batches) == [{"i": 0}, {"i": 1}] and taken == [0, 1, 2]
