"""The driver contract's robustness: waits bounded by the one deadline however many engines misbehave,
bounded lock and incarnation calls, errors that survive pickling, a context that refuses what it
cannot run, cleanup that still sends what it owes past the deadline, a colocated run that gives back
what it took, and a trainer whose version counter is behind refused before any byte moves."""

from __future__ import annotations

import copy
import math
import pickle
import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.base import Step
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import (
    ConfigError,
    DeadlineExceeded,
    DriverCallError,
    EngineDied,
    EngineError,
    IllegalTransition,
    InvariantViolation,
    NoTimeLeft,
    RankError,
    RefitBusyError,
)
from refit.protocol.lock import LocalLock

from .conftest import CONFIG, matches, perturbed

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


class IgnoresTimeout(ReferenceEngine):
    """Its pause answers long after the budget it was given (a blocking HTTP client with no timeout)."""

    def pause(self, mode: Any, *, timeout: float) -> None:
        time.sleep(timeout + 3.0)
        super().pause(mode, timeout=timeout)


def test_sixteen_engines_that_ignore_their_timeout_cost_one_deadline_not_sixteen(trainer) -> None:
    engines = [IgnoresTimeout.in_thread(f"slow{i}", CONFIG, seed=0) for i in range(16)]
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), engines, bucket_bytes=64 << 10, deadline_s=1.5,
        cleanup_grace_s=0.5,
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        result = protocol.run(ctx)
        took = time.monotonic() - t0
        assert took <= 1.5 + 0.5 + invariants.DEADLINE_SLACK_S, took  # not 16 x (timeout + slack)
        assert not result.ok and {o.status for o in result.engines.values()} == {"failed"}
        assert ctx.lock.holder is None
    finally:
        ctx.close()
        for e in engines:
            e.close()
    assert invariants.check_trace(ctx.recorder.events) == []


class FlakyReleaseLock(LocalLock):
    """Releases, then raises (a lock actor whose reply is lost)."""

    def release(self, owner: str) -> bool:
        super().release(owner)
        raise ConnectionError("lock service went away while answering")


class HungLock(LocalLock):
    def acquire(self, owner: str) -> bool:
        time.sleep(30)
        return True


def test_a_lock_that_raises_on_release_still_ends_the_run_and_leaves_the_context_usable(
    trainer, thread_engines, make_ctx
) -> None:
    ctx = make_ctx(trainer, thread_engines(2), lock=FlakyReleaseLock())
    first = protocol.run(ctx)
    assert first.ok
    run_events = [e for e in ctx.recorder.events if e.get("run") == first.run_id]
    release = next(e for e in run_events if e["kind"] == "lock" and e["event"] == "release")
    assert release["outcome"] == "error" and "ConnectionError" in release["error"]
    assert run_events[-1]["kind"] == "run" and run_events[-1]["event"] == "end"
    perturbed(trainer, seed=5)
    assert protocol.run(ctx).ok  # the context is still usable


def test_lock_calls_and_incarnation_reads_are_bounded(trainer, thread_engines, make_ctx) -> None:
    ctx = make_ctx(trainer, thread_engines(1), lock=HungLock(), deadline_s=2.0)
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="acquiring the engines' lock"):
        protocol.run(ctx)
    assert time.monotonic() - t0 < 2.0 + 1.0

    class SlowIncarnation(ReferenceEngine):
        @property
        def incarnation(self) -> str:
            time.sleep(30)
            return "never"

    engine = SlowIncarnation.in_thread("inc", CONFIG, seed=0)
    try:
        ctx = make_ctx(trainer, [engine], deadline_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="incarnation of engine inc"):
            protocol.run(ctx)
        assert time.monotonic() - t0 < 2.0 + 1.0
        assert ctx.lock.holder is None  # refused before the lock was taken
    finally:
        engine.close()


