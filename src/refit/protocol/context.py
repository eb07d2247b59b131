"""RefitContext (what to refit, how, within what budget) and RefitResult (what happened).

A context is created once per training job and passed to every `run`: it remembers what runs
must share (the last published version, the open transport connection, the lock, the trace and
a small thread pool for fanning calls out to engines). `close()` disconnects and ends the trace.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from refit.drivers.base import PAUSE_MODES, EngineDriver, PauseMode, Source, Transport
from refit.errors import ConfigError, RefitError
from refit.protocol.faults import FaultPlan
from refit.protocol.lock import EngineLock, lock_for
from refit.trace import TraceRecorder

Mode = Literal["colocated", "disaggregated"]
EngineStatus = Literal["updated", "unchanged", "quarantined", "stale", "failed"]


@dataclass
class EngineOutcome:
    """Where one engine stands after a run.

    status: updated (serves the new version), unchanged (serves its previous weights and version),
    quarantined (holds weights no version names, or none current: kept out of service until a refit
    completes), stale (was already out of service and this run did not bring it current), failed
    (died or stopped answering: the caller must restart it; it is stale until a refit completes).
    `version` is the version the engine serves, None when it must not serve.
    """

    name: str
    status: EngineStatus
    version: int | None
    buckets: int = 0  # buckets acked in its last attempt
    attempts: int = 0
    error: str | None = None


@dataclass
class RefitResult:
    run_id: str
    ok: bool
    state: str
    version: int | None  # the version this run published, None if it published nothing
    previous_version: int
    engines: dict[str, EngineOutcome]
    phase_seconds: dict[str, float]
    seconds: float
    bytes_moved: int  # bytes packed into the transport
    bytes_delivered: int  # bytes acknowledged by engines, summed over engines
    buckets: int
    trace_path: str | None
    error: RefitError | None = None
    violations: list[Any] = field(default_factory=list)

    def raise_for_error(self) -> RefitResult:
        if self.error is not None:
            raise self.error
        return self


@dataclass
class _Shared:
    """What consecutive runs of one context share."""

    version: int
    next_version: int
    connection_key: tuple[Any, ...] | None = None
    attached: set[str] = field(default_factory=set)  # incarnations attached to the open connection
    engine_versions: dict[str, int | None] = field(default_factory=dict)  # None: stale, must not serve
    incarnations: dict[str, str] = field(default_factory=dict)  # last incarnation seen per engine name
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    closed: bool = False


@dataclass
class RefitContext:
    """Everything one refit needs.

    source, transport, engines: the three driver roles.
    mode: "colocated" runs offload the trainer and restore it afterwards; "disaggregated" skips both.
    pause_mode: abort | retract | in_place (in_place only with engines that declare
        `supports_in_place_pause`: otherwise KV computed with the old weights would survive).
    bucket_bytes: target bucket size; a larger tensor travels alone.
    deadline_s: the whole run's budget; cleanup_grace_s: extra time must-run cleanup may take
        after the deadline (lock release, continue-or-quarantine, restore).
    version: the version the engines hold now (the next successful run publishes a larger one).
    retries: how many more times an engine whose update failed is retried within the run.
    call_timeout_s: cap on a single engine call (None: whatever is left of the deadline); set it
        to drop a hung engine early and let the healthy ones finish inside the deadline.
    lock: the engines' owner-token lock (default: shared by every context over the same engines).
    trace: a path for the JSONL trace, a TraceRecorder, or None (events are still kept in memory).
    faults: a FaultPlan for tests and `refit demo --fail-at`.
    clock: the monotonic clock every deadline and timing reads (`refit replay` swaps in the
        recorded one, so the replayed run makes the same time-based decisions).
    check_invariants: check every run's events against refit.invariants and raise on violation.
    """

    source: Source
    transport: Transport
    engines: Sequence[EngineDriver]
    mode: Mode = "disaggregated"
    pause_mode: PauseMode = "retract"
    bucket_bytes: int = 512 << 20
    deadline_s: float = 600.0
    cleanup_grace_s: float = 10.0
    version: int = 0
    retries: int = 1
    call_timeout_s: float | None = None
    lock: EngineLock | None = None
    trace: str | Path | TraceRecorder | None = None
    faults: FaultPlan | None = None
    check_invariants: bool = True
    clock: Callable[[], float] = time.monotonic
    _shared: _Shared = field(init=False, repr=False)
    recorder: TraceRecorder = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.engines = list(self.engines)
        self.validate()
        if self.lock is None:
            hosted = [lock for lock in (e.engine_lock() for e in self.engines) if lock is not None]
            self.lock = hosted[0] if hosted else lock_for(tuple(e.name for e in self.engines))
        self.recorder = (
            self.trace
            if isinstance(self.trace, TraceRecorder)
            else TraceRecorder(self.trace, config=self.describe(), clock=self.clock)
        )
        self._shared = _Shared(version=self.version, next_version=self.version + 1)

    def validate(self) -> None:
        """Refuse, before anything starts, what cannot be done safely."""
        if not self.engines:
            raise ConfigError("a refit needs at least one engine")
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names):
            raise ConfigError(f"engine names must be unique, got {names}")
        if self.mode not in ("colocated", "disaggregated"):
            raise ConfigError(f"mode must be 'colocated' or 'disaggregated', got {self.mode!r}")
        if self.pause_mode not in PAUSE_MODES:
            raise ConfigError(f"pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")
        if self.pause_mode == "in_place":
            unsafe = [e.name for e in self.engines if not e.supports_in_place_pause]
            if unsafe:
                raise ConfigError(
                    f"pause_mode 'in_place' keeps requests' KV across the update, and engines {unsafe} cannot "
                    "make that KV fresh (their flush refuses while requests hold KV); use 'retract' or 'abort'"
                )
        for e in self.engines:
            if self.transport.kind not in e.transports:
                raise ConfigError(f"engine {e.name} cannot receive the {self.transport.kind!r} transport")
        if self.bucket_bytes <= 0 or self.deadline_s <= 0 or self.cleanup_grace_s < 0:
            raise ConfigError("bucket_bytes and deadline_s must be positive, cleanup_grace_s non-negative")
        if self.retries < 0 or (self.call_timeout_s is not None and self.call_timeout_s <= 0):
            raise ConfigError("retries must be >= 0 and call_timeout_s positive (or None)")

    @property
    def colocated(self) -> bool:
        return self.mode == "colocated"

    @property
    def published_version(self) -> int:
        """The last version a run of this context published (or the initial one)."""
        return self._shared.version

    def describe(self) -> dict[str, Any]:
        return {
            "source": type(self.source).__name__,
            "transport": type(self.transport).__name__,
            "engines": [f"{type(e).__name__}:{e.name}" for e in self.engines],
            "mode": self.mode,
            "pause_mode": self.pause_mode,
            "bucket_bytes": self.bucket_bytes,
            "deadline_s": self.deadline_s,
            "cleanup_grace_s": self.cleanup_grace_s,
            "retries": self.retries,
            "call_timeout_s": self.call_timeout_s,
            "slots": self.transport.slots,
            "version": self.version,
        }

    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._shared.pool is None:
            workers = max(4, 2 * len(self.engines) * max(self.transport.slots, 1) + 2)
            self._shared.pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="refit-call")
        return self._shared.pool

    def close(self) -> None:
        """Disconnect the transport (engines detach) and end the trace. Idempotent."""
        if self._shared.closed:
            return
        from refit.protocol.runner import disconnect

        disconnect(self, timeout=self.cleanup_grace_s or 5.0)
        if self._shared.pool is not None:
            self._shared.pool.shutdown(wait=False, cancel_futures=True)
        self.recorder.close()
        self._shared.closed = True

    def __enter__(self) -> RefitContext:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
