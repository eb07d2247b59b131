"""`run(ctx)`: one refit, driven through the state table, with cleanup that always runs.

How a run proceeds:
  1. Take the engines' lock with a fresh owner token (busy -> RefitBusyError, nothing done).
  2. For each phase: commit the move in the machine (a refused move raises IllegalTransition),
     record the transition, then make the phase's driver calls. Engine calls fan out to the
     engines still in the run, on the context's thread pool; each is bounded by the run's one
     deadline (and `call_timeout_s`) and recorded as one event, in engine order.
  3. An engine whose call fails leaves the run (an `engine/dropped` event says why: error,
     timeout or dead); the others carry on. Engines that failed with an error after being paused
     are retried (`retry`: INVALIDATING again for them alone) while `retries` and time remain.
  4. TRANSFERRING streams buckets through `transport.slots` buffers: bucket i+1 is packed while
     engines copy bucket i; a buffer is reused only after every engine answered for it (a timed
     out engine leaves its buffer abandoned, never reused).
  5. CONTINUING: a per-engine commit gate re-checks from the run's own events that the engine's
     last attempt acked every bucket and finalized; those engines publish the version and
     continue. Engines that received no byte continue on their old weights; engines holding
     weights no version names are quarantined (STALE until a refit completes).
  6. A failure of the run itself (trainer side, deadline, no engine left) moves to ABORTING: owed
     finalizes run, clean engines continue, the trainer is restored, the connection is torn down,
     poisoned engines are quarantined (QUARANTINING), the run latches FAILED. Cleanup is bounded
     by the deadline plus `cleanup_grace_s`; the lock is released on every exit.
  7. The run's events are checked against `refit.invariants`; a violation raises.

A note on order: the runner commits a move and only then makes that phase's calls, so a failure is
recorded in the state where it happened (the trace says TRANSFERRING, engine e1, bucket 2), which
is what `refit check` and `refit replay` need. No I/O happens inside the machine.
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from refit import invariants
from refit.drivers.base import EngineDriver, Payload
from refit.drivers.buckets import BucketManifest, plan_buckets
from refit.errors import (
    DeadlineExceeded,
    DriverCallError,
    EngineDied,
    EngineError,
    InvariantViolation,
    NoTimeLeft,
    RefitBusyError,
    RefitError,
)
from refit.protocol.context import EngineOutcome, RefitContext, RefitResult
from refit.protocol.deadline import Deadline
from refit.protocol.faults import Fault, InjectedFault
from refit.states import RefitMachine, RefitState, Trigger

S, T = RefitState, Trigger
SLACK_S = 0.5  # how long past a call's timeout to wait for a driver whose own timeout should fire
RETRY_STATES = ("INVALIDATING", "TRANSFERRING", "POST_PROCESSING")  # failures here are retried


@dataclass
class _Engine:
    """The runner's view of one engine during one run."""

    index: int
    driver: EngineDriver
    previous_version: int | None  # None: stale (new incarnation, or left unversioned earlier)
    active: bool = True  # still on the run's happy path
    failure: str | None = None  # why it left: "error" | "timeout" (hung) | "dead" | "deadline" (no time left)
    failed_in: str | None = None  # the state it failed in
    error: str | None = None
    exc: RefitError | None = None  # the first error, as raised
    weights_ok: bool = True  # False: its weight memory came back without contents
    paused: bool = False  # a pause call was made (whatever its outcome)
    attempt: int = -1  # the pass it was last streamed in
    attempts: int = 0
    begun: bool = False  # begin succeeded in its current attempt: one finalize is owed
    finalized: bool = False  # ... and was paid
    loads_ok: set[int] = field(default_factory=set)  # acked in its current attempt
    touched: bool = False  # a bucket may have been applied (any attempt)
    bytes_ok: int = 0
    published: bool = False
    continued: bool = False
    kv_resumed: bool = False  # colocated: KV memory given back
    quarantined: bool = False
    starved: bool = False  # its last call never started: the run had no time left

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def reachable(self) -> bool:
        return self.failure not in ("dead", "timeout")

    def complete(self, n_buckets: int) -> bool:
        return self.begun and self.finalized and len(self.loads_ok) == n_buckets

    @property
    def must_not_serve(self) -> bool:
        """Holds weights its version does not name (or has no current version): never continue it."""
        return not self.published and (self.touched or not self.weights_ok or self.previous_version is None)


