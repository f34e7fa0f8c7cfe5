"""The rendezvous state codec: round trips, schema versions, malformed and tampered records."""

from __future__ import annotations

import json

import pytest

from elasticd.core.checkpoints import Holding
from elasticd.errors import RendezvousStateError, TamperedRecord
from elasticd.rendezvous.state import (
    Announcement,
    Participant,
    RendezvousSettings,
    RendezvousState,
    decode,
    decode_announcement,
    encode,
    encode_announcement,
)
from elasticd.store.signing import Signer

STATE = RendezvousState(
    version=12,
    round=3,
    complete=True,
    closed=False,
    reason="node_lost",
    restarts_used=2,
    participants={
        "b": Participant("10.0.0.2", 8, 29500),
        "a": Participant(
            "10.0.0.1", 4, 0, Holding("step_40", 12, (0, 1, 2, 3, 8, 9), 2, 1796049238.5)
        ),
    },
    wait_list={"c": Participant("10.0.0.3", 1, 0)},
    order=("b", "a"),
    expected=(),
    folded=5,
)


def test_round_trip_through_json_and_the_signer():
    signer = Signer(b"k" * 32, "c")
    raw = signer.seal("k", encode(STATE))
    assert decode(signer.open("k", raw).body) == STATE
    assert decode(json.loads(json.dumps(encode(RendezvousState())))) == RendezvousState()


def test_encoding_is_plain_json_with_a_schema_version():
    body = encode(STATE)
    assert body["schema"] == 1
    assert body["participants"]["b"] == {"addr": "10.0.0.2", "nproc": 8, "master_port": 29500}
    assert body["participants"]["a"]["holds"] == {
        "checkpoint": "step_40",
        "world": 12,
        "ranks": [0, 1, 2, 3, 8, 9],
        "round": 2,
        "saved": 1796049238.5,
    }
    assert json.loads(json.dumps(body)) == body


def test_unknown_schema_version_is_refused():
    body = encode(STATE) | {"schema": 2}
    with pytest.raises(RendezvousStateError, match="schema"):
        decode(body)


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b.pop("round"),
        lambda b: b.update(round="3"),
        lambda b: b.update(round=-1),
        lambda b: b.update(complete=1),
        lambda b: b.update(order="ba"),
        lambda b: b.update(order=[1, 2]),
        lambda b: b.update(participants=[]),
        lambda b: b["participants"].update(b={"addr": "x", "nproc": "8", "master_port": 1}),
        lambda b: b["participants"].update(b={"addr": "x", "nproc": 8}),
        lambda b: b.update(version=True),
        lambda b: b["participants"]["a"].update(holds=[]),
        lambda b: b["participants"]["a"]["holds"].update(ranks=[12]),
        lambda b: b["participants"]["a"]["holds"].update(ranks=[1, 0]),
        lambda b: b["participants"]["a"]["holds"].update(ranks=[0, 0]),
        lambda b: b["participants"]["a"]["holds"].update(ranks=[True]),
        lambda b: b["participants"]["a"]["holds"].update(world=0, ranks=[]),
        lambda b: b["participants"]["a"]["holds"].update(checkpoint="../x"),
        lambda b: b["participants"]["a"]["holds"].update(checkpoint=""),
        lambda b: b["participants"]["a"]["holds"].pop("world"),
        lambda b: b["participants"]["a"]["holds"].pop("round"),
        lambda b: b["participants"]["a"]["holds"].update(saved=True),
        lambda b: b["participants"]["a"]["holds"].update(saved="now"),
    ],
)
def test_malformed_state_is_refused(damage):
    body = encode(STATE)
    damage(body)
    with pytest.raises(RendezvousStateError):
        decode(body)


@pytest.mark.parametrize("body", [None, [], "state", 7])
def test_non_objects_are_refused(body):
    with pytest.raises(RendezvousStateError):
        decode(body)


def test_tampered_state_is_refused_by_the_signer():
    signer = Signer(b"k" * 32, "c")
    raw = signer.seal("k", encode(STATE)).replace(b'"restarts_used":2', b'"restarts_used":0')
    with pytest.raises(TamperedRecord):
        signer.open("k", raw)


def test_announcement_round_trip_and_schema():
    announcement = Announcement("node-1", Participant("10.0.0.1", 2, 29400))
    assert decode_announcement(encode_announcement(announcement)) == announcement
    with pytest.raises(RendezvousStateError):
        decode_announcement(encode_announcement(announcement) | {"schema": 99})


def test_next_bumps_the_version_only():
    assert STATE.next(closed=True) == RendezvousState(
        **{**STATE.__dict__, "version": 13, "closed": True}
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_nodes": 0, "max_nodes": 1},
        {"min_nodes": 3, "max_nodes": 2},
        {"min_nodes": 1, "max_nodes": 1, "keep_alive_interval": 0},
        {"min_nodes": 1, "max_nodes": 1, "max_restarts": -1},
        {"min_nodes": 1, "max_nodes": 1, "keep_alive_max_attempt": 0},
    ],
)
def test_settings_refuse_nonsense(kwargs):
    with pytest.raises(ValueError):
        RendezvousSettings("job", **kwargs)


def test_settings_defaults_match_the_design():
    settings = RendezvousSettings("job", 1, 2)
    assert (settings.keep_alive_interval, settings.keep_alive_max_attempt, settings.dead_after) == (
        1.0,
        3,
        3.0,
    )


def test_decoded_keeps_a_state_by_signer_key_and_bytes_and_forgets_the_oldest():
    from elasticd.rendezvous.state import Decoded

    signer = Signer(b"k" * 32, "c")
    decoded, other = Decoded(size=2), Signer(b"o" * 32, "c")
    states = [RendezvousState(version=v) for v in range(3)]
    for v, state in enumerate(states):
        decoded.put(signer, "k", b"raw%d" % v, state)
    assert decoded.get(signer, "k", b"raw0") is None  # the oldest went
    assert decoded.get(signer, "k", b"raw2") is states[2]
    assert decoded.get(other, "k", b"raw2") is None and decoded.get(signer, "j", b"raw2") is None
    built = []

    def build(state: RendezvousState) -> object:
        built.append(state)
        return object()

    first = decoded.built(states[1], build)
    assert decoded.built(states[1], build) is first and built == [
        states[1]
    ]  # once per state object


def test_a_head_names_the_state_version_and_opens_only_for_its_key():
    from elasticd.rendezvous.head import FULL_EVERY, head_version, seal_head, state_moved

    signer, refused = Signer(b"k" * 32, "c"), []
    raw = seal_head(signer, "p/head", RendezvousState(version=7, round=2))
    assert head_version(signer, "p/head", raw, lambda k, why: refused.append(why)) == 7
    assert (
        head_version(signer, "q/head", raw, lambda k, why: refused.append(why)) is None and refused
    )
    assert head_version(signer, "p/head", None, lambda k, why: refused.append(why)) is None
    assert not state_moved(7, 7, 1) and not state_moved(7, 6, 1)  # an older head hides nothing new
    assert state_moved(7, 8, 1) and state_moved(7, None, 1) and state_moved(None, 7, 1)
    assert state_moved(7, 7, FULL_EVERY)