@pytest.mark.parametrize(
    "err",
    [
        EngineError("bad_manifest", "model.norm.weight: shape [65] != model [64]"),
        EngineError("flush_refused", "2 running requests hold KV"),
        DriverCallError(
            "load failed",
            cause=EngineError("bad_payload", "x"),
            state="TRANSFERRING",
            engine="e1",
            call="load",
            bucket=3,
        ),
        DeadlineExceeded("pause did not finish", cause=TimeoutError("t"), state="PAUSING", engine="e0", call="pause"),
        ConfigError("deadline_s must be a positive finite number, got nan"),
        RefitBusyError("engines ['e0'] are being refit by another run", state="IDLE"),
        InvariantViolation("lock: released twice"),
        IllegalTransition("IDLE", "publish"),
        RankError(1, "RuntimeError: gather failed"),
        EngineDied("engine e1 is gone (exit code -9)"),
        NoTimeLeft("no time left for pause"),
    ],
    ids=lambda e: type(e).__name__ + "-" + str(getattr(e, "kind", "")),
)
def test_every_refit_error_survives_pickling_with_its_kind_message_and_effect(err: BaseException) -> None:
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err)
    for attr in ("kind", "message", "state", "engine", "call", "bucket", "rank", "trigger"):
        assert getattr(back, attr, None) == getattr(err, attr, None), attr
    assert getattr(back, "no_effect", None) == getattr(err, "no_effect", None)
    cause = getattr(err, "cause", None)
    if cause is not None:
        assert type(back.cause) is type(cause) and str(back.cause) == str(cause)


class NotASource:
    def metas(self) -> list:
        return []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"source": NotASource()}, "source must implement refit.drivers.Source, got NotASource"),
        ({"transport": object()}, "transport must implement refit.drivers.Transport, got object"),
        ({"engines": [object()]}, "engines must implement refit.drivers.EngineDriver"),
        ({"bucket_bytes": 0}, "bucket_bytes must be a positive finite integer, got 0"),
        ({"bucket_bytes": 1.5}, "bucket_bytes must be a positive finite integer, got 1.5"),
        ({"deadline_s": math.nan}, "deadline_s must be a positive finite number, got nan"),
        ({"deadline_s": math.inf}, "deadline_s must be a positive finite number, got inf"),
        ({"deadline_s": -1}, "deadline_s must be a positive finite number, got -1"),
        ({"cleanup_grace_s": -0.5}, "cleanup_grace_s must be a finite number >= 0, got -0.5"),
        ({"call_timeout_s": 0.0}, "call_timeout_s must be a positive finite number, got 0.0"),
        ({"retries": -1}, "retries must be an integer >= 0, got -1"),
        ({"retries": True}, "retries must be an integer >= 0, got True"),
        ({"version": 1.5}, "version must be an integer >= 0, got 1.5"),
        ({"mode": "both"}, "mode must be 'colocated' or 'disaggregated', got 'both'"),
        ({"pause_mode": "freeze"}, "pause_mode must be one of"),
    ],
)
def test_the_context_refuses_what_it_cannot_run(trainer, thread_engines, kwargs: dict, message: str) -> None:
    engine = thread_engines(1)[0]
    base: dict[str, Any] = {"source": TorchSource(trainer), "transport": SharedMemoryTransport(), "engines": [engine]}
    with pytest.raises(ConfigError) as info:
        protocol.RefitContext(**{**base, **kwargs})
    assert message in str(info.value)
    assert engine.info()["paused"] is False  # nothing was started


def test_a_quarantine_never_sent_does_not_count_as_done(trainer, thread_engines, make_ctx) -> None:
    """The invariant reads what reached the engine: a quarantine recorded as never sent leaves the
    paused engine unaccounted for."""
    ctx = make_ctx(trainer, thread_engines(2), retries=0,
                   faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, call="load"))  # fmt: skip
    result = protocol.run(ctx)
    assert result.engines["t1"].status == "quarantined"
    events = copy.deepcopy([e for e in ctx.recorder.events if e.get("run") == result.run_id])
    assert invariants.check_run(events) == []
    for e in events:
        if e["kind"] == "call" and e["event"] == "quarantine":
            e["sent"] = False
    found = invariants.check_run(events)
    assert any(v.invariant == "pause_continue" and "neither continued nor quarantined" in v.message for v in found)


