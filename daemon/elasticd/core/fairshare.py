"""Fair share (docs/scheduler.md), pure: usage per account decayed with a half-life, and Slurm's
classic fair-share factor from it.

Usage is node-seconds per account (the caller charges what its jobs held, as sreport
counts).  It decays by half every ``half_life`` (Slurm's PriorityDecayHalfLife, 7 days by
default), so old usage weighs less and nobody is penalised for long.  An account's factor
is ``2 ** (-U / S)``: U its share of all (decayed) usage, S its share of all shares; 1.0
for an account that used nothing, 0.5 for one that used exactly its share, less the more
it used beyond.  Sums are ``math.fsum``, exact whatever the order of the inputs, so the
same usage always gives the same factors (the allocator sorts by them).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

HALF_LIFE = 7 * 86400.0


def decay(
    usage: Mapping[str, float], elapsed: float, half_life: float = HALF_LIFE
) -> dict[str, float]:
    """``usage`` as it stands ``elapsed`` seconds later.  A half-life of 0 or less keeps no
    history (everything decays at once); a negative ``elapsed`` (a clock stepped back)
    decays nothing."""
    if half_life <= 0:
        return {account: 0.0 for account in usage}
    keep = 0.5 ** (max(elapsed, 0.0) / half_life)
    return {account: used * keep for account, used in usage.items()}


def charge(usage: Mapping[str, float], account: str, node_seconds: float) -> dict[str, float]:
    """``usage`` with ``node_seconds`` more used by ``account`` (never less: a negative
    charge is ignored)."""
    out = dict(usage)
    out[account] = out.get(account, 0.0) + max(node_seconds, 0.0)
    return out


def factor(
    usage: Mapping[str, float],
    shares: Mapping[str, float] | None = None,
    accounts: Iterable[str] = (),
) -> dict[str, float]:
    """The fair-share factor of every account named in ``usage``, ``shares`` or
    ``accounts``, in (0, 1]; higher goes first.  An account without a share has 1 (equal
    shares by default); one whose share is 0 gets 0 once anything at all was used."""
    shares = shares or {}
    names = sorted(set(usage) | set(shares) | set(accounts))
    total_use = math.fsum(max(usage.get(a, 0.0), 0.0) for a in names)
    total_share = math.fsum(max(shares.get(a, 1.0), 0.0) for a in names)
    return {
        a: _factor(
            max(usage.get(a, 0.0), 0.0), total_use, max(shares.get(a, 1.0), 0.0), total_share
        )
        for a in names
    }


def _factor(used: float, total_use: float, share: float, total_share: float) -> float:
    if total_use <= 0 or used <= 0:
        return 1.0
    if share <= 0 or total_share <= 0:
        return 0.0
    return math.pow(2.0, -(used / total_use) / (share / total_share))
