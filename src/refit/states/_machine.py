"""Builds the legality "brains" from the tables, strictly.

No callbacks, no I/O: a machine only answers "is this move legal?" and records where it is. A
refused trigger raises `IllegalTransition`; it never returns False. The run machine uses
`transitions`: it decides each (state, trigger) once per process and a run looks its moves up; an
engine machine is a plain lookup in the same kind of table (a run has one per engine, so it must
be cheap to build).
"""

from __future__ import annotations

from typing import Any

from transitions import Machine, MachineError

from refit.errors import IllegalTransition
from refit.states._facts import FACT_TABLES
from refit.states._table import ENGINE_TRANSITIONS, TRANSITIONS, EngineEvent, EngineState, RefitState, Trigger


def _transitions_machine(model: Any, initial: RefitState) -> Machine:
    """The run table as a `transitions` machine (strict: no auto transitions, refusals raise)."""
    return Machine(
        model=model,
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


def _decided_moves() -> dict[tuple[RefitState, str], RefitState]:
    """Every (state, trigger) `transitions` allows and where it leads, asked of one machine once
    per pair (set to the state, then triggered): a run then looks its moves up instead of building
    a machine and walking `transitions`' trigger path per move (tens of microseconds each, inside
    a stall)."""
    moves: dict[tuple[RefitState, str], RefitState] = {}

    class _Model:
        state: RefitState

    model = _Model()
    machine = _transitions_machine(model, RefitState.IDLE)
    for state in RefitState:
        for trig in (str(t) for t in Trigger):
            machine.set_state(state, model)
            try:
                moved = machine.events[trig].trigger(model)
            except MachineError:  # refused from this state
                continue
            if moved:
                moves[(state, trig)] = RefitState(model.state)
    return moves


_MOVES = _decided_moves()


class RefitMachine:
    """One run's position in the run table; its moves are the ones `transitions` decided from the
    table (`_decided_moves`), looked up."""

    __slots__ = ("state",)

    def __init__(self, initial: RefitState = RefitState.IDLE) -> None:
        self.state = RefitState(initial)

    def can(self, trigger: Trigger | str) -> bool:
        """True when `trigger` is legal from the current state."""
        return (self.state, str(trigger)) in _MOVES

    def fire(self, trigger: Trigger | str) -> RefitState:
        """Commit a legal move and return the new state; raise IllegalTransition otherwise."""
        name = str(trigger)
        dest = _MOVES.get((self.state, name))
        if dest is None:
            raise IllegalTransition(str(self.state), name)
        self.state = dest
        return dest

    def legal_triggers(self) -> list[str]:
        return sorted(t for (s, t) in _MOVES if s == self.state)


_ENGINE_MOVES: dict[tuple[EngineState, EngineEvent], EngineState] = {
    (src, event): dest for event, sources, dest in ENGINE_TRANSITIONS for src in sources
}


class EngineMachine:
    """One engine's position in the engine table during one run."""

    __slots__ = ("state",)

    def __init__(self, initial: EngineState = EngineState.JOINED) -> None:
        self.state = initial

    def can(self, event: EngineEvent) -> bool:
        return (self.state, event) in _ENGINE_MOVES

    def fire(self, event: EngineEvent) -> EngineState:
        dest = _ENGINE_MOVES.get((self.state, event))
        if dest is None:
            raise IllegalTransition(str(self.state), str(event))
        self.state = dest
        return dest


def _moves(table: tuple[tuple[Any, tuple[Any, ...], Any], ...]) -> dict[tuple[Any, Any], Any]:
    moves: dict[tuple[Any, Any], Any] = {}
    for event, sources, dest in table:
        for src in sources:
            if (src, event) in moves:
                raise ValueError(f"the table lists {event} from {src} twice")
            moves[(src, event)] = dest
    return moves


_FACT_MOVES = {name: _moves(table) for name, (table, _, _) in FACT_TABLES.items()}


class FactMachine:
    """One fact's position in its table (`refit.states._facts`): weights, failure, a memory
    region, the connection, the trainer, the ranks."""

    __slots__ = ("_moves", "name", "state")

    def __init__(self, name: str, initial: Any = None) -> None:
        _, start, _ = FACT_TABLES[name]
        self.name = name
        self.state: Any = start if initial is None else type(start)(initial)
        self._moves = _FACT_MOVES[name]

    def can(self, event: Any) -> bool:
        return (self.state, event) in self._moves

    def fire(self, event: Any) -> Any:
        dest = self._moves.get((self.state, event))
        if dest is None:
            raise IllegalTransition(f"{self.name} {self.state}", str(event))
        self.state = dest
        return dest

    def __repr__(self) -> str:
        return f"{self.name}:{self.state}"
