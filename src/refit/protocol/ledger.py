"""The run's ledger: each engine's position and the facts beside it, and what the run found.

Pure: no I/O, no clock, no drivers. The runner hands it each call's outcome (`apply`, `drop`); it
moves the engine's machines (`refit.states`: the engine table, and the weights, failure and
memory tables) and returns the trace events that outcome implies. Everything the runner decides
about an engine is read from here: whether it may be retried (`retryable`), what it is owed when
it did not take the version (`owed`), and its outcome (`outcome`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from refit.buckets import BucketManifest
from refit.drivers.base import Step, StepResult
from refit.errors import EngineDied, EngineError, InvariantViolation, NoTimeLeft, RefitError
from refit.protocol.answers import wrap_error
from refit.protocol.context import EngineOutcome
from refit.states import (
    RETRY_STATES,
    STAGED_STATES,
    UNPAUSED_STAGED,
    EngineEvent,
    EngineMachine,
    EngineState,
    FactMachine,
    Failure,
    FailureEvent,
    Memory,
    MemoryEvent,
    Weights,
    WeightsEvent,
)

E, EV, W, WE, F, FE, M, ME = (
    EngineState, EngineEvent, Weights, WeightsEvent, Failure, FailureEvent, Memory, MemoryEvent,
)  # fmt: skip
Event = tuple[str, str, dict[str, Any]]  # (kind, event, fields): what the runner records


@dataclass(eq=False)
class Engine:
    """The leader's record of one engine during one run."""

    index: int
    name: str
    tp: int
    incarnation: str
    previous_version: int | None  # None: stale (new incarnation, or left unversioned earlier)
    begin_moves_weights: bool = False  # its driver's capability: a begin alone makes its weights unusable
    holds_requests: bool = False  # its driver's capability: a hold keeps its requests (quarantine's keep_requests)
    holds_adapters_locally: bool = False  # its driver's capability: an adapter's hold needs no answer from it
    position: EngineMachine = field(default_factory=EngineMachine)
    weights: FactMachine = field(default_factory=lambda: FactMachine("weights"))
    failure: FactMachine = field(default_factory=lambda: FactMachine("failure"))
    memory: dict[str, FactMachine] = field(default_factory=dict)  # region -> its machine (colocated runs)
    failed_in: str | None = None  # the state it first left an attempt in
    error: str | None = None
    exc: RefitError | None = None
    attempt: int = -1
    attempts: int = 0
    acked: set[int] = field(default_factory=set)  # buckets acked in its current attempt
    bytes_ok: int = 0
    verdict: dict[str, Any] | None = None  # its last verification (`refit.verify.Verdict`, and seconds)
    held: str | None = None  # why the version policy holds it out of service (its quarantine is a hold)
    staging: dict[str, Any] | None = None  # its probe's account of the memory a staged copy needs (atomic runs)
    lost_from: EngineState | None = None  # where it stood when it died or stopped answering

    @property
    def state(self) -> EngineState:
        return self.position.state

    @property
    def reachable(self) -> bool:
        return self.state != E.GONE

    @property
    def active(self) -> bool:
        return self.failure.state == F.NONE and self.reachable

    @property
    def published(self) -> bool:
        return self.weights.state == W.LABELLED

    @property
    def staged(self) -> bool:
        """Its update writes a second copy (an atomic run's staged session) that nothing serves yet."""
        return self.state in UNPAUSED_STAGED

    @property
    def must_not_serve(self) -> bool:
        """Holds weights its version does not name (or has no current version): never continue it."""
        return not self.published and (self.weights.state != W.KEPT or self.previous_version is None)

    def region(self, tag: str) -> Memory:
        machine = self.memory.get(tag)
        return M.AS_FOUND if machine is None else machine.state

    def _memory(self, tag: str) -> FactMachine:
        return self.memory.setdefault(tag, FactMachine("memory"))


