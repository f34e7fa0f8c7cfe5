"""This node's GPUs' health, pure: NVML readings in, the GPUs taken out of the offer and
what to say and count out (the NVML reading itself is cluster/nvml.py's).

A GPU is taken out when NVML says it is lost, delivers a hardware Xid (``drain_xids``: a
fallen-off-the-bus 79, uncorrectable memory 48/94/95, row remapping 63/64, NVLink 74, GSP
119/120 ...; an Xid a program causes, such as 13, 31 or 43, is counted and said, not held
against the GPU), its volatile uncorrectable ECC count rises, or it has rows or pages
waiting for a remap (they take effect only at the next reset).  A thermal or power
slowdown is a warning, never a drain.  A GPU out comes back when an operator readmits it,
or, with ``readmit_after`` > 0, once it has read healthy that long.

A program can make a GPU report Xids at will (20,000 Xid 13 in one check, measured): a
check's Xids are said once per GPU and code with how many came, and that line once per
``log.summary_interval`` (``Throttle``) with how many more there were; they are counted
by code, all of them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from elasticd.core import instructions as do
from elasticd.faults import Throttle, held_back

# Xids that mean the hardware needs attention (NVIDIA's Xid catalogue, as DCGM's health
# watches read it); others are application or driver-side and leave the GPU in the offer.
DRAIN_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 122, 123, 140})


@dataclass(frozen=True)
class GpuReading:
    """One device at one check (cluster/nvml.py reads it)."""

    index: int
    uuid: str
    lost: bool = False  # NVML_ERROR_GPU_IS_LOST, or it no longer answers
    xids: tuple[int, ...] = ()  # Xid events delivered since the previous check
    ecc_uncorrected: int | None = None  # volatile uncorrectable ECC errors (None: not supported)
    rows_pending: bool = False  # remapped rows or retired pages waiting for a reset
    remap_failed: bool = False  # a row remapping failed
    slowdown: tuple[str, ...] = ()  # active thermal/power slowdowns ("hw thermal", ...)


@dataclass(frozen=True)
class GpuPolicy:
    drain_xids: frozenset[int] = DRAIN_XIDS
    readmit_after: float = 0.0  # healthy this long -> back in the offer (0: by an operator only)


@dataclass
class GpuOut:
    """A GPU out of the offer: why, since when (wall clock, shown) and when it last read bad."""

    index: int
    why: str
    since: float
    last_bad: float  # monotonic


def faults(reading: GpuReading, before: GpuReading | None, policy: GpuPolicy) -> list[str]:
    """Why this reading takes the GPU out (empty: it does not)."""
    why = ["lost (NVML: GPU is lost)"] if reading.lost else []
    why += [
        f"xid {code}" + (f" (x{n})" if n > 1 else "")
        for code, n in Counter(reading.xids).items()
        if code in policy.drain_xids
    ]
    ecc, was = reading.ecc_uncorrected, before.ecc_uncorrected if before is not None else None
    if ecc is not None and was is not None and ecc > was:
        why.append(f"ecc: {ecc - was} new uncorrectable errors ({ecc} in all)")
    if reading.rows_pending:
        why.append("rows pending remap")
    if reading.remap_failed:
        why.append("row remapping failed")
    return why


@dataclass
class GpuWatch:
    """What this node knows of its GPUs' health (None in NodeCore where NVML is absent)."""

    policy: GpuPolicy = field(default_factory=GpuPolicy)
    last: dict[str, GpuReading] = field(default_factory=dict)  # by UUID
    out: dict[str, GpuOut] = field(default_factory=dict)  # by UUID
    slowed: dict[str, tuple[str, ...]] = field(default_factory=dict)
    told: Throttle = field(default_factory=Throttle)  # Xids said, per GPU and code

    def read(
        self, readings: tuple[GpuReading, ...], mono: float, wall: float
    ) -> tuple[list[do.Instruction], bool]:
        """Judge one check: what to say and count, and whether the set of GPUs out changed."""
        said: list[do.Instruction] = []
        changed = False
        for reading in readings:
            why = faults(reading, self.last.get(reading.uuid), self.policy)
            said += self._other_news(reading, mono)
            if why:
                changed |= self._take_out(reading, "; ".join(why), mono, wall, said)
            elif reading.uuid in self.out and self._healed(self.out[reading.uuid], mono):
                said += self.readmit(reading.index, f"healthy for {self.policy.readmit_after:g} s")
                changed = True
            self.last[reading.uuid] = reading
        return said, changed

    def readmit(self, index: int, by: str) -> list[do.Instruction]:
        """Put the GPU of this index back in the offer (an operator, or healed)."""
        uuid = next((u for u, o in self.out.items() if o.index == index), None)
        if uuid is None:
            return []
        del self.out[uuid]
        return [
            do.Say("info", "gpu %d (%s) back in the offer: %s", None, (index, uuid, by)),
            do.Count("gpus_out", value=len(self.out)),
        ]

    def why_out(self) -> dict[int, str]:
        """Each GPU out, by index, and why (for the node's record)."""
        return {o.index: o.why for o in self.out.values()}

    def _take_out(
        self, reading: GpuReading, why: str, mono: float, wall: float, said: list[do.Instruction]
    ) -> bool:
        known = self.out.get(reading.uuid)
        if known is not None:
            known.last_bad = mono
            return False
        self.out[reading.uuid] = GpuOut(reading.index, why, wall, mono)
        said += [
            do.Say(
                "warning",
                "gpu %d (%s) taken out of this node's offer: %s",
                None,
                (reading.index, reading.uuid, why),
            ),
            do.Count("gpu_fault", label=why.split(":")[0].split(" (")[0]),
            do.Count("gpus_out", value=len(self.out)),
        ]
        return True

    def _other_news(self, reading: GpuReading, mono: float) -> list[do.Instruction]:
        """Xids that leave the GPU in (a line per code, and not every check), and slowdowns
        as they start and end: said; every Xid counted."""
        said: list[do.Instruction] = []
        xids = Counter(reading.xids)
        for code, n in xids.items():
            if code in self.policy.drain_xids:
                continue
            held = self.told.check(f"{reading.uuid} xid {code}", mono, count=n)
            if held is not None:
                said.append(
                    do.Say(
                        "warning",
                        "gpu %d: xid %d (an application or driver error: the GPU stays in)%s%s",
                        None,
                        (
                            reading.index,
                            code,
                            f", {n} in this check" if n > 1 else "",
                            held_back(held),
                        ),
                    )
                )
        said += [do.Count("xid", label=str(code), value=n) for code, n in xids.items()]
        if reading.slowdown != self.slowed.get(reading.uuid, ()):
            self.slowed[reading.uuid] = reading.slowdown
            said.append(
                do.Say(
                    "warning",
                    "gpu %d slowed down: %s",
                    None,
                    (reading.index, ", ".join(reading.slowdown)),
                )
                if reading.slowdown
                else do.Say("info", "gpu %d runs at full clocks again", None, (reading.index,))
            )
            said.append(
                do.Count(
                    "gpu_slowdown", label=str(reading.index), value=1 if reading.slowdown else 0
                )
            )
        return said

    def _healed(self, out: GpuOut, mono: float) -> bool:
        return self.policy.readmit_after > 0 and mono - out.last_bad >= self.policy.readmit_after
