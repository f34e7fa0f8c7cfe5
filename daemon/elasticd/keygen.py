"""``elasticd keygen FILE``: a new random cluster key, to copy to every node."""

from __future__ import annotations

import argparse
import os
import sys

from elasticd.store.signing import create_key

COMMAND = "keygen"


def main(argv: list[str]) -> int:
    return keygen(parse_keygen_args(argv).file)


def parse_keygen_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog=f"elasticd {COMMAND}",
        description="Write a new random cluster key to FILE (mode 0600), in the form the store "
        "host makes one.  An existing FILE is never overwritten.  Copy the file to "
        "every node of the cluster and point cluster.key_file (or elasticd "
        "--cluster-key) at it.",
    )
    p.add_argument("file", metavar="FILE", help="where to write the key (its directory must exist)")
    return p.parse_args(argv)


def keygen(path: str) -> int:
    """``elasticd keygen FILE``: a new cluster key in a new 0600 file; 1 if it cannot be made."""
    try:
        create_key(path)
    except FileExistsError:
        return _keygen_failed(
            f"{path} already exists; not overwriting it (a cluster's nodes "
            "must share one key: copy that file, or remove it first)"
        )
    except FileNotFoundError:
        return _keygen_failed(
            f"cannot create {path}: the directory "
            f"{os.path.dirname(os.path.abspath(path))} does not exist"
        )
    except OSError as exc:
        return _keygen_failed(f"cannot create {path}: {exc.strerror}")
    print(
        f"wrote a new cluster key to {path} (mode 0600); copy it to every node of the cluster "
        "(elasticd --cluster-key FILE, or cluster.key_file in the config)"
    )
    return 0


def _keygen_failed(message: str) -> int:
    print(f"elasticd {COMMAND}: {message}", file=sys.stderr)
    return 1