@dataclass
class _Reply:
    engine: _Engine
    ok: bool
    value: Any
    error: RefitError | None
    outcome: str  # ok | error | timeout


@dataclass
class _Pending:
    engine: _Engine
    call: str
    bucket: int | None
    state: str
    future: Future[Any]
    wait_s: float  # how long this call may take
    start: float


class _Run:
    def __init__(self, ctx: RefitContext) -> None:
        self.ctx = ctx
        self.run_id = uuid.uuid4().hex[:12]
        self.owner = f"{self.run_id}:{uuid.uuid4().hex[:8]}"
        self.machine = RefitMachine()
        shared = ctx._shared
        self.previous_version = shared.version
        self.version = shared.next_version
        self.engines = []
        for i, d in enumerate(ctx.engines):
            known = shared.incarnations.get(d.name)
            restarted = known is not None and known != d.incarnation
            previous = None if restarted else shared.engine_versions.get(d.name, shared.version)
            self.engines.append(_Engine(i, d, previous))
        self.clock = ctx.clock
        self.deadline = Deadline(ctx.deadline_s, clock=ctx.clock)
        self.cleanup_deadline = self.deadline.extended(ctx.cleanup_grace_s)
        self.attempt = 0
        self.events: list[dict[str, Any]] = []
        self.phase_seconds: dict[str, float] = {}
        self._phase_t0 = self.clock()
        self.plan: list[BucketManifest] = []
        self.bytes_moved = 0
        self.offloaded = False
        self.connection_dirty = False
        self.inflight: deque[tuple[Payload, list[_Pending]]] = deque()
        self.simulated_dead: set[str] = set()
        self.first_error: RefitError | None = None  # the first engine failure, for attribution
        self.error: RefitError | None = None

    # ---- recording ---------------------------------------------------------------------------

    def emit(self, kind: str, event: str, *, state: str | None = None, **fields: Any) -> dict[str, Any]:
        fields.setdefault("version", self.version)  # the version this run refits to
        fields.setdefault("attempt", self.attempt)
        record = self.ctx.recorder.emit(kind, event, run=self.run_id, state=state or str(self.machine.state), **fields)
        self.events.append(record)
        return record

    def enter(self, trigger: Trigger, *, bucket: int | None = None) -> None:
        src = self.machine.state
        dst = self.machine.fire(trigger)
        now = self.clock()
        if dst != src:
            self.phase_seconds[str(src)] = self.phase_seconds.get(str(src), 0.0) + now - self._phase_t0
            self._phase_t0 = now
        self.emit("transition", str(trigger), src=str(src), dst=str(dst), bucket=bucket)

    def _wrap(self, exc: BaseException, call: str, state: str, engine: str | None, bucket: int | None) -> RefitError:
        if isinstance(exc, RefitError):
            return exc
        where = {"state": state, "engine": engine, "call": call, "bucket": bucket}
        if isinstance(exc, TimeoutError):  # concurrent.futures.TimeoutError is TimeoutError
            return DeadlineExceeded(f"{call} did not finish inside the deadline: {exc}", cause=exc, **where)
        return DriverCallError(f"{call} failed: {type(exc).__name__}: {exc}", cause=exc, **where)

    def _fault(self, call: str, engine: int | None, bucket: int | None) -> Fault | None:
        plan = self.ctx.faults
        fault = plan.take(str(self.machine.state), call, engine, bucket) if plan else None
        if fault is not None:
            self.emit("fault", "injected", fault=fault.describe(), call=call)
        return fault

    # ---- calls ---------------------------------------------------------------------------------

    def _budget(self, cleanup: bool) -> float:
        left = (self.cleanup_deadline if cleanup else self.deadline).remaining()
        cap = self.ctx.call_timeout_s
        return left if cap is None else min(left, cap)

    def inline(
        self,
        call: str,
        side: str,
        fn: Callable[[], Any],
        *,
        bucket: int | None = None,
        cleanup: bool = False,
        **extra: Any,
    ) -> Any:
        """A trainer-side call (source or transport: gathers, collectives, copies), bounded by the
        deadline like an engine call: it runs on the pool and the runner stops waiting when the
        time is up (a hung collective cannot be cancelled, but it no longer holds the run)."""
        deadline = self.cleanup_deadline if cleanup else self.deadline
        state = str(self.machine.state)
        t0 = self.clock()
        try:
            if deadline.expired():
                raise TimeoutError(f"the run's deadline ({deadline.budget_s:g}s) passed before {call}")
            fault = self._fault(call, None, bucket)
            if fault is not None and fault.kind == "hang":  # the call does not return before the run ends
                fn = functools.partial(time.sleep, self.cleanup_deadline.remaining() + 1.0)
            elif fault is not None:
                raise InjectedFault(f"injected {fault.kind} fault at {state}/{call}")
            future = self.ctx.pool().submit(fn)
            try:
                value = future.result(timeout=deadline.remaining())
            except TimeoutError:
                if future.done():
                    raise
                raise TimeoutError(f"{call} did not return inside the deadline ({deadline.budget_s:g}s)") from None
        except Exception as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            self._record_call(call, side, state, outcome, t0, bucket=bucket, error=exc, **extra)
            raise self._wrap(exc, call, state, None, bucket) from exc
        self._record_call(call, side, state, "ok", t0, bucket=bucket, **extra)
        return value

    def _record_call(
        self,
        call: str,
        side: str,
        state: str,
        outcome: str,
        t0: float,
        *,
        error: BaseException | None = None,
        **fields: Any,
    ) -> None:
        self.emit(
            "call", call, state=state, side=side, outcome=outcome, duration_s=round(self.clock() - t0, 6),
            error=None if error is None else f"{type(error).__name__}: {error}", **fields,
        )  # fmt: skip

    def submit(
        self,
        call: str,
        engine: _Engine,
        fn: Callable[[EngineDriver, float], Any],
        *,
        bucket: int | None = None,
        cleanup: bool = False,
    ) -> _Pending:
        state = str(self.machine.state)
        wait_s = self._budget(cleanup)
        fault = self._fault(call, engine.index, bucket)
        fut: Future[Any] = Future()
        if engine.name in self.simulated_dead:
            fut.set_exception(EngineDied(f"engine {engine.name} is gone (simulated kill)"))
        elif fault is not None and fault.kind == "raise":
            fut.set_exception(InjectedFault(f"injected raise fault at {state}/{call}"))
        elif fault is not None and not self._arm(engine, fault, call, bucket, wait_s):
            self._simulate(fault, engine, call, wait_s, fut)
        elif wait_s <= 0:
            fut.set_exception(NoTimeLeft(f"no time left in the run's deadline for {call}"))
        else:
            fut = self.ctx.pool().submit(_timed, fn, engine.driver, wait_s)
        return _Pending(engine, call, bucket, state, fut, wait_s, self.clock())

    def _arm(self, engine: _Engine, fault: Fault, call: str, bucket: int | None, wait_s: float) -> bool:
        """Ask the engine to misbehave for real on this call; False if its driver cannot."""
        seconds = wait_s + SLACK_S + 0.5  # a hang outlasts the call's whole budget
        try:
            return bool(engine.driver.arm_fault(fault.kind, call, bucket=bucket, seconds=seconds, timeout=5.0))
        except Exception:
            return False

    def _simulate(self, fault: Fault, engine: _Engine, call: str, wait_s: float, fut: Future[Any]) -> None:
        if fault.kind == "kill":
            self.simulated_dead.add(engine.name)
            fut.set_exception(EngineDied(f"engine {engine.name} is gone (simulated kill)"))
        elif fault.kind == "corrupt":
            fut.set_exception(EngineError("bad_payload", f"{call}: payload corrupted in transit (simulated)"))
        else:  # hang: the engine never answers inside the call's budget
            self.ctx.pool().submit(_sleep_then, wait_s + SLACK_S + 0.1, fut)

    def collect(self, p: _Pending) -> _Reply:
        """Wait for one engine call (bounded) and record it. An engine already known to be hung
        is not waited on again: its other calls are only checked, not awaited."""
        value: Any = None
        exc: Exception | None = None
        done_at = None
        wait = 0.0 if p.engine.failure == "timeout" else max(p.wait_s, 0.0) + SLACK_S
        try:
            value, done_at = p.future.result(timeout=wait)
        except Exception as caught:
            exc = caught
            p.engine.starved = isinstance(caught, NoTimeLeft)
            if isinstance(caught, TimeoutError) and not p.future.done():  # our wait ran out, not the driver's
                exc = TimeoutError(f"{p.call} on engine {p.engine.name} did not return inside its {p.wait_s:.3g}s")
        outcome = "ok" if exc is None else "timeout" if isinstance(exc, TimeoutError) else "error"
        extra: dict[str, Any] = {"result": value} if isinstance(value, dict) else {}
        if getattr(exc, "no_effect", False):
            extra["effect"] = "none"  # the engine refused it before changing anything
        self._record_call(
            p.call, "engine", p.state, outcome, p.start, engine=p.engine.name, bucket=p.bucket, error=exc,
            done_at=done_at, attempt=max(p.engine.attempt, 0), **extra,
        )  # fmt: skip
        if exc is None:
            return _Reply(p.engine, True, value, None, "ok")
        return _Reply(p.engine, False, None, self._wrap(exc, p.call, p.state, p.engine.name, p.bucket), outcome)

    def fanout(
        self,
        call: str,
        fn: Callable[[EngineDriver, float], Any],
        engines: Sequence[_Engine] | None = None,
        *,
        cleanup: bool = False,
    ) -> list[_Reply]:
        targets = [e for e in self.engines if e.active] if engines is None else list(engines)
        pendings = [self.submit(call, e, fn, cleanup=cleanup) for e in targets]
        return [self.collect(p) for p in pendings]

    # ---- engines leaving the run -------------------------------------------------------------

    def drop(self, reply: _Reply) -> None:
        e = reply.engine
        err = reply.error
        dead = isinstance(getattr(err, "cause", None), EngineDied) or isinstance(err, EngineDied)
        if e.failure == "dead":
            return
        before = e.failure
        if e.active or dead or (reply.outcome == "timeout" and not e.starved):
            if dead:
                e.failure = "dead"
            elif reply.outcome == "timeout":
                e.failure = "deadline" if e.starved else "timeout"
            else:
                e.failure = "error"
        e.error = e.error or str(err)
        e.exc = e.exc or err
        if e.active:
            e.active = False
            e.failed_in = reply.error.state if reply.error else str(self.machine.state)
        if e.failure != before:
            self.emit("engine", "dropped", engine=e.name, failure=e.failure, error=str(err))

    def settle(self, replies: list[_Reply]) -> None:
        """Engines whose call failed leave the run (the others carry on)."""
        for r in replies:
            if not r.ok:
                self.drop(r)
                self.first_error = self.first_error or r.error

    def require_engines(self, what: str) -> None:
        """The run itself fails when no engine is left to carry it."""
        if not any(e.active for e in self.engines):
            raise self.first_error or DriverCallError(f"no engine left {what}", state=str(self.machine.state))

    # ---- the happy path ------------------------------------------------------------------------

    def execute(self) -> None:
        ctx = self.ctx
        if ctx.colocated:
            self.enter(T.OFFLOAD)
            self.offloaded = True
            self.inline("offload", "source", ctx.source.offload)
            replies = self.fanout("resume_memory", lambda d, t: d.resume_memory(["weights"], timeout=t))
            for r in replies:  # a failed resume leaves the weights unknown: treat them as lost
                intact = isinstance(r.value, dict) and r.value.get("weights_intact") is not False
                r.engine.weights_ok = r.ok and intact
            self.settle(replies)
            self.require_engines("after giving engines their weight memory")

        self.enter(T.CONNECT)
        metas = self.inline("metas", "source", ctx.source.metas)
        self.plan = plan_buckets(metas, ctx.bucket_bytes)
        self.emit(
            "plan", "buckets", buckets=len(self.plan), nbytes=sum(m.nbytes for m in self.plan), tensors=len(metas),
            manifests=[m.summary() for m in self.plan],
        )  # fmt: skip
        self.connect()
        self.require_engines("attached to the transport")

        self.enter(T.PAUSE)
        for e in self.engines:
            e.paused = e.active
        self.settle(self.fanout("pause", lambda d, t: d.pause(ctx.pause_mode, timeout=t)))
        self.require_engines("paused")

        self.enter(T.INVALIDATE)
        self.update([e for e in self.engines if e.active])
        while retry := self.retryable():
            self.attempt += 1
            self.enter(T.RETRY)
            self.update(retry)
        self.require_engines("with a complete update")

        self.enter(T.PUBLISH)
        self.commit()
        if not any(e.published for e in self.engines):
            raise self.first_error or DriverCallError("no engine published the version", state="CONTINUING")
        self.settle_rest(cleanup=False)

        if ctx.colocated:
            self.enter(T.RESTORE)
            self.inline("restore", "source", ctx.source.restore)
            self.offloaded = False
            self.resume_kv([e for e in self.engines if e.continued], cleanup=False)
            self.resume_kv([e for e in self.engines if e.continued and not e.kv_resumed and e.reachable], cleanup=False)
        self.enter(T.FINISH)

    def connect(self) -> None:
        ctx, shared = self.ctx, self.ctx._shared
        incarnations = tuple(e.driver.incarnation for e in self.engines)
        key = (incarnations, max([m.nbytes for m in self.plan] + [0]))  # same processes, buckets fit
        if shared.connection_key == key and ctx.transport.connected and shared.attached >= set(incarnations):
            return
        if ctx.transport.connected or shared.connection_key is not None:
            disconnect(ctx, timeout=self.deadline.remaining(), run=self)
        self.connection_dirty = True
        info = self.inline("connect", "transport", lambda: ctx.transport.connect(self.plan, len(self.engines)))
        shared.connection_key = key
        replies = self.fanout("attach", lambda d, t: d.attach(info, timeout=t))
        shared.attached = {r.engine.driver.incarnation for r in replies if r.ok}
        self.connection_dirty = False
        self.settle(replies)

    def update(self, engines: list[_Engine]) -> None:
        """INVALIDATING -> TRANSFERRING -> POST_PROCESSING for `engines` (one attempt each)."""
        for e in engines:
            e.active, e.failure, e.begun, e.finalized, e.loads_ok = True, None, False, False, set()
            e.attempt, e.attempts = self.attempt, e.attempts + 1
        self.settle(self.fanout("flush", lambda d, t: d.flush(timeout=t), [e for e in engines if e.active]))
        replies = self.fanout("begin", lambda d, t: d.begin(self.plan, timeout=t), [e for e in engines if e.active])
        for r in replies:
            r.engine.begun = r.ok
        self.settle(replies)
        self.transfer([e for e in engines if e.active])
        self.enter(T.POST_PROCESS)
        self.finalize_owed(cleanup=False)

    def retryable(self) -> list[_Engine]:
        if self.deadline.remaining() <= 0:
            return []
        return [
            e for e in self.engines
            if not e.active and e.failure == "error" and e.failed_in in RETRY_STATES
            and e.attempts <= self.ctx.retries
        ]  # fmt: skip

    def transfer(self, engines: list[_Engine]) -> None:
        self.enter(T.TRANSFER)
        if not self.plan or not any(e.active for e in engines):
            return  # nobody left to receive: do not touch the source
        buckets = iter(self.ctx.source.iter_buckets(self.plan))
        try:
            self._stream(buckets, engines)
        finally:
            close = getattr(buckets, "close", None)
            if close is not None:  # a generator source releases what it holds now, not at GC
                with contextlib.suppress(ValueError):  # still running in a hung call: left to finish
                    close()

    def _stream(self, buckets: Any, engines: list[_Engine]) -> None:
        ctx = self.ctx
        for manifest in self.plan:
            i = manifest.index
            if i > 0:
                self.enter(T.NEXT_BUCKET, bucket=i)
            tensors = self.inline("materialize", "source", lambda i=i: _next_bucket(buckets, i), bucket=i)
            while len(self.inflight) >= max(ctx.transport.slots, 1):
                self.drain_oldest()
            payload = self.inline(
                "pack", "transport", lambda m=manifest, ts=tensors: ctx.transport.pack(m, ts), bucket=i,
                manifest=manifest.summary(),
            )  # fmt: skip
            self.bytes_moved += manifest.nbytes
            targets = [e for e in engines if e.active]
            pendings = [self.submit("load", e, lambda d, t, p=payload: d.load(p, timeout=t), bucket=i) for e in targets]
            self.inflight.append((payload, pendings))
            del tensors
            if not targets:
                break
        while self.inflight:
            self.drain_oldest()

    def drain_oldest(self, *, cleanup: bool = False) -> None:
        """Collect every engine's answer for the oldest in-flight bucket, then release its buffer
        (or abandon it, if an engine did not answer and may still be reading it)."""
        payload, pendings = self.inflight.popleft()
        replies = [self.collect(p) for p in pendings]
        for r in replies:
            if r.ok:
                r.engine.touched = True
                r.engine.loads_ok.add(payload.manifest.index)
                r.engine.bytes_ok += payload.manifest.nbytes
            elif not getattr(getattr(r.error, "cause", None), "no_effect", False):
                r.engine.touched = True  # the engine may have applied part of it
        transport = self.ctx.transport
        answered = all(r.outcome != "timeout" for r in replies)
        if not answered:
            self.connection_dirty = True  # this connection is not reused by the next run
        call, free = ("release", transport.release) if answered else ("abandon", transport.abandon)
        with contextlib.suppress(*((RefitError,) if cleanup else ())):  # never reuse a buffer an engine may read
            self.inline(
                call, "transport", functools.partial(free, payload), bucket=payload.manifest.index, cleanup=cleanup
            )
        self.settle(replies)

    def finalize_owed(self, *, cleanup: bool) -> None:
        """Every session a begin opened is finalized exactly once (dead or hung engines excepted)."""
        owed = [e for e in self.engines if e.begun and not e.finalized and e.reachable]
        replies = self.fanout("finalize", lambda d, t: d.finalize(timeout=t), owed, cleanup=cleanup)
        for r in replies:
            r.engine.finalized = r.ok
            r.engine.begun = r.ok  # a failed finalize closed the session too: it is never repeated
        self.settle(replies)

    def commit(self) -> None:
        n = len(self.plan)
        ready = [e for e in self.engines if e.active and e.complete(n)]
        for e in ready:
            problems = invariants.commit_gate(self.events, [e.name], n, attempt=e.attempt)
            if problems:
                raise InvariantViolation("commit gate refused to publish: " + "; ".join(problems), state="CONTINUING")
        replies = self.fanout("publish", lambda d, t: d.publish(self.version, timeout=t), ready)
        for r in replies:
            r.engine.published = r.ok
            r.engine.touched = r.engine.touched or not r.ok  # a failed publish: label unknown
        if any(e.published for e in self.engines):
            self.ctx._shared.version = self.version
        self.settle(replies)
        replies = self.fanout("continue_generation", _continue, [e for e in self.engines if e.published])
        for r in replies:
            r.engine.continued = r.ok
        self.settle(replies)

    def settle_rest(self, *, cleanup: bool) -> None:
        """Engines that did not commit: continue the clean ones, quarantine the poisoned ones."""
        rest = [e for e in self.engines if not e.continued and not e.quarantined and e.failure != "dead"]
        back = [e for e in rest if not e.must_not_serve and (e.paused or e.error)]
        replies = self.fanout("continue_generation", _continue, back, cleanup=cleanup)
        for r in replies:
            r.engine.continued = r.ok
        self.settle(replies)
        out = [e for e in rest if e.must_not_serve and (e.paused or e.touched or not e.weights_ok)]
        if out and cleanup:
            self.enter(T.QUARANTINE)
        reason = f"refit to version {self.version} (run {self.run_id}) did not complete on this engine"
        replies = self.fanout("quarantine", lambda d, t: d.quarantine(reason, timeout=t), out, cleanup=cleanup)
        for r in replies:
            r.engine.quarantined = r.ok
        self.settle(replies)

    def resume_kv(self, engines: Sequence[_Engine], *, cleanup: bool) -> None:
        replies = self.fanout(
            "resume_memory", lambda d, t: d.resume_memory(["kv_cache"], timeout=t), engines, cleanup=cleanup
        )
        for r in replies:
            r.engine.kv_resumed = r.ok
        self.settle(replies)

    # ---- the failure path ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """ABORTING -> [QUARANTINING] -> FAILED. Every step is bounded and recorded."""
        ctx = self.ctx
        self.error = (
            exc if isinstance(exc, RefitError) else self._wrap(exc, "runner", str(self.machine.state), None, None)
        )
        self.enter(T.FAIL)
        self.emit("run", "error", error=str(self.error))
        while self.inflight:  # what engines did with in-flight buckets, before buffers are touched
            self.drain_oldest(cleanup=True)
        self.finalize_owed(cleanup=True)
        if self.offloaded:
            with contextlib.suppress(RefitError):  # recorded; cleanup goes on
                self.inline("restore", "source", ctx.source.restore, cleanup=True)
            self.offloaded = False
        if self.connection_dirty or any(e.touched and not e.published for e in self.engines):
            disconnect(ctx, timeout=self.cleanup_deadline.remaining(), run=self)
        self.settle_rest(cleanup=True)
        if ctx.colocated:
            self.resume_kv([e for e in self.engines if e.continued and not e.kv_resumed], cleanup=True)
        self.enter(T.LATCH)

    # ---- result ----------------------------------------------------------------------------------

    def outcomes(self) -> dict[str, EngineOutcome]:
        out = {}
        colocated = self.ctx.colocated
        for e in self.engines:
            serving = e.continued and (e.kv_resumed or not colocated)
            if e.published and serving:
                status, version = "updated", self.version
            elif e.quarantined:
                status, version = "quarantined", None
            elif serving and not e.must_not_serve:
                status, version = "unchanged", e.previous_version
            elif e.failure in ("dead", "timeout") or e.paused or e.continued:
                status, version = "failed", None  # died, hung, or left paused / without KV memory
            elif e.must_not_serve:
                status, version = "stale", None
            else:
                status, version = "unchanged", e.previous_version  # never touched: kept serving throughout
            out[e.name] = EngineOutcome(e.name, status, version, len(e.loads_ok), e.attempts, e.error)  # type: ignore[arg-type]
        return out


