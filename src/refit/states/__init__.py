"""The refit state tables and the strict machines built from them."""

from refit.errors import IllegalTransition
from refit.states._machine import EngineMachine, RefitMachine
from refit.states._table import (
    ACTIVE_STATES,
    ENGINE_TRANSITIONS,
    RETRY_STATES,
    TERMINAL_STATES,
    TRANSITIONS,
    EngineEvent,
    EngineState,
    RefitState,
    Trigger,
)

__all__ = [
    "ACTIVE_STATES",
    "ENGINE_TRANSITIONS",
    "RETRY_STATES",
    "TERMINAL_STATES",
    "TRANSITIONS",
    "EngineEvent",
    "EngineMachine",
    "EngineState",
    "IllegalTransition",
    "RefitMachine",
    "RefitState",
    "Trigger",
]
