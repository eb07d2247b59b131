"""The tables of what is kept beside a position: facts that were booleans and strings in the runner
are named machines here, in the same (event, sources, destination) form as the run and engine
tables, with the same rules: every state and legal move listed as data, nothing about drivers,
I/O or time; a move the table lacks raises `IllegalTransition`.

Per engine and run:
- **Weights**: what the engine's weights are relative to the versions refit names. KEPT (what it
  held when the run began), CHANGED (a bucket may have landed, a begin that moves weights ran, a
  staged copy may have been swapped in, or a publish failed, so its label is unknown; an atomic
  run's buckets land in a copy nothing serves, so only its swap touches), LOST (its weight memory
  came back with contents not reported intact), LABELLED (published: it holds this run's version and says so).
- **Failure**: why it left the current attempt. NONE (in it), ERROR (an error answer: it may be
  retried), TIMEOUT (hung), DEADLINE (the run had no time left for its call), DEAD. A worse reason
  replaces a milder one; DEAD is final; REJOIN puts an engine back into an attempt (a retry, or a
  collective group rebuilt without the members to blame).
- **Memory**, one per region (`weights`, `kv_cache`; colocated runs): what this run did to it.
  AS_FOUND (untouched), RESUMED (resumed; it was held already), TAKEN (resumed from released: if
  the engine never pauses, the run gives it back).

Per HTTP engine driver (`refit.drivers.http.UpdateLedger`), across runs:
- **Update**: the engine's weight-update session as its driver knows it (SGLang and vLLM label
  whatever weights they hold, so the driver keeps this itself). NAMED (no session: the weights are
  what the label names), OPENING (a begin was sent: the server may hold a partial update), OPEN
  (begun: loads are checked against the plan), FINALIZED (every planned bucket acked: it may
  publish), UNNAMED (no session, and the weights may be a mix: an update opened and not completed
  since, or the server was found paused by someone else).

Per context (`refit.protocol.session.Session`), across runs:
- **Connection**: whether the transport's connection may be reused. CLEAN (nothing spoiled it),
  DIRTY (being built, or an engine may still read a buffer that was abandoned), BROKEN (a member
  broke the collective group: rebuild before streaming again), CLOSED (the context is closed;
  final: a run that outlived the close changes nothing).

Per engine and adapter version (`refit.reference.lora.AdapterTable`), across runs: a LoRA refit
loads a new version of an adapter beside the ones requests still use.
- **Adapter**: STAGING (its tensors land in memory nothing serves), STAGED (every planned tensor
  landed and it was checked whole), LIVE (published: new requests naming the adapter get it),
  RETIRED (a newer version is live: only requests pinned to it use it), UNLOADED (freed once no
  request is pinned to it), DISCARDED (a staged version that never serves). A request is pinned to
  the LIVE version when it is admitted and keeps it to its last token.

Per run:
- **Trainer**: RESIDENT or OFFLOADED (colocated runs: owed a restore).
- **Ranks**: ANSWERING, or STUCK once a trainer-side step did not answer in time (later calls get
  no floor and no slack: they would only stack up).
"""

from enum import StrEnum
from typing import Any


class Weights(StrEnum):
    KEPT = "KEPT"
    CHANGED = "CHANGED"
    LOST = "LOST"
    LABELLED = "LABELLED"


class WeightsEvent(StrEnum):
    # a load (not staged) or a swap, acked or failed with effect; a begin that moves weights; a failed publish
    TOUCH = "touch"
    LOSE = "lose"  # weight memory resumed without intact contents, or its resume failed
    LABEL = "label"  # publish succeeded


W, WE = Weights, WeightsEvent
WEIGHTS_TRANSITIONS: tuple[tuple[WeightsEvent, tuple[Weights, ...], Weights], ...] = (
    (WE.TOUCH, (W.KEPT, W.CHANGED), W.CHANGED),
    (WE.TOUCH, (W.LOST,), W.LOST),  # still unknown: only a complete update names it
    (WE.LOSE, (W.KEPT, W.CHANGED, W.LOST), W.LOST),
    (WE.LABEL, (W.KEPT, W.CHANGED, W.LOST), W.LABELLED),
)


class Failure(StrEnum):
    NONE = "NONE"
    ERROR = "ERROR"
    TIMEOUT = "TIMEOUT"
    DEADLINE = "DEADLINE"
    DEAD = "DEAD"


class FailureEvent(StrEnum):
    ERR = "err"  # an error answer (or a call that broke the contract)
    HANG = "hang"  # no answer inside its budget
    RUN_OUT = "run_out"  # never sent: the run had no time left
    DIE = "die"
    REJOIN = "rejoin"


