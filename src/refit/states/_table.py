"""The refit state tables: the single source of truth for which moves a run, and each engine in it,
may make.

Rule 1: every state and every legal move is listed here, as data, and nowhere else.
Rule 2: this file knows nothing about drivers, engines, I/O or time. The runner
(`refit.protocol`) asks the machines built from these tables whether a move is legal and commits
it; `docs/diagrams/` is generated from them.

The run table. A state names the phase a run is *in*. Colocated runs pass OFFLOADING and
RESTORING; disaggregated runs skip them (`connect` from IDLE, `finish` from CONTINUING). A run
that verifies (`RefitContext(verify=...)`, on by default) passes VERIFYING between finalize and
publish: each finalized engine reports what it will serve and only those that match publish.
Engines whose update failed are retried (`retry`: back to INVALIDATING for them alone) while
attempts and time remain; a transport whose group a failed member broke is first rebuilt without
it (`reconnect`: RECONNECTING, then `retry`), and so is a collective group one of whose members
left before the transfer (its begin failed: `reconnect` from INVALIDATING, then `transfer`).
Engines that failed for good are quarantined inside CONTINUING while healthy ones publish. A
failure of the run itself (trainer side, deadline, no engine left) moves to ABORTING; from there
the run may quarantine poisoned engines and always ends latched in FAILED. DONE and FAILED have
no exits.

Atomic runs (`RefitContext(atomic=True)`, stage-then-swap) never pause to transfer: from
CONNECTING they `stage` (STAGING: each engine opens a session into a second copy of its weights
and goes on generating with the first), stream and finalize into the copies, verify them, then
`swap` (SWAPPING: one wave pauses each ready engine, flushes its cache, serves the copy, and
publishes and continues it, the publish in CONTINUING). A retry discards the copy and stages
again (`restage`); an engine that will not swap has its copy discarded, never quarantined for it.

The engine table. One per engine and run (h11 keeps one state per role): where that engine
stands in the update. Under a version policy (`RefitContext(max_staleness=k)`), an engine that did
not take the version others published and would serve one more than k versions behind it is held
(`hold`: STALE, out of service) instead of continued. In an atomic run an engine stages
(STAGING, STAGED, STAGE_VERIFIED) while it keeps serving, pauses only with its copy ready
(PAUSED_STAGED), and its weights change only at `swap` (SWAPPED); a copy that will not be served
(STRANDED, or any staged position the run leaves) is discarded, back to where the engine was.
A LoRA refit (`RefitContext` over a `LoraSource`) stages like an atomic run, into a new version of
the adapter instead of a copy of the weights; its publish is its switch (`activate`: new requests
get that version, those pinned to older ones keep theirs), so it never pauses, flushes or swaps.
Under a version policy it first waits in DRAINING (`drain`) until the versions its publish pushes
past max_staleness + 1 have no request left; generation goes on meanwhile.
Facts that are not positions (whether its weights changed or were lost, why it left the attempt)
are kept beside it; outcomes are derived from both.
"""

from enum import StrEnum


class RefitState(StrEnum):
    IDLE = "IDLE"
    OFFLOADING = "OFFLOADING"
    CONNECTING = "CONNECTING"
    STAGING = "STAGING"
    PAUSING = "PAUSING"
    INVALIDATING = "INVALIDATING"
    TRANSFERRING = "TRANSFERRING"
    POST_PROCESSING = "POST_PROCESSING"
    VERIFYING = "VERIFYING"
    RECONNECTING = "RECONNECTING"
    DRAINING = "DRAINING"
    SWAPPING = "SWAPPING"
    CONTINUING = "CONTINUING"
    RESTORING = "RESTORING"
    DONE = "DONE"
    ABORTING = "ABORTING"
    QUARANTINING = "QUARANTINING"
    FAILED = "FAILED"


class Trigger(StrEnum):
    OFFLOAD = "offload"
    CONNECT = "connect"
    STAGE = "stage"
    PAUSE = "pause"
    INVALIDATE = "invalidate"
    TRANSFER = "transfer"
    NEXT_BUCKET = "next_bucket"
    POST_PROCESS = "post_process"
    VERIFY = "verify"
    RECONNECT = "reconnect"
    RETRY = "retry"
    RESTAGE = "restage"
    DRAIN = "drain"
    SWAP = "swap"
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
    S.STAGING,
    S.PAUSING,
    S.INVALIDATING,
    S.TRANSFERRING,
    S.POST_PROCESSING,
    S.VERIFYING,
    S.RECONNECTING,
    S.DRAINING,
    S.SWAPPING,
    S.CONTINUING,
    S.RESTORING,
)
TERMINAL_STATES: tuple[RefitState, ...] = (S.DONE, S.FAILED)
# inside the update: an engine that fails here (an error, not a hang or a death) is retried when
# the run allows retries, its next attempt beginning the update again (VERIFYING: what it would
# serve is not what was sent)
RETRY_STATES: tuple[RefitState, ...] = (S.STAGING, S.INVALIDATING, S.TRANSFERRING, S.POST_PROCESSING, S.VERIFYING)