class HangsTransfers(ReferenceEngine):
    """Its loads stall past the whole run: the deadline and the grace are gone before cleanup."""

    def load(self, payload: Any, *, timeout: float) -> None:
        time.sleep(4.0)


def test_cleanup_still_sends_owed_calls_after_deadline_and_grace(trainer) -> None:
    """A slow engine eats the whole deadline (and there is no grace): the run still finalizes and
    quarantines the healthy engine that got bytes (each wave waits a short floor), and records
    those calls as sent and answered."""
    hung = HangsTransfers.in_thread("late", CONFIG, seed=0)
    healthy = ReferenceEngine.in_thread("ok", CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), [healthy, hung], bucket_bytes=64 << 10, deadline_s=1.0,
        cleanup_grace_s=0.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert result.state == "FAILED"
        run = [e for e in ctx.recorder.events if e.get("run") == result.run_id]
        fail = next(e for e in run if e["kind"] == "transition" and e["event"] == "fail")
        assert fail["t"] - run[0]["t"] >= 1.0  # cleanup starts with no time left
        owed = [
            e for e in run if e["kind"] == "call" and e["event"] in ("finalize", "quarantine") and e["engine"] == "ok"
        ]
        assert [e["event"] for e in owed] == ["finalize", "quarantine"]
        assert all(e["outcome"] != "timeout" and e.get("sent") is not False for e in owed)  # sent and answered
        assert healthy.info()["quarantined"]  # it got bytes: out of service, not serving mixed weights
        assert result.engines["ok"].status == "quarantined" and result.engines["late"].status == "failed"
    finally:
        ctx.close()
        hung.close()
        healthy.close()


def test_a_colocated_run_failing_before_pause_gives_back_the_memory_it_took(trainer, thread_engines, make_ctx) -> None:
    engines = thread_engines(2)
    for e in engines:  # training holds the memory; the weights have a CPU copy, so they come back intact
        e.release_memory(["weights", "kv_cache"], cpu_backup=True)
    ctx = make_ctx(
        trainer, engines, mode="colocated", faults=protocol.FaultPlan().fail_at("connecting", call="connect")
    )
    result = protocol.run(ctx)
    assert result.state == "FAILED"
    for e in engines:
        info = e.info()
        assert info["weights_released"] and not info["paused"]  # as it was before the run
        assert result.engines[e.name].status == "unchanged" and not result.engines[e.name].serving
    run = [e for e in ctx.recorder.events if e.get("run") == result.run_id and e["kind"] == "call"]
    calls = [c["event"] for c in run if c.get("engine") == "t0" and c["event"] != "detach"]  # the half-made
    assert calls == ["probe", "resume_memory", "release_memory"]  # connection is torn down too (detach)
    ctx.faults = None
    assert protocol.run(ctx).ok and all(matches(e, trainer) for e in engines)


class LosesKv(ReferenceEngine):
    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        if "kv_cache" in tags:
            raise EngineError("oom", "no memory for the KV cache")
        return super().resume_memory(tags, timeout=timeout)


def test_an_engine_left_without_its_kv_memory_is_reported_failed_not_unchanged(trainer) -> None:
    engine = LosesKv.in_thread("nokv", CONFIG, seed=0)
    engine.release_memory(["weights", "kv_cache"])
    ctx = protocol.RefitContext(TorchSource(trainer), SharedMemoryTransport(), [engine], mode="colocated",
                                bucket_bytes=64 << 10)  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert result.engines["nokv"].status == "failed" and not result.engines["nokv"].serving
    finally:
        ctx.close()
        engine.close()


