"""Stories, as dask keeps one per key: the last stimuli the core heard and the instructions
it gave, with the monotonic time of each and the stimulus id that ties an instruction to
its cause.  Each part keeps one (a job on this node); the node keeps one of its own (holds,
placement, the schedule, GPU health).  ``elasticctl status --debug`` shows them; a failing
test prints them."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from elasticd.core.model import WorkerGroup
from elasticd.core.records import JobRecord, Part
from elasticd.rendezvous import RendezvousInfo

KEPT = 200  # entries per job


@dataclass(frozen=True)
class Entry:
    at: float
    kind: str  # "heard" or "told"
    text: str


class Story:
    def __init__(self, kept: int = KEPT) -> None:
        self._entries: deque[Entry] = deque(maxlen=kept)

    def heard(self, at: float, stimulus: Any) -> None:
        sid = getattr(stimulus, "stimulus_id", "")
        self._entries.append(
            Entry(at, "heard", f"{_text(stimulus)} [{sid}]" if sid else _text(stimulus))
        )

    def told(self, at: float, why: str, instructions: Iterable[Any]) -> None:
        for instruction in instructions:
            self._entries.append(Entry(at, "told", f"{why}: {_text(instruction)}"))

    def entries(self) -> list[Entry]:
        return list(self._entries)

    def lines(self, origin: float | None = None) -> list[str]:
        """One line per entry, its time in seconds after ``origin`` (the first entry's)."""
        entries = self.entries()
        start = origin if origin is not None else (entries[0].at if entries else 0.0)
        return [f"{entry.at - start:9.3f} {entry.kind:5} {entry.text}" for entry in entries]

    def __repr__(self) -> str:
        return f"Story({len(self._entries)} entries)"


_CUT = 300


def _text(item: Any) -> str:
    """A stimulus or an instruction in a line: its kind and fields, long values cut."""
    name = type(item).__name__
    fields = getattr(item, "__dataclass_fields__", None)
    if fields is None:
        text = f"{name}({item!r})"
    else:
        shown = (key for key in fields if key not in ("job", "stimulus_id"))
        text = f"{name}(" + ", ".join(f"{key}={_short(getattr(item, key))}" for key in shown) + ")"
    return text if len(text) <= _CUT else text[:_CUT] + "..."


def _short(value: Any) -> str:
    if isinstance(value, tuple) and value and isinstance(value[0], JobRecord):
        return f"<{len(value)} jobs>"
    if isinstance(value, WorkerGroup):
        return f"<group round {value.round}: {[(w.local_rank, w.rank, w.state.value) for w in value.workers]}>"
    if isinstance(value, RendezvousInfo):
        return f"<round {value.round} ({value.reason}): {[m.node for m in value.members]}>"
    if isinstance(value, Part):
        return f"<part {value.state.value} round {value.round}: {[w.get('state') for w in value.workers]}>"
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."
