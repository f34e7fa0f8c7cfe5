"""etcd specifics of the store (elasticd.store.etcd), against real etcd processes: TLS and
users refused, connecting, fail-over between members, large reads, leases, compaction."""

from __future__ import annotations

import asyncio
import time

import pytest
from fixtures.etcd import EtcdCluster, require_etcd

from elasticd.errors import StoreConnectionError, StoreError, StoreTimeout
from elasticd.store.etcd import MAX_TXN_OPS, EtcdStore


def run(coro):
    return asyncio.run(coro)


async def connected(
    cluster: EtcdCluster, endpoints: list[str] | None = None, timeout: float = 5.0, **options
) -> EtcdStore:
    store = EtcdStore(
        endpoints or cluster.endpoints, **{"timeout": timeout, **cluster.store_options(), **options}
    )
    await store.connect(10.0)
    return store


def test_tls_without_a_client_certificate_is_refused(etcd_tls_cluster):
    endpoint = etcd_tls_cluster.endpoints[0]
    store = EtcdStore(
        [endpoint],
        timeout=2.0,
        ca_file=etcd_tls_cluster.tls.ca,
        user="root",
        password=etcd_tls_cluster.password,
    )
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as raised:
        run(store.connect(1.0))
    assert endpoint in str(raised.value)
    assert time.monotonic() - started < 5.0


def test_plain_tcp_to_a_tls_member_is_refused(etcd_tls_cluster):
    store = EtcdStore(etcd_tls_cluster.endpoints, timeout=2.0)
    with pytest.raises(StoreConnectionError):
        run(store.connect(1.0))


def test_a_wrong_password_is_refused_at_once_naming_the_endpoint_and_user(etcd_tls_cluster):
    endpoint = etcd_tls_cluster.endpoints[0]
    store = EtcdStore(
        [endpoint], timeout=2.0, **{**etcd_tls_cluster.store_options(), "password": "wrong"}
    )
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match="refused user 'root'") as raised:
        run(store.connect(20.0))
    assert endpoint in str(raised.value) and "authentication failed" in str(raised.value)
    assert time.monotonic() - started < 5.0  # not retried until the connect timeout


def test_the_client_certificate_alone_names_the_user(etcd_tls_cluster):
    """With authentication on and no password, etcd takes the user from the certificate."""

    async def scenario():
        store = await connected(etcd_tls_cluster, user="", password="")
        await store.set("cert-only", b"x")
        assert await store.get("cert-only") == b"x"
        await store.close()

    run(scenario())


def test_connect_to_dead_endpoints_fails_within_its_timeout_naming_them():
    from harness import free_port

    endpoints = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    store = EtcdStore(endpoints, timeout=5.0)
    started = time.monotonic()
    with pytest.raises(StoreConnectionError) as raised:
        run(store.connect(1.0))
    assert all(endpoint in str(raised.value) for endpoint in endpoints)
    assert 0.9 <= time.monotonic() - started < 3.0


def test_a_call_fails_at_once_when_no_member_answers():
    from harness import free_port

    store = EtcdStore([f"127.0.0.1:{free_port()}"], timeout=10.0)
    started = time.monotonic()
    with pytest.raises(StoreConnectionError, match="cannot reach etcd"):
        run(store.get("k"))
    assert time.monotonic() - started < 3.0


def test_connect_waits_for_a_member_that_comes_up_later(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path) as cluster:
        cluster.kill(0)

        async def scenario():
            store = EtcdStore(cluster.endpoints, timeout=5.0)
            loop = asyncio.get_running_loop()
            loop.call_later(0.5, cluster.start, 0)
            await store.connect(30.0)
            await store.set("k", b"v")
            assert await store.get("k") == b"v"
            await store.close()

        run(scenario())


def test_an_expired_auth_token_is_renewed(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path, password="pw", token_ttl=1) as cluster:

        async def scenario():
            store = await connected(cluster)
            await store.set("k", b"v")
            await asyncio.sleep(2.5)  # unused for longer than its TTL: etcd forgets the token
            assert await store.get("k") == b"v"
            await store.close()

        run(scenario())


def test_a_restarted_member_is_reached_again(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path, password="pw") as cluster:

        async def scenario():
            store = await connected(cluster)
            await store.set("k", b"v")
            cluster.kill(0)
            cluster.start(0)
            cluster.wait_healthy(0)
            assert await store.get("k") == b"v"
            await store.close()

        run(scenario())


