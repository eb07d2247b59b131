"""Builds the legality "brain" from the table with `transitions`, strictly.

No callbacks, no I/O: the machine only answers "is this move legal?" and records where the run is.
A refused trigger raises `IllegalTransition`; it never returns False.
"""

from __future__ import annotations

from transitions import Machine, MachineError

from refit.errors import IllegalTransition
from refit.states._table import TRANSITIONS, RefitState, Trigger


class RefitMachine:
    """One run's position in the table."""

    state: RefitState

    def __init__(self, initial: RefitState = RefitState.IDLE) -> None:
        self._machine = Machine(
            model=self,
            states=RefitState,
            transitions=[
                {"trigger": str(trig), "source": list(sources), "dest": dest} for trig, sources, dest in TRANSITIONS
            ],
            initial=initial,
            auto_transitions=False,
            ignore_invalid_triggers=False,
            queued=False,
            send_event=False,
        )

    def can(self, trigger: Trigger | str) -> bool:
        """True when `trigger` is legal from the current state."""
        return str(trigger) in self._machine.get_triggers(self.state)

    def fire(self, trigger: Trigger | str) -> RefitState:
        """Commit a legal move and return the new state; raise IllegalTransition otherwise."""
        name = str(trigger)
        if name not in {str(t) for t in Trigger}:
            raise IllegalTransition(str(self.state), name)
        try:
            moved = self._machine.events[name].trigger(self)
        except MachineError:
            raise IllegalTransition(str(self.state), name) from None
        if not moved:  # no conditions exist in the table, so this means a transitions bug
            raise IllegalTransition(str(self.state), name)
        return self.state

    def legal_triggers(self) -> list[str]:
        return sorted(self._machine.get_triggers(self.state))
