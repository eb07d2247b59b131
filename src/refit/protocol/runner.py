"""`run(ctx)`: one refit, driven through the state table, with cleanup that always runs.

How a run proceeds:
  1. Take the engines' lock with a fresh owner token (busy -> RefitBusyError, nothing done).
  2. For each phase: commit the move in the machine (a refused move raises IllegalTransition),
     record the transition, then make the phase's driver calls. Engine calls fan out to all
     engines at once on the context's thread pool; each is bounded by the run's one deadline
     and recorded as one event, in engine order, so traces are deterministic.
  3. TRANSFERRING streams buckets through `transport.slots` buffers: bucket i+1 is packed while
     engines copy bucket i, and a buffer is released for reuse only after every engine acked it.
  4. Before CONTINUING, a commit gate re-checks from the run's own events that every engine
     acked every bucket and finalized; only then is the version published, then generation
     continued.
  5. Any failure moves to ABORTING: sessions that were opened are finalized (once), engines that
     received no byte are continued on their old weights, the trainer is restored, the
     connection is torn down; engines holding weights no version names (POISONED) are
     quarantined in QUARANTINING; the run latches FAILED. All of it is bounded by the deadline
     plus `cleanup_grace_s`, and the lock is released on every exit.
  6. The run's events are checked against `refit.invariants`; a violation raises.
"""

from __future__ import annotations

import contextlib
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
    InvariantViolation,
    RefitBusyError,
    RefitError,
)
from refit.protocol.context import EngineOutcome, RefitContext, RefitResult
from refit.protocol.deadline import Deadline
from refit.protocol.faults import InjectedFault
from refit.states import RefitMachine, RefitState, Trigger

S, T = RefitState, Trigger
SLACK_S = 0.5  # how long past the deadline to wait for a driver whose own timeout should fire


@dataclass
class _Engine:
    """The runner's view of one engine during one run."""

    index: int
    driver: EngineDriver
    previous_version: int | None
    weights_ok: bool = True  # False: its weight memory came back without contents
    paused: bool = False  # a pause call was made (whatever its outcome)
    session: bool = False  # begin succeeded: finalize is owed exactly once
    finalize: str | None = None  # None | "ok" | "error"
    loads_attempted: set[int] = field(default_factory=set)
    loads_ok: set[int] = field(default_factory=set)
    bytes_ok: int = 0
    published: bool = False
    continued: bool = False
    kv_resumed: bool = False  # colocated: KV memory given back after continuing
    quarantined: bool = False
    error: str | None = None

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def touched(self) -> bool:
        """Its weights may differ from what its old version names."""
        return bool(self.loads_attempted) or not self.weights_ok

    @property
    def poisoned(self) -> bool:
        return self.touched and not self.published


