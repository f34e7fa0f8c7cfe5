"""EtcdStore: the store operations as coroutines over an etcd v3 cluster (docs/store.md).

How each operation maps onto etcd: ``get``/``set``/``delete`` are Range, Put and
DeleteRange.  ``compare_set`` is one Txn (the value equals ``expected``, or the key was never
created) whose failure branch reads the key.  ``append`` and an ``add`` of other than 1
read the key, then write the new value in a Txn that holds only if the key's mod revision
is still the one read, and start again from what a lost race read.  An ``add`` of 1 (a
number taken: N joiners at once) is one Txn that no race can fail, O(1) however many add
at once: a counter is kept as an offset plus the key's version (the puts since it was
created, which etcd counts), so the add is a put that keeps the value (``ignore_value``)
and reads the key back; every read shows the count (:func:`_shown`).  ``get_many`` is
Txns of up to 128 Range ops (etcd's default ``--max-txn-ops``).  ``wait_for`` reads the key
and the store's revision, then watches the key from the next revision: one round trip when
it is written, no polling.  Counters read as ASCII decimal, as TCPStore stores them; an add
over anything else (junk, a sign, more than 18 digits) raises NotACounter and writes
nothing.

gRPC is spoken over aetcd's generated stubs; aetcd's own client has no TLS, uses one
endpoint and never renews its auth token.  Calls go to one member at a time.  A member that
cannot be reached (or that lost its cluster's leader) is left for the next one, each tried
once per call; so is a member whose connection broke during a call, and the call is then
sent again, except an ``add`` or ``append``: it may have been applied, so it fails with
StoreConnectionError (as a TCPStore call whose connection broke does).

Calls ask for a member with a leader (etcd's ``hasleader``): during an election a member
answers "no leader" at once, and the call goes on to the next member after a short pause,
until its deadline.  A write that a member forwarded to a leader that has just died is lost
with it, and etcd answers only after its request timeout (5 s plus two elections): a read,
a ``set`` or a ``compare_set`` with no answer after ``_FIRST_ANSWER`` seconds is sent again
(each wait half as long again as the last), and reaches the leader elected meanwhile.  Else
every daemon's heartbeat stood still for those seconds whenever etcd lost its leader, and
the nodes were judged lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from aetcd import rpc

from elasticd.aio import back_off, gather
from elasticd.endpoint import split_endpoint
from elasticd.errors import StoreConnectionError, StoreError, StoreTimeout
from elasticd.store.base import check_compare_value, junk_counter

MAX_TXN_OPS = 128  # etcd's default --max-txn-ops
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 2.0
_REACH = 2.0  # seconds one member may take to accept a connection before the next is tried
_QUIET_RACES = 3  # lost compare-and-set races retried at once; then with a random pause
_RACE_PAUSE = 0.02
_HAS_LEADER = (("hasleader", "true"),)  # a member without a leader refuses the call at once
_NO_LEADER = "etcdserver: no leader"
_LEADERLESS_PAUSE = 0.1  # seconds between members that had no leader (an election runs)
_FIRST_ANSWER = 0.5  # seconds a call that may be sent again waits for its first answer
_ANSWER_GROWTH = 1.5  # each wait that long again: a slow answer still comes in the end
_SILENT_MEMBER = 1.0  # seconds without an answer after which such a call goes to another member
_CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 10_000),  # a member gone silent is noticed by calls in flight
    ("grpc.keepalive_timeout_ms", 5_000),
    # a channel of its own connections: a new one (made after a failure) tries at once, where
    # gRPC's shared pool would hand it another channel's connection still backing off and
    # its stale "Connection refused" (for ~1 s, longer the longer the member was away)
    ("grpc.use_local_subchannel_pool", 1),
)
_MOVE_ON = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
}  # the member, not the call, failed
_REFUSALS = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
}
_READY = grpc.ChannelConnectivity.READY

Send = Callable[["_Member", float], Awaitable[Any]]


class _Refused(StoreConnectionError):
    """etcd refused who we are (user, password, permissions) or what we asked: sending it
    again will not help."""


class _Member:
    """A channel to one endpoint, with its stubs and auth token."""

    def __init__(self, endpoint: str, credentials: grpc.ChannelCredentials | None) -> None:
        self.endpoint = endpoint
        self.channel = (
            grpc.aio.insecure_channel(endpoint, _CHANNEL_OPTIONS)
            if credentials is None
            else grpc.aio.secure_channel(endpoint, credentials, _CHANNEL_OPTIONS)
        )
        self.kv = rpc.KVStub(self.channel)
        self.watch = rpc.WatchStub(self.channel)
        self.lease = rpc.LeaseStub(self.channel)
        self.auth = rpc.AuthStub(self.channel)
        self.maintenance = rpc.MaintenanceStub(self.channel)
        self.metadata: tuple[tuple[str, str], ...] | None = None  # None: not authenticated yet

    @property
    def ready(self) -> bool:
        return self.metadata is not None and self.channel.get_state() == _READY

    async def connected(self, budget: float) -> str | None:
        """None once the channel is up; why not, when it failed or took ``budget`` seconds."""
        state = self.channel.get_state(try_to_connect=True)
        try:
            async with asyncio.timeout(budget):
                while state != _READY:
                    if state == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                        return await self._why_down()
                    await self.channel.wait_for_state_change(state)
                    state = self.channel.get_state(try_to_connect=True)
        except TimeoutError:
            return f"no connection within {budget:g}s"
        except grpc.aio.UsageError:  # closed meanwhile: a call that failed on it left it
            return "connection closed"
        return None

    async def _why_down(self) -> str:
        """A call on a channel that is down fails at once with the reason (it is not sent)."""
        try:
            await self.maintenance.Status(rpc.StatusRequest(), timeout=_REACH)
        except grpc.aio.AioRpcError as exc:
            return exc.details() or exc.code().name
        return "connection failed"

    async def close(self, grace: float | None = None) -> None:
        """Close the channel: its calls in flight fail at once, or after ``grace`` seconds
        if they have not ended by then."""
        await self.channel.close(grace)


class EtcdStore:
    """The :class:`~elasticd.store.base.Store` coroutines over an etcd v3 cluster.

    ``endpoints`` are the members' client addresses (HOST:PORT).  TLS when ``ca_file`` (the
    CA that signed the members' certificates) or ``cert_file``/``key_file`` (this client's)
    are given; ``user``/``password`` for etcd's authentication.  Each call has a deadline of
    ``timeout`` seconds (a wait: its own timeout plus that), past which it raises
    StoreTimeout.  A call fails at once with StoreConnectionError when no member can be
    reached; only :meth:`connect` waits for one.
    """

    def __init__(
        self,
        endpoints: list[str],
        *,
        timeout: float,
        ca_file: str = "",
        cert_file: str = "",
        key_file: str = "",
        user: str = "",
        password: str = "",
    ) -> None:
        if not endpoints:
            raise ValueError("no etcd endpoint")
        for endpoint in endpoints:
            split_endpoint(endpoint)
        if bool(cert_file) != bool(key_file):
            raise ValueError("a client certificate needs both cert_file and key_file")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.revision = 0  # the newest store revision any reply showed
        self._credentials = _credentials(ca_file, cert_file, key_file)
        self._user, self._password = user, password
        self._index = 0  # the endpoint calls go to
        self._member: _Member | None = None
        self._choosing = asyncio.Lock()
        self._unreachable = ""  # why the last member tried could not be used
        self._closed = False
        self._retiring: dict[_Member, asyncio.Task[None]] = {}  # silent, with calls in flight

    # -- the store operations -------------------------------------------------------------

    async def get(self, key: str) -> bytes | None:
        return _value(await self._kv("Range", _range(key), resend=True))

    async def set(self, key: str, value: bytes) -> None:
        await self._kv("Put", rpc.PutRequest(key=_key(key), value=value), resend=True)

    async def compare_set(
        self, key: str, expected: bytes | None, desired: bytes
    ) -> tuple[bool, bytes | None]:
        check_compare_value(expected)
        compare = (
            _compare(key, rpc.Compare.CREATE, create_revision=0)
            if expected is None
            else _compare(key, rpc.Compare.VALUE, value=expected)
        )
        reply = await self._txn([compare], [_put(key, desired)], [_op(_range(key))], resend=True)
        if reply.succeeded:
            return True, desired
        current = _value(reply.responses[0].response_range)
        return current == desired, current

    async def add(self, key: str, amount: int) -> int:
        async with self._deadline(self.timeout):
            current = (
                await self._add_one(key)
                if amount == 1
                else await self._kv("Range", _range(key), resend=True)
            )
            if isinstance(current, int):
                return current
            if amount == 0 and current.kvs:  # a read: no write, no new revision
                return _counter(key, _value(current))
            counted = 0

            def count(kv: Any) -> bytes:  # kept as an offset from the version this put makes
                nonlocal counted
                counted = _counter(key, None if kv is None else _shown(kv)) + amount
                return _COUNT + b"%d" % (counted - (kv.version + 1 if kv is not None else 1))

            await self._update(key, current, count)
            return counted

    async def _add_one(self, key: str) -> int | Any:
        """An add of 1 to a counter kept by version (the put bumps it, whoever else adds), or
        that creates one (whoever creates it first: the others bump it); the count, or the
        Range reply of a key that holds something else (a plain count, junk)."""
        bumped = rpc.RequestOp(request_put=rpc.PutRequest(key=_key(key), ignore_value=True))
        while True:
            reply = await self._txn(
                _by_version(key), [bumped, _op(_range(key))], [_op(_range(key))], retry=False
            )
            if reply.succeeded:
                return _counter(key, _value(reply.responses[1].response_range))
            if reply.responses[0].response_range.kvs:
                return reply.responses[0].response_range
            created = await self._txn(
                [_compare(key, rpc.Compare.CREATE, create_revision=0)],
                [_put(key, _COUNT + b"0")],
                [],
                retry=False,
            )
            if created.succeeded:
                return 1

    async def append(self, key: str, value: bytes) -> None:
        async with self._deadline(self.timeout):
            current = await self._kv("Range", _range(key), resend=True)
            await self._update(
                key, current, lambda kv: (kv.value if kv is not None else b"") + value
            )

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        """The values in one Txn per 128 keys, sent together."""
        chunks = [keys[i : i + MAX_TXN_OPS] for i in range(0, len(keys), MAX_TXN_OPS)]
        replies = await gather(
            *(self._txn([], [_op(_range(k)) for k in chunk], [], resend=True) for chunk in chunks)
        )
        return [_value(op.response_range) for reply in replies for op in reply.responses]

    async def delete(self, key: str) -> bool:
        return (await self._kv("DeleteRange", rpc.DeleteRangeRequest(key=_key(key)))).deleted > 0

    async def delete_under(self, prefixes: list[str]) -> int:
        """One range delete a prefix, in one Txn per 128 prefixes."""
        ranges = [
            rpc.RequestOp(
                request_delete_range=rpc.DeleteRangeRequest(
                    key=_key(prefix), range_end=_prefix_end(_key(prefix))
                )
            )
            for prefix in dict.fromkeys(prefixes)
        ]
        deleted = 0
        for i in range(0, len(ranges), MAX_TXN_OPS):
            reply = await self._txn([], ranges[i : i + MAX_TXN_OPS], [])
            deleted += sum(op.response_delete_range.deleted for op in reply.responses)
        return deleted

    async def wait_for(self, key: str, timeout: float) -> bool:
        """True once ``key`` exists, False after ``timeout`` seconds: a read, then a watch
        from the revision after it (started again there on another member if one fails)."""
        ends = asyncio.get_running_loop().time() + max(timeout, 0.0)
        while True:
            current = await self._kv("Range", _range(key), resend=True)
            if current.kvs:
                return True
            if timeout <= 0:
                return False
            watched = await self._watch(key, current.header.revision + 1, ends)
            if watched is not None:
                return watched
            # None: the revisions to watch from were compacted away; read again

    async def close(self) -> None:
        """Close the connection; calls in flight and later fail with StoreConnectionError."""
        self._closed = True
        if self._member is not None:
            member, self._member = self._member, None
            await member.close()
        for member, closing in list(self._retiring.items()):
            await member.close()
            await asyncio.gather(closing, return_exceptions=True)

    # -- extras: leases -------------------------------------------------------------------

    async def lease_grant(self, ttl: float) -> int:
        """A new lease of ``ttl`` seconds (etcd counts whole seconds, and may raise it to its
        minimum); its id."""

        async def send(member: _Member, timeout: float) -> Any:
            return await member.lease.LeaseGrant(
                rpc.LeaseGrantRequest(TTL=max(1, math.ceil(ttl))),
                timeout=timeout,
                metadata=member.metadata,
            )

        reply = await self._call(send)
        if reply.error:
            raise StoreConnectionError(f"etcd did not grant a lease: {reply.error}")
        return reply.ID

    async def lease_keep_alive(self, lease: int) -> bool:
        """Renew the lease for its TTL; False when it is gone (expired or revoked)."""

        async def send(member: _Member, timeout: float) -> Any:
            call = member.lease.LeaseKeepAlive(timeout=timeout, metadata=member.metadata)
            try:
                await call.write(rpc.LeaseKeepAliveRequest(ID=lease))
                return await call.read()
            finally:
                call.cancel()

        reply = await self._call(send)
        return reply is not grpc.aio.EOF and reply.TTL > 0

    async def put_with_lease(self, key: str, value: bytes, lease: int) -> None:
        """``set``, the key deleted when the lease ends (StoreConnectionError if it has)."""
        await self._kv("Put", rpc.PutRequest(key=_key(key), value=value, lease=lease))

    # -- extras: the history ---------------------------------------------------------------

    async def compact(self, revision: int) -> bool:
        """Forget every key's values older than ``revision`` (etcd's Compact: what it keeps
        only for watches that start in the past); False when the history was already
        compacted past it (by another daemon, or by etcd's own auto-compaction).
        ``revision``: this client's newest (``self.revision``, which every reply updates), or
        one before it; a revision etcd has not reached is a StoreError."""
        request = rpc.CompactionRequest(revision=revision)

        async def send(member: _Member, timeout: float) -> bool:
            try:
                await member.kv.Compact(request, timeout=timeout, metadata=member.metadata)
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
                    return False  # "required revision has been compacted"
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:  # "... is a future revision"
                    raise StoreError(f"etcd at {member.endpoint}: {details}") from None
                raise
            return True

        return bool(await self._call(send))

    # -- connecting -----------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a member that serves reads (a daemon may start
        before its etcd cluster has a leader).  A refused user fails at once."""
        backoff = _FIRST_BACKOFF
        problem = ""
        try:
            async with asyncio.timeout(timeout):
                while True:
                    try:
                        await self._kv(
                            "Range", rpc.RangeRequest(key=b"elasticd", count_only=True), resend=True
                        )
                        return
                    except _Refused:
                        raise
                    except StoreError as exc:
                        problem = str(exc)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF)
        except TimeoutError:
            raise StoreConnectionError(
                f"no etcd member of {', '.join(self.endpoints)} answered "
                f"within {timeout:g}s: {problem or 'no answer'}"
            ) from None

    # -- calls ----------------------------------------------------------------------------

    async def _kv(
        self, method: str, request: Any, *, retry: bool = True, resend: bool = False
    ) -> Any:
        """``resend``: the call may be sent again while its first sending may still apply (a
        read, a put of a value, a compare-and-set that reads its own value as a win)."""

        async def send(member: _Member, timeout: float) -> Any:
            return await getattr(member.kv, method)(
                request, timeout=timeout, metadata=(member.metadata or ()) + _HAS_LEADER
            )

        reply = await self._call(send, retry=retry, resend=resend)
        self.revision = max(self.revision, reply.header.revision)
        return reply

    async def _txn(
        self,
        compare: list,
        success: list,
        failure: list,
        *,
        retry: bool = True,
        resend: bool = False,
    ) -> Any:
        return await self._kv(
            "Txn",
            rpc.TxnRequest(compare=compare, success=success, failure=failure),
            retry=retry,
            resend=resend,
        )

    async def _update(self, key: str, current: Any, change: Callable[[Any], bytes]) -> bytes:
        """Write ``change(kv)`` (None: no key) if the key was not written since ``current`` (a
        Range reply) was read; after a lost race, again from the value the Txn read.  Never sent
        twice after a broken connection: it may have been applied."""
        races = 0
        while True:
            kv = current.kvs[0] if current.kvs else None
            new = change(kv)
            unchanged = _compare(key, rpc.Compare.MOD, mod_revision=kv.mod_revision if kv else 0)
            reply = await self._txn([unchanged], [_put(key, new)], [_op(_range(key))], retry=False)
            if reply.succeeded:
                return new
            current = reply.responses[0].response_range
            races += 1
            if races > _QUIET_RACES:  # crowded: spread the writers out
                await asyncio.sleep(random.uniform(0, _RACE_PAUSE))

    async def _watch(self, key: str, start: int, ends: float) -> bool | None:
        """True when the key is put at or after revision ``start``, False at ``ends`` (the
        loop's clock), None when ``start`` was compacted away."""
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=_key(key), start_revision=start, filters=[rpc.WatchCreateRequest.NODELETE]
            )
        )

        async def send(member: _Member, _: float) -> bool | None:
            call = member.watch.Watch(metadata=(member.metadata or ()) + _HAS_LEADER)
            try:
                await call.write(create)
                async with asyncio.timeout_at(ends):
                    while (reply := await call.read()) is not grpc.aio.EOF:
                        if reply.canceled:
                            _watch_canceled(member, reply)
                            return None  # its start was compacted away
                        if any(event.type == rpc.Event.PUT for event in reply.events):
                            return True
            except TimeoutError:
                return False
            finally:
                call.cancel()
            raise StoreConnectionError(f"etcd at {member.endpoint} ended a watch")

        left = ends - asyncio.get_running_loop().time()
        return await self._call(send, deadline=max(left, 0.0) + self.timeout)

    async def _call(
        self,
        send: Send,
        *,
        retry: bool = True,
        resend: bool = False,
        deadline: float | None = None,
    ) -> Any:
        """``send(member, seconds left)`` to a member that answers, within ``deadline``
        seconds; again to the next member when the one it went to failed, if ``retry``, or
        had no leader; again, to the next member where there is one, when it gave no answer
        in time, if ``resend``."""
        deadline = self.timeout if deadline is None else deadline
        clock = asyncio.get_running_loop().time
        async with self._deadline(deadline):
            ends, wait, silent = clock() + deadline, _FIRST_ANSWER, 0.0
            failures = 0
            while failures <= len(self.endpoints):  # every member, and a renewed auth token
                member = await self._chosen()
                try:
                    async with asyncio.timeout(wait if resend else None):
                        return await send(member, ends - clock())
                except TimeoutError:  # no answer yet: sent again, to whichever leader is now
                    if not resend:
                        raise
                    silent, wait = silent + wait, wait * _ANSWER_GROWTH
                    if silent >= _SILENT_MEMBER and len(self.endpoints) > 1:
                        silent = 0.0  # and to another member: this one may be frozen
                        self._move_on(member)  # (which gRPC's keepalive sees in 15 s)
                    continue
                except grpc.aio.AioRpcError as exc:
                    if (exc.details() or "") == _NO_LEADER:  # not applied: safe to send again
                        await self._leave(member)
                        await back_off(_LEADERLESS_PAUSE)
                        continue
                    await self._failed(member, exc.code(), exc.details() or exc.code().name, retry)
                except asyncio.CancelledError:
                    if _cancelled():
                        raise
                    await self._failed(
                        member, grpc.StatusCode.CANCELLED, "connection closed", retry
                    )
                failures += 1
        raise StoreConnectionError(
            f"no etcd member of {', '.join(self.endpoints)} could serve "
            f"the call: {self._unreachable}"
        )

    async def _failed(
        self, member: _Member, code: grpc.StatusCode, details: str, retry: bool
    ) -> None:
        """Returns when the call may be sent again (to the next member, or after a new auth
        token); raises the StoreError it means otherwise."""
        if self._closed:
            raise StoreConnectionError(f"the etcd client for {', '.join(self.endpoints)} is closed")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise StoreTimeout(f"etcd at {member.endpoint}: {details}")
        self._unreachable = f"{member.endpoint}: {details}"
        if code == grpc.StatusCode.UNAUTHENTICATED and self._user:
            member.metadata = None  # the token expired, or the member restarted: a new one
            return
        if code in _REFUSALS:
            raise _Refused(f"etcd at {member.endpoint} refused the call: {details}")
        if code not in _MOVE_ON:
            raise StoreConnectionError(f"etcd at {member.endpoint} failed the call: {details}")
        await self._leave(member)
        if not retry:
            raise StoreConnectionError(
                f"lost etcd at {member.endpoint} during a write that may "
                f"have been applied: {details}"
            )

    async def _chosen(self) -> _Member:
        """The member calls go to: the current one, or the next that accepts a connection
        (and this client's user), each tried once."""
        member = self._member
        if member is not None and member.ready and not self._closed:
            return member
        async with self._choosing:
            for _ in range(len(self.endpoints)):
                if self._closed:
                    raise StoreConnectionError(
                        f"the etcd client for {', '.join(self.endpoints)} is closed"
                    )
                if self._member is None:
                    self._member = _Member(self.endpoints[self._index], self._credentials)
                member = self._member
                try:
                    problem = await member.connected(_REACH)
                    if problem is None and member.metadata is None:
                        problem = await self._authenticate(member)
                except asyncio.CancelledError:
                    if _cancelled():
                        raise
                    problem = "connection closed"  # by a call that failed on it meanwhile
                if problem is None:
                    return member
                self._unreachable = f"{member.endpoint}: {problem}"
                await self._leave(member)
        raise StoreConnectionError(f"cannot reach etcd ({self._unreachable})")

    async def _authenticate(self, member: _Member) -> str | None:
        """Get a token for this client's user (none needed without one); why not, when the
        member could not answer; _Refused when it refused the user."""
        if not self._user:
            member.metadata = ()
            return None
        request = rpc.AuthenticateRequest(name=self._user, password=self._password)
        try:
            reply = await member.auth.Authenticate(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in _MOVE_ON or exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return exc.details() or exc.code().name
            raise _Refused(
                f"etcd at {member.endpoint} refused user {self._user!r}: {exc.details()}"
            ) from None
        member.metadata = (("token", reply.token),)
        return None

    def _next_after(self, member: _Member) -> bool:
        """Calls go to the next member from now on, unless another call moved them from
        ``member`` already (False)."""
        if self._member is not member:
            return False
        self._member = None
        self._index = (self._index + 1) % len(self.endpoints)
        return True

    def _move_on(self, member: _Member) -> None:
        """Calls go to the next member from now on; those in flight on this one (a write
        that cannot be sent twice) keep it until they end, for the store's timeout at most."""
        if not self._next_after(member):
            return
        closing = asyncio.get_running_loop().create_task(member.close(self.timeout))
        self._retiring[member] = closing
        closing.add_done_callback(lambda _: self._retiring.pop(member, None))

    async def _leave(self, member: _Member) -> None:
        """Calls go to the next member from now on (unless another failed call moved them
        already); the channel closes, failing its other calls, which move on too."""
        self._next_after(member)
        await member.close()

    @contextlib.asynccontextmanager
    async def _deadline(self, seconds: float) -> AsyncIterator[None]:
        try:
            async with asyncio.timeout(seconds):
                yield
        except TimeoutError:
            raise StoreTimeout(
                f"etcd ({', '.join(self.endpoints)}): no answer within {seconds:g}s"
            ) from None


def _cancelled() -> bool:
    """Whether this task is being cancelled (or timed out); grpc.aio also raises
    CancelledError in the calls of a channel that closes, which is not that."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _watch_canceled(member: _Member, reply: Any) -> None:
    """Raises for a watch that etcd canceled, unless because its start was compacted."""
    if reply.compact_revision:
        return
    raise StoreConnectionError(
        f"etcd at {member.endpoint} canceled a watch: {reply.cancel_reason or 'no reason given'}"
    )


def _credentials(ca_file: str, cert_file: str, key_file: str) -> grpc.ChannelCredentials | None:
    if not (ca_file or cert_file):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file),
        certificate_chain=_read(cert_file),
    )


def _read(path: str) -> bytes | None:
    if not path:
        return None
    try:
        with open(path, "rb") as file:
            return file.read()
    except OSError as exc:
        raise StoreConnectionError(
            f"cannot read {path} (for TLS to etcd): {exc.strerror}"
        ) from None


def _key(key: str) -> bytes:
    return key.encode()


def _prefix_end(prefix: bytes) -> bytes:
    """The end of the range of keys that start with ``prefix`` (etcd's rule: the prefix with
    its last byte below 0xff raised by one; b"\\0", every key, for a prefix of 0xff only)."""
    stripped = prefix.rstrip(b"\xff")
    return stripped[:-1] + bytes([stripped[-1] + 1]) if stripped else b"\0"


def _range(key: str) -> Any:
    return rpc.RangeRequest(key=_key(key))


def _put(key: str, value: bytes) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=_key(key), value=value))


def _op(request: Any) -> Any:
    return rpc.RequestOp(request_range=request)


def _compare(key: str, target: int, **value: Any) -> Any:
    return rpc.Compare(key=_key(key), target=target, result=rpc.Compare.EQUAL, **value)


def _by_version(key: str) -> list[Any]:
    """Compares that hold when the key is a counter kept by version (see ``add``): its
    value starts with a zero byte, and is longer."""
    return [
        rpc.Compare(
            key=_key(key), target=rpc.Compare.VALUE, result=rpc.Compare.GREATER, value=b"\0"
        ),
        rpc.Compare(key=_key(key), target=rpc.Compare.VALUE, result=rpc.Compare.LESS, value=b"\1"),
    ]


_COUNT = b"\0elasticd-count:"  # and the offset: the count is the offset plus the key's version


def _value(reply: Any) -> bytes | None:
    """The value in a Range reply as the store's users see it; None when the key is missing."""
    return _shown(reply.kvs[0]) if reply.kvs else None


def _shown(kv: Any) -> bytes:
    """A key's value, a counter kept by version as its count in ASCII decimal."""
    if kv.value.startswith(_COUNT):
        offset = kv.value[len(_COUNT) :]
        digits = offset[1:] if offset[:1] == b"-" else offset
        if 0 < len(digits) < 19 and digits.isdigit():
            return b"%d" % (int(offset) + kv.version)
    return kv.value


def _counter(key: str, value: bytes | None) -> int:
    """The count a counter key holds: 0 when it is missing or empty (etcd, unlike TCPStore,
    tells an empty value from none, and an add writes a number over it); NotACounter when it
    holds anything but a plain count."""
    if not value:
        return 0
    junk = junk_counter(key, value)
    if junk is not None:
        raise junk
    return int(value)