class Ledger:
    """Per engine and per run: no I/O. `version` is the version the run refits to."""

    def __init__(self, version: int, engines: Sequence[Engine], *, adapter: str | None = None) -> None:
        self.version = version
        # a LoRA refit's adapter: a publish makes its staged version live (`activate`), and the version
        # policy holds that adapter on an engine, not the whole engine (`hold_step`)
        self.adapter = adapter
        self.engines = list(engines)
        self.plan: list[BucketManifest] = []
        self.ahead: list[str] = []  # engines found at or past the target version
        self.first_error: RefitError | None = None
        self.expected: dict[str, str] = {}  # the trainer's digests of what it sent (verify on)
        self.probe: dict[str, Any] | None = None  # verify="probe": the trainer's logprobs and the tolerance

    # ---- outcomes of calls --------------------------------------------------------------------

    def apply(self, e: Engine, step: Step, res: StepResult) -> list[Event]:
        """Move `e`'s machines for one step's result; the events it implies."""
        if res.ok:
            return self._ok(e, step, res.value)
        err = res.error
        effect = not getattr(err, "no_effect", False)
        if isinstance(err, EngineError) and err.kind == "version_ahead":
            self.ahead.append(e.name)
            if isinstance(err.data.get("version"), int):
                e.previous_version = err.data["version"]  # it keeps serving the version it holds
        call = step.call
        if call == "load" and effect and not e.staged:
            e.weights.fire(WE.TOUCH)  # part of it may have landed (a staged copy's is not served)
        elif call == "swap" and effect:
            e.weights.fire(WE.TOUCH)  # it may serve the copy: which weights it serves is unknown
        elif call == "begin" and e.begin_moves_weights and effect:
            e.weights.fire(WE.TOUCH)  # it may have begun: weights unusable
        elif call == "pause" and e.position.can(EV.PAUSE):
            e.position.fire(EV.PAUSE)  # it may have paused: it is owed a continue or a quarantine
        elif call == "finalize" and e.position.can(EV.CLOSE):
            e.position.fire(EV.CLOSE)  # a failed finalize closes the session too: never repeated
        elif call == "verify" and e.position.can(EV.REJECT):
            e.position.fire(EV.REJECT)  # unverified: its weights are no version's
        elif call == "publish":
            e.weights.fire(WE.TOUCH)  # its label is unknown now
        elif call == "resume_memory" and "weights" in step.args[0]:
            e.weights.fire(WE.LOSE)  # a failed weight-memory resume leaves the weights unknown
        return self.drop(e, step, err)

    def _ok(self, e: Engine, step: Step, value: Any) -> list[Event]:
        call = step.call
        if call == "probe":
            return self._probed(e, step, value if isinstance(value, dict) else {})
        if call == "resume_memory":
            tags = list(step.args[0])
            if "weights" in tags and not (isinstance(value, dict) and value.get("weights_intact") is True):
                e.weights.fire(WE.LOSE)  # contents not reported intact: unknown, so never served unpublished
            said = value.get("resumed") if isinstance(value, dict) else None
            for tag in tags:  # only what was released before was taken by this run
                e._memory(tag).fire(ME.TAKE if not isinstance(said, list) or tag in said else ME.RESUME)
        elif call == "release_memory":
            for tag in step.args[0]:
                e._memory(tag).fire(ME.RELEASE)
        elif call == "pause":
            e.position.fire(EV.PAUSE)
        elif call == "begin":
            e.position.fire(EV.OPEN)
            if e.begin_moves_weights:  # unusable until a complete update
                e.weights.fire(WE.TOUCH)
        elif call == "stage":
            e.position.fire(EV.STAGE)  # the served weights stay as they are until the swap
        elif call == "swap":
            e.position.fire(EV.SWAP)
            e.weights.fire(WE.TOUCH)
        elif call == "discard":
            e.position.fire(EV.DISCARD)
        elif call == "load":
            assert step.bucket is not None
            e.acked.add(step.bucket)
            e.bytes_ok += self.plan[step.bucket].payload_bytes
            if not e.staged:
                e.weights.fire(WE.TOUCH)
        elif call == "finalize":
            complete = len(e.acked) == len(self.plan) and e.failure.state == F.NONE
            e.position.fire(EV.FINALIZE if complete else EV.CLOSE)
        elif call == "verify":
            return self._verified(e, step, value)
        elif call == "publish":
            e.position.fire(EV.ACTIVATE if self.adapter is not None and e.state in UNPAUSED_STAGED else EV.PUBLISH)
            e.weights.fire(WE.LABEL)
        elif call == "continue_generation":
            if e.must_not_serve:  # a driver bug the table would not see: never report it as clean
                raise InvariantViolation(f"engine {e.name} was continued holding weights no version names")
            e.position.fire(EV.CONTINUE)
        elif call == "quarantine":
            e.position.fire(EV.HOLD if e.held is not None and e.position.can(EV.HOLD) else EV.QUARANTINE)
        return []

    def _probed(self, e: Engine, step: Step, info: dict[str, Any]) -> list[Event]:
        version = info.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            return []  # not a version (the driver does not know, or reports nonsense): the runner's record stands
        e.previous_version = version if info.get("serving", True) else None
        if "staging_bytes" in info:
            e.staging = {k: info.get(k) for k in ("staging_bytes", "free_bytes", "pool")}
        if version >= self.version:  # a driver whose engine did not refuse
            self.ahead.append(e.name)
            return self.drop(e, step, EngineError("version_ahead", f"engine holds version {version}"))
        return []

    def _verified(self, e: Engine, step: Step, value: Any) -> list[Event]:
        """Judge an engine's report of what it will serve against what the trainer sent."""
        from refit.verify import judge

        if e.state not in (E.FINALIZED, E.STAGED) or e.failure.state != F.NONE:
            return []  # its attempt did not complete: there is nothing to verify, and it will not publish
        kind = step.args[0] if step.args else None
        asked_probe = len(step.args) > 1 and step.args[1] is not None
        verdict = judge(value, kind, self.expected, self.probe if asked_probe else None)
        seconds = value.get("seconds") if isinstance(value, dict) else None
        problems = verdict.pop("problems")
        read_back = value.get("read_back") if isinstance(value, dict) else None  # tensors hashed from memory
        e.verdict = {**verdict, "seconds": seconds if isinstance(seconds, int | float) else None}
        fields = {"engine": e.name, "ok": verdict["ok"], "digest": kind, "attempt": max(e.attempt, 0)}
        if kind is not None:
            fields["compared"] = verdict["compared"]
            if isinstance(read_back, int) and not isinstance(read_back, bool):
                e.verdict["read_back"] = fields["read_back"] = read_back
        if "probe" in verdict:
            fields["probe"] = verdict["probe"]
        if verdict["ok"]:
            e.position.fire(EV.VERIFY)
            return [("engine", "verified", fields)]
        e.position.fire(EV.REJECT)
        if kind is not None:
            fields.update(
                mismatched=verdict["mismatched"], missing=verdict["missing"], unexpected=verdict["unexpected"]
            )
        err = EngineError("unverified", "; ".join(problems))
        return [("engine", "verified", fields), *self.drop(e, step, err)]

    def drop(self, e: Engine, step: Step, err: BaseException | None) -> list[Event]:
        """`e` leaves the current attempt (the others carry on)."""
        wrapped = wrap_error(err or RuntimeError("failed"), step.call, step.state, e.name, step.bucket)
        before = e.failure.state
        if before == F.DEAD:
            return []
        if isinstance(err, EngineDied):
            e.failure.fire(FE.DIE)
        elif isinstance(err, TimeoutError):
            e.failure.fire(FE.RUN_OUT if isinstance(err, NoTimeLeft) else FE.HANG)
        else:
            e.failure.fire(FE.ERR)
        if e.failure.state in (F.DEAD, F.TIMEOUT) and e.position.can(EV.LOSE):
            e.lost_from = e.state
            e.position.fire(EV.LOSE)
        if before == F.NONE:
            e.failed_in = step.state
        e.error = e.error or str(wrapped)
        e.exc = e.exc or wrapped
        self.first_error = self.first_error or wrapped
        if e.failure.state == before:
            return []
        return [("engine", "dropped", {"engine": e.name, "failure": e.failure.state.lower(), "error": str(wrapped)})]

    def rejoin(self, e: Engine) -> None:
        """`e` failed only because a collective group could not form: it tries again, blameless."""
        e.failure.fire(FE.REJOIN)
        e.error, e.exc = None, None

    def begin_attempt(self, e: Engine, attempt: int) -> None:
        e.failure.fire(FE.REJOIN)
        e.acked, e.attempt, e.attempts = set(), attempt, e.attempts + 1

    # ---- decisions read from the ledger -----------------------------------------------------------

    def retryable(self, retries: int) -> list[Engine]:
        """Engines that failed with an error inside the update and have attempts left: paused, or
        (atomic runs) holding a copy that will not be swapped, or refused their stage."""
        return [
            e for e in self.engines
            if e.failure.state == F.ERROR and e.failed_in in RETRY_STATES and e.attempts <= retries
            and (e.state in (E.PAUSED, E.STRANDED) or (e.state == E.JOINED and e.failed_in == "STAGING"))
        ]  # fmt: skip

    def ready(self, *, verify: bool) -> list[Engine]:
        """Engines that may publish: verified (or, when the run does not verify, finalized); in an
        atomic run, their staged copies (they swap first)."""
        want = (E.VERIFIED, E.STAGE_VERIFIED) if verify else (E.FINALIZED, E.STAGED)
        return [e for e in self.engines if e.active and e.state in want]

    def owes_finalize(self) -> list[Engine]:
        return [e for e in self.engines if e.state in (E.OPEN, E.STAGING) and e.reachable]

    def hung_generating(self) -> list[Engine]:
        """Atomic runs: engines that stopped answering while they still generated (never paused in
        this run): once they answer again they serve their old weights, so they are owed what a
        clean engine left behind is (its copy discarded, and the version policy's hold)."""
        unpaused = (E.JOINED, *UNPAUSED_STAGED)
        return [e for e in self.engines if e.failure.state == F.TIMEOUT and e.lost_from in unpaused]

    def staging_problems(self) -> list[str]:
        """Atomic runs, after the probe and before connect: why the engines' staged copies do not
        fit. Each engine's copy needs `staging_bytes` beside what it serves; engines that report
        the same memory `pool` (one host's memory, one device) add up against the least `free_bytes`
        any of them saw. An engine that reports no figure cannot be checked, so it is refused too;
        one that cannot tell what is free (None) is not."""
        problems: list[str] = []
        pools: dict[str, list[tuple[Engine, int, int | None]]] = {}
        for e in self.engines:
            if not e.active:
                continue
            info = e.staging or {}
            need, free = info.get("staging_bytes"), info.get("free_bytes")
            if isinstance(need, bool) or not isinstance(need, int) or need < 0:
                problems.append(f"engine {e.name} did not report the memory a staged copy of its weights needs")
                continue
            free = free if isinstance(free, int) and not isinstance(free, bool) else None
            pools.setdefault(str(info.get("pool") or e.name), []).append((e, need, free))
        for pool, members in pools.items():
            need = sum(n for _, n, _ in members)
            frees = [f for _, _, f in members if f is not None]
            if frees and need > min(frees):
                names = ", ".join(e.name for e, _, _ in members)
                where = f"(memory pool {pool}, shared)" if len(members) > 1 else f"({pool})"
                problems.append(
                    f"engine{'s' if len(members) > 1 else ''} {names} {where} need {_gib(need)} for staged copies of "
                    f"their weights and {_gib(min(frees))} is free"
                )
        return problems

    def touched_unpublished(self) -> bool:
        """Some engine's weights changed without being labelled: the connection is not reused."""
        return any(e.weights.state == W.CHANGED for e in self.engines)

    def owed(
        self, e: Engine, *, colocated: bool, cont: str, quarantine: str, kv: str, reason: str, hold: str | None = None
    ) -> list[Step]:
        """What an engine that did not (or could not) take the version is owed: a continue if it is
        clean and paused (colocated: and its KV memory back), a quarantine if it holds weights no
        version names, its weight memory released again if the run took it and never paused.
        `hold`: the version policy holds a clean engine out of service (a quarantine, recorded as
        a hold: STALE) instead of continuing it; the reason is what it is told."""
        if not e.reachable or e.state in (E.SERVING, E.QUARANTINED, E.STALE):
            return []
        kv_steps = [Step("resume_memory", kv, (["kv_cache"],))] if colocated else []
        if e.state in UNPAUSED_STAGED or e.state == E.PAUSED_STAGED:  # atomic: its copy will not be served
            paused = e.state == E.PAUSED_STAGED
            if paused and e.must_not_serve:
                return [Step("quarantine", quarantine, (reason,))]  # (a quarantine drops the copy too)
            steps = [Step("discard", cont)]  # then as it was: serving (never paused), or paused
            if hold is not None:
                e.held = hold
                return [*steps, hold_step(e, quarantine, hold, self.adapter)]
            return [*steps, Step("continue_generation", cont), *kv_steps] if paused else steps
        if e.state in STAGED_STATES:  # SWAPPED: it serves the copy, unpublished
            return [Step("quarantine", quarantine, (reason,))]
        if e.state == E.PUBLISHED:
            return [Step("continue_generation", cont), *kv_steps]
        steps: list[Step] = []
        if e.state == E.JOINED and e.region("weights") == M.TAKEN:
            steps.append(Step("release_memory", cont, (["weights"],)))
        if e.must_not_serve and (e.state != E.JOINED or e.weights.state != W.KEPT):
            return [*steps, Step("quarantine", quarantine, (reason,))]
        if hold is not None and e.position.can(EV.HOLD):  # clean, but held out of service
            e.held = hold
            return [*steps, hold_step(e, quarantine, hold, self.adapter)]
        if e.state == E.PAUSED:
            return [Step("continue_generation", cont), *kv_steps]
        return steps

    def outcome(self, e: Engine, *, colocated: bool) -> EngineOutcome:
        st = e.state
        serving = st == E.SERVING and (e.region("kv_cache") != M.AS_FOUND or not colocated)
        status: str
        version: int | None = None
        error = e.error
        if st == E.GONE:
            status = "failed"  # died or hung
        elif st == E.STALE:
            status = "stale"  # held out of service by the version policy
        elif st == E.QUARANTINED:
            status = "quarantined"
        elif e.held is not None:  # the version policy's hold did not go through: it may serve an old version
            status = "failed"
            error = f"{error}; then holding it out of service did not go through ({e.held})"
        elif st == E.SERVING and not serving:
            status = "failed"  # continued but without its KV memory
        elif serving:
            status, version = ("updated", self.version) if e.published else ("unchanged", e.previous_version)
        elif st != E.JOINED:
            status = "failed"  # left paused: a continue or quarantine did not go through
        elif e.weights.state != W.KEPT or (colocated and e.region("weights") == M.TAKEN):
            status = "failed"  # its memory could not be given back, or came back empty
        elif e.previous_version is None:
            status = "stale"
        else:  # untouched by the run: as it was before (serving, or released in a colocated job)
            status, version = "unchanged", e.previous_version
            serving = not colocated
        return EngineOutcome(e.name, status, version, len(e.acked), e.attempts, error, serving, e.verdict)  # type: ignore[arg-type]

    def outcomes(self, *, colocated: bool) -> dict[str, EngineOutcome]:
        return {e.name: self.outcome(e, colocated=colocated) for e in self.engines}


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def hold_step(e: Engine, state: str, reason: str, adapter: str | None = None) -> Step:
    """The version policy's hold of `e`: a quarantine that keeps its requests where its driver can
    (`holds_requests`). In a LoRA refit (`adapter`), of that adapter only: new requests naming it
    wait until a refit reaches the engine; the engine serves everything else as before."""
    if adapter is not None:
        return Step("quarantine", state, (reason, True, adapter))
    return Step("quarantine", state, (reason, True) if e.holds_requests else (reason,))