@dataclass
class _Pending:
    engine: _Engine
    call: str
    bucket: int | None
    state: str
    future: Future[Any]
    deadline: Deadline
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
        self.engines = [
            _Engine(i, d, shared.engine_versions.get(d.name, shared.version)) for i, d in enumerate(ctx.engines)
        ]
        self.deadline = Deadline(ctx.deadline_s)
        self.cleanup_deadline = self.deadline.extended(ctx.cleanup_grace_s)
        self.events: list[dict[str, Any]] = []
        self.phase_seconds: dict[str, float] = {}
        self._phase_t0 = time.perf_counter()
        self.plan: list[BucketManifest] = []
        self.bytes_moved = 0
        self.offloaded = False
        self.connection_dirty = False
        self.inflight: deque[tuple[Payload, list[_Pending]]] = deque()
        self.error: RefitError | None = None

    # ---- recording ---------------------------------------------------------------------------

    def emit(self, kind: str, event: str, *, state: str | None = None, **fields: Any) -> dict[str, Any]:
        fields.setdefault("version", self.version)  # the version this run is refitting to
        record = self.ctx.recorder.emit(kind, event, run=self.run_id, state=state or str(self.machine.state), **fields)
        self.events.append(record)
        return record

    def enter(self, trigger: Trigger, *, bucket: int | None = None) -> None:
        src = self.machine.state
        dst = self.machine.fire(trigger)
        now = time.perf_counter()
        if dst != src:
            self.phase_seconds[str(src)] = self.phase_seconds.get(str(src), 0.0) + now - self._phase_t0
            self._phase_t0 = now
        self.emit("transition", str(trigger), src=str(src), dst=str(dst), bucket=bucket)

    def _record_call(
        self,
        call: str,
        side: str,
        state: str,
        outcome: str,
        duration: float,
        *,
        engine: str | None = None,
        bucket: int | None = None,
        error: BaseException | None = None,
        **extra: Any,
    ) -> None:
        self.emit(
            "call",
            call,
            state=state,
            side=side,
            engine=engine,
            bucket=bucket,
            outcome=outcome,
            duration_s=round(duration, 6),
            error=None if error is None else f"{type(error).__name__}: {error}",
            **extra,
        )

    def _wrap(self, exc: BaseException, call: str, state: str, engine: str | None, bucket: int | None) -> RefitError:
        if isinstance(exc, RefitError):
            return exc
        where = {"state": state, "engine": engine, "call": call, "bucket": bucket}
        if isinstance(exc, TimeoutError):  # concurrent.futures.TimeoutError is TimeoutError
            return DeadlineExceeded(f"{call} did not finish inside the deadline: {exc}", cause=exc, **where)
        return DriverCallError(f"{call} failed: {type(exc).__name__}: {exc}", cause=exc, **where)

    def _fault(self, call: str, engine: int | None, bucket: int | None) -> BaseException | None:
        plan = self.ctx.faults
        fault = plan.take(str(self.machine.state), call, engine, bucket) if plan else None
        if fault is None:
            return None
        self.emit("fault", "injected", fault=fault.describe(), call=call)
        return InjectedFault(f"injected {fault.kind} fault at {self.machine.state}/{call}")

    # ---- calls ---------------------------------------------------------------------------------

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
        """A trainer-side call (source or transport), run on this thread."""
        deadline = self.cleanup_deadline if cleanup else self.deadline
        state = str(self.machine.state)
        t0 = time.perf_counter()
        try:
            if deadline.expired():
                raise TimeoutError(f"the run's deadline ({deadline.budget_s:g}s) passed before {call}")
            fault = self._fault(call, None, bucket)
            if fault is not None:
                raise fault
            value = fn()
        except Exception as exc:
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            self._record_call(call, side, state, outcome, time.perf_counter() - t0, bucket=bucket, error=exc, **extra)
            raise self._wrap(exc, call, state, None, bucket) from exc
        self._record_call(call, side, state, "ok", time.perf_counter() - t0, bucket=bucket, **extra)
        return value

    def submit(
        self,
        call: str,
        engine: _Engine,
        fn: Callable[[EngineDriver, float], Any],
        *,
        bucket: int | None = None,
        cleanup: bool = False,
    ) -> _Pending:
        deadline = self.cleanup_deadline if cleanup else self.deadline
        state = str(self.machine.state)
        fault = self._fault(call, engine.index, bucket)
        timeout = deadline.remaining()
        if fault is not None or timeout <= 0:
            fut: Future[Any] = Future()
            fut.set_exception(fault or TimeoutError(f"no time left in the run's deadline for {call}"))
        else:
            fut = self.ctx.pool().submit(fn, engine.driver, timeout)
        return _Pending(engine, call, bucket, state, fut, deadline, time.perf_counter())

    def collect(self, p: _Pending) -> tuple[bool, Any, RefitError | None]:
        """Wait for one engine call (bounded) and record it."""
        value: Any = None
        exc: Exception | None = None
        try:
            value = p.future.result(timeout=p.deadline.remaining() + SLACK_S)
        except Exception as caught:
            exc = caught
            if isinstance(caught, TimeoutError) and not p.future.done():  # our wait ran out, not the driver's
                exc = TimeoutError(f"{p.call} on engine {p.engine.name} did not return inside the deadline")
        outcome = "ok" if exc is None else "timeout" if isinstance(exc, TimeoutError) else "error"
        extra = {"result": value} if isinstance(value, dict) else {}
        duration = time.perf_counter() - p.start
        self._record_call(
            p.call, "engine", p.state, outcome, duration, engine=p.engine.name, bucket=p.bucket, error=exc, **extra
        )
        if exc is None:
            return True, value, None
        err = self._wrap(exc, p.call, p.state, p.engine.name, p.bucket)
        p.engine.error = p.engine.error or str(err)
        return False, None, err

    def fanout(
        self,
        call: str,
        fn: Callable[[EngineDriver, float], Any],
        engines: Sequence[_Engine] | None = None,
        *,
        cleanup: bool = False,
        before: Callable[[_Engine], None] | None = None,
    ) -> list[tuple[_Engine, bool, Any, RefitError | None]]:
        targets = list(self.engines if engines is None else engines)
        pendings = []
        for e in targets:
            if before is not None:
                before(e)
            pendings.append(self.submit(call, e, fn, cleanup=cleanup))
        return [(p.engine, *self.collect(p)) for p in pendings]

    @staticmethod
    def raise_first(results: list[tuple[_Engine, bool, Any, RefitError | None]]) -> None:
        for _, ok, _, err in results:
            if not ok and err is not None:
                raise err

    # ---- the happy path ------------------------------------------------------------------------

    def execute(self) -> None:
        ctx = self.ctx
        if ctx.colocated:
            self.enter(T.OFFLOAD)
            self.offloaded = True
            self.inline("offload", "source", ctx.source.offload)
            results = self.fanout("resume_memory", lambda d, t: d.resume_memory(["weights"], timeout=t))
            for e, ok, value, _ in results:
                if ok and isinstance(value, dict) and value.get("weights_intact") is False:
                    e.weights_ok = False
            self.raise_first(results)

        self.enter(T.CONNECT)
        metas = self.inline("metas", "source", ctx.source.metas)
        self.plan = plan_buckets(metas, ctx.bucket_bytes)
        # the connection stays valid while the same engine processes are there and every bucket fits its buffers
        key = (tuple(e.driver.incarnation for e in self.engines), max([m.nbytes for m in self.plan] + [0]))
        self.emit(
            "plan",
            "buckets",
            buckets=len(self.plan),
            nbytes=sum(m.nbytes for m in self.plan),
            tensors=len(metas),
        )
        if ctx._shared.connection_key != key or not ctx.transport.connected:
            if ctx.transport.connected:
                disconnect(ctx, timeout=self.deadline.remaining(), run=self)
            self.connection_dirty = True
            info = self.inline("connect", "transport", lambda: ctx.transport.connect(self.plan, len(self.engines)))
            self.raise_first(self.fanout("attach", lambda d, t: d.attach(info, timeout=t)))
            ctx._shared.connection_key = key
            self.connection_dirty = False

        self.enter(T.PAUSE)
        self.raise_first(self.fanout("pause", lambda d, t: d.pause(ctx.pause_mode, timeout=t), before=_mark_paused))

        self.enter(T.INVALIDATE)
        self.raise_first(self.fanout("flush", lambda d, t: d.flush(timeout=t)))
        results = self.fanout("begin", lambda d, t: d.begin(self.plan, timeout=t))
        for e, ok, _, _ in results:
            e.session = ok
        self.raise_first(results)

        self.transfer()

        self.enter(T.POST_PROCESS)
        self.finalize_all(self.engines, cleanup=False)

        self.enter(T.PUBLISH)
        problems = invariants.commit_gate(self.events, [e.name for e in self.engines], len(self.plan))
        if problems:
            raise InvariantViolation("commit gate refused to publish: " + "; ".join(problems), state=str(S.CONTINUING))
        results = self.fanout("publish", lambda d, t: d.publish(self.version, timeout=t))
        for e, ok, _, _ in results:
            e.published = ok
        if any(e.published for e in self.engines):
            ctx._shared.version = self.version
        self.raise_first(results)
        results = self.fanout("continue_generation", lambda d, t: d.continue_generation(timeout=t))
        for e, ok, _, _ in results:
            e.continued = ok
        self.raise_first(results)

        if ctx.colocated:
            self.enter(T.RESTORE)
            self.inline("restore", "source", ctx.source.restore)
            self.offloaded = False
            self.resume_kv(self.engines, cleanup=False)
        self.enter(T.FINISH)

    def transfer(self) -> None:
        ctx = self.ctx
        self.enter(T.TRANSFER)
        buckets = iter(ctx.source.iter_buckets(self.plan))
        try:
            self._stream(buckets)
        finally:
            close = getattr(buckets, "close", None)
            if close is not None:  # a generator source releases what it holds now, not at GC
                close()

    def _stream(self, buckets: Any) -> None:
        ctx = self.ctx
        for manifest in self.plan:
            i = manifest.index
            if i > 0:
                self.enter(T.NEXT_BUCKET, bucket=i)
            tensors = self.inline("materialize", "source", lambda i=i: _next_bucket(buckets, i), bucket=i)
            while len(self.inflight) >= max(ctx.transport.slots, 1):
                self.drain_oldest()
            payload = self.inline(
                "pack",
                "transport",
                lambda m=manifest, ts=tensors: ctx.transport.pack(m, ts),
                bucket=i,
                manifest=manifest.summary(),
            )
            self.bytes_moved += manifest.nbytes
            pendings = []
            for e in self.engines:
                e.loads_attempted.add(i)
                pendings.append(self.submit("load", e, lambda d, t, p=payload: d.load(p, timeout=t), bucket=i))
            self.inflight.append((payload, pendings))
            del tensors
        while self.inflight:
            self.drain_oldest()

    def drain_oldest(self, *, quiet: bool = False) -> None:
        """Collect every engine's ack for the oldest in-flight bucket; release its buffer only if all acked."""
        payload, pendings = self.inflight.popleft()
        first_error: RefitError | None = None
        for p in pendings:
            ok, _, err = self.collect(p)
            if ok:
                p.engine.loads_ok.add(payload.manifest.index)
                p.engine.bytes_ok += payload.manifest.nbytes
            elif first_error is None:
                first_error = err
        if first_error is None:
            self.inline(
                "release",
                "transport",
                lambda: self.ctx.transport.release(payload),
                bucket=payload.manifest.index,
                cleanup=quiet,
            )
        else:
            self.connection_dirty = True  # an unacked buffer: never reuse this connection
            if not quiet:
                raise first_error

    def resume_kv(self, engines: Sequence[_Engine], *, cleanup: bool) -> None:
        results = self.fanout(
            "resume_memory", lambda d, t: d.resume_memory(["kv_cache"], timeout=t), engines, cleanup=cleanup
        )
        for e, ok, _, _ in results:
            e.kv_resumed = ok
        if not cleanup:
            self.raise_first(results)

    def finalize_all(self, engines: Sequence[_Engine], *, cleanup: bool) -> None:
        owed = [e for e in engines if e.session and e.finalize is None]
        results = self.fanout("finalize", lambda d, t: d.finalize(timeout=t), owed, cleanup=cleanup)
        for e, ok, _, _ in results:
            e.finalize = "ok" if ok else "error"
        if not cleanup:
            self.raise_first(results)

    # ---- the failure path ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """ABORTING -> [QUARANTINING] -> FAILED. Never raises; every step is bounded and recorded."""
        ctx = self.ctx
        self.error = (
            exc if isinstance(exc, RefitError) else self._wrap(exc, "runner", str(self.machine.state), None, None)
        )
        self.enter(T.FAIL)
        self.emit("run", "error", error=str(self.error))
        while self.inflight:  # collect what engines did with in-flight buckets before touching buffers
            self._quietly(lambda: self.drain_oldest(quiet=True))
        self.finalize_all(self.engines, cleanup=True)

        # Engines that received no byte go back to serving their old weights. One whose call failed
        # before it was paused is continued too: continuing is idempotent, and if it fails the
        # engine is reported failed rather than vouched for.
        clean = [e for e in self.engines if (e.paused or e.error) and not e.continued and not e.poisoned]
        if clean:
            for e, ok, _, _ in self.fanout("continue_generation", _continue, clean, cleanup=True):
                e.continued = ok
        if self.offloaded:
            self._quietly(lambda: self.inline("restore", "source", ctx.source.restore, cleanup=True))
            self.offloaded = False
        if ctx.colocated:
            back = [e for e in self.engines if e.continued and not e.kv_resumed]
            if back:
                self.resume_kv(back, cleanup=True)
        if self.connection_dirty or any(e.loads_attempted and not e.published for e in self.engines):
            disconnect(ctx, timeout=self.cleanup_deadline.remaining(), run=self)

        poisoned = [e for e in self.engines if e.poisoned and not e.quarantined]
        if poisoned:
            self.enter(T.QUARANTINE)
            reason = f"refit run {self.run_id} to version {self.version} did not complete: {self.error.message}"
            for e, ok, _, _ in self.fanout(
                "quarantine", lambda d, t: d.quarantine(reason, timeout=t), poisoned, cleanup=True
            ):
                e.quarantined = ok
        self.enter(T.LATCH)

    def _quietly(self, fn: Callable[[], Any]) -> None:
        with contextlib.suppress(RefitError):  # already recorded; cleanup goes on
            fn()

    # ---- result ----------------------------------------------------------------------------------

    def outcomes(self) -> dict[str, EngineOutcome]:
        out = {}
        for e in self.engines:
            if e.published and e.continued:
                status, version = "updated", self.version
            elif e.quarantined:
                status, version = "quarantined", None
            elif e.poisoned or ((e.paused or e.error or e.published) and not e.continued):
                status, version = "failed", None
            else:
                status, version = "unchanged", e.previous_version
            out[e.name] = EngineOutcome(e.name, status, version, len(e.loads_ok), e.error)  # type: ignore[arg-type]
        return out


