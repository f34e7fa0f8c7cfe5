"""The pure parts of bench_sharing.py: its seeded trace and its metrics (stdlib only).

The trace has the shapes that published cluster traces show (Microsoft Philly, Jeon et al.,
ATC'19; SenseTime Helios, Hu et al., SC'21; Alibaba PAI, Weng et al., NSDI'22): most jobs
are small and short, a few are large and long and hold most of the GPU-time, job sizes and
durations are heavy-tailed (log-normal here), arrivals are a Poisson process, and a few
users submit unequal shares of the jobs.  Scaled down so that 8 one-slot nodes on a 2-core
host replay it in about five minutes:

- small (70 %): ``--nnodes 1:1`` or ``1:2``, work log-normal around 30 units (15 s on one node
  at the default 0.5 s a step), 10..100;
- medium (20 %): ``1:4`` or ``2:4``, around 160 units, 60..400;
- large (10 %): ``2:N`` or ``4:N`` (N the cluster's nodes), ``--nnodes-step 2`` for half of
  them, around 600 units, 300..1200;
- 20 % of the small and medium jobs ``--preemptible`` (best-effort work);
- four users submitting 40 / 30 / 20 / 10 % of the jobs;
- arrivals: exponential gaps at the rate that offers ``load`` times the cluster's capacity
  while they arrive (1.3: jobs queue, as a shared cluster's do at busy hours).

A job's work is in sample-units: a step of its workers takes ``step`` seconds and processes
WORLD_SIZE units, so it runs ``ceil(work / size) * step`` seconds at a fixed size.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any

USERS = ("u1", "u2", "u3", "u4")
USER_WEIGHTS = (0.4, 0.3, 0.2, 0.1)
# kind: (probability, node ranges as (min, max or None = the cluster's nodes),
#        median work, sigma of its log, clip)
KINDS = {
    "small": (0.7, ((1, 1), (1, 2)), 30.0, 0.6, (10, 100)),
    "medium": (0.2, ((1, 4), (2, 4)), 160.0, 0.5, (60, 400)),
    "large": (0.1, ((2, None), (4, None)), 600.0, 0.4, (300, 1200)),
}
PREEMPTIBLE = 0.2


@dataclass(frozen=True)
class TraceJob:
    name: str
    user: str
    kind: str
    arrival: float  # seconds after the replay's start
    min_nodes: int
    max_nodes: int
    work: int  # sample-units
    nnodes_step: int = 1
    preemptible: bool = False
    priority: int = 0

    @property
    def nnodes(self) -> str:
        return f"{self.min_nodes}:{self.max_nodes}"

    def ideal(self, step: float) -> float:
        """Its run time alone on the cluster at its largest size, no start-up: slowdown's unit."""
        return math.ceil(self.work / self.max_nodes) * step

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def make_trace(
    seed: int, jobs: int, nodes: int, *, load: float = 1.3, step: float = 0.5
) -> list[TraceJob]:
    """``jobs`` jobs for a cluster of ``nodes`` one-slot nodes; the same arguments always give
    the same trace."""
    if jobs < 1 or nodes < 1 or load <= 0 or step <= 0:
        raise ValueError("jobs and nodes must be at least 1, load and step more than 0")
    rng = random.Random(seed)
    drawn = [_draw(rng, nodes) for _ in range(jobs)]
    # arrivals: offered work / capacity = load over the arrival window
    window = sum(work for _, _, _, work, _, _ in drawn) * step / (nodes * load)
    rate = jobs / window
    arrival, trace = 0.0, []
    for index, (kind, low, high, work, stepped, preemptible) in enumerate(drawn):
        user = rng.choices(USERS, USER_WEIGHTS)[0]
        trace.append(
            TraceJob(
                f"{kind[0]}{index:02d}-{user}",
                user,
                kind,
                round(arrival, 2),
                low,
                high,
                work,
                stepped,
                preemptible,
            )
        )
        arrival += rng.expovariate(rate)
    return trace


def _draw(rng: random.Random, nodes: int) -> tuple[str, int, int, int, int, bool]:
    kind = rng.choices(list(KINDS), [k[0] for k in KINDS.values()])[0]
    _, ranges, median, sigma, (lo, hi) = KINDS[kind]
    low, high = rng.choice(ranges)
    high = nodes if high is None else min(high, nodes)
    low = min(low, high)
    work = int(min(hi, max(lo, rng.lognormvariate(math.log(median), sigma))))
    stepped = 2 if kind == "large" and rng.random() < 0.5 and low % 2 == 0 and high >= 2 else 1
    preemptible = kind != "large" and rng.random() < PREEMPTIBLE
    return kind, low, high, work, stepped, preemptible
