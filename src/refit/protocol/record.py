"""The run's record: every move of the run machine and every call, as trace events, in table order.

`Recording` is the half of a run that writes down what happened: it moves the run machine
(`enter`, `move_to`: a step is recorded in its own state), records each engine step and hands its
result to the ledger (`apply`), records each trainer-side step (`rank_wait`), and records a wave's
results state by state (`absorb`). The runner (`runner._Run`) is the other half: the phase script.
"""

from __future__ import annotations

from typing import Any

from refit.drivers.base import Step, StepResult
from refit.errors import DriverCallError, NoTimeLeft
from refit.protocol.answers import wrap_error
from refit.protocol.context import RefitContext
from refit.protocol.ledger import Engine, Event, Ledger
from refit.protocol.ranks import RankStep
from refit.protocol.waves import RankCall, Results, Waves, call_fields
from refit.states import TRANSITIONS, RefitMachine, RefitState, Trigger

_ORDER = {s: i for i, s in enumerate(RefitState)}


def _next_trigger(state: RefitState, target: RefitState | None = None) -> Trigger:
    """The happy-path move out of `state` towards `target`: the one straight into it where the
    table has one (CONNECTING -> STAGING in an atomic or LoRA run), else the first it lists."""
    moves = [(trig, dst) for trig, sources, dst in TRANSITIONS if state in sources]
    return next((trig for trig, dst in moves if dst == target), moves[0][0])


class Recording:
    """Recording for one run (the runner sets these in its constructor)."""

    ctx: RefitContext
    run_id: str
    version: int
    attempt: int
    machine: RefitMachine
    waves: Waves
    ledger: Ledger
    engines: list[Engine]
    events: list[dict[str, Any]]
    phase_seconds: dict[str, float]
    _phase_t0: float
    ran_out: bool = False  # a call of this run found no time left: the deadline ran out (as recorded)

    def emit(self, kind: str, event: str, *, state: str | None = None, **fields: Any) -> dict[str, Any]:
        fields.setdefault("version", self.version)  # the version this run refits to
        fields.setdefault("attempt", self.attempt)
        record = self.ctx.recorder.emit(kind, event, run=self.run_id, state=state or str(self.machine.state), **fields)
        self.events.append(record)
        return record

    def emit_all(self, events: list[Event]) -> None:
        for kind, event, fields in events:
            extra = {"sent_batches": self.waves.last_batch} if (kind, event) == ("engine", "dropped") else {}
            self.emit(kind, event, **fields, **extra)  # (calls in later batches were sent after it left)

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
            self.enter(_next_trigger(self.machine.state, target))

    def record(self, e: Engine, step: Step, res: StepResult, batch: int, state: str | None = None) -> None:
        self.ran_out = self.ran_out or isinstance(res.error, NoTimeLeft)
        fields = call_fields(step, res, self.waves.budgets.get(batch))
        self.emit(
            "call", step.call, state=state or step.state, side="engine", engine=e.name,
            attempt=max(e.attempt, 0), batch=batch, **fields,
        )  # fmt: skip
        moves = res.value.get("adapter_moves") if res.ok and isinstance(res.value, dict) else None
        if moves:  # in the trace now: its driver may acknowledge them (`EngineDriver.recorded_moves`)
            self.waves.drivers[e.index].recorded_moves(moves)

    def apply(self, e: Engine, step: Step, res: StepResult, batch: int, state: str | None = None) -> None:
        """Record one engine step and hand its result to the ledger."""
        self.record(e, step, res, batch, state)
        self.emit_all(self.ledger.apply(e, step, res))

    def rank_wait(self, rc: RankCall, *, state: str | None = None) -> tuple[list[Any] | None, BaseException | None]:
        """Wait for a trainer-side step (bounded), record it as one event; (values, error)."""
        answer = self.waves.rank_wait(rc)
        self.ran_out = self.ran_out or isinstance(answer.error, NoTimeLeft)
        self.emit("call", rc.step.call, state=state or rc.step.state, **answer.fields)
        return answer.values, answer.error

    def rank_call(self, step: RankStep, *, cleanup: bool = False, **extra: Any) -> list[Any]:
        values, exc = self.rank_wait(self.waves.rank_start(step, cleanup=cleanup, **extra))
        if exc is not None:
            raise wrap_error(exc, step.call, step.state, None, step.bucket) from exc
        return values or []

    def wave(self, plan: dict[Engine, list[Step]], *, cleanup: bool = False) -> None:
        """Send a wave, wait for it, record and apply every step in table order."""
        w = self.waves.start(plan, cleanup=cleanup)
        self.absorb(self.waves.wait(w), w.batch)

    def absorb(self, results: Results, batch: int, *, alongside: RankCall | None = None) -> BaseException | None:
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
                        self.apply(e, step, res, batch)
        return failed

    def drop(self, e: Engine, step: Step, err: BaseException) -> None:
        self.emit_all(self.ledger.drop(e, step, err))

    def require_engines(self, what: str) -> None:
        """The run itself fails when no engine is left to carry it."""
        if not any(e.active for e in self.engines):
            raise self.ledger.first_error or DriverCallError(f"no engine left {what}", state=str(self.machine.state))
