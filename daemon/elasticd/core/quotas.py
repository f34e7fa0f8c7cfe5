"""What one submit may hold and how many jobs one user may have, pure.

Every daemon of the cluster keeps every job in memory, the store and the history keep its
spec, and ``list`` shows it to everyone: without bounds one user fills them all (80 submits
of 3.6 MiB of arguments each made every user's ``elasticctl list`` fail, and the daemon
hold 1.4 GB, until retention).  So a job's command line and environment are
capped (config keys, counted as ``execve`` counts them), the rest of its spec by fixed
bounds that no real job comes near (name and role: model.validate), and the jobs of one
user that have not ended by ``jobs.max_per_user``.  Each refusal names the limit and the
key that sets it.  The spec's text is valid Unicode (model.validate).

The scheduler's inputs are bounded here too (docs/scheduler.md): the ``--priority`` a user may ask
(PriorityBounds, from the config's scheduler section) and the ``--account`` a user may
charge (a group they are in).  Root and the admin group are bound by neither.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from elasticd.core.model import JobSpec

KiB = 1024
PATH_BYTES = 4096  # python, workdir (PATH_MAX: the kernel refuses a longer path anyway)
NODE_NAMES = 4096  # names in --nodes or --exclude (the largest cluster designed for)
NODE_NAME_BYTES = 255  # a host name is at most 253


@dataclass(frozen=True)
class SubmitLimits:
    argv_bytes: int = 128 * KiB  # jobs.max_argv_bytes
    env_bytes: int = 128 * KiB  # jobs.max_env_bytes
    per_user: int = 100  # jobs.max_per_user: jobs not ended, per user; 0: no limit


def argv_size(argv: Iterable[str]) -> int:
    """Bytes of a command line as ``execve`` counts them: each argument and its NUL."""
    return sum(len(arg.encode()) + 1 for arg in argv)


def env_size(env: Mapping[str, str]) -> int:
    """Bytes of an environment as ``execve`` counts them: ``NAME=VALUE`` and a NUL each."""
    return sum(len(name.encode()) + len(value.encode()) + 2 for name, value in env.items())


def spec_refusal(spec: JobSpec, limits: SubmitLimits) -> str | None:
    """Why ``spec`` is too large to submit (None: it is not)."""
    size = argv_size(spec.argv)
    if size > limits.argv_bytes:
        return (
            f"the job's command line is {size} bytes, over the limit "
            f"(jobs.max_argv_bytes = {limits.argv_bytes}): pass large inputs in a file"
        )
    size = env_size(spec.env)
    if size > limits.env_bytes:
        return (
            f"the job's environment (yours, with --env) is {size} bytes, over the limit "
            f"(jobs.max_env_bytes = {limits.env_bytes}): unset what the job does not need "
            "(env -u NAME elasticctl submit ...)"
        )
    for what, path in (("python", spec.python), ("workdir", spec.workdir)):
        if len(path.encode()) > PATH_BYTES:
            return f"the job's {what} is longer than {PATH_BYTES} bytes"
    for what, names in (("--nodes", spec.nodes), ("--exclude", spec.exclude)):
        if len(names) > NODE_NAMES or any(len(n.encode()) > NODE_NAME_BYTES for n in names):
            return f"{what} may name at most {NODE_NAMES} nodes of at most {NODE_NAME_BYTES} bytes each"
    return None


def count_refusal(user: str, open_jobs: int, limits: SubmitLimits) -> str | None:
    """Why ``user``, who has ``open_jobs`` jobs that have not ended, may not submit another
    (None: they may)."""
    if limits.per_user and open_jobs >= limits.per_user:
        return (
            f"{user} has {open_jobs} jobs that have not ended, the most one user may have "
            f"(jobs.max_per_user = {limits.per_user}): wait for some to end or cancel some"
        )
    return None


@dataclass(frozen=True)
class PriorityBounds:
    """The highest ``--priority`` each user may ask: ``default`` (scheduler.max_priority),
    raised for a user by ``users`` (scheduler.priority_users) and for the members of a group
    by ``groups`` (scheduler.priority_groups).  A priority of 0 or less is always allowed."""

    default: int = 0
    users: Mapping[str, int] = field(default_factory=dict)
    groups: Mapping[str, int] = field(default_factory=dict)

    def of(self, user: str, groups: Iterable[str], is_admin: bool) -> int | None:
        """``user``'s bound: the highest of the default, their own entry and the entries of
        the groups they are in; None (unbounded) for root and the admin group."""
        if is_admin:
            return None
        return max(
            [
                self.default,
                self.users.get(user, self.default),
                *(self.groups.get(group, self.default) for group in groups),
            ]
        )

    def refusal(
        self, priority: int, user: str, groups: Sequence[str], is_admin: bool
    ) -> str | None:
        """Why ``user`` may not ask ``priority`` (None: they may), naming their bound, the
        key it comes from and the keys that raise it."""
        bound = self.of(user, groups, is_admin)
        if bound is None or priority <= max(bound, 0):
            return None
        return (
            f"--priority {priority} is over {bound}, the highest {user} may ask "
            f"({self._source(user, groups, bound)}): an operator raises it with "
            f"scheduler.priority_users.{user} or scheduler.priority_groups.<group>"
        )

    def _source(self, user: str, groups: Sequence[str], bound: int) -> str:
        if self.users.get(user) == bound:
            return f"scheduler.priority_users.{user} = {bound}"
        group = next((g for g in groups if self.groups.get(g) == bound), None)
        if group is not None:
            return f"scheduler.priority_groups.{group} = {bound}"
        return f"scheduler.max_priority = {self.default}"


def account_refusal(account: str, user: str, groups: Sequence[str], is_admin: bool) -> str | None:
    """Why ``user``, who is in ``groups``, may not charge a job to ``account`` (None: they
    may).  An account is a group; root and the admin group may name any."""
    if is_admin or account in groups:
        return None
    return (
        f"--account {account}: {user} may charge jobs only to a group they are in "
        f"({', '.join(groups) or 'none'}); root and the admin group may name any account"
    )
