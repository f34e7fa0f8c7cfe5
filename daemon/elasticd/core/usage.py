"""Usage records (Slurm's sacct and sreport; docs/scheduler.md), pure: what each job held on each
node and for how long, from its record, and the totals that ``elasticctl usage`` shows and
the allocator's fair share (core/fairshare.py) reads.

A *span* is one node's share of one job while its workers ran: from the first time that
node's part ran a round (``Part.ran``) to its last report once the part ended
(``Part.updated`` of a SUCCEEDED, FAILED, STOPPED or LEFT part), with the slots and GPUs
the part held there (``Part.slots``, ``Part.gpus``: what placement gave it, whatever the
workers did with them).  It is charged to the job's user and account (``JobSpec.account``;
"" is the user's primary group, named by ``spec.gid`` through a resolver the caller passes).

What the records cannot say, and what is charged instead:

* Waiting is free: a node whose part waits in the rendezvous holds its slots but is charged
  only once its workers run (in place: from the first warm-up, before any round), as Slurm
  charges a job from its start.  A part between rounds (RESTARTING) is
  charged: the job still holds the node.
* One part per node: a record keeps each node's latest part.  A node that left a job and
  took it again (a shrink then a grow, a drain then an undrain, a restarted daemon) would
  lose its earlier span; the registry carries it into the new part (``carried``, at most
  ``MAX_BEFORE`` of them: beyond, the two closest are merged, their gap charged too).
  A node whose registry lost the old part (its history gone) loses those spans.
* A part that never said it ended: a node lost for good (its daemon killed, its host
  gone) leaves its last report, RUNNING, say.  Its span ends at the earliest report of a
  part in a later round (the survivors re-formed without it: at or a little after they
  did), or when the job ended, whichever comes first; with neither, it runs on.  (A part
  between rounds while the others already run the next looks the same for that moment;
  once it runs the next round too, its span is whole again.)  A daemon that restarts
  reports its old part LEFT at its restart: the time it was down is charged.
* Parts of daemons older than these fields (``ran`` is None and ``slots`` is None) are
  charged from the job's first start (``Part.started``) if they ran a round, with their
  workers as slots and GPUs only for ``--nproc-per-node gpu``: an overcharge for a node
  that joined late, GPUs unknown otherwise.

Times are wall-clock seconds as the nodes wrote them; a clock stepped back makes a span
shorter, never negative.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from typing import Any

from elasticd.core.model import GPU, NEW_PART, PartState
from elasticd.core.records import JobRecord, Part

MAX_BEFORE = 32  # earlier spans one node's part carries
BY = ("user", "account")
_RAN = frozenset({PartState.RUNNING, PartState.BARRIER, PartState.SUCCEEDED})


@dataclass(frozen=True)
class Span:
    job: str
    node: str
    user: str
    account: str
    start: float
    end: float | None  # None: it runs
    slots: int
    gpus: int

    def clipped(self, since: float, until: float) -> float:
        """Seconds of the span within [since, until] (a running span runs until ``until``)."""
        end = until if self.end is None else min(self.end, until)
        return max(0.0, end - max(self.start, since))


@dataclass(frozen=True)
class Total:
    node_seconds: float = 0.0
    slot_seconds: float = 0.0
    gpu_seconds: float = 0.0
    jobs: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "node_seconds": self.node_seconds,
            "slot_seconds": self.slot_seconds,
            "gpu_seconds": self.gpu_seconds,
            "jobs": self.jobs,
        }


def spans(record: JobRecord, group_name: Callable[[int], str] = str) -> list[Span]:
    """Every span of the job, by node then start.  ``group_name(gid)`` names the account of
    a job submitted without one (its user's primary group); the default, the number, is
    what ``ls -l`` shows for a group without a name."""
    spec = record.spec
    account = spec.account or group_name(spec.gid)
    found: list[Span] = []
    for node in sorted(record.parts):
        part = record.parts[node]
        shares = [_earlier(span) for span in part.before] + [_current(record, part)]
        found += sorted(
            (Span(spec.id, node, spec.user, account, *share) for share in shares if share),
            key=lambda s: s.start,
        )
    return found


def totals(
    spans: Iterable[Span], *, since: float, until: float, by: str = "user"
) -> dict[str, Total]:
    """Node-, slot- and GPU-seconds and jobs per user or per account (``by``) within
    [since, until]: each span clipped to it (one that runs, up to ``until``: keep it at
    most now).  A job counts for a key when one of its spans has time in the window."""
    if by not in BY:
        raise ValueError(f"by must be one of {', '.join(BY)}, got {by!r}")
    seconds: dict[str, list[tuple[float, float, float]]] = {}
    jobs: dict[str, set[str]] = {}
    for span in spans:
        held = span.clipped(since, until)
        if held > 0:
            key = getattr(span, by)
            seconds.setdefault(key, []).append((held, held * span.slots, held * span.gpus))
            jobs.setdefault(key, set()).add(span.job)
    found: dict[str, Total] = {}
    for key, rows in sorted(seconds.items()):
        nodes, slots, gpus = zip(*rows)
        found[key] = Total(math.fsum(nodes), math.fsum(slots), math.fsum(gpus), len(jobs[key]))
    return found


def decayed(spans: Iterable[Span], now: float, half_life: float) -> dict[str, float]:
    """Node-seconds per account as of ``now``, each second used at t weighing
    ``2 ** (-(now - t) / half_life)``: over a span [s, e] the integral
    ``h / ln 2 * 2 ** (-(now - e) / h) * (1 - 2 ** (-(e - s) / h))``, exactly (what
    fairshare.decay would give had every second been charged as it passed).  Time after
    ``now`` is not used yet; a half-life of 0 or less keeps no history (all 0.0)."""
    used: dict[str, list[float]] = {}
    for span in spans:
        end = now if span.end is None else min(span.end, now)
        length = max(0.0, end - span.start)
        weight = _integral(now - end, length, half_life) if half_life > 0 else 0.0
        used.setdefault(span.account, []).append(weight)
    return {account: math.fsum(weights) for account, weights in sorted(used.items())}


_NOTHING = 1e-9  # node-seconds: a job's weight decayed below this is forgotten


class UsageSums:
    """``decayed`` of every job's spans, kept as running sums: what the fair share reads at
    every plan without reading the history again.  ``update`` takes each record as it
    changes; its ended spans go into one sum per account, held at a reference time and
    decayed as a whole (a span's weight at ``now`` is its weight at the reference time
    times ``2 ** (-(now - ref) / half_life)``); the spans still running are kept apart and
    weighed at each ``at``.  A job forgotten (pruned) keeps what it used, as Slurm's usage
    outlives its job records.  Equal to ``decayed`` up to rounding."""

    REBASE = 64.0  # half-lives: the reference time moves on before its factors overflow

    def __init__(self, half_life: float, group_name: Callable[[int], str] = str) -> None:
        self.half_life = half_life
        self._group_name = group_name
        self._ref: float | None = None
        self._sums: dict[str, float] = {}  # account -> ended spans' weight at ``_ref``
        self._ended: dict[str, tuple[str, float]] = {}  # job -> its account and that weight
        self._running: dict[str, list[Span]] = {}  # job -> its spans not ended at its update
        self._pruned = 0  # jobs kept after the last pruning

    def update(
        self, record: JobRecord, now: float, group_name: Callable[[int], str] | None = None
    ) -> None:
        """Take ``record`` (a job's latest) into the sums; ``now``: when it was read;
        ``group_name``: in place of the one given at the start (a pass's own cache)."""
        if self.half_life <= 0:
            return
        ended: list[Span] = []
        running: list[Span] = []
        for span in spans(record, group_name or self._group_name):
            (ended if span.end is not None and span.end <= now else running).append(span)
        if self._ref is None:
            self._ref = now
        elif (
            now - self._ref > self.REBASE * self.half_life
            or len(self._ended) > 2 * self._pruned + 1024
        ):
            self._rebase(now)  # the jobs kept: at most twice those that still weigh
        weight = math.fsum(self._weight(s.start, s.end) for s in ended if s.end is not None)
        account = ended[0].account if ended else ""
        before = self._ended.pop(record.id, None)
        if before is not None:
            self._add(before[0], -before[1])
        if weight > 0:
            self._ended[record.id] = (account, weight)
            self._add(account, weight)
        if running:
            self._running[record.id] = running
        else:
            self._running.pop(record.id, None)

    def at(self, now: float) -> dict[str, float]:
        """Node-seconds per account as of ``now`` (``decayed``'s answer)."""
        if self.half_life <= 0 or self._ref is None:
            return {}
        if now - self._ref > self.REBASE * self.half_life:
            self._rebase(now)
        keep = 2.0 ** (-(now - self._ref) / self.half_life)
        used = {account: weight * keep for account, weight in self._sums.items()}
        live = decayed((s for found in self._running.values() for s in found), now, self.half_life)
        for account, weight in live.items():
            used[account] = used.get(account, 0.0) + weight
        return dict(sorted(used.items()))

    def _weight(self, start: float, end: float) -> float:
        """The weight at ``_ref`` of the seconds from ``start`` to ``end``."""
        assert self._ref is not None
        length = max(0.0, end - start)
        if length <= 0:
            return 0.0
        rate = math.log(2) / self.half_life
        return math.exp(-rate * (self._ref - end)) * -math.expm1(-rate * length) / rate

    def _add(self, account: str, weight: float) -> None:
        total = self._sums.get(account, 0.0) + weight
        self._sums[account] = total if total >= _NOTHING else 0.0  # not a rounding's residue

    def _rebase(self, now: float) -> None:
        """Move the reference time to ``now``; forget the jobs whose weight decayed to
        nothing (what each added stays in its account's sum; should its record change
        again, its new weight is added)."""
        assert self._ref is not None
        keep = 2.0 ** (-(now - self._ref) / self.half_life)
        self._sums = {a: w * keep for a, w in self._sums.items()}
        self._ended = {
            j: (a, w * keep) for j, (a, w) in self._ended.items() if w * keep >= _NOTHING
        }
        self._ref, self._pruned = now, len(self._ended)


def _integral(age: float, length: float, half_life: float) -> float:
    """The decayed weight of ``length`` seconds that ended ``age`` seconds ago."""
    if length <= 0:
        return 0.0
    rate = math.log(2) / half_life
    exact = math.exp(-rate * age) * -math.expm1(-rate * length) / rate
    return min(exact, length)  # never more than undecayed (it is not, but for rounding)


def carried(old: Part | None, new: Part) -> Part:
    """``new``, this node's next report of its part of a job, with the spans its earlier
    parts of the job left: a new agent's part (it starts at RENDEZVOUS after the old one
    ended) takes the old one's span along with what that carried; a report of the same
    part keeps what it carries."""
    if old is None:
        return new
    before = old.before
    if new.state is NEW_PART and not old.state.active:
        ended = _own(old)
        if ended is not None and ended[1] is not None:
            before = _bounded(before + ((ended[0], ended[1], ended[2], ended[3]),))
    return new if new.before == before else replace(new, before=before)


def _bounded(before: tuple[tuple[Any, ...], ...]) -> tuple[tuple[Any, ...], ...]:
    """At most MAX_BEFORE spans: the two closest in time (the smallest gap) become one,
    charged over the gap too, with the larger of their slots and GPUs."""
    spans = sorted(before, key=lambda s: s[0])
    while len(spans) > MAX_BEFORE:
        i = min(range(len(spans) - 1), key=lambda k: spans[k + 1][0] - spans[k][1])
        a, b = spans[i], spans[i + 1]
        spans[i : i + 2] = [(a[0], max(a[1], b[1]), max(a[2], b[2]), max(a[3], b[3]))]
    return tuple(spans)


def _earlier(span: Any) -> tuple[float, float, int, int] | None:
    """A carried span, if it is one (a record of another version may hold anything)."""
    if not isinstance(span, (tuple, list)) or len(span) != 4:
        return None
    start, end, slots, gpus = _time(span[0]), _time(span[1]), _count(span[2]), _count(span[3])
    if start is None or end is None:
        return None
    return start, max(start, end), slots, gpus


def _current(record: JobRecord, part: Part) -> tuple[float, float | None, int, int] | None:
    """The span of the node's latest part, if it ran."""
    own = _own(part, record.spec.nproc_per_node)
    if own is None:
        return None
    start, end, slots, gpus = own
    if end is None:
        end = _silent_end(record, part)
    return start, None if end is None else max(start, end), slots, gpus


def _own(part: Part, nproc: int | str = 0) -> tuple[float, float | None, int, int] | None:
    """(start, end as the part says it: None while active, slots, GPUs), or None if it
    never ran.  ``nproc``: the job's ``--nproc-per-node``, for a part of an older daemon."""
    if part.slots is None and part.ran is None:
        ran = part.round is not None or part.state in _RAN
        start = _time(part.started) if ran else None
        slots = len(part.workers) or _count(nproc)
        gpus = slots if nproc == GPU else 0
    else:
        start, slots, gpus = _time(part.ran), _count(part.slots), _count(part.gpus)
    if start is None:
        return None
    return start, None if part.state.active else _time(part.updated), slots, gpus


def _silent_end(record: JobRecord, part: Part) -> float | None:
    """When an active part's node stopped running the job, as far as the record tells: the
    job's end; or, for a part of an earlier round than other parts, the earliest report of
    a part in a later round (its survivors re-formed without it); else it runs (None)."""
    ends = []
    if record.outcome is not None:
        ends.append(_time(record.outcome.ended))
    if part.round is not None:
        ends += [
            _time(p.updated)
            for p in record.parts.values()
            if p.round is not None and p.round > part.round
        ]
    known = [end for end in ends if end is not None]
    return min(known) if known else None


def _time(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def report(
    spans: Iterable[Span],
    *,
    since: float | None,
    until: float,
    user: str | None = None,
    account: str | None = None,
) -> dict[str, Any]:
    """``elasticctl usage``'s document: totals per user and per account within [since,
    until] (since None: all there is) of the spans of ``user`` and of ``account`` (None:
    everyone's).  Names and numbers only: nothing of what a job runs or how it failed."""
    chosen = [s for s in spans if user in (None, s.user) and account in (None, s.account)]
    start = -math.inf if since is None else since
    return {
        "since": since,
        "until": until,
        **{
            f"{by}s": [
                {by: key, **total.to_json()}
                for key, total in totals(chosen, since=start, until=until, by=by).items()
            ]
            for by in BY
        },
    }
