"""A rendezvous participant in its own process, behaving like a minimal agent.

Loop: join; print {"event": "formed", ...}; watch the round; print {"event": "watch", ...};
on waiting nodes ask for a scale-up round; on a superseded round join again; stop when closed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for the blocking adapter
from blocking_rendezvous import BlockingRendezvous

from elasticd.rendezvous import RendezvousSettings
from elasticd.store.c10d import connect
from elasticd.store.signing import Signer, load_key


def say(**event) -> None:
    print(json.dumps(event), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    for name in ("endpoint", "prefix", "node", "key_file"):
        parser.add_argument(name)
    parser.add_argument("min_nodes", type=int)
    parser.add_argument("max_nodes", type=int)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--last-call", type=float, default=0.3)
    parser.add_argument("--nproc", type=int, default=1)
    args = parser.parse_args()

    settings = RendezvousSettings(
        "job",
        args.min_nodes,
        args.max_nodes,
        join_timeout=60.0,
        last_call_timeout=args.last_call,
        keep_alive_interval=args.interval,
    )
    store = connect(args.endpoint, connect_timeout=30.0)
    handler = BlockingRendezvous(
        store,
        Signer(load_key(args.key_file), "c"),
        settings,
        args.node,
        f"{args.node}.addr",
        prefix=args.prefix,
    )
    while True:
        info = handler.next_rendezvous(args.nproc, 29400)
        say(
            event="formed",
            round=info.round,
            reason=info.reason,
            group_rank=info.group_rank,
            members=[m.node for m in info.members],
            world_size=info.world_size,
        )
        event = handler.watch(info.round).result()
        say(event="watch", kind=event.kind, reason=event.reason, waiting=event.waiting)
        if event.kind == "closed":
            handler.shutdown(wait=True)
            return 0
        if event.kind == "waiting":
            handler.request_next_round(info.round, "scale_up")


if __name__ == "__main__":
    sys.exit(main())
