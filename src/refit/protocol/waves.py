"""Waves: the only place a run calls engine drivers and trainer ranks, under one `Budget`.

A wave is one call per engine (consecutive steps a driver may batch into one round trip), sent at
once on each engine's own lane and waited for once: however many engines ignore their timeouts,
the wait ends at the wave's budget plus `SLACK_S`. What comes back is checked against the
step-result contract (`answers.py`); an answer that came after its budget is not trusted
(`LateAnswer`). A trainer-side step (`RankStep`) runs on every rank under the same rules.
Nothing here decides anything about a refit: results go back to the runner, which records them
and hands them to the ledger.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from refit.drivers.base import Step, StepResult, outcome_of
from refit.errors import DeadlineExceeded, EngineDied, EngineError, LateAnswer, NoTimeLeft
from refit.invariants.integrity import LATE_TOLERANCE_S
from refit.protocol.answers import SLACK_S, clean, malformed
from refit.protocol.deadline import Deadline
from refit.protocol.ranks import RECORDED_RESULTS, RankStep
from refit.states import FactMachine, Failure, Ranks, RanksEvent

CLEANUP_FLOOR_S = 0.25  # owed cleanup calls are still sent, and waited on this long, past deadline + grace
LOCK_TIMEOUT_S = 5.0  # a lock call (or incarnation read) waits at most this long, within the deadline


class Member(Protocol):
    """What a wave needs of an engine's record: where its driver is, its name, why it failed."""

    index: int
    name: str
    failure: FactMachine


@dataclass
class Budget:
    """How long each call of one run may take: the run's deadline; the cleanup deadline (the
    deadline plus `cleanup_grace_s`, for must-run cleanup only), past which owed calls still get
    `CLEANUP_FLOOR_S`; the per-call cap; and whether the trainer ranks stopped answering (then
    they get no floor and no slack: their calls would only stack up)."""

    deadline: Deadline
    cleanup: Deadline
    call_timeout_s: float | None = None
    ranks: FactMachine = field(default_factory=lambda: FactMachine("ranks"))

    @classmethod
    def of(cls, deadline_s: float, grace_s: float, call_timeout_s: float | None, clock: Callable[[], float]) -> Budget:
        deadline = Deadline(deadline_s, clock=clock)
        return cls(deadline, deadline.extended(grace_s), call_timeout_s)

    @property
    def ranks_stuck(self) -> bool:
        return self.ranks.state == Ranks.STUCK

    def engine_call(self, cleanup: bool = False) -> float:
        return min(self._left(cleanup), self.call_timeout_s) if self.call_timeout_s is not None else self._left(cleanup)

    def rank_call(self, cleanup: bool = False) -> float:
        if cleanup and self.ranks_stuck:  # a rank already stopped answering: no floor, they would stack
            return self.cleanup.remaining()
        return self._left(cleanup)

    def rank_slack(self) -> float:
        return 0.0 if self.ranks_stuck else SLACK_S

    def end_of_run(self) -> tuple[float, float]:
        """The budget and slack of the ranks' end-of-run bookkeeping."""
        if self.ranks_stuck:
            return max(self.cleanup.remaining(), 0.0), 0.0
        return min(self._left(True), LOCK_TIMEOUT_S), SLACK_S

    def short(self) -> float:
        """A lock call or incarnation read: at most LOCK_TIMEOUT_S, within the deadline."""
        return min(self.deadline.remaining(), LOCK_TIMEOUT_S)

    def release(self) -> float:
        """The lock's release: cleanup time, with the floor, at most LOCK_TIMEOUT_S."""
        return min(self._left(True), LOCK_TIMEOUT_S)

    def _left(self, cleanup: bool) -> float:
        if cleanup:
            return max(self.cleanup.remaining(), CLEANUP_FLOOR_S)
        return self.deadline.remaining()


@dataclass
class Wave:
    batch: int
    budget: float
    started: float  # time.monotonic(): waits are real time even when a replay fakes the clock
    items: list[tuple[Any, list[Step], Future[list[StepResult]]]]


@dataclass
class RankCall:
    step: RankStep
    future: Future[list[Any]]
    budget: float
    started: float
    t0: float  # the run's clock, for the event's duration
    extra: dict[str, Any]