def test_a_member_back_is_reached_at_once_while_another_channel_to_it_backs_off(tmp_path):
    """gRPC shares connections between a process's channels: a fresh one (made after a
    failure) took over another's backing-off connection and failed at once with its stale
    "Connection refused" for a second or more after the member was back (CI: a cancel refused
    after an etcd restart)."""
    require_etcd()
    from elasticd.store.etcd import _Member

    with EtcdCluster(tmp_path) as cluster:

        async def scenario():
            cluster.kill(0)
            away = _Member(cluster.endpoints[0], None)  # another channel, its backoff growing
            for _ in range(15):
                assert await away.connected(2.0) is not None
                await asyncio.sleep(0.2)
            cluster.start(0)
            await asyncio.to_thread(cluster.wait_healthy, 0)
            store = EtcdStore(cluster.endpoints, timeout=5.0)
            await store.set("k", b"v")  # a call fails at once only when no member answers
            await store.close()
            await away.close()

        run(scenario())


def test_get_many_reads_more_keys_than_one_transaction_takes(etcd_cluster):
    keys = [f"many/{i}" for i in range(MAX_TXN_OPS * 2 + 5)]

    async def scenario():
        store = await connected(etcd_cluster)
        await asyncio.gather(*(store.set(key, key.encode()) for key in keys[::2]))
        values = await store.get_many(keys)
        assert values == [key.encode() if i % 2 == 0 else None for i, key in enumerate(keys)]
        await store.close()

    run(scenario())


def test_add_on_a_value_that_is_no_counter_is_a_store_error(etcd_cluster):
    async def scenario():
        store = await connected(etcd_cluster)
        await store.set("not-a-counter", b"abc")
        with pytest.raises(StoreError, match="not a counter"):
            await store.add("not-a-counter", 1)
        await store.close()

    run(scenario())


def test_a_wait_in_flight_when_the_store_closes_raises_connection_error(etcd_cluster):
    async def scenario():
        store = await connected(etcd_cluster)
        waiting = asyncio.create_task(store.wait_for("never-set", 30.0))
        await asyncio.sleep(0.3)
        await store.close()
        with pytest.raises(StoreConnectionError):
            await waiting

    run(scenario())


def test_revision_follows_the_writes(etcd_cluster):
    async def scenario():
        store = await connected(etcd_cluster)
        await store.set("rev", b"1")
        before = store.revision
        await store.set("rev", b"2")
        assert store.revision == before + 1
        await store.close()

    run(scenario())


def test_compacting_forgets_the_history_not_the_keys_and_waits_still_end(etcd_cluster):
    async def scenario():
        store = await connected(etcd_cluster)
        for value in (b"1", b"2", b"3"):
            await store.set("kept", value)
        revision = store.revision
        with pytest.raises(StoreError, match="future revision"):
            await store.compact(revision + 100)
        assert await store.compact(revision) is True
        assert await store.compact(revision) is False  # compacted already: no error
        assert await store.compact(revision - 1) is False
        assert await store.get("kept") == b"3"
        waiting = asyncio.create_task(store.wait_for("written-after", 10.0))
        await asyncio.sleep(0.2)
        await store.set("written-after", b"x")
        assert await waiting is True
        assert store.revision > revision
        await store.close()

    run(scenario())


def test_a_leased_key_goes_with_its_lease(etcd_cluster):
    async def scenario():
        store = await connected(etcd_cluster)
        lease = await store.lease_grant(1)
        await store.put_with_lease("leased", b"x", lease)
        assert await store.lease_keep_alive(lease) is True
        assert await store.get("leased") == b"x"
        deadline = time.monotonic() + 10
        while await store.get("leased") is not None:  # expires within its TTL (1 s) and a tick
            assert time.monotonic() < deadline, "the leased key outlived its lease"
            await asyncio.sleep(0.1)
        assert await store.lease_keep_alive(lease) is False
        with pytest.raises(StoreConnectionError, match="lease not found"):
            await store.put_with_lease("leased", b"y", lease)
        await store.close()

    run(scenario())


def test_calls_and_waits_move_to_another_member_when_theirs_dies(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path, members=3) as cluster:

        async def scenario():
            store = await connected(cluster)
            writer = await connected(cluster, endpoints=cluster.endpoints[1:])
            await store.set("before", b"1")
            assert await store.add("counter", 1) == 1
            waiting = asyncio.create_task(store.wait_for("later", 30.0))
            await asyncio.sleep(0.3)  # the watch is on member 0
            cluster.kill(0)
            assert await store.get("before") == b"1"
            await store.set("after", b"2")
            assert await store.compare_set("after", b"2", b"3") == (True, b"3")
            assert await store.add("counter", 1) == 2
            await writer.set("later", b"x")
            assert await asyncio.wait_for(waiting, 10) is True
            await store.close()
            await writer.close()

        run(scenario())


