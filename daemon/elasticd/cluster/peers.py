"""Daemon-to-daemon requests (a remote node's logs) over ZeroMQ CURVE.

Each daemon has a CURVE key pair (``<state>/peer.key``, 0600) and serves a ROUTER on
``tcp://<node address>:<peer port>``.  Its public key and endpoint travel in its signed node
record, so a daemon trusts exactly the keys that the cluster key vouches for: the ZAP
policy admits a client only if its public key belongs to a known node, and a client pins
the server key of the node it asks.  Traffic is encrypted and both ends are authenticated;
no shared file system is assumed.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import zmq
import zmq.asyncio
from zmq.utils import z85

from elasticd.endpoint import split_endpoint
from elasticd.errors import ElasticdError, StoreError
from elasticd.wire import protocol, safejson

PEER_DOMAIN = b"elasticd-peer"
_KEY_FILE_BYTES = 4096  # {"public": 40 characters, "secret": 40 characters}

log = logging.getLogger(__name__)


class PeerError(ElasticdError):
    """Another daemon could not be asked."""

    code = "peer_unreachable"


@dataclass(frozen=True)
class PeerKeys:
    public: bytes  # Z85, 40 bytes
    secret: bytes


def load_or_create_keys(path: str) -> PeerKeys:
    """This daemon's CURVE key pair from ``path`` (0600), made there first if there is none.
    A file that is not a key pair (damaged) is moved aside, named in the log, and a new pair
    is made: others learn the public key from this node's signed record anyway."""
    try:
        with open(path, "rb") as f:
            keys = _parse_keys(f.read(_KEY_FILE_BYTES + 1))
        if keys is not None:
            return keys
        aside = f"{path}.corrupt-{time.strftime('%Y%m%dT%H%M%S')}"
        os.replace(path, aside)
        log.error("%s is not a CURVE key pair: moved it to %s and made a new one", path, aside)
    except FileNotFoundError:
        pass
    return _create_keys(path)


def _parse_keys(raw: bytes) -> PeerKeys | None:
    try:
        doc = safejson.loads(raw, max_bytes=_KEY_FILE_BYTES)
    except safejson.Undecodable:
        return None
    if not isinstance(doc, dict):
        return None
    public, secret = doc.get("public"), doc.get("secret")
    if not (_z85_key(public) and _z85_key(secret)):
        return None
    return PeerKeys(public.encode(), secret.encode())


def _z85_key(value: object) -> TypeGuard[str]:
    """A CURVE key as zmq.curve_keypair gives it: 40 characters of Z85."""
    return isinstance(value, str) and len(value) == 40 and value.isascii()


def _create_keys(path: str) -> PeerKeys:
    public, secret = zmq.curve_keypair()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"public": public.decode(), "secret": secret.decode()}, f)
    return PeerKeys(public, secret)


def curve_policy(
    known_keys: Callable[[], dict[bytes, str]],
) -> Callable[[bytes, bytes, list[bytes]], bytes | None]:
    """ZAP policy: admit a CURVE client whose public key is a known node's; its user id is
    that node's name."""

    def policy(mechanism: bytes, address: bytes, credentials: list[bytes]) -> bytes | None:
        if mechanism != b"CURVE" or not credentials:
            return None
        node = known_keys().get(z85.encode(credentials[0]))
        return node.encode() if node else None

    return policy


def router_socket(
    ctx: zmq.asyncio.Context,
    *,
    domain: bytes | None,
    max_message: int,
    hwm: int,
    handshake: float,
    curve_secret: bytes | None,
) -> zmq.asyncio.Socket:
    """A ROUTER as the daemon's servers on TCP have it: authenticated in ``domain`` (its ZAP
    policy admits the callers), CURVE when given a secret, a reply to a peer that went away
    an error rather than a silent drop, messages up to ``max_message`` bytes and ``hwm`` of
    them queued each way, nothing kept at close, a connection that does not authenticate
    within ``handshake`` seconds dropped.  No domain: no ZAP, and no CURVE either."""
    router = ctx.socket(zmq.ROUTER)
    if domain is not None:
        router.setsockopt(zmq.ZAP_DOMAIN, domain)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.MAXMSGSIZE, max_message)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.SNDHWM, hwm)
    router.setsockopt(zmq.RCVHWM, hwm)
    router.setsockopt(zmq.HANDSHAKE_IVL, int(handshake * 1000))
    if curve_secret is not None:
        router.curve_server = True
        router.curve_secretkey = curve_secret
    return router


@dataclass(frozen=True)
class PeerCaller:
    node: str