# (trigger, sources, destination), in the order of the happy path, then recovery, then failure.
TRANSITIONS: tuple[tuple[Trigger, tuple[RefitState, ...], RefitState], ...] = (
    (T.OFFLOAD, (S.IDLE,), S.OFFLOADING),
    (T.CONNECT, (S.IDLE, S.OFFLOADING), S.CONNECTING),
    (T.PAUSE, (S.CONNECTING,), S.PAUSING),
    (T.INVALIDATE, (S.PAUSING,), S.INVALIDATING),
    # atomic runs: a staged session instead of pause, flush and begin (generation goes on)
    (T.STAGE, (S.CONNECTING,), S.STAGING),
    # RECONNECTING: a group rebuilt first; STAGING: an atomic run's copies are open
    (T.TRANSFER, (S.INVALIDATING, S.RECONNECTING, S.STAGING), S.TRANSFERRING),
    (T.NEXT_BUCKET, (S.TRANSFERRING,), S.TRANSFERRING),
    (T.POST_PROCESS, (S.TRANSFERRING,), S.POST_PROCESSING),
    # POST_PROCESSING: verify="off"; SWAPPING: an atomic run's publish rides the swap wave;
    # DRAINING: a LoRA refit's, once the versions it pushes out have no request left
    (T.PUBLISH, (S.POST_PROCESSING, S.VERIFYING, S.SWAPPING, S.DRAINING), S.CONTINUING),
    (T.VERIFY, (S.POST_PROCESSING,), S.VERIFYING),
    (T.SWAP, (S.POST_PROCESSING, S.VERIFYING), S.SWAPPING),  # atomic: pause, flush, swap, then publish
    (T.DRAIN, (S.POST_PROCESSING, S.VERIFYING), S.DRAINING),  # LoRA: wait for room within max_staleness + 1
    (T.RESTORE, (S.CONTINUING,), S.RESTORING),
    (T.FINISH, (S.CONTINUING, S.RESTORING), S.DONE),
    (T.RECONNECT, (S.INVALIDATING, S.STAGING, S.POST_PROCESSING, S.VERIFYING), S.RECONNECTING),
    (T.RETRY, (S.POST_PROCESSING, S.VERIFYING, S.RECONNECTING), S.INVALIDATING),
    (T.RESTAGE, (S.POST_PROCESSING, S.VERIFYING, S.RECONNECTING), S.STAGING),  # atomic: discard, stage again
    (T.FAIL, (S.IDLE, *ACTIVE_STATES), S.ABORTING),  # IDLE: the ranks' metadata or the plan was refused
    (T.QUARANTINE, (S.ABORTING,), S.QUARANTINING),
    (T.LATCH, (S.ABORTING, S.QUARANTINING), S.FAILED),
)


class EngineState(StrEnum):
    JOINED = "JOINED"  # in the run; nothing that changes generation has happened to it yet
    PAUSED = "PAUSED"  # generation stopped, no update session open
    OPEN = "OPEN"  # cache flushed and an update session begun: exactly one finalize is owed
    FINALIZED = "FINALIZED"  # its attempt acked every bucket and finalized (verify="off": it may publish)
    VERIFIED = "VERIFIED"  # what it reports it will serve is what the trainer sent: it may publish
    PUBLISHED = "PUBLISHED"  # labelled with the run's version: it must be continued
    SERVING = "SERVING"  # continued (colocated: and its KV memory back): generating again
    QUARANTINED = "QUARANTINED"  # kept out of service until a refit completes
    STALE = "STALE"  # clean, held out of service by the version policy (max_staleness) until a refit reaches it
    GONE = "GONE"  # died or stopped answering: only a restart helps
    # atomic runs: a second copy of the weights is written while the served one keeps generating
    STAGING = "STAGING"  # a staged session open: one finalize owed, and a swap or a discard
    STAGED = "STAGED"  # the copy finalized whole (verify="off": it may swap)
    STAGE_VERIFIED = "STAGE_VERIFIED"  # what the copy will serve is what the trainer sent: it may swap
    STRANDED = "STRANDED"  # a copy that will not be swapped (closed incomplete, or rejected): owed a discard
    PAUSED_STAGED = "PAUSED_STAGED"  # paused for the swap, the copy not yet served
    SWAPPED = "SWAPPED"  # paused, serving the copy: it may publish


