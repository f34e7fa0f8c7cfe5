"""Store backends (docs/store.md): the protocols, the daemon's TCPStore client, the c10d
TCPStore server, the etcd client, an in-memory store, signing.

Only ``elasticd.store.c10d`` uses torch (the server a store host runs, and torch's blocking
client), and imports it lazily: a daemon that does not host the store never loads torch.
Only ``elasticd.store.etcd`` uses gRPC; it is not imported here, so that only the daemons of
an etcd cluster load it.
"""

from elasticd.store.base import StoreBackend
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer, create_key, load_key, load_or_create_key

__all__ = ["MemoryStore", "Signer", "StoreBackend", "create_key", "load_key", "load_or_create_key"]