def _mark_paused(e: _Engine) -> None:
    e.paused = True


def _continue(d: EngineDriver, t: float) -> None:
    d.continue_generation(timeout=t)


def _next_bucket(buckets: Any, index: int) -> Any:
    try:
        return next(buckets)
    except StopIteration:
        raise RuntimeError(f"the source yielded no bucket {index}: it ended before the plan did") from None


def disconnect(ctx: RefitContext, *, timeout: float, run: _Run | None = None) -> None:
    """Engines detach, the transport frees its buffers; best effort, bounded, recorded."""
    if not ctx.transport.connected and ctx._shared.connection_key is None:
        return
    ctx._shared.connection_key = None
    deadline = Deadline(max(timeout, 0.05))
    emit = run.emit if run is not None else ctx.recorder.emit
    pool = ctx.pool()
    pendings = [(d, pool.submit(d.detach, timeout=deadline.remaining()), time.perf_counter()) for d in ctx.engines]
    for d, fut, t0 in pendings:
        try:
            fut.result(timeout=deadline.remaining() + SLACK_S)
            outcome, error = "ok", None
        except Exception as exc:  # a dead engine cannot detach; the transport is freed anyway
            outcome = "timeout" if isinstance(exc, TimeoutError) else "error"
            error = f"{type(exc).__name__}: {exc}"
        emit(
            "call",
            "detach",
            side="engine",
            engine=d.name,
            outcome=outcome,
            duration_s=round(time.perf_counter() - t0, 6),
            error=error,
        )
    t0 = time.perf_counter()
    try:
        ctx.transport.disconnect()
        emit(
            "call",
            "disconnect",
            side="transport",
            outcome="ok",
            duration_s=round(time.perf_counter() - t0, 6),
        )
    except Exception as exc:
        emit("call", "disconnect", side="transport", outcome="error", error=f"{type(exc).__name__}: {exc}")


