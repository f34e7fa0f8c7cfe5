"""State tables, h11's ``_state.py`` in small (a leaf: stdlib and errors.py only).

``StateTable``: the legal moves of one kind of state; ``EventTable``: what each kind of
event does in each state.  A move or a pair a table does not list raises
IllegalTransition and the caller changes nothing, so a case the design did not foresee is
a loud bug, never a silent guess.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

from elasticd.errors import Conflict

S = TypeVar("S", bound=enum.Enum)
T = TypeVar("T")


class IllegalTransition(Conflict):
    """A state change that its table does not allow (nothing was changed)."""


class StateTable(Generic[S]):
    """The legal moves of one kind of state.  Staying in a state is always legal."""

    def __init__(self, name: str, moves: Mapping[S, Iterable[S]]) -> None:
        self.name = name
        self._moves = {state: frozenset(targets) for state, targets in moves.items()}
        kind = type(next(iter(self._moves)))
        missing = [state.value for state in kind if state not in self._moves]
        if missing:
            raise ValueError(f"the table of {name} has no row for {', '.join(missing)}")

    def allows(self, old: S | None, new: S) -> bool:
        return old is None or old == new or new in self._moves[old]

    def check(self, old: S | None, new: S) -> S:
        """``new``, if ``old -> new`` is legal (``old`` None: the first state); else raise."""
        if old is not None and not self.allows(old, new):
            raise IllegalTransition(f"{self.name} cannot go from {old.value} to {new.value}")
        return new


class EventTable(Generic[S, T]):
    """``rows[state][event type]``: what that event does in that state (a handler, a new
    state).  Every state of the enum has a row, so a state nobody thought about is caught
    when the table is built."""

    def __init__(self, name: str, rows: Mapping[S, Mapping[type, T]]) -> None:
        self.name = name
        self._rows = {state: dict(row) for state, row in rows.items()}
        kind = type(next(iter(self._rows)))
        missing = [state.value for state in kind if state not in self._rows]
        if missing:
            raise ValueError(f"the event table of {name} has no row for {', '.join(missing)}")

    def lookup(self, state: S, event: object) -> T:
        row = self._rows[state]
        for kind in type(event).__mro__:
            if kind in row:
                return row[kind]
        raise IllegalTransition(f"{self.name} in {state.value} cannot take {type(event).__name__}")

    def takes(self, state: S) -> Iterable[type]:
        return self._rows[state].keys()