class PeerClient:
    def __init__(self, ctx: zmq.asyncio.Context, keys: PeerKeys, timeout: float = 15.0) -> None:
        self._ctx = ctx
        self._keys = keys
        self._timeout_ms = int(timeout * 1000)

    async def stream(
        self,
        endpoint: str,
        server_key: str,
        op: str,
        args: dict[str, Any],
        alive: Callable[[], bool] = lambda: True,
    ) -> AsyncIterator[Any]:
        """Results of a streaming request to the daemon at ``endpoint`` until its end.

        The first reply must come within the timeout, and while the node is not lost
        (``alive()``, checked every second: a request to a node that lost power must not
        wait out the timeout once the cluster knows); after that the stream may be quiet
        for as long as ``alive()``, checked once per timeout.
        """
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey = self._keys.secret
        sock.curve_publickey = self._keys.public
        sock.curve_serverkey = server_key.encode()
        sock.connect(endpoint)
        try:
            await sock.send(protocol.encode_request(protocol.Request(uuid.uuid4().hex, op, args)))
            answered, quiet_since = False, time.monotonic()
            while True:
                slice_ms = self._timeout_ms if answered else min(self._timeout_ms, 1000)
                if not await sock.poll(slice_ms):
                    if not alive():
                        raise PeerError(f"no answer from {endpoint} (its node is lost)")
                    if not answered and time.monotonic() - quiet_since >= self._timeout_ms / 1000:
                        raise PeerError(f"no answer from {endpoint}")
                    continue
                answered = True
                reply = protocol.decode_reply(await sock.recv())
                if not reply.ok:
                    raise PeerError(f"{endpoint}: {reply.message}")
                if reply.end:
                    return
                yield reply.result
        finally:
            sock.close(linger=0)


class Probe(enum.Enum):
    UP = "up"  # the daemon accepted a connection
    REFUSED = "refused"  # its host answered with a reset: nothing listens there any more
    SILENT = "silent"  # no answer at all: a partition, a host gone, or a dropping firewall


async def probe(endpoint: str, timeout: float) -> Probe:
    """Does a daemon still listen at ``tcp://host:port``?  One TCP handshake, no ZMTP.

    A killed daemon's port answers with a reset at once, so a node that died is told from a
    node whose workers failed in one round trip, long before its heartbeat is missed.
    """
    try:
        host, port = split_endpoint(endpoint)
        async with asyncio.timeout(timeout):
            _, writer = await asyncio.open_connection(host, port)
    except ConnectionRefusedError:
        return Probe.REFUSED
    except (TimeoutError, OSError, ValueError):
        return Probe.SILENT
    writer.close()
    return Probe.UP


def judged_lost(answer: Probe, heard_meanwhile: bool) -> bool:
    """Silence alone proves nothing (a firewall that drops the peer port looks the same):
    a silent node is lost only if its heartbeat also stood still while we waited for it."""
    return answer is Probe.REFUSED or (answer is Probe.SILENT and not heard_meanwhile)


class NodeView(Protocol):
    """What peers need to know of the other nodes (cluster.NodeService)."""

    async def record(self, name: str) -> Any: ...  # its signed record, or None
    def alive(self, name: str) -> bool: ...
    async def beats(self, names: list[str]) -> dict[str, int | None]: ...  # heartbeat versions now
    @property
    def interval(self) -> float: ...  # seconds between two heartbeats


class PeerLinks:
    """Requests to other nodes by name, with the endpoints and keys of their signed records."""

    def __init__(self, client: PeerClient, nodes: NodeView) -> None:
        self._client = client
        self._nodes = nodes

    async def unreachable(self, nodes: list[str], timeout: float) -> list[str]:
        """The nodes among ``nodes`` whose daemon is gone (unknown nodes count as up)."""
        records = [(node, await self._nodes.record(node)) for node in nodes]
        known = [
            (node, r.peer_endpoint) for node, r in records if r is not None and r.peer_endpoint
        ]
        names = [node for node, _ in known]
        before, asked = await self._beats(names), time.monotonic()
        answers = await asyncio.gather(*(probe(endpoint, timeout) for _, endpoint in known))
        after: dict[str, int | None] = {}
        if Probe.SILENT in answers:  # a heartbeat moves once per interval: give it one
            await asyncio.sleep(max(0.0, asked + self._nodes.interval - time.monotonic()))
            after = await self._beats(names)
        return [
            node
            for node, answer in zip(names, answers)
            if judged_lost(answer, after.get(node) not in (None, before.get(node)))
        ]

    async def _beats(self, names: list[str]) -> dict[str, int | None]:
        """Heartbeat versions; none known when the store does not answer."""
        try:
            return await self._nodes.beats(names)
        except StoreError:
            return {}

    async def logs(self, node: str, args: dict[str, Any]) -> AsyncIterator[Any]:
        record = await self._nodes.record(node)
        if record is None or not record.peer_endpoint:
            raise PeerError(f"node {node} is not known")
        async for result in self._client.stream(
            record.peer_endpoint,
            record.peer_key,
            "logs",
            args,
            alive=lambda: self._nodes.alive(node),
        ):
            yield result
