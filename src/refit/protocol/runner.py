"""`run(ctx)`: one refit, driven by the leader through the state tables; cleanup always runs.

How a run proceeds (on the leader; other trainer ranks follow, see `refit.protocol.ranks`):
  1. Take the engines' lock with a fresh owner token (bounded; busy -> RefitBusyError, nothing
     done). Read each engine's incarnation (bounded). Every rank reports its tensor metadata; the
     ranks must agree; the transport plans the buckets.
  2. Engine calls go out in *waves*: one call per engine carrying consecutive steps (a driver that
     can batch them into one round trip) and an optional trainer-side step run at the same time
     on every rank (a collective transport's join or send). One deadline bounds the whole wave,
     however many engines ignore their timeouts. Steady state takes two control waves:
       [probe, (resume weights), pause, flush, begin]   then the bucket loop   then
       [publish, continue, (resume KV)]
     with each engine's finalize riding on its last bucket's call. Each step is then recorded as
     its own event in its own state, in table order: the run machine moves into a step's state
     before the step is recorded, so traces, invariants, fault injection and replay stay per step.
  3. Each engine has its own small machine (EngineMachine: joined, paused, open, finalized,
     published, serving, quarantined, gone) plus facts (its weights kept/changed/lost, why it left
     the attempt); outcomes are derived from them. An engine whose call fails leaves the attempt;
     the others carry on. Engines that failed with an error after being paused are retried (a
     collective transport's group, which a failed member breaks for all, is rebuilt first).
  4. TRANSFERRING streams buckets through `transport.slots` buffers: every rank packs bucket k
     (gathering shards straight into its buffer) while engines copy bucket k-1; a buffer is
     released only after every engine answered for it (and the send finished), else abandoned.
  5. CONTINUING: a per-engine commit gate re-checks from the run's own events that the engine's
     last attempt acked every bucket and finalized; those engines publish and continue. Engines
     that got no byte continue on their old weights; engines holding weights no version names are
     quarantined.
  6. A failure of the run itself moves to ABORTING: owed finalizes run, the trainer is restored,
     a dirty connection is torn down, clean engines continue, a colocated engine never paused
     gets its memory released again, poisoned ones are quarantined. Cleanup is bounded by the
     deadline plus `cleanup_grace_s`; past that, owed calls are still sent with a short floor.
  7. The run's events are checked against `refit.invariants`; a violation raises.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from refit import invariants
from refit.drivers.base import Step, StepResult, Topology, outcome_of
from refit.drivers.buckets import BucketManifest
from refit.errors import (
    DeadlineExceeded,
    DriverCallError,
    EngineDied,
    EngineError,
    InvariantViolation,
    LateAnswer,
    NoTimeLeft,
    RefitBusyError,
    RefitError,
)
from refit.invariants.integrity import LATE_TOLERANCE_S
from refit.protocol.answers import SLACK_S, clean, malformed
from refit.protocol.context import EngineOutcome, RefitContext, RefitResult
from refit.protocol.deadline import Deadline
from refit.protocol.faults import FaultyEngine, FaultyRanks
from refit.protocol.ranks import RECORDED_RESULTS, RankStep
from refit.protocol.session import disconnect
from refit.states import (
    RETRY_STATES,
    TRANSITIONS,
    EngineEvent,
    EngineMachine,
    EngineState,
    RefitMachine,
    RefitState,
    Trigger,
)

S, T, E, EV = RefitState, Trigger, EngineState, EngineEvent
CLEANUP_FLOOR_S = 0.25  # owed cleanup calls are still sent, and waited on this long, past deadline + grace
LOCK_TIMEOUT_S = 5.0  # a lock call (or incarnation read) waits at most this long, within the deadline
_ORDER = {s: i for i, s in enumerate(RefitState)}


def _next_trigger(state: RefitState) -> Trigger:
    """The happy-path move out of `state`: the first the table lists from it."""
    return next(trig for trig, sources, _ in TRANSITIONS if state in sources)


@dataclass(eq=False)
class _Engine:
    """The leader's view of one engine during one run: its machine and the facts beside it."""

    index: int
    driver: Any  # an EngineDriver (or the fault wrapper around one)
    tp: int
    incarnation: str
    previous_version: int | None  # None: stale (new incarnation, or left unversioned earlier)
    machine: EngineMachine = field(default_factory=EngineMachine)
    weights: str = "kept"  # kept | changed (a bucket may have landed) | lost (memory came back empty)
    published: bool = False
    failure: str | None = None  # why it left the attempt: error | timeout (hung) | dead | deadline
    failed_in: str | None = None
    error: str | None = None
    exc: RefitError | None = None
    attempt: int = -1
    attempts: int = 0
    acked: set[int] = field(default_factory=set)  # buckets acked in its current attempt
    bytes_ok: int = 0
    resumed: set[str] = field(default_factory=set)  # memory regions resumed in this run (colocated)
    taken: set[str] = field(default_factory=set)  # ... of which were released before it: given back on abort

    @property
    def name(self) -> str:
        return self.driver.name

    @property
    def state(self) -> EngineState:
        return self.machine.state

    @property
    def reachable(self) -> bool:
        return self.state != E.GONE

    @property
    def active(self) -> bool:
        return self.failure is None and self.reachable

    @property
    def must_not_serve(self) -> bool:
        """Holds weights its version does not name (or has no current version): never continue it."""
        return not self.published and (self.weights != "kept" or self.previous_version is None)


@dataclass
class _Wave:
    batch: int
    budget: float
    started: float  # time.monotonic(): waits are real time even when a replay fakes the clock
    items: list[tuple[_Engine, list[Step], Future[list[StepResult]]]]


@dataclass
class _RankCall:
    step: RankStep
    future: Future[list[Any]]
    budget: float
    started: float
    t0: float  # ctx clock, for the event's duration
    extra: dict[str, Any]


@dataclass
class _Bucket:
    manifest: BucketManifest
    wave: _Wave
    send: _RankCall | None


Results = dict[_Engine, list[tuple[Step, StepResult]]]