def test_a_trainer_behind_the_engines_is_refused_before_any_byte_moves(trainer) -> None:
    engines = [ReferenceEngine.in_thread(f"v{i}", CONFIG, seed=0, version=5) for i in range(2)]
    before = [e.score(PROMPT) for e in engines]
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), engines, bucket_bytes=64 << 10, version=0
    )
    try:
        result = protocol.run(ctx)
        assert result.state == "FAILED" and result.version is None and result.bytes_moved == 0
        assert "already hold version 1 or newer" in str(result.error) and "behind" in str(result.error)
        calls = [e["event"] for e in ctx.recorder.events if e.get("run") == result.run_id and e["kind"] == "call"]
        assert "pause" not in calls and "load" not in calls and "pack" not in calls
        for e, old in zip(engines, before, strict=True):
            assert e.info()["version"] == 5 and not e.info()["paused"] and torch.equal(e.score(PROMPT), old)
            assert result.engines[e.name].status == "unchanged" and result.engines[e.name].version == 5
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_batched_steps_take_two_control_round_trips(trainer, thread_engines, make_ctx) -> None:
    """Steady state: [probe, resume weights, pause, flush, begin] and [publish, continue, resume KV]
    go out as one call per engine each; every step is still its own event in its own state."""
    engines = thread_engines(3)
    for e in engines:
        e.release_memory(["weights", "kv_cache"])
    ctx = make_ctx(trainer, engines, mode="colocated")
    assert protocol.run(ctx).round_trips == 4  # the first run also connects: probe, attach, then the rest
    for e in engines:
        e.release_memory(["weights", "kv_cache"])
    perturbed(trainer, seed=8)
    result = protocol.run(ctx)
    assert result.ok and result.round_trips == 2
    run = [e for e in ctx.recorder.events if e.get("run") == result.run_id]
    t0 = [(e["state"], e["event"], e["batch"]) for e in run if e["kind"] == "call" and e.get("engine") == "t0"]
    assert [(s, c) for s, c, _ in t0 if c != "load"] == [
        ("OFFLOADING", "probe"), ("OFFLOADING", "resume_memory"), ("PAUSING", "pause"), ("INVALIDATING", "flush"),
        ("INVALIDATING", "begin"), ("POST_PROCESSING", "finalize"), ("VERIFYING", "verify"), ("CONTINUING", "publish"),
        ("CONTINUING", "continue_generation"), ("RESTORING", "resume_memory"),
    ]  # fmt: skip
    assert len({b for s, c, b in t0 if s in ("OFFLOADING", "PAUSING", "INVALIDATING")}) == 1  # one call
    assert len({b for s, c, b in t0 if s in ("CONTINUING", "RESTORING")}) == 1
    assert invariants.check_run(run) == []


class Unbatched(ReferenceEngine):
    """A driver whose engine cannot batch: the default runs one engine call per step."""

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Any) -> Any:
        self.calls = getattr(self, "calls", 0) + len(steps)
        return super(ReferenceEngine, self).run_steps_async(steps, timeout=timeout, executor=executor)


def test_a_driver_that_cannot_batch_gets_one_call_per_step(trainer) -> None:
    engine = Unbatched.in_thread("one-by-one", CONFIG, seed=0)
    ctx = protocol.RefitContext(TorchSource(trainer), SharedMemoryTransport(), [engine], bucket_bytes=64 << 10)
    try:
        result = protocol.run(ctx)
        assert result.ok and matches(engine, trainer)
    finally:
        ctx.close()
        engine.close()


def test_publish_is_refused_engine_side_without_a_complete_finalized_session(thread_engines) -> None:
    engine = thread_engines(1)[0]
    results = engine.run_steps_async(
        [Step("probe", "CONNECTING", (1,)), Step("publish", "CONTINUING", (1,)), Step("continue_generation", "CONTINUING")],
        timeout=5.0, executor=None,  # type: ignore[arg-type]
    ).result(timeout=5)  # fmt: skip
    assert [r.outcome for r in results] == ["ok", "error"]  # the batch stopped at the refused publish
    assert isinstance(results[1].error, EngineError) and results[1].error.kind == "not_ready"
    assert engine.info()["version"] == 0


