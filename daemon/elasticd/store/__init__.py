"""Store backends (docs/store.md): the protocols, the daemon's TCPStore client and server, the
etcd client, an in-memory store, signing.

The daemon never loads torch: it hosts and reaches a c10d TCPStore with its own server
(``tcpserver``) and client (``tcpstore``).  Only ``elasticd.store.c10d``, torch's blocking
client for tests and tools, imports torch (lazily).
Only ``elasticd.store.etcd`` uses gRPC; it is not imported here, so that only the daemons of
an etcd cluster load it.
"""

from elasticd.store.base import StoreBackend
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer, create_key, load_key, load_or_create_key

__all__ = ["MemoryStore", "Signer", "StoreBackend", "create_key", "load_key", "load_or_create_key"]
