"""Drive refits: `run(ctx) -> RefitResult` over a `RefitContext`.

from refit import protocol
ctx = protocol.RefitContext(source=..., transport=..., engines=[...], mode="colocated")
result = protocol.run(ctx)          # one whole refit; result.ok, result.version, result.engines
...
ctx.close()                         # disconnect, end the trace
"""

from refit.protocol.context import EngineOutcome, RefitContext, RefitResult
from refit.protocol.deadline import Deadline
from refit.protocol.errors import (
    ConfigError,
    DeadlineExceeded,
    DriverCallError,
    IllegalTransition,
    InjectedFault,
    InvariantViolation,
    RefitBusyError,
    RefitError,
)
from refit.protocol.faults import Fault, FaultPlan
from refit.protocol.lock import EngineLock, LocalLock, lock_for
from refit.protocol.runner import run

__all__ = [
    "ConfigError",
    "Deadline",
    "DeadlineExceeded",
    "DriverCallError",
    "EngineLock",
    "EngineOutcome",
    "Fault",
    "FaultPlan",
    "IllegalTransition",
    "InjectedFault",
    "InvariantViolation",
    "LocalLock",
    "RefitBusyError",
    "RefitContext",
    "RefitError",
    "RefitResult",
    "lock_for",
    "run",
]