class EngineEvent(StrEnum):
    PAUSE = "pause"
    OPEN = "open"  # flush and begin succeeded (first attempt or retry)
    FINALIZE = "finalize"  # finalize succeeded after every bucket was acked
    VERIFY = "verify"  # its report of what it will serve matched the trainer's
    REJECT = "reject"  # it did not: its weights are no version's (retried or quarantined)
    CLOSE = "close"  # the session ended without a publishable update (partial, failed finalize)
    PUBLISH = "publish"
    CONTINUE = "continue"
    QUARANTINE = "quarantine"
    HOLD = "hold"  # did not take the version others published and is too far behind it to serve
    LOSE = "lose"
    STAGE = "stage"  # a staged session opened (atomic runs)
    SWAP = "swap"  # the staged copy is served
    DISCARD = "discard"  # the staged copy is dropped: the served weights are as they were
    ACTIVATE = "activate"  # a LoRA refit's publish: its staged adapter version goes live (nothing paused)


E, EV = EngineState, EngineEvent
# an atomic run's positions between its stage and its publish (a quarantine drops the copy)
STAGED_STATES: tuple[EngineState, ...] = (E.STAGING, E.STAGED, E.STAGE_VERIFIED, E.STRANDED, E.PAUSED_STAGED, E.SWAPPED)
UNPAUSED_STAGED: tuple[EngineState, ...] = (E.STAGING, E.STAGED, E.STAGE_VERIFIED, E.STRANDED)

ENGINE_TRANSITIONS: tuple[tuple[EngineEvent, tuple[EngineState, ...], EngineState], ...] = (
    (EV.PAUSE, (E.JOINED,), E.PAUSED),
    (EV.OPEN, (E.PAUSED,), E.OPEN),
    (EV.FINALIZE, (E.OPEN,), E.FINALIZED),
    (EV.CLOSE, (E.OPEN,), E.PAUSED),
    (EV.VERIFY, (E.FINALIZED,), E.VERIFIED),
    (EV.REJECT, (E.FINALIZED,), E.PAUSED),
    (EV.STAGE, (E.JOINED,), E.STAGING),
    (EV.FINALIZE, (E.STAGING,), E.STAGED),
    (EV.CLOSE, (E.STAGING,), E.STRANDED),
    (EV.VERIFY, (E.STAGED,), E.STAGE_VERIFIED),
    (EV.REJECT, (E.STAGED,), E.STRANDED),
    (EV.PAUSE, (E.STAGED, E.STAGE_VERIFIED), E.PAUSED_STAGED),
    (EV.SWAP, (E.PAUSED_STAGED,), E.SWAPPED),
    (EV.DISCARD, (E.STAGING, E.STAGED, E.STAGE_VERIFIED, E.STRANDED), E.JOINED),  # never paused: as it was
    (EV.DISCARD, (E.PAUSED_STAGED,), E.PAUSED),
    (EV.PUBLISH, (E.FINALIZED, E.VERIFIED, E.SWAPPED), E.PUBLISHED),
    # a LoRA refit: the staged version is a new adapter beside the ones requests use, so its publish
    # is its switch: new requests get it, requests pinned to older versions keep theirs
    (EV.ACTIVATE, (E.STAGED, E.STAGE_VERIFIED), E.PUBLISHED),
    (EV.CONTINUE, (E.PAUSED, E.PUBLISHED), E.SERVING),
    (EV.QUARANTINE, (E.JOINED, E.PAUSED, E.OPEN, E.FINALIZED, E.VERIFIED, E.PUBLISHED, *STAGED_STATES), E.QUARANTINED),
    (EV.HOLD, (E.JOINED, E.PAUSED), E.STALE),
    (
        EV.LOSE,
        (E.JOINED, E.PAUSED, E.OPEN, E.FINALIZED, E.VERIFIED, E.PUBLISHED, E.SERVING, E.STALE, *STAGED_STATES),
        E.GONE,
    ),
)