def _timed(fn: Callable[[EngineDriver, float], Any], driver: EngineDriver, timeout: float) -> tuple[Any, float]:
    """Run a driver call and note when it returned (CLOCK_MONOTONIC: comparable with engine audits)."""
    value = fn(driver, timeout)
    return value, round(time.monotonic(), 6)


def _sleep_then(seconds: float, fut: Future[Any]) -> None:
    time.sleep(seconds)
    if not fut.done():
        fut.set_exception(TimeoutError("engine did not answer (simulated hang)"))


def _continue(d: EngineDriver, t: float) -> None:
    d.continue_generation(timeout=t)


def _next_bucket(buckets: Any, index: int) -> Any:
    try:
        return next(buckets)
    except StopIteration:
        raise RuntimeError(f"the source yielded no bucket {index}: it ended before the plan did") from None


def disconnect(ctx: RefitContext, *, timeout: float, run: _Run | None = None) -> None:
    """Engines detach, the transport frees its buffers; best effort, bounded, recorded."""
    shared = ctx._shared
    if not ctx.transport.connected and shared.connection_key is None:
        return
    shared.connection_key = None
    shared.attached = set()
    clock = ctx.clock
    deadline = Deadline(max(timeout, 0.05), clock=clock)
    emit = run.emit if run is not None else ctx.recorder.emit
    pool = ctx.pool()
    pendings = [(d, pool.submit(d.detach, timeout=deadline.remaining()), clock()) for d in ctx.engines]
    for d, fut, t0 in pendings:
        try:
            fut.result(timeout=deadline.remaining() + SLACK_S)
            outcome, error = "ok", None
        except Exception as exc:  # a dead engine cannot detach; the transport is freed anyway
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            error = f"{type(exc).__name__}: {exc}"
        emit(
            "call", "detach", side="engine", engine=d.name, outcome=outcome,
            duration_s=round(clock() - t0, 6), error=error,
        )  # fmt: skip
    t0 = clock()
    try:
        ctx.transport.disconnect()
        emit("call", "disconnect", side="transport", outcome="ok", duration_s=round(clock() - t0, 6))
    except Exception as exc:
        emit("call", "disconnect", side="transport", outcome="error", error=f"{type(exc).__name__}: {exc}")