# ---- found by an adversarial review: each was a real failure before its fix -------------------------


class LateAcquireLock(LocalLock):
    """Answers after the run gave up, but does take the lock (a lock actor under load)."""

    slow = True

    def acquire(self, owner: str) -> bool:
        if self.slow:
            time.sleep(2.5)
        return super().acquire(owner)


def test_a_lock_taken_after_the_run_gave_up_is_given_back(trainer, thread_engines, make_ctx) -> None:
    lock = LateAcquireLock()
    ctx = make_ctx(trainer, thread_engines(2), lock=lock, deadline_s=2.0, cleanup_grace_s=0.5)
    with pytest.raises(DeadlineExceeded, match="acquiring the engines' lock"):
        protocol.run(ctx)
    time.sleep(1.0)  # the late acquire lands, then is released
    assert lock.holder is None
    lock.slow = False
    ctx.deadline_s = 10.0
    assert protocol.run(ctx).ok


class ShortAnswers(ReferenceEngine):
    """Runs every step but hands back fewer results than steps, none failed (a contract breach)."""

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Any) -> Any:
        fut = super().run_steps_async(steps, timeout=timeout, executor=executor)
        out: Any = type(fut)()
        fut.add_done_callback(lambda f: out.set_result(f.result()[:1]) if f.exception() is None else None)
        return out


class NoneAnswers(ReferenceEngine):
    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Any) -> Any:
        fut = super().run_steps_async(steps, timeout=timeout, executor=executor)
        out: Any = type(fut)()
        fut.add_done_callback(lambda f: out.set_result([None, *f.result()[1:]]) if f.exception() is None else None)
        return out


@pytest.mark.parametrize("policy", [None, 0])
@pytest.mark.parametrize("broken", [ShortAnswers, NoneAnswers])
def test_a_driver_answer_that_breaks_the_contract_never_leaves_an_engine_paused(trainer, broken, policy) -> None:
    """Paused with no word is what must never happen: with no version policy the runner continues
    the engine on its old version; under the default one (max_staleness=0) it holds it out of
    service, saying why."""
    good = ReferenceEngine.in_thread("good", CONFIG, seed=0)
    bad = broken.in_thread("bad", CONFIG, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), [good, bad], bucket_bytes=64 << 10, max_staleness=policy
    )
    try:
        result = protocol.run(ctx)  # raises InvariantViolation if anything is left unaccounted for
        assert result.engines["good"].status == "updated" and matches(good, trainer)
        if policy is None:
            assert result.engines["bad"].status == "unchanged"
            assert not bad.info()["paused"]  # its steps ran: the runner continued it, it serves
            assert bad.generate(PROMPT, 2)["weight_versions"] == [0, 0]
        else:  # the hold ran; the driver's answer to it was a contract breach (NoneAnswers): not confirmed
            held = result.engines["bad"]
            assert "stale: it holds version 0" in bad.info()["quarantined"]
            if broken is NoneAnswers:
                assert held.status == "failed" and "holding it out of service did not go through" in held.error
            else:
                assert held.status == "stale"
    finally:
        ctx.close()
        good.close()
        bad.close()


class Jittery(ReferenceEngine):
    """One call per step, each delayed a little: two buckets' loads in flight could overtake."""

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Any) -> Any:
        return super(ReferenceEngine, self).run_steps_async(steps, timeout=timeout, executor=executor)

    def load(self, payload: Any, *, timeout: float) -> None:
        time.sleep(0.002 * (payload.manifest.index % 3))
        super().load(payload, timeout=timeout)


