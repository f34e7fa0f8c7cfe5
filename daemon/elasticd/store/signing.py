"""Signed store records: ``{"v":1,"body":...,"mac":"<hex HMAC-SHA256(key, canonical body)>"}``.

The canonical form of a body is compact JSON with sorted keys and ASCII escapes, so every
daemon computes the same MAC for the same body. The cluster key lives in a 0600 file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import stat
from typing import Any, Callable, TypeVar

from elasticd.errors import ConfigError, ElasticdError, TamperedRecord

T = TypeVar("T")
Refused = Callable[[str, str], None]  # (key, why): a record no daemon acts on; logged and counted

ENVELOPE_VERSION = 1
KEY_CONFIG = "cluster.key_file"
_KEY_BYTES = 32


def canonical_json(body: Any) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


class Signer:
    """Seals bodies into signed envelopes and opens them again, refusing tampered ones."""

    def __init__(self, key: bytes) -> None:
        if not key:
            raise ValueError("the signing key is empty")
        self._key = bytes(key)

    def seal(self, body: Any) -> bytes:
        canonical = canonical_json(body)
        return b'{"v":%d,"body":%s,"mac":"%s"}' % (ENVELOPE_VERSION, canonical, self._mac(canonical).encode())

    def open(self, raw: bytes) -> Any:
        """The body of a sealed record; TamperedRecord if it is not one we sealed."""
        try:
            envelope = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as err:
            raise TamperedRecord(f"record is not JSON: {err}") from None
        if not isinstance(envelope, dict) or envelope.get("v") != ENVELOPE_VERSION:
            raise TamperedRecord("record is not a version 1 envelope")
        mac = envelope.get("mac")
        if not isinstance(mac, str) or "body" not in envelope:
            raise TamperedRecord("record has no MAC")
        body = envelope["body"]
        if not hmac.compare_digest(mac, self._mac(canonical_json(body))):
            raise TamperedRecord("record MAC does not match")
        return body

    def _mac(self, canonical: bytes) -> str:
        return hmac.new(self._key, canonical, hashlib.sha256).hexdigest()


def open_or_refuse(signer: Signer, key: str, raw: bytes | None, parse: Callable[[Any], T],
                   refused: Refused) -> T | None:
    """The record stored at ``key``, opened and parsed; None when there is none, and None
    (reported to ``refused``) when it fails its MAC or does not parse."""
    if raw is None:
        return None
    try:
        return parse(signer.open(raw))
    except TamperedRecord as exc:
        refused(key, str(exc))
    except (ElasticdError, KeyError, TypeError, ValueError, AttributeError) as exc:
        refused(key, f"unreadable: {exc}")
    return None


def load_key(path: str) -> bytes:
    """Read the cluster key; refuse a file that group or others may read, or an empty one."""
    try:
        with open(path, "rb") as file:
            mode = os.fstat(file.fileno()).st_mode
            text = file.read().strip()
    except OSError as err:
        raise ConfigError(KEY_CONFIG, f"cannot read {path}: {err.strerror}") from err
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(KEY_CONFIG, f"{path} is accessible by group or others (mode {mode & 0o777:o}); chmod 600 it")
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