def run(ctx: RefitContext) -> RefitResult:
    """Drive one whole refit. Returns a RefitResult whether it succeeded or failed (errors are data:
    `result.ok`, `result.error`, per-engine `result.engines`); raises RefitBusyError when another
    run holds the engines, and InvariantViolation when the run's own events break an invariant."""
    if ctx._shared.closed:
        raise RuntimeError("this RefitContext is closed")
    r = _Run(ctx)
    r.emit(
        "run", "start", previous_version=r.previous_version, owner=r.owner, engines=[e.name for e in r.engines],
        incarnations=[e.driver.incarnation for e in r.engines], mode=ctx.mode, pause_mode=ctx.pause_mode,
        bucket_bytes=ctx.bucket_bytes, deadline_s=ctx.deadline_s, cleanup_grace_s=ctx.cleanup_grace_s,
        retries=ctx.retries, call_timeout_s=ctx.call_timeout_s,
    )  # fmt: skip
    lock = ctx.lock
    if lock is None:  # RefitContext.__post_init__ always sets one
        raise RuntimeError("RefitContext has no lock")
    holder = lock.holder
    if not lock.acquire(r.owner):
        r.emit("lock", "acquire", owner=r.owner, outcome="busy", holder=holder)
        r.emit("run", "end", result="busy")
        raise RefitBusyError(f"engines {[e.name for e in r.engines]} are being refit by another run", state="IDLE")
    r.emit("lock", "acquire", owner=r.owner, outcome="ok", holder=holder)
    interrupt: BaseException | None = None
    t0 = ctx.clock()
    try:
        r.execute()
    except BaseException as exc:
        if not isinstance(exc, Exception):
            interrupt = exc  # KeyboardInterrupt / SystemExit: clean up, then re-raise
        r.abort(exc)
    finally:
        released = lock.release(r.owner)
        r.emit("lock", "release", owner=r.owner, outcome="ok" if released else "not_owner", holder=r.owner)
        ctx._shared.next_version = r.version + 1
        outcomes = r.outcomes()
        ctx._shared.engine_versions.update({name: o.version for name, o in outcomes.items()})
        ctx._shared.incarnations.update({e.name: e.driver.incarnation for e in r.engines})
        now = ctx.clock()
        r.phase_seconds[str(r.machine.state)] = r.phase_seconds.get(str(r.machine.state), 0.0) + now - r._phase_t0
        published = r.version if any(e.published for e in r.engines) else None
        r.emit(
            "run", "end", result=str(r.machine.state), published=published,
            engine_outcomes={n: {"status": o.status, "version": o.version} for n, o in outcomes.items()},
            error=None if r.error is None else str(r.error),
        )  # fmt: skip
    failed = [o for o in outcomes.values() if o.status != "updated"]
    error = r.error
    if error is None and failed:
        first = next(e for e in r.engines if e.name == failed[0].name)
        cause = first.exc
        error = DriverCallError(
            f"{len(failed)} of {len(outcomes)} engines did not take version {r.version} "
            f"({', '.join(f'{o.name} {o.status}' for o in failed)})"
            + (f": {cause.message}" if cause is not None else ""),
            cause=cause,
            state=cause.state if cause is not None else first.failed_in,
            engine=first.name,
            call=cause.call if cause is not None else None,
            bucket=cause.bucket if cause is not None else None,
        )
    result = RefitResult(
        run_id=r.run_id,
        ok=r.machine.state == S.DONE and not failed,
        state=str(r.machine.state),
        version=published,
        previous_version=r.previous_version,
        engines=outcomes,
        phase_seconds={k: round(v, 6) for k, v in r.phase_seconds.items()},
        seconds=round(now - t0, 6),
        bytes_moved=r.bytes_moved,
        bytes_delivered=sum(e.bytes_ok for e in r.engines),
        buckets=len(r.plan),
        trace_path=str(ctx.recorder.path) if ctx.recorder.path else None,
        error=error,
    )
    if interrupt is not None:
        raise interrupt
    if ctx.check_invariants:
        result.violations = invariants.check_run(r.events)
        if result.violations:
            err = InvariantViolation("; ".join(str(v) for v in result.violations))
            err.result = result  # type: ignore[attr-defined]
            raise err
    return result
