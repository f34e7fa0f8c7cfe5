"""The rendezvous with participants in separate processes (participant.py), one SIGKILLed."""

from __future__ import annotations

from rendezvous_support import join, results, settings

from elasticd.rendezvous.keys import Keys


def test_processes_form_then_survive_a_sigkilled_member(spawn):
    # last call is long: round 0 completes when max (3) are in, round 1 when both survivors are
    a, b, c = (spawn(node, 2, 3, "--last-call", "30", "--nproc", "2") for node in ("a", "b", "c"))
    formed = [p.expect("formed") for p in (a, b, c)]
    assert [f["group_rank"] for f in formed] == [0, 1, 2]
    assert {(f["round"], tuple(f["members"]), f["world_size"]) for f in formed} == {
        (0, ("a", "b", "c"), 6)
    }
    c.kill()  # SIGKILL
    for survivor in (a, b):
        assert survivor.expect("watch", timeout=30) == {
            "event": "watch",
            "kind": "next_round",
            "reason": "node_lost",
            "waiting": 0,
        }
    again = [p.expect("formed", timeout=30) for p in (a, b)]
    assert {(f["round"], tuple(f["members"])) for f in again} == {(1, ("a", "b"))}


def test_a_process_sigkilled_mid_rendezvous_is_dropped(spawn, make_handler, pool, store, prefix):
    victim = spawn("victim", 2, 4, "--last-call", "2")
    assert store.wait_for(Keys(prefix).joins(0), 60.0)  # the victim logged its join record
    victim.kill()  # SIGKILL before the round could complete
    config = settings(
        2, 4, last_call_timeout=2.0
    )  # the dead are dropped long before last call ends
    infos = results(join(pool, [make_handler(n, config) for n in ("a", "b")]))
    assert [m.node for m in infos[0].members] == ["a", "b"]
