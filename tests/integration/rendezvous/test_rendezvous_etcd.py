"""The rendezvous on a real etcd (the store protocol is the same; etcd maps ``add`` and a
compare-and-set against "missing" to transactions): a round forms, a counter an attacker
bumped or filled with junk freezes nobody, and the completer deletes the round's join log."""

from __future__ import annotations

import asyncio
import time

import pytest
from fixtures.etcd import EtcdCluster, require_etcd

from elasticd.rendezvous import RendezvousSettings
from elasticd.rendezvous.handler import RendezvousHandler
from elasticd.rendezvous.keys import Keys
from elasticd.store.etcd import EtcdStore
from elasticd.store.signing import Signer

SIGNER = Signer(b"k" * 32, "c")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    require_etcd()
    with EtcdCluster(tmp_path_factory.mktemp("etcd")) as cluster:
        yield cluster


async def form(
    etcd: EtcdCluster, prefix: str, nodes: list[str], tamper=None
) -> tuple[list, list[str]]:
    """Every node joins with a store client of its own; the infos and the join-log keys left
    once the completer's sweeper ran."""
    settings = RendezvousSettings("job", len(nodes), len(nodes), keep_alive_interval=0.2)
    stores = [EtcdStore(etcd.endpoints, timeout=10.0) for _ in nodes]
    for store in stores:
        await store.connect(10.0)
    if tamper is not None:
        await tamper(stores[0])
    handlers = [
        RendezvousHandler(s, SIGNER, settings, n, f"{n}.addr", prefix=prefix)
        for s, n in zip(stores, nodes)
    ]
    keepers = [asyncio.create_task(h.keep()) for h in handlers]
    try:
        infos = await asyncio.wait_for(
            asyncio.gather(*(h.next_rendezvous(1, 1) for h in handlers)), 30
        )
        left = ["?"]
        for _ in range(50):
            left = [
                k
                for k in [
                    Keys(prefix).joins(0),
                    *(Keys(prefix).join(0, i) for i in range(1, 2 * len(nodes))),
                ]
                if await stores[0].get(k) is not None
            ]
            if not left:
                break
            await asyncio.sleep(0.1)
        return infos, left
    finally:
        for h in handlers:
            h.shutdown()
        for k in keepers:
            k.cancel()
        await asyncio.gather(*keepers, return_exceptions=True)
        for store in stores:
            await store.close()


def test_a_round_forms_on_etcd_and_its_join_log_is_deleted(etcd, request):
    nodes = [f"n{i}" for i in range(8)]
    infos, left = asyncio.run(form(etcd, f"elasticd/test/{request.node.name}", nodes))
    assert [m.node for m in infos[0].members] == nodes and len({i.group_rank for i in infos}) == 8
    assert left == []


@pytest.mark.parametrize("tamper", ["bumped", "junk", "empty"])
def test_a_tampered_counter_on_etcd_freezes_nobody(etcd, request, tamper):
    """Bumped past a gap nobody reads, not a count, or empty (etcd's add reads that as 0;
    the handler reads it as no count): the round forms."""
    prefix = f"elasticd/test/{request.node.name}"

    async def bump(store) -> None:
        if tamper == "bumped":
            await store.add(Keys(prefix).joins(0), 10**12)
        else:
            await store.set(Keys(prefix).joins(0), b"junk" if tamper == "junk" else b"")

    started = time.monotonic()
    infos, _ = asyncio.run(form(etcd, prefix, ["a", "b", "c"], bump))
    assert [m.node for m in infos[0].members] == ["a", "b", "c"] and time.monotonic() - started < 10