def test_calls_to_one_engine_arrive_in_the_order_they_were_made(trainer) -> None:
    engines = [Jittery.in_thread(f"j{i}", CONFIG, seed=0) for i in range(2)]
    ctx = protocol.RefitContext(TorchSource(trainer), SharedMemoryTransport(), engines, bucket_bytes=32 << 10)
    try:
        for step in range(3):
            perturbed(trainer, seed=40 + step)
            assert protocol.run(ctx).ok
        assert all(matches(e, trainer) for e in engines)
    finally:
        ctx.close()
        for e in engines:
            e.close()


class RefusesContinue(ReferenceEngine):
    def continue_generation(self, *, timeout: float) -> None:
        raise EngineError("scheduler_busy", "could not restart the scheduler")


def test_an_engine_that_refuses_to_continue_is_quarantined_and_reported(trainer) -> None:
    good = ReferenceEngine.in_thread("good", CONFIG, seed=0)
    bad = RefusesContinue.in_thread("bad", CONFIG, seed=0)
    ctx = protocol.RefitContext(TorchSource(trainer), SharedMemoryTransport(), [good, bad], bucket_bytes=64 << 10)
    try:
        result = protocol.run(ctx)  # errors are data: no InvariantViolation
        assert result.engines["good"].status == "updated"
        assert result.engines["bad"].status == "quarantined" and bad.info()["quarantined"]
    finally:
        ctx.close()
        good.close()
        bad.close()


class QuietResume(ReferenceEngine):
    """Reports nothing from resume_memory (as an HTTP call with an empty body would)."""

    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        super().resume_memory(tags, timeout=timeout)
        return {}


def test_weight_memory_not_reported_intact_is_never_served_unpublished(trainer) -> None:
    engine = QuietResume.in_thread("quiet", CONFIG, seed=0)
    engine.release_memory(["weights", "kv_cache"])  # no CPU copy: the weights come back as zeros
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), [engine], mode="colocated", bucket_bytes=64 << 10,
        faults=protocol.FaultPlan().fail_at("transferring", bucket=0, call="pack"),
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert result.engines["quiet"].status == "quarantined"
        with pytest.raises(EngineError, match="quarantined"):
            engine.generate(PROMPT, 2)
    finally:
        ctx.close()
        engine.close()


class AnswersLate(ReferenceEngine):
    """Its load takes longer than the budget it was given and answers ok anyway."""

    def load(self, payload: Any, *, timeout: float) -> None:
        time.sleep(timeout + 0.35)  # inside the late window: past the 0.25 s tolerance, before the 0.5 s slack
        self.client.call("load", payload, timeout=60.0)


def test_an_answer_after_its_budget_is_never_recorded_as_a_success(trainer) -> None:
    """The late ok is an error (late: true, effect unknown): that engine is never reported updated
    (quarantined, or failed when its queued calls keep it too late to quarantine), the other
    engine takes the version, and the trace keeps every invariant."""
    engines = [ReferenceEngine.in_thread("on-time", CONFIG, seed=0), AnswersLate.in_thread("late", CONFIG, seed=0)]
    ctx = protocol.RefitContext(
        TorchSource(trainer), SharedMemoryTransport(), engines, bucket_bytes=64 << 10, call_timeout_s=0.3,
        retries=0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        statuses = {n: o.status for n, o in result.engines.items()}
        assert statuses["on-time"] == "updated" and statuses["late"] in ("quarantined", "failed"), statuses
        assert matches(engines[0], trainer)
        late = [e for e in ctx.recorder.events if e.get("late")]
        assert late and all(e["outcome"] == "error" and e["engine"] == "late" for e in late)
        assert "LateAnswer" in late[0]["error"] and "ignores its timeout" in late[0]["error"]
        assert late[0]["budget_s"] <= 0.3
    finally:
        ctx.close()
        for e in engines:
            e.close()
    assert invariants.check_trace(ctx.recorder.events) == []
