"""TCPStore servers for tests, each in a child process: ours (``TCPStoreServer``, what a daemon
hosts) and torch's libuv server (the reference our protocol is checked against).

A child, because torch's blocking client holds the GIL while it waits for an answer: with
our server on a thread of the same process, neither would move.  The child ends with the
test process (it is killed when its stdin closes) or at :meth:`ServerProcess.close`.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

from elasticd.endpoint import join_endpoint
from elasticd.errors import StoreConnectionError

SERVERS = ("elasticd", "torch")

_PRELUDE = """
import sys, threading, os
host, port = sys.argv[1], int(sys.argv[2])
"""
_SERVE = {
    "elasticd": """
from elasticd.store.tcpserver import TCPStoreServer
try:
    server = TCPStoreServer(host, port)
except Exception as exc:
    print("error:", exc, flush=True)
    sys.exit(1)
""",
    "torch": """
import socket
from datetime import timedelta
from torch.distributed import TCPStore
try:
    sock = socket.create_server((host, port))
    server = TCPStore(host, sock.getsockname()[1], None, True, timedelta(seconds=30),
                      wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)
except Exception as exc:
    print("error: cannot host the store on", f"{host}:{port}:", exc, flush=True)
    sys.exit(1)
""",
}
_WAIT = """
print(server.port, flush=True)
sys.stdin.read()  # until the test process closes it (or dies)
os._exit(0)
"""


class ServerProcess:
    """A store server (``kind``: one of SERVERS) at ``host:port`` (0: any free port)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, kind: str = "elasticd") -> None:
        self.host = host
        self.kind = kind
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _PRELUDE + _SERVE[kind] + _WAIT, host, str(port)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"},
        )
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline().strip() if ready else "error: no answer in 120 s"
        if not line.isdigit():
            self.close()
            raise StoreConnectionError(line.removeprefix("error: "))
        self.port = int(line)

    @property
    def endpoint(self) -> str:
        return join_endpoint(self.host, self.port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self) -> None:
        """Stop serving: the process is gone when this returns."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()
