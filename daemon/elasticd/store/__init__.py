"""Store backends (DESIGN §4): the protocol, an in-memory store, the c10d TCPStore, signing.

``elasticd.store.c10d`` imports torch lazily, so importing this package stays cheap.
"""

from elasticd.store.base import StoreBackend
from elasticd.store.memory import MemoryStore
from elasticd.store.signing import Signer, load_key, load_or_create_key, create_key

__all__ = ["StoreBackend", "MemoryStore", "Signer", "load_key", "create_key", "load_or_create_key"]
