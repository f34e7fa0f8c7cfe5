"""Local users and groups made for one test (useradd, groupadd) and removed after it.

Names carry a random tag, so that tests that run at once (pytest-xdist, or two runs on one
host) never share a user; each user gets a group of its own (useradd's default), no home
directory and no login shell.  ``account()`` runs one useradd/userdel/groupadd/groupdel at a
time on the host: they lock /etc/passwd and, finding it locked, retry after a second.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from hostwide import host_lock


def account(*argv: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
    """Run ``argv`` (useradd, userdel, groupadd, groupdel) while no other test does."""
    with host_lock("accounts"):
        return subprocess.run(argv, check=check, capture_output=True)


@contextmanager
def local_users(*roles: str, admin_group: bool = False) -> Iterator[dict[str, str]]:
    """``{role: user name}`` for each role, plus ``{"admins": group}`` (the users whose role
    starts with "admin" are its members) when ``admin_group``; all removed at the end."""
    tag = uuid.uuid4().hex[:6]
    names = {role: f"e24{role[:8]}{tag}" for role in roles}
    group = f"e24adm{tag}"
    made: list[str] = []
    try:
        if admin_group:
            account("groupadd", group)
        for role, name in names.items():
            extra = ["-G", group] if admin_group and role.startswith("admin") else []
            account("useradd", "-M", "-U", "-s", "/usr/sbin/nologin", *extra, name)
            made.append(name)
        yield {**names, **({"admins": group} if admin_group else {})}
    finally:  # -f: a test that failed may leave their jobs running until its daemons stop
        for name in made:
            account("userdel", "-f", name, check=False)
        if admin_group:
            account("groupdel", group, check=False)