class _Run:
    def __init__(self, ctx: RefitContext) -> None:
        self.ctx = ctx
        self.run_id = uuid.uuid4().hex[:12]
        self.owner = f"{self.run_id}:{uuid.uuid4().hex[:8]}"
        self.machine = RefitMachine()
        shared = ctx._shared
        self.previous_version = shared.version
        self.version = shared.next_version
        self.clock = ctx.clock
        self.deadline = Deadline(ctx.deadline_s, clock=ctx.clock)
        self.cleanup_deadline = self.deadline.extended(ctx.cleanup_grace_s)
        self.transport = ctx.transport
        plan = ctx.faults
        self.ranks: Any = FaultyRanks(ctx.ranks, plan, self.fault_fired) if plan else ctx.ranks
        self.engines = [
            _Engine(i, FaultyEngine(d, plan, i, self.fault_fired) if plan else d, d.tp_size, d.name, None)
            for i, d in enumerate(ctx.engines)
        ]
        self.attempt = 0
        self.events: list[dict[str, Any]] = []
        self.phase_seconds: dict[str, float] = {}
        self._phase_t0 = self.clock()
        self.plan: list[BucketManifest] = []
        self.epochs: tuple[Any, ...] = ()  # every rank's storage epoch (storage-sharing transports)
        self.topology: Topology | None = None
        self.bytes_moved = 0
        self.offloaded = False
        self.connection_dirty = False  # not to be reused by the next run
        self.broken = False  # a collective group a member broke: rebuild before streaming again
        self.inflight: deque[_Bucket] = deque()
        self.held: list[tuple[_Engine, Step, StepResult, int]] = []  # finalizes that rode on last buckets
        self.rode = 0  # 1: bucket 0 rode the pause wave (`ride_first_bucket`)
        self.lock_taken: int | None = None  # the lock's acquisition count once this run took it
        self.first_error: RefitError | None = None
        self.error: RefitError | None = None
        self.round_trips = 0
        self.batches = itertools.count()
        self.ahead: list[str] = []  # engines whose probe found them at or past the target version
        self.ranks_stuck = False  # a trainer-side step did not answer in time this run
        self.budgets: dict[int, float] = {}  # batch -> the budget its engine calls were given
        self.answered: dict[int, float] = {}  # id(future) -> when it completed (time.monotonic)

    # ---- recording ---------------------------------------------------------------------------

    def emit(self, kind: str, event: str, *, state: str | None = None, **fields: Any) -> dict[str, Any]:
        fields.setdefault("version", self.version)  # the version this run refits to
        fields.setdefault("attempt", self.attempt)
        record = self.ctx.recorder.emit(kind, event, run=self.run_id, state=state or str(self.machine.state), **fields)
        self.events.append(record)
        return record

    def fault_fired(self, fault: Any, call: str) -> None:
        self.emit("fault", "injected", fault=fault.describe(), call=call)

    def enter(self, trigger: Trigger, *, bucket: int | None = None) -> None:
        src = self.machine.state
        dst = self.machine.fire(trigger)
        now = self.clock()
        if dst != src:
            self.phase_seconds[str(src)] = self.phase_seconds.get(str(src), 0.0) + now - self._phase_t0
            self._phase_t0 = now
        self.emit("transition", str(trigger), src=str(src), dst=str(dst), bucket=bucket)

    def move_to(self, state: str) -> None:
        """Walk the happy path until the machine is in `state` (for steps recorded after a wave)."""
        target = RefitState(state)
        while self.machine.state != target:
            if _ORDER[self.machine.state] > _ORDER[target]:
                raise RuntimeError(f"a step of state {target} came after the run reached {self.machine.state}")
            self.enter(_next_trigger(self.machine.state))

    def _wrap(self, exc: BaseException, call: str, state: str, engine: str | None, bucket: int | None) -> RefitError:
        if isinstance(exc, RefitError):
            return exc
        where = {"state": state, "engine": engine, "call": call, "bucket": bucket}
        if isinstance(exc, TimeoutError):  # concurrent.futures.TimeoutError is TimeoutError
            return DeadlineExceeded(f"{call} did not finish inside the deadline: {exc}", cause=exc, **where)
        return DriverCallError(f"{call} failed: {type(exc).__name__}: {exc}", cause=exc, **where)

    def record_step(self, e: _Engine, step: Step, res: StepResult, batch: int, state: str | None = None) -> None:
        err = res.error
        extra: dict[str, Any] = {"result": res.value} if isinstance(res.value, dict) else {}
        if step.call in ("resume_memory", "release_memory") and step.args:
            extra["tags"] = list(step.args[0])
        if batch in self.budgets:
            extra["budget_s"] = round(self.budgets[batch], 6)
        if isinstance(err, LateAnswer):
            extra["late"] = True  # the driver ignored its timeout: a driver bug, never a success
        if getattr(err, "no_effect", False):
            extra["effect"] = "none"  # the engine refused it before changing anything
        if isinstance(err, NoTimeLeft):
            extra["sent"] = False  # the run had no time left: the call never reached the engine
        if isinstance(err, EngineError) and err.data:
            extra["error_data"] = err.data  # facts the runner acted on (the version a probe found): for replay
        self.emit(
            "call", step.call, state=state or step.state, side="engine", engine=e.name, bucket=step.bucket,
            outcome=res.outcome, duration_s=round(res.seconds, 6),
            error=None if err is None else f"{type(err).__name__}: {err}", done_at=res.done_at,
            attempt=max(e.attempt, 0), batch=batch, **extra,
        )  # fmt: skip

    # ---- budgets -----------------------------------------------------------------------------

    def _budget(self, cleanup: bool, *, cap: bool = True) -> float:
        left = (self.cleanup_deadline if cleanup else self.deadline).remaining()
        if cleanup:
            left = max(left, CLEANUP_FLOOR_S)
        limit = self.ctx.call_timeout_s if cap else None
        return left if limit is None else min(left, limit)

    # ---- trainer ranks ------------------------------------------------------------------------

    def rank_start(self, step: RankStep, *, cleanup: bool = False, **extra: Any) -> _RankCall:
        budget = self._budget(cleanup, cap=False)
        if cleanup and self.ranks_stuck:  # a rank already stopped answering: no floor, they would stack
            budget = self.cleanup_deadline.remaining()
        t0 = self.clock()
        if budget <= 0:
            fut: Future[list[Any]] = Future()
            fut.set_exception(NoTimeLeft(f"the run's deadline passed before {step.call}"))
        else:
            try:
                fut = self.ranks.start(step, timeout=budget)
            except Exception as exc:
                fut = Future()
                fut.set_exception(exc)
        rc = _RankCall(step, fut, budget, time.monotonic(), t0, extra)
        fut.add_done_callback(self._stamp)
        return rc

    def rank_wait(self, rc: _RankCall, *, state: str | None = None) -> tuple[list[Any] | None, BaseException | None]:
        """Wait for a trainer-side step (bounded), record it as one event; (values, error)."""
        exc: BaseException | None = None
        values = None
        # a rank that stopped answering answers nothing late: once one has, no slack past the budget
        slack = 0.0 if self.ranks_stuck else SLACK_S
        try:
            values = rc.future.result(timeout=max(rc.started + rc.budget + slack - time.monotonic(), 0.0))
        except Exception as caught:
            exc = caught
            if isinstance(caught, TimeoutError) and not rc.future.done():  # our wait ran out, not the ranks'
                exc = TimeoutError(f"{rc.step.call} did not return on every trainer rank inside {rc.budget:.3g}s")
        if isinstance(exc, TimeoutError):
            self.ranks_stuck = True
        answered = self.answered.get(id(rc.future), time.monotonic()) - rc.started
        late = rc.future.done() and not isinstance(exc, TimeoutError) and answered > rc.budget + LATE_TOLERANCE_S
        if late:
            exc = LateAnswer(
                f"{rc.step.call} answered {answered:.3f}s into the call, past its {rc.budget:.3f}s budget: "
                f"a trainer-side driver ignores its timeout, so its answer is not trusted",
                cause=exc, state=rc.step.state, call=rc.step.call, bucket=rc.step.bucket,
            )  # fmt: skip
        outcome = "ok" if exc is None else outcome_of(exc)
        took = answered if rc.future.done() else self.clock() - rc.t0  # until it answered, not until recorded
        self.emit(
            "call", rc.step.call, state=state or rc.step.state, side=rc.step.side, outcome=outcome,
            duration_s=round(took, 6), error=None if exc is None else f"{type(exc).__name__}: {exc}",
            bucket=rc.step.bucket, ranks=self.ctx.ranks.world if self.ctx.ranks else 1,
            budget_s=round(rc.budget, 6) if rc.budget > 0 else None, late=True if late else None,
            per_rank=values if rc.step.call in RECORDED_RESULTS and exc is None else None, **rc.extra,
        )  # fmt: skip
        return values, exc

    def rank_call(self, step: RankStep, *, cleanup: bool = False, **extra: Any) -> list[Any]:
        values, exc = self.rank_wait(self.rank_start(step, cleanup=cleanup, **extra))
        if exc is not None:
            raise self._wrap(exc, step.call, step.state, None, step.bucket) from exc
        return values or []

    # ---- engine waves ---------------------------------------------------------------------------

    def start_wave(self, plan: dict[_Engine, list[Step]], *, cleanup: bool = False, count: bool = True) -> _Wave:
        budget = self._budget(cleanup)
        wave = _Wave(next(self.batches), budget, time.monotonic(), [])
        self.budgets[wave.batch] = budget
        for e, steps in plan.items():
            if not steps:
                continue
            if budget <= 0:
                fut: Future[list[StepResult]] = Future()
                fut.set_result([StepResult("timeout", error=NoTimeLeft(f"no time left for {steps[0].call}"))])
            else:
                try:
                    fut = e.driver.run_steps_async(steps, timeout=budget, executor=self.ctx.lane(e.name))
                except Exception as exc:
                    fut = Future()
                    fut.set_exception(exc)
            fut.add_done_callback(self._stamp)
            wave.items.append((e, steps, fut))
        if count and wave.items:
            self.round_trips += 1
        return wave

    def _stamp(self, fut: Future[Any]) -> None:
        self.answered[id(fut)] = time.monotonic()

    def wait_wave(self, wave: _Wave) -> Results:
        """Every engine's step results, waiting once for all of them (engines already known to be
        hung are not waited on again)."""
        waiting = [f for e, _, f in wave.items if e.failure != "timeout"]
        end = wave.started + wave.budget + SLACK_S
        concurrent.futures.wait(waiting, timeout=max(end - time.monotonic(), 0.0))
        out: Results = {}
        for e, steps, fut in wave.items:
            out[e] = self._step_results(e, steps, fut, wave)
        return out

    def _step_results(
        self, e: _Engine, steps: list[Step], fut: Future[list[StepResult]], wave: _Wave
    ) -> list[tuple[Step, StepResult]]:
        """One result per step that ran. Anything a driver hands back that breaks the contract (not
        a list of StepResults, more results than steps, a result after a failure, fewer results
        without a failure) fails every step of the call: their effect is unknown."""
        now = time.monotonic()
        if not fut.done():
            err: BaseException = TimeoutError(
                f"engine {e.name} did not answer {[s.call for s in steps]} inside its {wave.budget:.3g}s"
            )
            return [(s, StepResult("timeout", error=err, seconds=now - wave.started)) for s in steps]
        exc = fut.exception()
        if exc is None:
            exc = malformed(fut.result(), len(steps))
            if exc is None:
                pairs = [(s, clean(r)) for s, r in zip(steps, fut.result(), strict=False)]
                return self._late(e, pairs, fut, wave)
        return [(s, StepResult(outcome_of(exc), error=exc, seconds=now - wave.started, done_at=now)) for s in steps]

    def _late(
        self, e: _Engine, pairs: list[tuple[Step, StepResult]], fut: Future[Any], wave: _Wave
    ) -> list[tuple[Step, StepResult]]:
        """An answer (ok or error) that came after the call's budget is a driver that ignores its
        timeout: its answer is not trusted (effect unknown) and it is recorded `late`."""
        answered = self.answered.get(id(fut), time.monotonic()) - wave.started
        if answered <= wave.budget + LATE_TOLERANCE_S:
            return pairs
        out = []
        for s, r in pairs:
            if r.outcome == "timeout" or isinstance(r.error, EngineDied):
                out.append((s, r))
                continue
            err = LateAnswer(
                f"engine {e.name}'s driver answered {s.call} {answered:.3f}s into the call, past its "
                f"{wave.budget:.3f}s budget: it ignores its timeout, so its answer "
                f"({r.outcome}) is not trusted",
                cause=r.error, state=s.state, engine=e.name, call=s.call, bucket=s.bucket,
            )  # fmt: skip
            out.append((s, StepResult("error", error=err, seconds=r.seconds, done_at=r.done_at)))
        return out

    def wave(self, plan: dict[_Engine, list[Step]], *, cleanup: bool = False) -> None:
        """Send a wave, wait for it, record and apply every step in table order."""
        w = self.start_wave(plan, cleanup=cleanup)
        self.absorb(self.wait_wave(w), w.batch)

    def absorb(self, results: Results, batch: int, *, alongside: _RankCall | None = None) -> BaseException | None:
        """Record a wave's results state by state: move into each step's state (along the table),
        record the trainer-side step of that state first, then every engine's steps, in engine
        order. Everything the wave did is recorded before anything is decided on it. Returns the
        trainer-side step's error, if it failed."""
        states = {s.state for pairs in results.values() for s, _ in pairs}
        if alongside is not None:
            states.add(alongside.step.state)
        failed: BaseException | None = None
        for state in sorted(states, key=lambda s: _ORDER[RefitState(s)]):
            self.move_to(state)
            if alongside is not None and alongside.step.state == state:
                _, failed = self.rank_wait(alongside)
            for e in self.engines:
                for step, res in results.get(e, ()):
                    if step.state == state:
                        self.record_step(e, step, res, batch)
                        self.apply(e, step, res)
        return failed

    # ---- applying results to the engine's machine and facts -------------------------------------

    def apply(self, e: _Engine, step: Step, res: StepResult) -> None:
        call = step.call
        if res.ok:
            self._apply_ok(e, step, res.value)
            return
        err = res.error
        if isinstance(err, EngineError) and err.kind == "version_ahead":
            self.ahead.append(e.name)
            if isinstance(err.data.get("version"), int):
                e.previous_version = err.data["version"]  # it keeps serving the version it holds
        if call == "load" and not getattr(err, "no_effect", False):
            e.weights = "changed" if e.weights == "kept" else e.weights  # part of it may have landed
        elif (
            call == "begin" and getattr(e.driver, "begin_moves_weights", False) and not getattr(err, "no_effect", False)
        ):
            e.weights = "changed" if e.weights == "kept" else e.weights  # it may have begun: weights unusable
        elif call == "pause" and e.machine.can(EV.PAUSE):
            e.machine.fire(EV.PAUSE)  # it may have paused: it is owed a continue or a quarantine
        elif call == "finalize" and e.machine.can(EV.CLOSE):
            e.machine.fire(EV.CLOSE)  # a failed finalize closes the session too: never repeated
        elif call == "publish":
            e.weights = "changed" if e.weights == "kept" else e.weights  # its label is unknown now
        elif call == "resume_memory" and "weights" in step.args[0]:
            e.weights = "lost"  # a failed weight-memory resume leaves the weights unknown
        self.drop(e, step, err)

    def _apply_ok(self, e: _Engine, step: Step, value: Any) -> None:
        call = step.call
        if call == "probe":
            self._probed(e, step, value if isinstance(value, dict) else {})
        elif call == "resume_memory":
            tags = set(step.args[0])
            e.resumed |= tags
            intact = isinstance(value, dict) and value.get("weights_intact") is True
            if "weights" in tags and not intact:
                e.weights = "lost"  # contents not reported intact: unknown, so never served unpublished
            if isinstance(value, dict) and isinstance(value.get("resumed"), list):
                tags &= set(value["resumed"])  # only what was released before was taken by this run
            e.taken |= tags
        elif call == "release_memory":
            e.resumed -= set(step.args[0])
            e.taken -= set(step.args[0])
        elif call == "attach":
            self.ctx._shared.attached.add(e.incarnation)
        elif call == "pause":
            e.machine.fire(EV.PAUSE)
        elif call == "begin":
            e.machine.fire(EV.OPEN)
            if getattr(e.driver, "begin_moves_weights", False):  # unusable until a complete update
                e.weights = "changed" if e.weights == "kept" else e.weights
        elif call == "load":
            assert step.bucket is not None
            e.acked.add(step.bucket)
            e.bytes_ok += self.plan[step.bucket].payload_bytes
            e.weights = "changed" if e.weights == "kept" else e.weights
        elif call == "finalize":
            complete = len(e.acked) == len(self.plan) and e.failure is None
            e.machine.fire(EV.FINALIZE if complete else EV.CLOSE)
        elif call == "publish":
            e.machine.fire(EV.PUBLISH)
            e.published = True
            self.ctx._shared.version = self.version
        elif call == "continue_generation":
            if e.must_not_serve:  # a driver bug the table would not see: never report it as clean
                raise InvariantViolation(f"engine {e.name} was continued holding weights no version names")
            e.machine.fire(EV.CONTINUE)
        elif call == "quarantine":
            e.machine.fire(EV.QUARANTINE)

    def _probed(self, e: _Engine, step: Step, info: dict[str, Any]) -> None:
        version = info.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return  # not a version (the driver does not know, or reports nonsense): the runner's record stands
        e.previous_version = version if info.get("serving", True) else None
        if version >= self.version:  # a driver whose engine did not refuse
            self.ahead.append(e.name)
            self.drop(e, step, EngineError("version_ahead", f"engine holds version {version}"))

    def drop(self, e: _Engine, step: Step, err: BaseException | None) -> None:
        """The engine leaves the current attempt (the others carry on)."""
        wrapped = self._wrap(err or RuntimeError("failed"), step.call, step.state, e.name, step.bucket)
        dead = isinstance(err, EngineDied)
        if e.failure == "dead":
            return
        before = e.failure
        if dead:
            e.failure = "dead"
        elif isinstance(err, TimeoutError):
            e.failure = "deadline" if isinstance(err, NoTimeLeft) else "timeout"
        elif e.failure is None:
            e.failure = "error"
        if e.failure in ("dead", "timeout") and e.machine.can(EV.LOSE):
            e.machine.fire(EV.LOSE)
        if before is None:
            e.failed_in = step.state
        e.error = e.error or str(wrapped)
        e.exc = e.exc or wrapped
        self.first_error = self.first_error or wrapped
        if e.failure != before:
            self.emit("engine", "dropped", engine=e.name, failure=e.failure, error=str(wrapped))

    def require_engines(self, what: str) -> None:
        """The run itself fails when no engine is left to carry it."""
        if not any(e.active for e in self.engines):
            raise self.first_error or DriverCallError(f"no engine left {what}", state=str(self.machine.state))

    # ---- the happy path ------------------------------------------------------------------------

    def execute(self) -> None:
        ctx = self.ctx
        self.prepare()
        state = "OFFLOADING" if ctx.colocated else "CONNECTING"
        if ctx.colocated:
            self.enter(T.OFFLOAD)
            self.offloaded = True
            self.rank_call(RankStep("offload", state))
        else:
            self.enter(T.CONNECT)
        head = [Step("probe", state, (self.version,))]
        if ctx.colocated:
            head.append(Step("resume_memory", state, (["weights"],)))
        tail = [
            Step("pause", "PAUSING", (ctx.pause_mode,)),
            Step("flush", "INVALIDATING"),
            Step("begin", "INVALIDATING", (self.plan,)),
        ]
        members = self.engines
        self.topology = ctx._shared.topology
        if self.needs_connect(members):
            self.wave({e: list(head) for e in members})
            self.check_probes()
            self.require_engines("after the probe")
            if ctx.colocated:
                self.enter(T.CONNECT)
            self.connect([e for e in members if e.active], "CONNECTING")
            self.require_engines("attached to the transport")
            self.wave({e: list(tail) for e in members if e.active})
        elif self.first_bucket_can_ride(members):
            self.ride_first_bucket(members, head + tail)
            self.check_probes()
        else:
            self.wave({e: head + tail for e in members})
            self.check_probes()
        self.require_engines("paused, flushed and in an update session")
        self.stream([e for e in self.engines if e.active and e.state == E.OPEN], start=self.rode)
        while retry := self.retryable():
            self.attempt += 1
            for e in retry:
                e.failure, e.acked, e.attempt, e.attempts = None, set(), self.attempt, e.attempts + 1
            if self.broken:
                self.enter(T.RECONNECT)
                self.connect(retry, "RECONNECTING")
            self.enter(T.RETRY)
            self.wave(
                {
                    e: [Step("flush", "INVALIDATING"), Step("begin", "INVALIDATING", (self.plan,))]
                    for e in retry
                    if e.active
                }
            )
            self.stream([e for e in retry if e.active and e.state == E.OPEN])
        self.commit()
        self.enter(T.FINISH)

    def prepare(self) -> None:
        """IDLE: incarnations (bounded), every rank's metadata (which must agree), the plan."""
        ctx = self.ctx
        per_rank = self.rank_call(RankStep("metas", "IDLE"))
        metas = per_rank[0]
        for rank, other in enumerate(per_rank[1:], start=1):
            if other != metas:
                diff = next((f"{a} vs {b}" for a, b in zip(metas, other, strict=False) if a != b), "a different count")
                raise RefitError(f"trainer rank {rank} sends different tensors than rank 0: {diff}", state="IDLE")
        self.plan = self.transport.plan(metas, ctx.bucket_bytes)
        self.emit(
            "plan", "buckets", buckets=len(self.plan), nbytes=sum(m.nbytes for m in self.plan), tensors=len(metas),
            manifests=[m.summary() for m in self.plan],
        )  # fmt: skip
        self.read_epochs("IDLE")
        if self.transport.wants_prepare:  # work that needs no engine, done before any is paused
            self.rank_call(RankStep("prepare", "IDLE", (self.plan,)))

    def read_epochs(self, state: str) -> None:
        """Every rank's storage epoch, for a transport that shares the source's storages: a
        connection is reused only for the storages it shared (a reallocated trainer reconnects)."""
        if self.transport.shares_storages:
            self.epochs = tuple(self.rank_call(RankStep("epoch", state)))

    def read_incarnations(self) -> None:
        """Each engine's incarnation (a restarted engine is reconnected and fully refit), bounded."""
        shared = self.ctx._shared
        incarnations = self.bounded_each([lambda d=e.driver: d.incarnation for e in self.engines], "incarnation")
        for e, inc in zip(self.engines, incarnations, strict=True):
            e.incarnation = inc
            known = shared.incarnations.get(e.name)
            restarted = known is not None and known != inc
            e.previous_version = None if restarted else shared.engine_versions.get(e.name, shared.version)
            e.attempts, e.attempt = 1, 0

    def bounded_each(self, fns: Sequence[Callable[[], Any]], what: str) -> list[Any]:
        """Call each engine's function on its lane, waiting once for all, within the deadline."""
        futures = [self.ctx.lane(e.name).submit(fn) for e, fn in zip(self.engines, fns, strict=True)]
        budget = min(self.deadline.remaining(), LOCK_TIMEOUT_S)
        concurrent.futures.wait(futures, timeout=budget)
        out = []
        for i, f in enumerate(futures):
            if not f.done():
                raise DeadlineExceeded(f"{what} of engine {self.engines[i].name} did not return in {budget:.3g}s")
            out.append(f.result())
        return out

    def check_probes(self) -> None:
        """A trainer whose version counter is behind an engine's is refused before any byte moves."""
        if self.ahead:
            raise RefitError(
                f"engines {self.ahead} already hold version {self.version} or newer; the trainer's "
                f"version counter ({self.previous_version}) is behind: nothing was moved",
                state=str(self.machine.state),
            )

    def needs_connect(self, members: Sequence[_Engine]) -> bool:
        shared = self.ctx._shared
        return not (
            shared.connection_key == self.connection_key(members)
            and self.ctx.transport_connected
            and shared.attached >= {e.incarnation for e in members}
        )

    def connection_key(self, members: Sequence[_Engine]) -> tuple[Any, ...]:
        return (tuple((e.name, e.incarnation, e.tp) for e in members), tuple(self.plan), self.ctx.mode, self.epochs)

    def connect(self, members: list[_Engine], state: str) -> None:
        """Connect the transport on every rank and attach `members` (a collective transport's
        group forms while the engines attach: `join` runs at the same time). A group that did not
        form is torn down and rebuilt without the members to blame (dead, hung, or failing for a
        reason of their own rather than because the group could not form)."""
        ctx, shared = self.ctx, self.ctx._shared
        while True:
            if self.ctx.transport_connected or shared.connection_key is not None:
                self.teardown(cleanup=False)
            self.connection_dirty = True
            budget = self._budget(False)
            topo = Topology.of(
                ctx.ranks.world if ctx.ranks else 1, [(e.name, e.tp) for e in members], colocated=ctx.colocated,
                timeout_s=max(budget * 0.7, 0.05),
            )  # fmt: skip
            infos = self.rank_call(RankStep("connect", state, (self.plan, topo)))
            per_engine = self.transport.attach_infos(infos, topo)
            w = self.start_wave({e: [Step("attach", state, (per_engine[e.name],))] for e in members})
            join = self.rank_start(RankStep("join", state)) if self.transport.collective else None
            results = self.wait_wave(w)
            self.absorb(results, w.batch, alongside=join)
            formed = join is None or (join.future.done() and join.future.exception() is None)
            attached = [e for e in members if e.active]
            if not self.transport.collective or (formed and len(attached) == len(members)):
                members = attached
                break
            blamed = [e for e in members if not _rendezvous_only(e, results.get(e, []))]
            if not blamed or len(blamed) == len(members) or self.deadline.remaining() <= 0:
                self.teardown(cleanup=False)
                raise self.first_error or DriverCallError("the transport group did not form", state=state)
            members = [e for e in members if e not in blamed]
            for e in members:  # they failed only because the group could not form: they try again
                e.failure, e.error, e.exc = None, None, None
        self.topology = shared.topology = topo
        self.read_epochs(state)  # what was shared (sharing may have moved a CPU storage into shared memory)
        shared.connection_key = self.connection_key(members)
        self.connection_dirty = False
        self.broken = False

    def teardown(self, *, cleanup: bool) -> None:
        """Engines detach, every rank disconnects; recorded, bounded, never raises."""
        shared = self.ctx._shared
        attached = [e for e in self.engines if e.reachable]  # detaching one never attached changes nothing
        shared.connection_key, shared.attached = None, set()
        if attached:
            # inside the run (before a connect) the run's own deadline bounds it; only cleanup may use the grace
            w = self.start_wave({e: [Step("detach", str(self.machine.state))] for e in attached}, cleanup=cleanup)
            for e, pairs in self.wait_wave(w).items():
                for step, res in pairs:
                    self.record_step(e, step, res, w.batch, state=str(self.machine.state))
        self.rank_wait(self.rank_start(RankStep("disconnect", str(self.machine.state)), cleanup=True))
        self.connection_dirty = False

    # ---- the bucket loop ------------------------------------------------------------------------

    def first_bucket_can_ride(self, members: Sequence[_Engine]) -> bool:
        """Whether bucket 0 may ride the pause wave: a disaggregated run over a point-to-point
        transport, no other run has taken the engines' lock since this context's last run (the
        lock counts its acquisitions; a lock that cannot say means no ride), and every engine is
        the incarnation this context last saw, at a version it knows to be below this run's. So no
        probe can refuse: bytes move only where nothing would stop them."""
        shared = self.ctx._shared
        if self.ctx.colocated or self.transport.collective or not self.plan:
            return False
        if self.lock_taken is None or shared.lock_taken is None or self.lock_taken != shared.lock_taken + 1:
            return False
        for e in members:
            known = shared.engine_versions.get(e.name)
            if shared.incarnations.get(e.name) != e.incarnation or not isinstance(known, int) or known >= self.version:
                return False
        return True

    def ride_first_bucket(self, members: list[_Engine], steps: list[Step]) -> None:
        """Steady state, every engine where this context left it (`first_bucket_can_ride`): bucket
        0 is packed before any engine pauses and each engine's pause wave carries its load (and
        the finalize, for a one-bucket plan): the engines stall for one round trip less. The
        wave's steps are recorded state by state as any wave's, the pack in TRANSFERRING; a pack
        that fails sends the wave without the load (the run then fails in TRANSFERRING, with no
        byte moved, as it would have)."""
        manifest = self.plan[0]
        pack = self.rank_start(RankStep("pack", "TRANSFERRING", (0, self.attempt), 0), manifest=manifest.summary())
        concurrent.futures.wait([pack.future], timeout=max(pack.started + pack.budget - time.monotonic(), 0.0))
        packed = pack.future.done() and pack.future.exception() is None
        plan = {e: list(steps) for e in members}
        if packed:
            assert self.topology is not None
            payloads = self.transport.payloads(manifest, pack.future.result(), self.topology)
            self.bytes_moved += manifest.payload_bytes
            for e in members:
                plan[e].append(Step("load", "TRANSFERRING", (payloads[e.name],), 0))
                if len(self.plan) == 1:
                    plan[e].append(Step("finalize", "POST_PROCESSING"))
        w = self.start_wave(plan)
        results = self.wait_wave(w)
        held = {e: [(s, r) for s, r in pairs if s.call == "finalize"] for e, pairs in results.items()}
        failed = self.absorb(
            {e: [(s, r) for s, r in pairs if s.call != "finalize"] for e, pairs in results.items()},
            w.batch,
            alongside=pack,
        )
        if failed is not None:
            raise self._wrap(failed, "pack", "TRANSFERRING", None, 0) from failed
        for e, pairs in held.items():  # recorded in POST_PROCESSING, as a last bucket's finalize is
            self.held.extend((e, s, r, w.batch) for s, r in pairs)
        timed_out = any(s.call == "load" and r.outcome == "timeout" for pairs in results.values() for s, r in pairs)
        if timed_out:
            self.connection_dirty = True  # an engine may still read this buffer: not reused next run
        call = "abandon" if timed_out else "release"
        self.rank_call(RankStep(call, "TRANSFERRING", (0,), 0))
        self.rode = 1

    def stream(self, engines: list[_Engine], start: int = 0) -> None:
        """TRANSFERRING then POST_PROCESSING for one attempt of `engines`, from bucket `start` (1:
        bucket 0 rode the pause wave and the run is in TRANSFERRING already)."""
        if start == 0:
            self.enter(T.TRANSFER)
        n = len(self.plan)
        slots = max(self.transport.slots, 1)
        for manifest in self.plan[start:] if engines else ():
            k = manifest.index
            if k > 0:
                self.enter(T.NEXT_BUCKET, bucket=k)
            while len(self.inflight) >= slots:
                self.drain_oldest()
            live = [e for e in engines if e.active]
            if not live or self.broken:
                break
            parts = self.rank_call(RankStep("pack", "TRANSFERRING", (k, self.attempt), k), manifest=manifest.summary())
            assert self.topology is not None
            payloads = self.transport.payloads(manifest, parts, self.topology)
            self.bytes_moved += manifest.payload_bytes
            steps = {e: [Step("load", "TRANSFERRING", (payloads[e.name],), k)] for e in live}
            if k == n - 1:
                for e in live:
                    steps[e].append(Step("finalize", "POST_PROCESSING"))
            w = self.start_wave(steps, count=False)
            send = self.rank_start(RankStep("send", "TRANSFERRING", (k,), k)) if self.transport.collective else None
            self.inflight.append(_Bucket(manifest, w, send))
        while self.inflight:
            self.drain_oldest()
        self.enter(T.POST_PROCESS)
        self.post_process()

    def drain_oldest(self, *, cleanup: bool = False) -> None:
        """Collect every engine's answer for the oldest in-flight bucket, then release its buffer on
        every rank (or abandon it, if an engine did not answer and may still be reading it)."""
        b = self.inflight.popleft()
        k = b.manifest.index
        results = self.wait_wave(b.wave)
        sent_ok = True
        timed_out = False
        if b.send is not None:
            _, exc = self.rank_wait(b.send)
            sent_ok = exc is None
            timed_out = isinstance(exc, TimeoutError)
        for e in self.engines:
            for step, res in results.get(e, ()):
                if step.call == "load":
                    self.record_step(e, step, res, b.wave.batch)
                    self.apply(e, step, res)
                    timed_out |= res.outcome == "timeout"
                else:
                    self.held.append((e, step, res, b.wave.batch))
        failed = [e.name for e, pairs in results.items() for s, r in pairs if s.call == "load" and not r.ok]
        if self.transport.collective and (failed or not sent_ok):
            self.break_group(k, failed, sent_ok)
        if timed_out:
            self.connection_dirty = True  # an engine may still read this buffer: not reused next run
        call = "abandon" if timed_out else "release"
        rc = self.rank_start(RankStep(call, "TRANSFERRING", (k,), k), cleanup=cleanup)
        _, exc = self.rank_wait(rc, state=str(self.machine.state) if cleanup else None)
        if exc is not None and not cleanup:
            raise self._wrap(exc, call, "TRANSFERRING", None, k) from exc

    def break_group(self, k: int, failed: list[str], sent_ok: bool) -> None:
        """A collective group is all-or-nothing per bucket: once a member failed, no later bucket
        can go through it. Every engine of the attempt that still needs buckets fails with it."""
        self.broken = True
        self.connection_dirty = True
        who = ", ".join(failed) if failed else "the trainer's send"
        for e in self.engines:
            if e.active and e.state == E.OPEN and len(e.acked) < len(self.plan):
                reason = RuntimeError(f"the transport group broke at bucket {k} ({who} failed)")
                self.drop(e, Step("load", "TRANSFERRING", bucket=k), reason)

    def post_process(self) -> None:
        """POST_PROCESSING: finalizes that rode on last buckets, then every other finalize owed."""
        held, self.held = self.held, []
        for e, step, res, batch in held:
            self.record_step(e, step, res, batch)
            self.apply(e, step, res)
        owed = [e for e in self.engines if e.state == E.OPEN and e.reachable]
        if owed:
            self.wave({e: [Step("finalize", "POST_PROCESSING")] for e in owed})

    def retryable(self) -> list[_Engine]:
        if self.deadline.remaining() <= 0:
            return []
        return [
            e for e in self.engines
            if e.failure == "error" and e.failed_in in RETRY_STATES and e.state == E.PAUSED
            and e.attempts <= self.ctx.retries
        ]  # fmt: skip

    # ---- committing ------------------------------------------------------------------------------

    def commit(self) -> None:
        """CONTINUING (and RESTORING): complete engines publish and continue, clean ones continue,
        poisoned ones are quarantined; one wave, with the trainer's restore alongside."""
        ctx = self.ctx
        n = len(self.plan)
        ready = [e for e in self.engines if e.active and e.state == E.FINALIZED]
        if not ready:
            raise self.first_error or DriverCallError("no engine completed the update", state=str(self.machine.state))
        self.enter(T.PUBLISH)
        for e in ready:
            problems = invariants.commit_gate(self.events, [e.name], n, attempt=e.attempt)
            if problems:
                raise InvariantViolation("commit gate refused to publish: " + "; ".join(problems), state="CONTINUING")
        kv = [Step("resume_memory", "RESTORING", (["kv_cache"],))] if ctx.colocated else []
        plan: dict[_Engine, list[Step]] = {}
        for e in self.engines:
            if e in ready:
                plan[e] = [
                    Step("publish", "CONTINUING", (self.version,)),
                    Step("continue_generation", "CONTINUING"),
                    *kv,
                ]
            else:
                plan[e] = self.settle_steps(e, "CONTINUING", "CONTINUING", kv_state="RESTORING")
        restore = self.rank_start(RankStep("restore", "RESTORING")) if ctx.colocated else None
        w = self.start_wave(plan)
        restore_failed = self.absorb(self.wait_wave(w), w.batch, alongside=restore)
        if restore is not None:
            self.offloaded = restore_failed is not None
            if restore_failed is not None:
                raise self._wrap(restore_failed, "restore", "RESTORING", None, None)
        if not any(e.published for e in self.engines):
            raise self.first_error or DriverCallError("no engine published the version", state=str(self.machine.state))
        if self.broken:  # a group a member broke is not reused by the next run
            self.teardown(cleanup=False)
        # failure path of the commit: engines that did not publish or continue are settled now
        state = str(self.machine.state)
        self.settle(state, state, cleanup=False)
        if ctx.colocated:
            lacking = [e for e in self.engines if e.state == E.SERVING and "kv_cache" not in e.resumed and e.reachable]
            if lacking:
                self.wave({e: [Step("resume_memory", state, (["kv_cache"],))] for e in lacking})

    def settle(self, continue_state: str, quarantine_state: str, *, cleanup: bool) -> None:
        """Continue the clean engines, quarantine the poisoned; an engine that refused its continue
        is quarantined in a second wave (one that refuses that too is left reported failed)."""
        plan = {
            e: self.settle_steps(e, continue_state, quarantine_state, kv_state=continue_state) for e in self.engines
        }
        if not any(plan.values()):
            return
        self.wave(plan, cleanup=cleanup)
        reason = f"refit to version {self.version} (run {self.run_id}): it refused to continue"
        refused = [
            e for e, steps in plan.items()
            if steps and e.reachable and e.state in (E.PAUSED, E.FINALIZED, E.PUBLISHED)
            and any(s.call == "continue_generation" for s in steps)
        ]  # fmt: skip
        if refused:
            if cleanup and self.machine.can(T.QUARANTINE):
                self.enter(T.QUARANTINE)
            state = str(self.machine.state)
            self.wave({e: [Step("quarantine", state, (reason,))] for e in refused}, cleanup=cleanup)

    def settle_steps(self, e: _Engine, continue_state: str, quarantine_state: str, *, kv_state: str) -> list[Step]:
        """What an engine that did not (or could not) take the version is owed: a continue if it
        is clean and paused (colocated: and its KV memory back), a quarantine if it holds weights
        no version names, its weight memory released again if the run took it and never paused."""
        if not e.reachable or e.state in (E.SERVING, E.QUARANTINED):
            return []
        kv = [Step("resume_memory", kv_state, (["kv_cache"],))] if self.ctx.colocated else []
        if e.state == E.PUBLISHED:
            return [Step("continue_generation", continue_state), *kv]
        steps: list[Step] = []
        if e.state == E.JOINED and "weights" in e.taken:
            steps.append(Step("release_memory", continue_state, (["weights"],)))
        if e.must_not_serve and (e.state != E.JOINED or e.weights != "kept"):
            reason = f"refit to version {self.version} (run {self.run_id}) did not complete on this engine"
            return [*steps, Step("quarantine", quarantine_state, (reason,))]
        if e.state == E.PAUSED:
            return [Step("continue_generation", continue_state), *kv]
        return steps

    # ---- the failure path ----------------------------------------------------------------------

    def abort(self, exc: BaseException) -> None:
        """ABORTING -> [QUARANTINING] -> FAILED. Every step is bounded and recorded."""
        self.error = (
            exc if isinstance(exc, RefitError) else self._wrap(exc, "runner", str(self.machine.state), None, None)
        )
        if isinstance(self.error, DeadlineExceeded) and self.deadline.expired() and self.first_error is not None:
            self.error = self.first_error  # the deadline ran out: what ate it is the error to report
        self.enter(T.FAIL)
        self.emit("run", "error", error=str(self.error))
        while self.inflight:  # what engines did with in-flight buckets, before buffers are touched
            self.drain_oldest(cleanup=True)
        held, self.held = self.held, []
        for e, step, res, batch in held:
            self.record_step(e, step, res, batch, state="ABORTING")
            self.apply(e, step, res)
        owed = [e for e in self.engines if e.state == E.OPEN and e.reachable]
        if owed:
            self.wave({e: [Step("finalize", "ABORTING")] for e in owed}, cleanup=True)
        if self.offloaded:
            self.rank_wait(self.rank_start(RankStep("restore", "ABORTING"), cleanup=True))
            self.offloaded = False
        unpublished = any(e.weights == "changed" and not e.published for e in self.engines)
        if self.connection_dirty or self.broken or unpublished:
            self.teardown(cleanup=True)
        self.settle("ABORTING", "QUARANTINING", cleanup=True)
        self.enter(T.LATCH)

    def end_ranks(self) -> list[Any]:
        """Every rank closes its stream and reports its stats (bookkeeping: not a protocol step)."""
        if self.ranks_stuck:  # a rank stopped answering: what is left of the grace, no floor, no slack
            budget, slack = max(self.cleanup_deadline.remaining(), 0.0), 0.0
        else:
            budget, slack = min(self._budget(True, cap=False), LOCK_TIMEOUT_S), SLACK_S
        try:
            return self.ctx.ranks.start(RankStep("end_run", str(self.machine.state)), timeout=budget).result(
                timeout=budget + slack
            )
        except Exception:
            return []

    # ---- result ----------------------------------------------------------------------------------

    def outcomes(self) -> dict[str, EngineOutcome]:
        return {e.name: self.outcome(e) for e in self.engines}

    def outcome(self, e: _Engine) -> EngineOutcome:
        colocated = self.ctx.colocated
        st = e.state
        serving = st == E.SERVING and ("kv_cache" in e.resumed or not colocated)
        status: str
        version: int | None = None
        if st == E.GONE:
            status = "failed"  # died or hung
        elif st == E.QUARANTINED:
            status = "quarantined"
        elif st == E.SERVING and not serving:
            status = "failed"  # continued but without its KV memory
        elif serving:
            status, version = ("updated", self.version) if e.published else ("unchanged", e.previous_version)
        elif st != E.JOINED:
            status = "failed"  # left paused: a continue or quarantine did not go through
        elif e.weights != "kept" or (colocated and "weights" in e.taken):
            status = "failed"  # its memory could not be given back, or came back empty
        elif e.previous_version is None:
            status = "stale"
        else:  # untouched by the run: as it was before (serving, or released in a colocated job)
            status, version = "unchanged", e.previous_version
            serving = not colocated
        return EngineOutcome(e.name, status, version, len(e.acked), e.attempts, e.error, serving)  # type: ignore[arg-type]


