"""Sealed store records: authenticated, bound to the key they are stored under, versioned,
and encrypted when they hold secrets.

    {"v":2,"ver":<n>,"body":<body>,"mac":"<hex HMAC-SHA256>"}   a signed record
    {"v":2,"ver":<n>,"enc":"<base64 nonce + AES-GCM ciphertext>"} a secret one

The MAC (or the AEAD's associated data) covers the store key and the version, so a record
copied under another key, or into another cluster, does not open; readers that keep the
newest version of a key (:class:`Freshness`) refuse an older one written back.  Both keys
are derived from the cluster key (HKDF, with the cluster's name), which lives in a 0600 file.
The canonical form of a body is compact JSON with sorted keys and ASCII escapes, so every
daemon computes the same MAC for the same body.  A record is decoded within bounds
(``safejson``: at most :data:`MAX_RECORD` bytes, nested at most 64 deep), so whatever a
store holds opens or raises TamperedRecord, never anything else.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from elasticd.errors import ConfigError, ElasticdError, TamperedRecord
from elasticd.wire import safejson

T = TypeVar("T")
Refused = Callable[[str, str], None]  # (key, why): a record no daemon acts on; logged and counted

ENVELOPE_VERSION = 2
KEY_CONFIG = "cluster.key_file"
MAX_RECORD = 16 << 20  # bytes: a job's spec (a 4 MiB request at most) encrypted, and room to spare
_KEY_BYTES = 32
_NONCE_BYTES = 12


def canonical_json(body: Any) -> bytes:
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def _derive(key: bytes, purpose: str, cluster: str) -> bytes:
    info = f"elasticd/{ENVELOPE_VERSION}/{purpose}/{cluster}".encode()
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(key)


def subkey(key: bytes, purpose: str, cluster: str) -> bytes:
    """A key of its own for ``purpose`` (the failure detector's MAC), derived from the
    cluster key as the records' keys are: knowing it tells nothing of theirs."""
    if not key:
        raise ValueError("the cluster key is empty")
    return _derive(bytes(key), purpose, cluster)


@dataclass(frozen=True)
class Opened:
    body: Any
    version: int


class Signer:
    """Seals bodies into records for one cluster and opens them again, refusing any that
    was not sealed for the key it is read from."""

    def __init__(self, key: bytes, cluster: str) -> None:
        if not key:
            raise ValueError("the signing key is empty")
        self._mac_key = _derive(bytes(key), "mac", cluster)
        self._aead = AESGCM(_derive(bytes(key), "aead", cluster))

    def seal(self, key: str, body: Any, *, version: int = 0, secret: bool = False) -> bytes:
        """The record for ``body`` at ``key``; ``secret``: encrypted, not only signed."""
        canonical = canonical_json(body)
        context = canonical_json([key, version])
        if secret:
            nonce = os.urandom(_NONCE_BYTES)
            sealed = base64.b64encode(nonce + self._aead.encrypt(nonce, canonical, context))
            return b'{"v":%d,"ver":%d,"enc":"%s"}' % (ENVELOPE_VERSION, version, sealed)
        return b'{"v":%d,"ver":%d,"body":%s,"mac":"%s"}' % (
            ENVELOPE_VERSION,
            version,
            canonical,
            self._mac(context, canonical).encode(),
        )

    def open(self, key: str, raw: bytes) -> Opened:
        """The body and version of the record read at ``key``; TamperedRecord if it is not
        one we sealed for that key.  A signed record in the shape :meth:`seal` writes has its
        MAC checked over the body's bytes as read, before anything is decoded, and only its
        body is decoded (no re-encoding); any other shape takes the general path."""
        parts = _signed_parts(raw)
        if parts is not None:
            signed_version, canonical, signed_mac = parts
            if not hmac.compare_digest(
                signed_mac, self._mac(canonical_json([key, signed_version]), canonical).encode()
            ):
                raise TamperedRecord(
                    "record MAC does not match (forged, or copied from another key)"
                )
            return Opened(_decoded(canonical, "record"), signed_version)
        envelope = _decoded(raw, "record")
        if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
            raise TamperedRecord(f"record is not a version {ENVELOPE_VERSION} envelope")
        version = envelope.get("ver")
        if type(version) is not int or version < 0:
            raise TamperedRecord("record has no version")
        context = canonical_json([key, version])
        if "enc" in envelope:
            return Opened(self._decrypt(envelope["enc"], context), version)
        mac = envelope.get("mac")
        if not isinstance(mac, str) or "body" not in envelope:
            raise TamperedRecord("record has no MAC")
        body = envelope["body"]
        # bytes: compare_digest refuses a str that is not ASCII with a TypeError
        if not hmac.compare_digest(mac.encode(), self._mac(context, canonical_json(body)).encode()):
            raise TamperedRecord("record MAC does not match (forged, or copied from another key)")
        return Opened(body, version)

    def _decrypt(self, sealed: Any, context: bytes) -> Any:
        try:
            blob = base64.b64decode(sealed, validate=True)
            plain = self._aead.decrypt(blob[:_NONCE_BYTES], blob[_NONCE_BYTES:], context)
        except (TypeError, ValueError, binascii.Error, InvalidTag):
            raise TamperedRecord(
                "encrypted record does not open (forged, or copied from another key)"
            ) from None
        return _decoded(plain, "encrypted record")

    def _mac(self, context: bytes, canonical: bytes) -> str:
        return hmac.new(self._mac_key, context + b"\n" + canonical, hashlib.sha256).hexdigest()


_SIGNED_HEAD = b'{"v":%d,"ver":' % ENVELOPE_VERSION
_SIGNED_BODY = b',"body":'
_SIGNED_MAC = b',"mac":"'
_MAC_HEX = 64


def _signed_parts(raw: bytes) -> tuple[int, bytes, bytes] | None:
    """(version, the body's bytes, the MAC) of a record in the exact shape :meth:`Signer.seal`
    writes for a signed one; None for any other bytes."""
    if not isinstance(raw, bytes) or not raw.startswith(_SIGNED_HEAD) or len(raw) > MAX_RECORD:
        return None
    start = len(_SIGNED_HEAD)
    at = raw.find(_SIGNED_BODY, start, start + 19 + len(_SIGNED_BODY))
    digits = raw[start:at]
    if at < 0 or not digits.isdigit() or (len(digits) > 1 and digits[0] == 48):
        return None
    tail = len(raw) - len(_SIGNED_MAC) - _MAC_HEX - 2
    if (
        tail <= at + len(_SIGNED_BODY)
        or raw[tail : tail + len(_SIGNED_MAC)] != _SIGNED_MAC
        or raw[-2:] != b'"}'
    ):
        return None
    return int(digits), raw[at + len(_SIGNED_BODY) : tail], raw[tail + len(_SIGNED_MAC) : -2]


def _decoded(raw: bytes, what: str) -> Any:
    try:
        return safejson.loads(raw, max_bytes=MAX_RECORD)
    except safejson.Undecodable as err:
        raise TamperedRecord(f"{what} is not JSON within bounds: {err}") from None


class Freshness:
    """The newest version of each key that a reader accepted: an older one is a replay."""

    def __init__(self) -> None:
        self._newest: dict[str, int] = {}

    def check(self, key: str, version: int) -> None:
        newest = self._newest.get(key, -1)
        if version < newest:
            raise TamperedRecord(
                f"record is version {version}, older than version {newest} "
                "seen before (written back)"
            )
        self._newest[key] = version

    def forget(self, key: str) -> None:
        self._newest.pop(key, None)

    def newest(self, key: str) -> int:
        """The newest version accepted for ``key`` (-1: none yet)."""
        return self._newest.get(key, -1)


class VersionClock:
    """Versions for a record this daemon rewrites: strictly increasing, and past what an
    earlier run of the daemon wrote (microseconds of the wall clock at the least)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self._wall = wall
        self._last = 0

    def next(self) -> int:
        self._last = max(self._last + 1, int(self._wall() * 1_000_000))
        return self._last


def open_or_refuse(
    signer: Signer,
    key: str,
    raw: bytes | None,
    parse: Callable[[Any], T],
    refused: Refused,
    fresh: Freshness | None = None,
) -> T | None:
    """The record stored at ``key``, opened and parsed; None when there is none, and None
    (reported to ``refused``) when it fails its MAC, is older than one ``fresh`` saw, or
    does not parse."""
    opened = open_version(signer, key, raw, refused, fresh)
    if opened is None:
        return None
    try:
        return parse(opened.body)
    except (ElasticdError, KeyError, TypeError, ValueError, AttributeError) as exc:
        refused(key, f"unreadable: {exc}")
    except Exception as exc:  # whatever a body makes a parser raise, it is the body's refusal
        refused(key, f"unreadable: {type(exc).__name__}: {exc}")
    return None


def open_version(
    signer: Signer, key: str, raw: bytes | None, refused: Refused, fresh: Freshness | None = None
) -> Opened | None:
    """Like :func:`open_or_refuse`, unparsed: the body and its version."""
    if raw is None:
        return None
    try:
        opened = signer.open(key, raw)
        if fresh is not None:
            fresh.check(key, opened.version)
        return opened
    except TamperedRecord as exc:
        refused(key, str(exc))
    return None


class SignedLines(Generic[T]):
    """An append-only log of sealed records, one per line, at one key (join logs, indexes),
    read incrementally: each read parses only the lines appended since the last one.  A
    line that does not open is refused (reported once) and read as None."""

    def __init__(
        self, signer: Signer, key: str, parse: Callable[[Any], T], refused: Refused
    ) -> None:
        self._signer, self.key, self._parse, self._refused = signer, key, parse, refused
        self._raw = b""
        self._records: list[T | None] = []

    def line(self, body: Any) -> bytes:
        return self._signer.seal(self.key, body) + b"\n"

    def fold(self, raw: bytes | None) -> list[T | None]:
        """Every record of the log, given its value just read."""
        raw = raw or b""
        if not raw.startswith(self._raw):  # rewritten (a reset store, or tampering): read it all
            self._raw, self._records = b"", []
        tail = raw[len(self._raw) : raw.rfind(b"\n") + 1]
        self._records.extend(
            open_or_refuse(self._signer, self.key, line, self._parse, self._refused)
            for line in tail.splitlines()
        )
        self._raw += tail
        return list(self._records)


def load_key(path: str) -> bytes:
    """Read the cluster key; refuse a file that group or others may read, or an empty one."""
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            text = file.read().strip()
    except OSError as err:
        raise ConfigError(KEY_CONFIG, f"cannot read {path}: {err.strerror}") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            KEY_CONFIG,
            f"{path} is accessible by group or others (mode {mode & 0o777:o}); chmod 600 it",
        )
    if not text:
        raise ConfigError(KEY_CONFIG, f"{path} is empty")
    try:
        return bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        return text


def create_key(path: str) -> bytes:
    """Write 32 random bytes, hex-encoded, to a new 0600 file (never overwrites)."""
    key = secrets.token_bytes(_KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, key.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return key


def load_or_create_key(path: str) -> bytes:
    """The key in ``path``, created first if there is none (standalone mode)."""
    try:
        return create_key(path)
    except FileExistsError:
        return load_key(path)
