"""The refit state table: the single source of truth for which moves a run may make.

Rule 1: every state and every legal move of a refit run is listed here, as data, and nowhere else.
Rule 2: this file knows nothing about drivers, engines, I/O or time. The runner
(`refit.protocol`) asks the machine built from this table whether a move is legal, commits it,
and only then performs the phase's driver calls; `docs/diagrams/` is generated from it.

A state names the phase a run is *in*. Colocated runs pass OFFLOADING and RESTORING;
disaggregated runs skip them (`connect` from IDLE, `finish` from CONTINUING). An engine whose
update failed is retried (`retry`: back to INVALIDATING for that engine alone) while attempts and
time remain; engines that failed for good are quarantined inside CONTINUING while healthy ones
publish. A failure of the run itself (trainer side, deadline, no engine left) moves to ABORTING;
from there the run may quarantine poisoned engines and always ends latched in FAILED. DONE and
FAILED have no exits.
"""

from enum import StrEnum


class RefitState(StrEnum):
    IDLE = "IDLE"
    OFFLOADING = "OFFLOADING"
    CONNECTING = "CONNECTING"
    PAUSING = "PAUSING"
    INVALIDATING = "INVALIDATING"
    TRANSFERRING = "TRANSFERRING"
    POST_PROCESSING = "POST_PROCESSING"
    CONTINUING = "CONTINUING"
    RESTORING = "RESTORING"
    DONE = "DONE"
    ABORTING = "ABORTING"
    QUARANTINING = "QUARANTINING"
    FAILED = "FAILED"


class Trigger(StrEnum):
    OFFLOAD = "offload"
    CONNECT = "connect"
    PAUSE = "pause"
    INVALIDATE = "invalidate"
    TRANSFER = "transfer"
    NEXT_BUCKET = "next_bucket"
    POST_PROCESS = "post_process"
    RETRY = "retry"
    PUBLISH = "publish"
    RESTORE = "restore"
    FINISH = "finish"
    FAIL = "fail"
    QUARANTINE = "quarantine"
    LATCH = "latch"


S = RefitState
T = Trigger

ACTIVE_STATES: tuple[RefitState, ...] = (
    S.OFFLOADING,
    S.CONNECTING,
    S.PAUSING,
    S.INVALIDATING,
    S.TRANSFERRING,
    S.POST_PROCESSING,
    S.CONTINUING,
    S.RESTORING,
)
TERMINAL_STATES: tuple[RefitState, ...] = (S.DONE, S.FAILED)

# (trigger, sources, destination), in the order of the happy path, then the failure path.
TRANSITIONS: tuple[tuple[Trigger, tuple[RefitState, ...], RefitState], ...] = (
    (T.OFFLOAD, (S.IDLE,), S.OFFLOADING),
    (T.CONNECT, (S.IDLE, S.OFFLOADING), S.CONNECTING),
    (T.PAUSE, (S.CONNECTING,), S.PAUSING),
    (T.INVALIDATE, (S.PAUSING,), S.INVALIDATING),
    (T.TRANSFER, (S.INVALIDATING,), S.TRANSFERRING),
    (T.NEXT_BUCKET, (S.TRANSFERRING,), S.TRANSFERRING),
    (T.POST_PROCESS, (S.TRANSFERRING,), S.POST_PROCESSING),
    (T.RETRY, (S.POST_PROCESSING,), S.INVALIDATING),
    (T.PUBLISH, (S.POST_PROCESSING,), S.CONTINUING),
    (T.RESTORE, (S.CONTINUING,), S.RESTORING),
    (T.FINISH, (S.CONTINUING, S.RESTORING), S.DONE),
    (T.FAIL, ACTIVE_STATES, S.ABORTING),
    (T.QUARANTINE, (S.ABORTING,), S.QUARANTINING),
    (T.LATCH, (S.ABORTING, S.QUARANTINING), S.FAILED),
)