def _rendezvous_only(e: _Engine, attach: list[tuple[Step, StepResult]]) -> bool:
    """This attach went through, or failed only because the collective group did not form."""
    if not e.reachable or not attach:
        return False
    _, res = attach[-1]
    return res.ok or (isinstance(res.error, EngineError) and res.error.kind == "rendezvous")


def _on_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run `fn` on a thread of its own (a stuck lock service cannot starve anything else)."""
    fut: Future[Any] = Future()

    def call() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=call, name="refit-lock", daemon=True).start()
    return fut


def _within(fut: Future[Any], budget: float, what: str) -> Any:
    """`fut`'s value, waiting at most `budget`; DeadlineExceeded naming `what` otherwise."""
    try:
        return fut.result(timeout=max(budget, 0.0))
    except concurrent.futures.TimeoutError:
        if fut.done():
            raise
        raise DeadlineExceeded(f"{what} did not return within {budget:.3g}s") from None


def run(ctx: RefitContext) -> RefitResult:
    """Drive one whole refit. Returns a RefitResult whether it succeeded or failed (errors are data:
    `result.ok`, `result.error`, per-engine `result.engines`); raises RefitBusyError when another
    run holds the engines, and InvariantViolation when the run's own events break an invariant.
    Under SPMD every rank calls it; the followers get the leader's result."""
    if ctx._shared.closed:
        raise RuntimeError("this RefitContext is closed")
    assert ctx.ranks is not None
    if not ctx.leader:
        outcome = ctx.ranks.follow(ctx.deadline_s + ctx.cleanup_grace_s + 5.0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
    try:
        result = _lead(ctx)
    except BaseException as exc:
        ctx.ranks.finish(exc)
        raise
    ctx.ranks.finish(result)
    log = logging.getLogger(__name__)
    unfired = ctx.faults.unfired() if ctx.faults is not None else []
    if unfired:  # an injected fault that matched no step tested nothing: say so
        log.warning(
            "refit run %s: %d planned fault(s) never fired (no step matched): %s", result.run_id, len(unfired),
            "; ".join(str(f.describe()) for f in unfired),
        )  # fmt: skip
    if not result.ok:  # errors are data, but a failed refit is said out loud: a WARNING on this module's logger
        engines = ", ".join(f"{n} {o.status}" for n, o in result.engines.items())
        log.warning(
            "refit run %s failed in %s (ended %s; engines: %s): %s; trace: %s",
            result.run_id, getattr(result.error, "state", None) or result.state, result.state, engines or "none",
            result.error, result.trace_path or "not written (RefitContext(trace=PATH) writes one)",
        )  # fmt: skip
    return result


def _lead(ctx: RefitContext) -> RefitResult:
    r = _Run(ctx)
    try:
        r.read_incarnations()
    except RefitError:
        r.emit("run", "start", previous_version=r.previous_version, owner=r.owner, engines=[e.name for e in r.engines])
        r.emit("run", "end", result="incarnation_error")
        raise
    r.emit(
        "run", "start", previous_version=r.previous_version, owner=r.owner, engines=[e.name for e in r.engines],
        incarnations=[e.incarnation for e in r.engines], engine_tp=[e.tp for e in r.engines], mode=ctx.mode,
        pause_mode=ctx.pause_mode, bucket_bytes=ctx.bucket_bytes, deadline_s=ctx.deadline_s,
        cleanup_grace_s=ctx.cleanup_grace_s, retries=ctx.retries, call_timeout_s=ctx.call_timeout_s,
        ranks=ctx.ranks.world if ctx.ranks else 1, transport=ctx.transport.kind, collective=ctx.transport.collective,
        shares_storages=ctx.transport.shares_storages or None,
    )  # fmt: skip
    lock = ctx.lock
    if lock is None:
        raise RuntimeError("RefitContext has no lock")
    lock_deadline = Deadline(max(min(r.deadline.remaining(), LOCK_TIMEOUT_S), 1e-3), clock=time.monotonic)
    acquire: Future[Any] | None = None
    try:  # the two lock calls share one budget
        holder = _within(_on_thread(lambda: lock.holder), lock_deadline.remaining(), "reading the lock holder")
        acquire = _on_thread(lambda: lock.acquire(r.owner))
        acquired = _within(acquire, lock_deadline.remaining(), "acquiring the engines' lock")
    except Exception as exc:
        if acquire is not None and not acquire.done():  # it may still take the lock: give it back then
            acquire.add_done_callback(lambda f: f.exception() is None and f.result() and lock.release(r.owner))
        r.emit("lock", "acquire", owner=r.owner, outcome=outcome_of(exc), error=str(exc))
        r.emit("run", "end", result="lock_error")
        raise r._wrap(exc, "lock.acquire", "IDLE", None, None) from exc
    if not acquired:
        r.emit("lock", "acquire", owner=r.owner, outcome="busy", holder=holder)
        r.emit("run", "end", result="busy")
        raise RefitBusyError(f"engines {[e.name for e in r.engines]} are being refit by another run", state="IDLE")
    if hasattr(lock, "acquisitions"):  # optional: lets a steady-state run know nobody refit in between
        with contextlib.suppress(Exception):
            r.lock_taken = int(_within(_on_thread(lambda: lock.acquisitions), lock_deadline.remaining(), "the lock"))
    r.emit("lock", "acquire", owner=r.owner, outcome="ok", holder=holder, taken=r.lock_taken)
    interrupt: BaseException | None = None
    t0 = ctx.clock()
    stats: list[Any] = []
    try:
        try:
            r.execute()
        except BaseException as exc:
            if not isinstance(exc, Exception):
                interrupt = exc  # KeyboardInterrupt / SystemExit: clean up, then re-raise
            r.abort(exc)
        stats = r.end_ranks()
    finally:
        try:
            budget = min(max(r.cleanup_deadline.remaining(), CLEANUP_FLOOR_S), LOCK_TIMEOUT_S)
            released = _within(_on_thread(lambda: lock.release(r.owner)), budget, "lock release")
            r.emit("lock", "release", owner=r.owner, outcome="ok" if released else "not_owner", holder=r.owner)
        except Exception as exc:  # recorded; the run's end is still written and the context stays usable
            r.emit("lock", "release", owner=r.owner, outcome=outcome_of(exc), error=f"{type(exc).__name__}: {exc}")
        ctx._shared.next_version = r.version + 1
        outcomes = r.outcomes()
        ctx._shared.engine_versions.update({name: o.version for name, o in outcomes.items()})
        ctx._shared.incarnations.update({e.name: e.incarnation for e in r.engines})
        ctx._shared.lock_taken = r.lock_taken
        now = ctx.clock()
        r.phase_seconds[str(r.machine.state)] = r.phase_seconds.get(str(r.machine.state), 0.0) + now - r._phase_t0
        published = r.version if any(e.published for e in r.engines) else None
        r.emit(
            "run", "end", result=str(r.machine.state), published=published,
            engine_outcomes={n: {"status": o.status, "version": o.version} for n, o in outcomes.items()},
            error=None if r.error is None else str(r.error), round_trips=r.round_trips,
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
        round_trips=r.round_trips,
        ranks=ctx.ranks.world if ctx.ranks else 1,
        trainer_peak_bytes=max((getattr(s, "peak_bytes", 0) for s in stats or []), default=0),
    )
    result.rank_stats = stats or []  # type: ignore[attr-defined]
    if interrupt is not None:
        raise interrupt
    if ctx.check_invariants:
        result.violations = invariants.check_run(r.events)
        if result.violations:
            err = InvariantViolation("; ".join(str(v) for v in result.violations))
            err.result = result  # type: ignore[attr-defined]
            raise err
    return result


__all__ = ["disconnect", "run"]