F, FE = Failure, FailureEvent
FAILURE_TRANSITIONS: tuple[tuple[FailureEvent, tuple[Failure, ...], Failure], ...] = (
    (FE.ERR, (F.NONE, F.ERROR), F.ERROR),
    (FE.ERR, (F.TIMEOUT,), F.TIMEOUT),  # a milder reason never replaces a worse one
    (FE.ERR, (F.DEADLINE,), F.DEADLINE),
    (FE.ERR, (F.DEAD,), F.DEAD),
    (FE.HANG, (F.NONE, F.ERROR, F.TIMEOUT, F.DEADLINE), F.TIMEOUT),
    (FE.RUN_OUT, (F.NONE, F.ERROR, F.TIMEOUT, F.DEADLINE), F.DEADLINE),
    (FE.DIE, (F.NONE, F.ERROR, F.TIMEOUT, F.DEADLINE, F.DEAD), F.DEAD),
    (FE.REJOIN, (F.NONE, F.ERROR), F.NONE),
)


class Memory(StrEnum):
    AS_FOUND = "AS_FOUND"
    RESUMED = "RESUMED"
    TAKEN = "TAKEN"


class MemoryEvent(StrEnum):
    RESUME = "resume"  # resumed, and the engine says it was held already
    TAKE = "take"  # resumed, and it was released before (or the engine does not say)
    RELEASE = "release"


M, ME = Memory, MemoryEvent
MEMORY_TRANSITIONS: tuple[tuple[MemoryEvent, tuple[Memory, ...], Memory], ...] = (
    (ME.RESUME, (M.AS_FOUND, M.RESUMED), M.RESUMED),
    (ME.RESUME, (M.TAKEN,), M.TAKEN),
    (ME.TAKE, (M.AS_FOUND, M.RESUMED, M.TAKEN), M.TAKEN),
    (ME.RELEASE, (M.RESUMED, M.TAKEN), M.AS_FOUND),
)
MEMORY_REGIONS: tuple[str, ...] = ("weights", "kv_cache")


class Update(StrEnum):
    NAMED = "NAMED"
    OPENING = "OPENING"
    OPEN = "OPEN"
    FINALIZED = "FINALIZED"
    UNNAMED = "UNNAMED"


class UpdateEvent(StrEnum):
    OPEN = "open"  # a begin is about to be sent
    BEGIN = "begin"  # it succeeded: the plan is recorded
    CLOSE = "close"  # finalize: the session ends
    COMPLETE = "complete"  # ... and every planned bucket was acked
    PUBLISH = "publish"
    RESET = "reset"  # a probe or a quarantine: whatever session this driver ran is over
    TAINT = "taint"  # found paused on first contact: someone may have left an update half done
    VOUCH = "vouch"  # a continue the runner asked for (only for named weights), or a new server process


U, UE = Update, UpdateEvent
ANY_UPDATE = (U.NAMED, U.OPENING, U.OPEN, U.FINALIZED, U.UNNAMED)
UPDATE_TRANSITIONS: tuple[tuple[UpdateEvent, tuple[Update, ...], Update], ...] = (
    (UE.OPEN, ANY_UPDATE, U.OPENING),
    (UE.BEGIN, (U.OPENING,), U.OPEN),
    (UE.CLOSE, (U.OPEN,), U.UNNAMED),
    (UE.COMPLETE, (U.UNNAMED,), U.FINALIZED),
    (UE.PUBLISH, (U.FINALIZED,), U.NAMED),
    (UE.RESET, (U.OPENING, U.OPEN, U.FINALIZED, U.UNNAMED), U.UNNAMED),
    (UE.RESET, (U.NAMED,), U.NAMED),
    (UE.TAINT, ANY_UPDATE, U.UNNAMED),
    (UE.VOUCH, ANY_UPDATE, U.NAMED),
)


class Connection(StrEnum):
    CLEAN = "CLEAN"
    DIRTY = "DIRTY"
    BROKEN = "BROKEN"
    CLOSED = "CLOSED"


class ConnectionEvent(StrEnum):
    BUILD = "build"  # teardown done, a new connection being made
    FORM = "form"  # every rank connected and every member attached
    ABANDON = "abandon"  # a buffer an engine may still read was abandoned
    BREAK = "break"  # a member failed a collective bucket
    TEAR_DOWN = "tear_down"  # engines detached, ranks disconnected
    CLOSE = "close"


