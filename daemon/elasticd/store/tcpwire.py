"""TCPStore's wire vocabulary, shared by our client (``tcpstore``) and server (``tcpserver``):
torch's ``TCPStoreBackend.hpp`` (torch 2.13).  A request is a one-byte query type and its
arguments; byte strings are a little-endian uint64 length and the bytes, integers
little-endian."""

from __future__ import annotations

import enum
import struct

MAGIC = 0x3C85F7CE  # VALIDATE's argument: what a TCPStore client opens with


class Query(enum.IntEnum):  # QueryType, in its order
    VALIDATE = 0
    SET = 1
    COMPARE_SET = 2
    GET = 3
    ADD = 4
    CHECK = 5
    WAIT = 6
    GETNUMKEYS = 7
    DELETE_KEY = 8
    APPEND = 9
    MULTI_GET = 10
    MULTI_SET = 11
    CANCEL_WAIT = 12
    PING = 13
    QUEUE_PUSH = 14
    QUEUE_POP = 15
    QUEUE_LEN = 16
    LIST_KEYS = 17
    BARRIER = 18


READY, NOT_READY = 0, 1  # CheckResponseType
STOP_WAITING, WAIT_CANCELED = 0, 1  # WaitResponseType


def blob(data: bytes) -> bytes:
    """A byte string as the protocol frames it."""
    return struct.pack("<Q", len(data)) + data
