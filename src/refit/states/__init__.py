"""The refit state table and the strict machine built from it."""

from refit.errors import IllegalTransition
from refit.states._machine import RefitMachine
from refit.states._table import ACTIVE_STATES, TERMINAL_STATES, TRANSITIONS, RefitState, Trigger

__all__ = [
    "ACTIVE_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "IllegalTransition",
    "RefitMachine",
    "RefitState",
    "Trigger",
]
