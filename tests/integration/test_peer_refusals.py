"""Refused handshakes on the peer port are counted, and logged in a few lines (docs/security.md,
"Between daemons"): 1500 CURVE handshakes with the node's public key (it is in its node record) and keys
that are no node's gave 1500 WARNING lines.  Now: the first is logged, every one is counted
(elasticd_peer_refused_total), and one line per interval (log.summary_interval; 60 s by
default, a few seconds here) sums up the rest."""

from __future__ import annotations

import json
import re
import time
import uuid

import zmq
from harness import Daemon, free_port
from store_attack import metric, wait_for

HANDSHAKES = 1500
BATCH = 100
REFUSED = "elasticd_peer_refused_total"
INTERVAL = 3.0  # log.summary_interval: seconds between the lines that sum the refusals up


def handshake_flood(port: int, server_key: bytes, count: int, daemon: Daemon) -> None:
    """``count`` CURVE handshakes, each with a fresh key pair that is no node's, a batch of
    sockets at a time (each batch waits until the daemon has refused all of it)."""
    ctx = zmq.Context()
    try:
        for start in range(0, count, BATCH):
            sockets = []
            for _ in range(min(BATCH, count - start)):
                public, secret = zmq.curve_keypair()
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RECONNECT_IVL, -1)  # one handshake per socket
                sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = (
                    server_key,
                    public,
                    secret,
                )
                sock.connect(f"tcp://127.0.0.1:{port}")
                sockets.append(sock)
            wanted = start + len(sockets)
            wait_for(lambda: metric(daemon, REFUSED) >= wanted, 120, f"{wanted} refused handshakes")
            for sock in sockets:
                sock.close()
    finally:
        ctx.term()


def test_a_flood_of_refused_handshakes_is_counted_and_summed_up(daemon_factory, shared_tmp):
    config = shared_tmp / "summary.toml"
    port = free_port()  # the peer port (the tier's data plane listens too, on any port)
    config.write_text(f"[log]\nsummary_interval = {INTERVAL}\n[node]\npeer_port = {port}\n")
    daemon = daemon_factory(
        f"pr-{uuid.uuid4().hex[:6]}", metrics_port=free_port(), args=("--config", str(config))
    ).start()
    server_key = json.loads((daemon.state_dir / "peer.key").read_text())["public"].encode()
    started = time.monotonic()
    handshake_flood(port, server_key, HANDSHAKES, daemon)
    assert metric(daemon, REFUSED) == HANDSHAKES  # every one counted
    lines = refusal_lines(daemon)
    # the lines are at least an interval apart: the first, then at most one per interval
    # (within the first interval: the first alone)
    assert len(lines) <= 1 + (time.monotonic() - started) // INTERVAL, lines
    assert re.search(r"WARNING .*: refused a elasticd-peer connection from 127\.0\.0\.1 ", lines[0])

    # every refusal is told: in a line of its own, or counted in a later line (the summary
    # once an interval is over, or the next refusal's "(N more since the last such line)")
    wait_for(lambda: told(daemon) == HANDSHAKES, 150, "the summary of the other refusals")
    lines = refusal_lines(daemon)
    elapsed = time.monotonic() - started
    assert 2 <= len(lines) <= 1 + elapsed // INTERVAL, (elapsed, lines)
    assert daemon.ctl("nodes")[0]["state"] == "up"  # and the daemon serves on


def refusal_lines(daemon: Daemon) -> list[str]:
    return [
        line
        for line in daemon.log_path.read_text(errors="replace").splitlines()
        if "refused" in line and "peer" in line
    ]


def told(daemon: Daemon) -> int:
    """The refusals the log tells of: a line each, plus the counts of those held back."""
    lines = refusal_lines(daemon)
    alone = [line for line in lines if "refused a elasticd-peer connection" in line]
    held = sum(
        int(n)
        for line in alone
        for n in re.findall(r"\((\d+) more since the last such line\)", line)
    )
    summed = sum(
        int(n)
        for line in lines
        for n in re.findall(
            rf"refused (\d+) more elasticd-peer connections in the last {INTERVAL:g} s "
            r"\(the newest from 127\.0\.0\.1\)",
            line,
        )
    )
    return len(alone) + held + summed