C, CE = Connection, ConnectionEvent
OPEN_CONNECTION = (C.CLEAN, C.DIRTY, C.BROKEN)
CONNECTION_TRANSITIONS: tuple[tuple[ConnectionEvent, tuple[Connection, ...], Connection], ...] = (
    (CE.BUILD, OPEN_CONNECTION, C.DIRTY),
    (CE.FORM, (C.DIRTY,), C.CLEAN),
    (CE.ABANDON, (C.CLEAN, C.DIRTY), C.DIRTY),
    (CE.ABANDON, (C.BROKEN,), C.BROKEN),
    (CE.BREAK, OPEN_CONNECTION, C.BROKEN),
    (CE.TEAR_DOWN, OPEN_CONNECTION, C.CLEAN),
    (CE.CLOSE, (*OPEN_CONNECTION, C.CLOSED), C.CLOSED),
    # a run that outlived `close()` (which waits for it, up to the run's own bound) still ends its
    # cleanup: what it does to a closed connection changes nothing
    (CE.BUILD, (C.CLOSED,), C.CLOSED),
    (CE.FORM, (C.CLOSED,), C.CLOSED),
    (CE.ABANDON, (C.CLOSED,), C.CLOSED),
    (CE.BREAK, (C.CLOSED,), C.CLOSED),
    (CE.TEAR_DOWN, (C.CLOSED,), C.CLOSED),
)


class Trainer(StrEnum):
    RESIDENT = "RESIDENT"
    OFFLOADED = "OFFLOADED"


class TrainerEvent(StrEnum):
    OFFLOAD = "offload"
    RESTORE = "restore"  # restored, or given up on by the failure path (its error is recorded)


TRAINER_TRANSITIONS: tuple[tuple[TrainerEvent, tuple[Trainer, ...], Trainer], ...] = (
    (TrainerEvent.OFFLOAD, (Trainer.RESIDENT,), Trainer.OFFLOADED),
    (TrainerEvent.RESTORE, (Trainer.OFFLOADED,), Trainer.RESIDENT),
)


class Ranks(StrEnum):
    ANSWERING = "ANSWERING"
    STUCK = "STUCK"


class RanksEvent(StrEnum):
    STALL = "stall"


RANKS_TRANSITIONS: tuple[tuple[RanksEvent, tuple[Ranks, ...], Ranks], ...] = (
    (RanksEvent.STALL, (Ranks.ANSWERING, Ranks.STUCK), Ranks.STUCK),
)


class Adapter(StrEnum):
    STAGING = "STAGING"
    STAGED = "STAGED"
    LIVE = "LIVE"
    RETIRED = "RETIRED"
    UNLOADED = "UNLOADED"
    DISCARDED = "DISCARDED"


class AdapterEvent(StrEnum):
    COMPLETE = "complete"  # every planned tensor landed and the adapter was checked whole
    PUBLISH = "publish"  # new requests naming its adapter get this version
    SUPERSEDE = "supersede"  # a newer version of its adapter was published: only requests pinned to it use it
    UNLOAD = "unload"  # its memory freed (the engine's guard: no request is pinned to it)
    DISCARD = "discard"  # a staged version that will never serve (a failed load or run)


A, AE = Adapter, AdapterEvent
ADAPTER_TRANSITIONS: tuple[tuple[AdapterEvent, tuple[Adapter, ...], Adapter], ...] = (
    (AE.COMPLETE, (A.STAGING,), A.STAGED),
    (AE.PUBLISH, (A.STAGED,), A.LIVE),
    (AE.SUPERSEDE, (A.LIVE,), A.RETIRED),
    (AE.UNLOAD, (A.LIVE, A.RETIRED), A.UNLOADED),
    (AE.DISCARD, (A.STAGING, A.STAGED), A.DISCARDED),
)
# the positions in which requests may use a version (LIVE: new ones too; RETIRED: those pinned to it)
SERVABLE_ADAPTER: tuple[Adapter, ...] = (A.LIVE, A.RETIRED)

# name -> (table, initial state, terminal states): what `refit diagram` draws, in this order
FACT_TABLES: dict[str, tuple[tuple[tuple[Any, tuple[Any, ...], Any], ...], StrEnum, tuple[StrEnum, ...]]] = {
    "weights": (WEIGHTS_TRANSITIONS, W.KEPT, (W.LABELLED,)),
    "failure": (FAILURE_TRANSITIONS, F.NONE, (F.DEAD,)),
    "memory": (MEMORY_TRANSITIONS, M.AS_FOUND, ()),
    "update": (UPDATE_TRANSITIONS, U.NAMED, ()),
    "connection": (CONNECTION_TRANSITIONS, C.CLEAN, (C.CLOSED,)),
    "trainer": (TRAINER_TRANSITIONS, Trainer.RESIDENT, ()),
    "ranks": (RANKS_TRANSITIONS, Ranks.ANSWERING, ()),
    "adapter": (ADAPTER_TRANSITIONS, A.STAGING, (A.UNLOADED, A.DISCARDED)),
}
