"""``host:port`` as written in configs and records: one parser, one printer (stdlib-only)."""

from __future__ import annotations

from elasticd.wire.numbers import is_whole


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``host:port``, ``[v6addr]:port`` or ``tcp://…`` -> (host, port); ValueError otherwise."""
    text = endpoint.removeprefix("tcp://")
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address must be bracketed, or the port is ambiguous
        raise ValueError(f"{endpoint!r}: write an IPv6 address as [ADDR]:PORT")
    if not sep or not host or not is_whole(port) or int(port) > 65535:
        raise ValueError(f"{endpoint!r} is not HOST:PORT")
    return host, int(port)


def join_endpoint(host: str, port: int) -> str:
    """(host, port) -> ``host:port``, with an IPv6 address bracketed."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