def test_calls_move_to_another_member_when_theirs_freezes(tmp_path):
    """A member stopped (SIGSTOP: a hung process, a host cut off without a reset) answers
    nothing and keeps its connections open: gRPC's keepalive notices it after up to 15 s,
    and daemons writing their heartbeats there would have been judged lost meanwhile."""
    require_etcd()
    with EtcdCluster(tmp_path, members=3) as cluster:

        async def scenario():
            leader = cluster.leader()
            frozen = 1 if leader == 0 else 0  # a follower: a frozen leader costs an election
            first = [cluster.endpoints[frozen]]
            store = await connected(
                cluster, endpoints=first + [e for e in cluster.endpoints if e not in first]
            )
            await store.set("before", b"1")
            cluster.freeze(frozen)
            try:
                started = time.monotonic()
                assert await store.get("before") == b"1"
                await store.set("after", b"2")
                assert await store.compare_set("after", b"2", b"3") == (True, b"3")
                took = time.monotonic() - started
            finally:
                cluster.thaw(frozen)
            assert took < 5.0, f"{took:.1f}s on a frozen member"  # bound; typically 0.5-1 s
            await store.close()

        run(scenario())


def test_a_stalled_member_left_by_a_read_still_answers_the_writes_it_holds(tmp_path):
    """A member that stalls for 1.6 s (a slow disk) and then answers: the read moves to the
    next member after a second, and an add and an append that cannot be sent twice, in
    flight on the stalled member, still get its answer instead of failing."""
    require_etcd()
    with EtcdCluster(tmp_path, members=3) as cluster:

        async def scenario():
            leader = cluster.leader()
            stalled = 1 if leader == 0 else 0
            first = [cluster.endpoints[stalled]]
            store = await connected(
                cluster,
                endpoints=first + [e for e in cluster.endpoints if e not in first],
                timeout=10.0,
            )
            await store.set("k", b"1")
            assert await store.add("n", 1) == 1
            cluster.freeze(stalled)
            asyncio.get_running_loop().call_later(1.6, cluster.thaw, stalled)
            got = await asyncio.gather(store.get("k"), store.add("n", 1), store.append("a", b"x"))
            assert got == [b"1", 2, None]
            assert await store.get("a") == b"x" and await store.add("n", 0) == 2
            await store.close()

        run(scenario())


def test_a_cluster_without_quorum_times_out(tmp_path):
    require_etcd()
    with EtcdCluster(tmp_path, members=3) as cluster:

        async def scenario():
            store = await connected(cluster, timeout=1.0)
            cluster.kill(1)
            cluster.kill(2)
            started = time.monotonic()
            with pytest.raises((StoreTimeout, StoreConnectionError)):
                await store.get("k")
            assert time.monotonic() - started < 5.0
            await store.close()

        run(scenario())


def test_joiners_adding_one_at_once_each_take_a_number_of_their_own_in_one_txn(etcd_cluster):
    """An add of 1 is a put that keeps the value (the count is an offset plus the key's
    version): 200 at once take 1..200 with no race lost, reads show the count, an add of
    another amount counts on from it, and junk under the counter's own prefix is junk."""
    from elasticd.errors import NotACounter
    from elasticd.store.etcd import _COUNT

    async def scenario():
        store = await connected(etcd_cluster)
        numbers = await asyncio.gather(*(store.add("joins", 1) for _ in range(200)))
        assert sorted(numbers) == list(range(1, 201))
        assert await store.get_many(["joins"]) == [b"200"] and await store.add("joins", 5) == 205
        assert await store.add("joins", 1) == 206 and await store.get("joins") == b"206"
        await store.set("junk", _COUNT + b"--5")
        with pytest.raises(NotACounter):
            await store.add("junk", 1)
        assert await store.get("junk") == _COUNT + b"--5"
        await store.close()

    run(scenario())


def test_a_write_sent_as_the_leader_dies_is_answered_by_the_next_leader(tmp_path):
    """A member forwards a write to its leader; a leader that dies loses it, and etcd answers
    only after its request timeout (5 s plus two elections).  The client sends it again: it
    lands once another member leads, and reads and writes go on meanwhile."""
    require_etcd()
    with EtcdCluster(tmp_path, members=3) as cluster:
        leader = cluster.leader()
        assert leader is not None
        follower = next(e for i, e in enumerate(cluster.endpoints) if i != leader)

        async def scenario():
            store = await connected(cluster, endpoints=[follower], timeout=30.0)
            await store.set("beat", b"0")
            cluster.kill(leader)
            took = []
            for beat in range(1, 6):
                started = time.monotonic()
                await store.set("beat", b"%d" % beat)
                assert await store.get("beat") == b"%d" % beat
                assert await store.compare_set("beat", b"%d" % beat, b"%d" % beat) == (
                    True,
                    b"%d" % beat,
                )
                took.append(time.monotonic() - started)
            assert max(took) < 5.0, took  # etcd's own answer comes after 6 s
            await store.close()

        run(scenario())
