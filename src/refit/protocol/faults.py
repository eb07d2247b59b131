"""Deterministic, keyed fault injection: make a chosen step fail, to prove cleanup works.

`FaultPlan().fail_at("transferring", engine=1, bucket=2, kind="kill")` fires at the first step that
matches (state, engine index, bucket, call); keys left as None match anything; each fault fires
once and is recorded in the trace. Kinds:

  raise    the step fails with InjectedFault instead of running
  hang     the step does not return inside its time budget (the engine stalls, then carries on late)
  kill     the engine's process dies (SIGKILL) when the step reaches it
  corrupt  the step's payload arrives damaged: a bucket's bytes fail their checksum, any other
           request cannot be decoded
  silent   (flip, swap_qk, downcast, skip, swap_tp, kv_replica, late_copy on a load; stale_head on
           a finalize) the engine answers as if all went well and holds wrong weights (`refit.
           reference.engine.SILENT_FAULTS`): only verification before publish catches them. Injected inside the
           engine only: a driver without `arm_fault` fails the step saying it cannot host one.

Faults are injected by wrappers put around the engine drivers and the trainer ranks (`wrap`)
for a run that has a plan (`FaultyEngine`, `FaultyRanks`): the runner's own call path knows
nothing of them. hang, kill and corrupt happen inside the engine when its driver supports
`arm_fault` (the reference engine does); otherwise the wrapper simulates them at the driver
boundary. On trainer-side steps, which every rank runs, the leader's wrapper decides for all ranks
at once: hang stalls the step past its budget (no rank runs it) and the other kinds raise.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any

from refit.drivers.base import EngineDriver, Step, StepResult
from refit.errors import EngineDied, EngineError

SILENT_KINDS = ("flip", "swap_qk", "downcast", "skip", "swap_tp", "kv_replica", "late_copy", "stale_head")
LOUD_KINDS = ("raise", "hang", "kill", "corrupt")  # the call fails, hangs or the engine dies: it is noticed
FAULT_KINDS = (*LOUD_KINDS, *SILENT_KINDS)
TP_KINDS = ("swap_tp", "kv_replica")  # silent kinds that need TP ranks (kv_replica: fewer KV heads than ranks)
SILENT_CALLS = {"stale_head": "finalize"}  # the call each silent kind corrupts (the others: load)
# The calls the runner makes in each state a fault can fire in (engine and trainer side): a fault
# keyed to any other (state, call) can never fire. tests/fault_matrix.py checks every call of
# its real runs against this table, so it cannot drift from the runner.
FAULT_CALLS: dict[str, frozenset[str]] = {
    "OFFLOADING": frozenset({"offload", "probe", "resume_memory"}),
    "CONNECTING": frozenset({"probe", "resume_memory", "attach", "detach", "connect", "join", "disconnect"}),
    "STAGING": frozenset({"stage", "discard"}),  # atomic runs
    "PAUSING": frozenset({"pause"}),
    "INVALIDATING": frozenset({"flush", "begin"}),
    "TRANSFERRING": frozenset({"pack", "send", "load", "release", "abandon"}),
    "POST_PROCESSING": frozenset({"finalize"}),
    "VERIFYING": frozenset({"verify", "digests"}),
    "RECONNECTING": frozenset({"attach", "detach", "connect", "join", "disconnect"}),
    "DRAINING": frozenset({"drain"}),  # LoRA refits
    "SWAPPING": frozenset({"pause", "flush", "swap"}),  # atomic runs
    "CONTINUING": frozenset(
        {"publish", "continue_generation", "quarantine", "release_memory", "detach", "disconnect", "discard"}
    ),
    "RESTORING": frozenset({"restore", "resume_memory", "quarantine", "detach", "disconnect"}),
}
# the trainer ranks' steps (`refit.protocol.ranks.Participant`), some in states the table above
# does not list (IDLE: metas, predigest, prepare, logprobs; ABORTING: restore)
TRAINER_STEPS = frozenset(
    {"metas", "epoch", "predigest", "prepare", "logprobs", "offload", "restore", "connect", "join", "pack", "send",
     "release", "abandon", "digests", "disconnect", "end_run", "materialize"}
)  # fmt: skip
FAULT_STATES = frozenset({"IDLE", "ABORTING", *FAULT_CALLS})  # where a planned fault can match a step
FAULT_STATES_SHOWN = tuple(s.lower() for s in FAULT_CALLS)  # what a refusal names (IDLE, ABORTING: tests')
HANG_SLACK_S = 0.6  # how far past its budget an injected hang answers (the runner waits budget + 0.5)


class InjectedFault(RuntimeError):
    """The error an injected `raise` fault produces."""


@dataclass
class Fault:
    state: str
    engine: int | None = None
    bucket: int | None = None
    call: str | None = None
    kind: str = "raise"
    after: int = 0  # matching steps let through before it fires (1: a retry's step, not the first)
    fired: int = 0
    passed: int = 0

    def matches(self, state: str, call: str, engine: int | None, bucket: int | None) -> bool:
        return (
            self.fired == 0
            and self.state == state
            and (self.engine is None or self.engine == engine)
            and (self.bucket is None or self.bucket == bucket)
            and (self.call is None or self.call == call)
        )

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {
            "state": self.state,
            "engine": self.engine,
            "bucket": self.bucket,
            "call": self.call,
            "kind": self.kind,
        }
        if self.after:
            out["after"] = self.after
        return out


@dataclass
class FaultPlan:
    faults: list[Fault] = field(default_factory=list)

    def fail_at(
        self,
        state: str,
        *,
        engine: int | None = None,
        bucket: int | None = None,
        call: str | None = None,
        kind: str = "raise",
    ) -> FaultPlan:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind {kind!r}; known {FAULT_KINDS}")
        state = state.upper()
        if state not in FAULT_STATES:
            raise ValueError(f"{state.lower()!r} is not a state a fault can fire in ({', '.join(FAULT_STATES_SHOWN)})")
        if call is not None and kind not in SILENT_KINDS:
            known = frozenset().union(*FAULT_CALLS.values(), TRAINER_STEPS)
            listed = FAULT_CALLS.get(state)
            if call not in known or (listed is not None and call not in listed):
                calls = sorted(listed if listed is not None else known)
                raise ValueError(
                    f"no {call!r} call is made in {state.lower()}, so a fault there could never fire (its calls: "
                    f"{', '.join(calls)})"
                )
        if kind in SILENT_KINDS:
            want = SILENT_CALLS.get(kind, "load")
            if call not in (None, want) or state != ("POST_PROCESSING" if want == "finalize" else "TRANSFERRING"):
                where = "post_processing, call finalize" if want == "finalize" else "transferring, call load"
                raise ValueError(f"fault kind {kind!r} corrupts a {want}: plan it at {where}")
            call = want
        key = (state, engine, bucket, call)
        if any((f.state, f.engine, f.bucket, f.call) == key for f in self.faults):
            raise ValueError(f"a fault is already planned at {key}")
        self.faults.append(Fault(state, engine, bucket, call, kind))
        return self

    def take(self, state: str, call: str, engine: int | None, bucket: int | None) -> Fault | None:
        """The fault to fire for this step, marking it fired; None if no fault matches."""
        for fault in self.faults:
            if fault.matches(state, call, engine, bucket):
                if fault.passed < fault.after:
                    fault.passed += 1
                    continue
                fault.fired += 1
                return fault
        return None

    @classmethod
    def parse(cls, spec: str, *, engines: int | None = None) -> FaultPlan:
        """'transferring:engine=1:bucket=2[:call=load][:kind=kill]' -> a plan with that one fault.
        Refuses (ValueError) a state that is not an active state of the table, an unknown key or
        kind, a non-integer or negative engine/bucket, an engine index past `engines`."""
        from refit.states import ACTIVE_STATES

        state, *parts = spec.split(":")
        if state.upper() not in {str(s) for s in ACTIVE_STATES}:
            known = ", ".join(str(s).lower() for s in ACTIVE_STATES)
            raise ValueError(f"fault spec {spec!r}: {state!r} is not a state a fault can fire in ({known})")
        kwargs: dict[str, object] = {}
        for part in parts:
            key, sep, value = part.partition("=")
            if not sep or key not in ("engine", "bucket", "call", "kind"):
                raise ValueError(f"bad fault spec part {part!r} in {spec!r} (use engine=, bucket=, call=, kind=)")
            if key in ("engine", "bucket"):
                if not value.isdigit():
                    raise ValueError(f"fault spec {spec!r}: {key} must be a non-negative integer, got {value!r}")
                kwargs[key] = int(value)
            else:
                kwargs[key] = value
        if engines is not None and isinstance(kwargs.get("engine"), int) and kwargs["engine"] >= engines:  # type: ignore[operator]
            raise ValueError(f"fault spec {spec!r}: engine={kwargs['engine']} but there are {engines} engines")
        calls = FAULT_CALLS.get(state.upper(), frozenset())
        if "bucket" in kwargs and state.upper() != "TRANSFERRING":
            raise ValueError(f"fault spec {spec!r}: bucket= only applies in transferring (the bucket loop)")
        call = kwargs.get("call")
        known = frozenset().union(*FAULT_CALLS.values())
        if isinstance(call, str) and call in known and call not in calls:  # unknown calls: refit demo names them
            raise ValueError(
                f"fault spec {spec!r}: {call} never runs in {state.lower()} (calls there: {', '.join(sorted(calls))})"
            )
        return cls().fail_at(state, **kwargs)  # type: ignore[arg-type]

    def unfired(self) -> list[Fault]:
        return [f for f in self.faults if not f.fired]

    def out_of_reach(self, buckets: int, engines: int) -> list[str]:
        """The unfired faults this run can never fire: a bucket its plan does not have, or an
        engine it does not drive (known once the run has planned its buckets)."""
        out = []
        for f in self.unfired():
            if f.bucket is not None and not 0 <= f.bucket < buckets:
                out.append(
                    f"{f.describe()} targets bucket {f.bucket}, but this refit's plan has {buckets} bucket(s), "
                    f"0 to {buckets - 1} (a smaller bucket_bytes makes more)"
                )
            elif f.engine is not None and not 0 <= f.engine < engines:
                out.append(f"{f.describe()} targets engine {f.engine}, but the run drives {engines} engine(s)")
        return out


OnFire = Callable[[Fault, str], None]


def _later(seconds: float, fire: Callable[[], None]) -> None:
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def _timeout_later(fut: Future[Any], seconds: float, message: str) -> None:
    def fire() -> None:
        if not fut.done():
            fut.set_exception(TimeoutError(message))

    _later(seconds, fire)


class FaultyEngine:
    """An engine driver with a fault plan in front of it (one run)."""

    def __init__(self, driver: EngineDriver, plan: FaultPlan, index: int, on_fire: OnFire) -> None:
        self.driver = driver
        self.plan = plan
        self.index = index
        self.on_fire = on_fire
        self.killed_by: Fault | None = None  # a simulated kill: every later step finds the engine gone

    def __getattr__(self, name: str) -> Any:
        return getattr(self.driver, name)

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Executor) -> Future[list[StepResult]]:
        if self.killed_by is not None:
            return _done([StepResult("error", error=EngineDied(f"engine {self.driver.name} is gone (simulated kill)"))])
        for i, step in enumerate(steps):  # noqa: B007 - `i` marks where the fault fires
            fault = self.plan.take(step.state, step.call, self.index, step.bucket)
            if fault is not None:
                break
        else:
            return self.driver.run_steps_async(steps, timeout=timeout, executor=executor)
        self.on_fire(fault, step.call)
        refused = None
        if fault.kind != "raise":
            armed, refused = self._arm(fault, step, timeout)
            if armed:
                return self.driver.run_steps_async(steps, timeout=timeout, executor=executor)  # it misbehaves for real
        if fault.kind == "hang":
            out: Future[list[StepResult]] = Future()
            _timeout_later(out, timeout + HANG_SLACK_S, f"engine {self.driver.name} did not answer (simulated hang)")
            return out
        if fault.kind == "kill":
            self.killed_by = fault
            return _done([StepResult("error", error=EngineDied(f"engine {self.driver.name} is gone (simulated kill)"))])
        err: BaseException
        if fault.kind == "raise":
            err = InjectedFault(f"injected raise fault at {step.state}/{step.call}")
        elif fault.kind in SILENT_KINDS:  # wrong weights cannot be faked from outside the engine
            why = f"it refused: {refused}" if refused else "its driver has no arm_fault"
            err = InjectedFault(f"engine {self.driver.name} cannot host a silent {fault.kind} fault ({why})")
        else:
            err = EngineError("bad_payload", f"{step.call}: payload corrupted in transit (simulated)")
        prefix = list(steps[:i])
        if not prefix:
            return _done([StepResult("error", error=err)])
        return _then(self.driver.run_steps_async(prefix, timeout=timeout, executor=executor), len(prefix), err)

    def _arm(self, fault: Fault, step: Step, timeout: float) -> tuple[bool, str | None]:
        """Ask the engine to misbehave for real on this step: (armed, why the engine refused)."""
        try:
            armed = self.driver.arm_fault(
                fault.kind, step.call, bucket=step.bucket, seconds=timeout + HANG_SLACK_S + 0.5, timeout=5.0
            )
        except Exception as exc:
            return False, str(getattr(exc, "message", None) or exc)
        return bool(armed), None


def _done(results: list[StepResult]) -> Future[list[StepResult]]:
    fut: Future[list[StepResult]] = Future()
    fut.set_result(results)
    return fut


def _then(prefix: Future[list[StepResult]], n: int, err: BaseException) -> Future[list[StepResult]]:
    """The prefix's results, then the faulted step's error if the prefix ran through."""
    out: Future[list[StepResult]] = Future()

    def done(f: Future[list[StepResult]]) -> None:
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
            return
        results = f.result()
        if len(results) == n and all(r.ok for r in results):
            results = [*results, StepResult("error", error=err)]
        out.set_result(results)

    prefix.add_done_callback(done)
    return out


class FaultyRanks:
    """The trainer ranks with a fault plan in front of them (one run): the leader decides for every
    rank, so a faulted step is never run by some ranks and not others."""

    def __init__(self, ranks: Any, plan: FaultPlan, on_fire: OnFire) -> None:
        self.ranks = ranks
        self.plan = plan
        self.on_fire = on_fire

    def __getattr__(self, name: str) -> Any:
        return getattr(self.ranks, name)

    def start(self, step: Any, *, timeout: float) -> Future[list[Any]]:
        fault = self.plan.take(step.state, step.call, None, step.bucket)
        if fault is None:
            return self.ranks.start(step, timeout=timeout)
        self.on_fire(fault, step.call)
        out: Future[list[Any]] = Future()
        if fault.kind == "hang":
            _timeout_later(out, timeout + HANG_SLACK_S, f"{step.call} did not return (simulated hang)")
        else:
            out.set_exception(InjectedFault(f"injected {fault.kind} fault at {step.state}/{step.call}"))
        return out


def wrap(plan: FaultPlan | None, drivers: Sequence[Any], ranks: Any, on_fire: OnFire) -> tuple[list[Any], Any]:
    """The drivers and ranks a run calls: as they are without a plan; with one, each behind its
    fault wrapper (the run's calls go through the wrappers and know nothing of them)."""
    if plan is None:
        return list(drivers), ranks
    return [FaultyEngine(d, plan, i, on_fire) for i, d in enumerate(drivers)], FaultyRanks(ranks, plan, on_fire)
