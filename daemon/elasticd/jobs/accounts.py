"""Accounts (docs/scheduler.md): a job's use is charged to a group of its user.  A spec keeps
``account`` empty when it is the submitter's own group (so a spec at its defaults stays
readable by a daemon of the previous version); this names it."""

from __future__ import annotations

import functools
import grp
import os
from collections.abc import Callable

from elasticd.core.model import JobSpec


def group_name(gid: int) -> str:
    """The group's name on this node (its number as text where there is none)."""
    try:
        return grp.getgrgid(gid).gr_name
    except (KeyError, OverflowError):
        return str(gid)


def group_namer() -> Callable[[int], str]:
    """group_name, each group looked up once: for one pass over many jobs' records."""
    return functools.cache(group_name)


def group_names(user: str, gid: int) -> list[str]:
    """The groups ``user`` is in, by name: ``gid`` (the caller's group) first."""
    try:
        gids = os.getgrouplist(user, gid)
    except OSError:
        gids = []
    return list(dict.fromkeys(group_name(g) for g in (gid, *gids)))


def account_of(spec: JobSpec) -> str:
    """The account ``spec`` is charged to: the one it names, else its group's name."""
    return spec.account or group_name(spec.gid)
