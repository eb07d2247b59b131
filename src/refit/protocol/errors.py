"""The errors a refit raises or reports (defined in `refit.errors`, re-exported here)."""

from refit.errors import (
    ConfigError,
    DeadlineExceeded,
    DriverCallError,
    EngineDied,
    EngineError,
    IllegalTransition,
    InvariantViolation,
    RefitBusyError,
    RefitError,
)
from refit.protocol.faults import InjectedFault

__all__ = [
    "ConfigError",
    "DeadlineExceeded",
    "DriverCallError",
    "EngineDied",
    "EngineError",
    "IllegalTransition",
    "InjectedFault",
    "InvariantViolation",
    "RefitBusyError",
    "RefitError",
]