def run(ctx: RefitContext) -> RefitResult:
    """Drive one whole refit. Returns a RefitResult whether it succeeded or failed (errors are data:
    `result.ok`, `result.error`); raises RefitBusyError when another run holds the engines, and
    InvariantViolation when the run's own events break an invariant (a refit bug)."""
    if ctx._shared.closed:
        raise RuntimeError("this RefitContext is closed")
    r = _Run(ctx)
    r.emit(
        "run",
        "start",
        version=r.version,
        previous_version=r.previous_version,
        owner=r.owner,
        engines=[e.name for e in r.engines],
        mode=ctx.mode,
        pause_mode=ctx.pause_mode,
        bucket_bytes=ctx.bucket_bytes,
        deadline_s=ctx.deadline_s,
        cleanup_grace_s=ctx.cleanup_grace_s,
    )
    lock = ctx.lock
    if lock is None:  # RefitContext.__post_init__ always sets one
        raise RuntimeError("RefitContext has no lock")
    if not lock.acquire(r.owner):
        r.emit("lock", "acquire", owner=r.owner, outcome="busy", holder=lock.holder)
        r.emit("run", "end", result="busy")
        raise RefitBusyError(f"engines {[e.name for e in r.engines]} are being refit by another run", state="IDLE")
    r.emit("lock", "acquire", owner=r.owner, outcome="ok")
    interrupt: BaseException | None = None
    t0 = time.perf_counter()
    try:
        r.execute()
    except BaseException as exc:
        if not isinstance(exc, Exception):
            interrupt = exc  # KeyboardInterrupt / SystemExit: clean up, then re-raise
        r.abort(exc)
    finally:
        released = lock.release(r.owner)
        r.emit("lock", "release", owner=r.owner, outcome="ok" if released else "not_owner")
        ctx._shared.next_version = r.version + 1
        outcomes = r.outcomes()
        ctx._shared.engine_versions.update({name: o.version for name, o in outcomes.items()})
        now = time.perf_counter()
        r.phase_seconds[str(r.machine.state)] = r.phase_seconds.get(str(r.machine.state), 0.0) + now - r._phase_t0
        published = r.version if any(e.published for e in r.engines) else None
        r.emit(
            "run",
            "end",
            result=str(r.machine.state),
            published=published,
            engine_outcomes={n: {"status": o.status, "version": o.version} for n, o in outcomes.items()},
            error=None if r.error is None else str(r.error),
        )
    result = RefitResult(
        run_id=r.run_id,
        ok=r.machine.state == S.DONE,
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
        error=r.error,
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