@dataclass
class RankAnswer:
    values: list[Any] | None
    error: BaseException | None
    fields: dict[str, Any]  # the call event's fields


Results = dict[Any, list[tuple[Step, StepResult]]]


class Waves:
    """Calls for one run: `drivers[i]` answers for the member whose `index` is i."""

    def __init__(
        self,
        drivers: Sequence[Any],
        ranks: Any,
        lane: Callable[[str], Executor],
        budget: Budget,
        clock: Callable[[], float],
        world: int,
    ) -> None:
        self.drivers = list(drivers)
        self.ranks = ranks
        self.lane = lane
        self.budget = budget
        self.clock = clock
        self.world = world
        self.round_trips = 0
        self.budgets: dict[int, float] = {}  # batch -> the budget its engine calls were given
        self._batches = itertools.count()
        self.last_batch = -1  # the newest engine call started (batches are numbered in the order sent)
        self._answered: dict[int, float] = {}  # id(future) -> when it completed (time.monotonic)

    def _stamp(self, fut: Future[Any]) -> None:
        self._answered[id(fut)] = time.monotonic()

    # ---- engines -------------------------------------------------------------------------------

    def start(
        self, plan: dict[Any, list[Step]], *, cleanup: bool = False, count: bool = True, limit: float | None = None
    ) -> Wave:
        """Send `plan`'s steps, each engine's in one call, within the engine-call budget (at most
        `limit` seconds: a wave whose engines may wait inside the call, DRAINING's)."""
        budget = self.budget.engine_call(cleanup)
        if limit is not None:
            budget = min(budget, limit)
        wave = Wave(next(self._batches), budget, time.monotonic(), [])
        self.budgets[wave.batch] = budget
        self.last_batch = wave.batch
        for e, steps in plan.items():
            if not steps:
                continue
            if budget <= 0:
                fut: Future[list[StepResult]] = Future()
                fut.set_result([StepResult("timeout", error=NoTimeLeft(f"no time left for {steps[0].call}"))])
            else:
                try:
                    fut = self.drivers[e.index].run_steps_async(steps, timeout=budget, executor=self.lane(e.name))
                except Exception as exc:
                    fut = Future()
                    fut.set_exception(exc)
            fut.add_done_callback(self._stamp)
            wave.items.append((e, steps, fut))
        if count and wave.items:
            self.round_trips += 1
        return wave

    def wait(self, wave: Wave) -> Results:
        """Every engine's step results, waiting once for all of them (engines already known to be
        hung are not waited on again)."""
        waiting = [f for e, _, f in wave.items if e.failure.state != Failure.TIMEOUT]
        end = wave.started + wave.budget + SLACK_S
        concurrent.futures.wait(waiting, timeout=max(end - time.monotonic(), 0.0))
        return {e: self._step_results(e, steps, fut, wave) for e, steps, fut in wave.items}

    def _step_results(
        self, e: Member, steps: list[Step], fut: Future[list[StepResult]], wave: Wave
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
        self, e: Member, pairs: list[tuple[Step, StepResult]], fut: Future[Any], wave: Wave
    ) -> list[tuple[Step, StepResult]]:
        """An answer (ok or error) that came after the call's budget is a driver that ignores its
        timeout: its answer is not trusted (effect unknown) and it is recorded `late`."""
        answered = self._answered.get(id(fut), time.monotonic()) - wave.started
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

    def each(self, members: Sequence[Member], fns: Sequence[Callable[[], Any]], what: str) -> list[Any]:
        """Call each engine's function on its lane, waiting once for all, within the deadline."""
        futures = [self.lane(e.name).submit(fn) for e, fn in zip(members, fns, strict=True)]
        budget = self.budget.short()
        concurrent.futures.wait(futures, timeout=budget)
        out = []
        for e, f in zip(members, futures, strict=True):
            if not f.done():
                raise DeadlineExceeded(f"{what} of engine {e.name} did not return in {budget:.3g}s")
            out.append(f.result())
        return out

    # ---- trainer ranks ----------------------------------------------------------------------------

    def rank_start(self, step: RankStep, *, cleanup: bool = False, **extra: Any) -> RankCall:
        budget = self.budget.rank_call(cleanup)
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
        rc = RankCall(step, fut, budget, time.monotonic(), t0, extra)
        fut.add_done_callback(self._stamp)
        return rc

    def rank_settle(self, rc: RankCall) -> bool:
        """Wait for `rc` within its budget, recording nothing; whether it succeeded."""
        concurrent.futures.wait([rc.future], timeout=max(rc.started + rc.budget - time.monotonic(), 0.0))
        return rc.future.done() and rc.future.exception() is None

    def rank_wait(self, rc: RankCall) -> RankAnswer:
        """Wait for a trainer-side step (bounded): its values or error, and its event's fields."""
        exc: BaseException | None = None
        values = None
        # a rank that stopped answering answers nothing late: once one has, no slack past the budget
        try:
            values = rc.future.result(
                timeout=max(rc.started + rc.budget + self.budget.rank_slack() - time.monotonic(), 0.0)
            )
        except Exception as caught:
            exc = caught
            if isinstance(caught, TimeoutError) and not rc.future.done():  # our wait ran out, not the ranks'
                exc = TimeoutError(f"{rc.step.call} did not return on every trainer rank inside {rc.budget:.3g}s")
        if isinstance(exc, TimeoutError):
            self.budget.ranks.fire(RanksEvent.STALL)
        answered = self._answered.get(id(rc.future), time.monotonic()) - rc.started
        late = rc.future.done() and not isinstance(exc, TimeoutError) and answered > rc.budget + LATE_TOLERANCE_S
        if late:
            exc = LateAnswer(
                f"{rc.step.call} answered {answered:.3f}s into the call, past its {rc.budget:.3f}s budget: "
                f"a trainer-side driver ignores its timeout, so its answer is not trusted",
                cause=exc, state=rc.step.state, call=rc.step.call, bucket=rc.step.bucket,
            )  # fmt: skip
        took = answered if rc.future.done() else self.clock() - rc.t0  # until it answered, not until recorded
        fields = dict(
            side=rc.step.side, outcome="ok" if exc is None else outcome_of(exc), duration_s=round(took, 6),
            error=None if exc is None else f"{type(exc).__name__}: {exc}", bucket=rc.step.bucket, ranks=self.world,
            budget_s=round(rc.budget, 6) if rc.budget > 0 else None, late=True if late else None,
            per_rank=values if rc.step.call in RECORDED_RESULTS and exc is None else None, **rc.extra,
        )  # fmt: skip
        return RankAnswer(values, exc, fields)

    def end_of_run(self, ranks: Any, state: str) -> list[Any]:
        """Every rank closes its stream and reports its stats (bookkeeping: not a protocol step, so
        `ranks` are the context's own, never behind a fault wrapper)."""
        budget, slack = self.budget.end_of_run()
        try:
            return ranks.start(RankStep("end_run", state), timeout=budget).result(timeout=budget + slack)
        except Exception:
            return []


def call_fields(step: Step, res: StepResult, budget: float | None) -> dict[str, Any]:
    """An engine call's event fields (beyond who, when and which batch)."""
    err = res.error
    extra: dict[str, Any] = {"result": res.value} if isinstance(res.value, dict) else {}
    if step.call in ("resume_memory", "release_memory") and step.args:
        extra["tags"] = list(step.args[0])
    if budget is not None:
        extra["budget_s"] = round(budget, 6)
    if isinstance(err, LateAnswer):
        extra["late"] = True  # the driver ignored its timeout: a driver bug, never a success
    if getattr(err, "no_effect", False):
        extra["effect"] = "none"  # the engine refused it before changing anything
    if isinstance(err, NoTimeLeft):
        extra["sent"] = False  # the run had no time left: the call never reached the engine
    if isinstance(err, EngineError) and err.data:
        extra["error_data"] = err.data  # facts the runner acted on (the version a probe found): for replay
    return dict(
        bucket=step.bucket, outcome=res.outcome, duration_s=round(res.seconds, 6),
        error=None if err is None else f"{type(err).__name__}: {err}", done_at=res.done_at, **extra,
    )  # fmt: skip
