"""Local users and groups made for one test (useradd, groupadd) and removed after it.

Names carry a random tag, so that two runs on one host never share a user; each user gets
a group of its own (useradd's default), no home directory and no login shell.
"""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager


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
            subprocess.run(["groupadd", group], check=True)
        for role, name in names.items():
            extra = ["-G", group] if admin_group and role.startswith("admin") else []
            subprocess.run(
                ["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", *extra, name], check=True
            )
            made.append(name)
        yield {**names, **({"admins": group} if admin_group else {})}
    finally:  # -f: a test that failed may leave their jobs running until its daemons stop
        for name in made:
            subprocess.run(["userdel", "-f", name], check=False)
        if admin_group:
            subprocess.run(["groupdel", group], check=False)
