"""protocol.run over reference engines on threads: the whole protocol, fast, no processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from refit import invariants, protocol
from refit.buckets import plan_buckets
from refit.drivers.base import Step
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.reference.model import TinyLlama, greedy

from .conftest import CONFIG, matches, perturbed

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
HAPPY_COLOCATED = ["offload", "connect", "pause", "invalidate", "transfer"] + ["next_bucket"] * 7 + [
    "post_process", "verify", "publish", "restore", "finish",
]  # fmt: skip
HAPPY_DISAGGREGATED = ["connect", "pause", "invalidate", "transfer"] + ["next_bucket"] * 7 + [
    "post_process", "verify", "publish", "finish",
]  # fmt: skip


def transitions(ctx: protocol.RefitContext, run_id: str) -> list[str]:
    return [e["event"] for e in ctx.recorder.events if e.get("run") == run_id and e["kind"] == "transition"]


def calls(ctx: protocol.RefitContext, run_id: str | None = None) -> list[dict]:
    return [e for e in ctx.recorder.events if e["kind"] == "call" and (run_id is None or e.get("run") == run_id)]


@pytest.mark.parametrize(("mode", "expected"), [("colocated", HAPPY_COLOCATED), ("disaggregated", HAPPY_DISAGGREGATED)])
def test_a_refit_lands(mode: str, expected: list[str], trainer: TinyLlama, thread_engines, make_ctx) -> None:
    engines = thread_engines(2)
    if mode == "colocated":
        for e in engines:
            e.release_memory(["weights", "kv_cache"])  # the trainer had the memory while training
    ctx = make_ctx(trainer, engines, mode=mode)
    result = protocol.run(ctx)
    assert result.ok and result.state == "DONE" and result.error is None
    assert result.version == 1 and ctx.published_version == 1
    assert {o.status for o in result.engines.values()} == {"updated"}
    assert transitions(ctx, result.run_id) == expected
    assert result.buckets == 8 and result.bytes_moved >= sum(t.nbytes for t in trainer.state_dict().values())
    assert result.bytes_delivered == 2 * result.bytes_moved
    assert set(result.phase_seconds) >= {"CONNECTING", "TRANSFERRING", "CONTINUING"}
    assert ("OFFLOADING" in result.phase_seconds) == (mode == "colocated")
    for e in engines:
        assert matches(e, trainer)
        assert e.generate(PROMPT, 8)["output"] == greedy(trainer, PROMPT, 8)
        assert e.info()["version"] == 1
    assert ctx.lock.holder is None
    assert invariants.check_run([e for e in ctx.recorder.events if e.get("run") == result.run_id]) == []


def test_consecutive_refits_reuse_the_connection(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    engines = thread_engines(2)
    ctx = make_ctx(trainer, engines)
    versions = []
    for step in range(3):
        perturbed(trainer, seed=step)
        result = protocol.run(ctx)
        assert result.ok
        versions.append(result.version)
        assert all(matches(e, trainer) for e in engines)
    assert versions == [1, 2, 3]
    assert [c["event"] for c in calls(ctx) if c["event"] in ("connect", "attach")] == ["connect", "attach", "attach"]
    ctx.close()
    assert invariants.check_trace(ctx.recorder.events) == []


def test_a_restarted_engine_gets_a_fresh_connection(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    first = thread_engines(2)
    ctx = make_ctx(trainer, first)
    assert protocol.run(ctx).ok
    replacement = ReferenceEngine.in_thread(first[1].name, CONFIG, seed=0)  # same name, new incarnation
    try:
        ctx.engines[1] = replacement
        result = protocol.run(ctx)
        assert result.ok
        assert [c["event"] for c in calls(ctx, result.run_id) if c["event"] in ("disconnect", "connect")] == [
            "disconnect", "connect",
        ]  # fmt: skip
        assert matches(replacement, trainer)
    finally:
        ctx.close()
        replacement.close()


def test_a_connection_with_an_abandoned_buffer_is_rebuilt_by_the_next_run(
    trainer: TinyLlama, thread_engines, make_ctx
) -> None:
    """A load that hangs leaves its buffer abandoned (the engine may still read it): the session's
    connection is DIRTY, so the next run rebuilds it even though the run itself ended DONE with the
    other engine updated. (Before issue 20 the flag was per run and the next run reused it.)"""
    engines = thread_engines(2)
    plan = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, call="load", kind="hang")
    ctx = make_ctx(trainer, engines, faults=plan, call_timeout_s=1.0)
    first = protocol.run(ctx)
    assert first.state == "DONE" and first.engines[engines[1].name].status == "failed"
    assert "abandon" in [c["event"] for c in calls(ctx, first.run_id)]
    assert ctx.session.connection.state == "DIRTY"
    ctx.faults = None
    engines[1].info(timeout=10)  # the injected hang is over: the engine answers again
    perturbed(trainer, seed=7)
    second = protocol.run(ctx)
    assert [c["event"] for c in calls(ctx, second.run_id) if c["event"] in ("disconnect", "connect")] == [
        "disconnect", "connect",
    ]  # fmt: skip
    assert second.ok and all(matches(e, trainer) for e in engines)
    assert ctx.session.connection.state == "CLEAN"


def test_close_from_another_thread_waits_for_the_run_to_settle_every_engine(
    trainer: TinyLlama, thread_engines, make_ctx
) -> None:
    """`ctx.close()` while a run waits on a hung engine: the run finishes its own cleanup first
    (the healthy engine is updated and serving), then the context closes. (Found by review of
    issue 20: the run's cleanup hit the closed connection's table and left the healthy engine
    paused; before issue 20 the close raced the run.)"""
    engines = thread_engines(2)
    plan = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=2, call="load", kind="hang")
    ctx = make_ctx(trainer, engines, faults=plan, call_timeout_s=1.0, retries=0)
    out: dict[str, object] = {}
    runner = threading.Thread(target=lambda: out.update(result=protocol.run(ctx)))
    runner.start()
    time.sleep(0.4)
    ctx.close()
    runner.join(30)
    result = out["result"]
    assert isinstance(result, protocol.RefitResult) and result.state == "DONE"
    assert result.engines[engines[0].name].status == "updated"
    assert not engines[0].info()["paused"] and matches(engines[0], trainer)
    assert ctx.lock.holder is None and ctx.session.closed
    with pytest.raises(RuntimeError, match="closed"):
        protocol.run(ctx)


def test_a_driver_that_raises_on_detach_does_not_stop_close(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    """A driver that raises from `run_steps_async` instead of answering: close records that
    engine's detach as failed, still disconnects the ranks and ends the trace."""
    engines = thread_engines(2)
    ctx = make_ctx(trainer, engines)
    assert protocol.run(ctx).ok
    broken = engines[1]
    original = broken.run_steps_async

    def raising(steps, *, timeout, executor):  # type: ignore[no-untyped-def]
        if any(s.call == "detach" for s in steps):
            raise RuntimeError("driver bug: detach raises")
        return original(steps, timeout=timeout, executor=executor)

    broken.run_steps_async = raising  # type: ignore[method-assign]
    ctx.close()
    ends = [(c["event"], c.get("engine"), c["outcome"]) for c in calls(ctx) if c["event"] in ("detach", "disconnect")]
    assert ends == [
        ("detach", engines[0].name, "ok"), ("detach", broken.name, "error"), ("disconnect", None, "ok"),
    ]  # fmt: skip
    assert ctx.session.closed


def test_unsafe_configurations_are_refused_before_anything_runs(trainer: TinyLlama, thread_engines) -> None:
    engines = thread_engines(2)
    with pytest.raises(protocol.ConfigError, match=r"in_place.*pass kv='keep'"):  # old-weight KV, unasked
        protocol.RefitContext(TorchSourceFor(trainer), Shm(), engines, pause_mode="in_place")
    with pytest.raises(protocol.ConfigError, match="unique"):
        protocol.RefitContext(TorchSourceFor(trainer), Shm(), [engines[0], engines[0]])
    with pytest.raises(protocol.ConfigError, match="at least one engine"):
        protocol.RefitContext(TorchSourceFor(trainer), Shm(), [])
    assert all(e.info()["paused"] is False and e.info()["version"] == 0 for e in engines)


def TorchSourceFor(model: TinyLlama):
    from refit.drivers.torch_source import TorchSource

    return TorchSource(model)


def Shm():
    from refit.drivers.shm import SharedMemoryTransport

    return SharedMemoryTransport()


def test_a_second_run_while_one_holds_the_lock_fails_at_once(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    engines = thread_engines(2)
    ctx = make_ctx(trainer, engines)
    assert ctx.lock.acquire("another-run")  # another refit of the same engines is in flight
    with pytest.raises(protocol.RefitBusyError, match="being refit by another run"):
        protocol.run(ctx)
    assert ctx.lock.holder == "another-run"  # not stolen
    assert calls(ctx) == []  # nothing was touched
    assert all(e.info()["version"] == 0 and not e.info()["paused"] for e in engines)
    assert not ctx.lock.release("a-stale-owner")  # a late release from someone else is ignored
    assert ctx.lock.holder == "another-run"
    assert ctx.lock.release("another-run")
    assert protocol.run(ctx).ok


def test_two_contexts_over_the_same_engines_share_the_lock(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    engines = thread_engines(2)
    a, b = make_ctx(trainer, engines), make_ctx(trainer, engines)
    assert a.lock is b.lock


# ---- an exception injected at every driver call of a real run ---------------------------------------


def call_points(mode: str) -> list[tuple[str, str, int | None, int | None]]:
    """Every (state, call, engine, bucket) a clean run of this mode makes, read from its own trace."""
    engines = [ReferenceEngine.in_thread(f"probe{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=100)
    ctx = protocol.RefitContext(TorchSourceFor(model), Shm(), engines, mode=mode, bucket_bytes=64 << 10)  # type: ignore[arg-type]
    try:
        protocol.run(ctx)
        index = {e.name: i for i, e in enumerate(engines)}
        points = [(c["state"], c["event"], index.get(c.get("engine")), c.get("bucket")) for c in calls(ctx)]
    finally:
        ctx.close()
        for e in engines:
            e.close()
    return list(dict.fromkeys(points))


POINTS = {mode: call_points(mode) for mode in ("colocated", "disaggregated")}
CASES = [(mode, p) for mode, points in POINTS.items() for p in points]


def check_no_mixed_weights(
    engines: list[ReferenceEngine],
    old: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    result: protocol.RefitResult,
) -> None:
    """Every engine either serves weights its version names (old@0 or new@1), or is out of service:
    quarantined, or held as stale (the default policy, max_staleness=0: it did not take the version
    another engine published, so it may not serve the old one)."""
    for e in engines:
        info = e.info()
        outcome = result.engines[e.name]
        if info["quarantined"]:
            assert outcome.status in ("quarantined", "stale") and outcome.version is None
            if outcome.status == "stale":  # held before any byte of the new version reached it
                assert result.version == 1 and info["version"] == 0
                assert all(torch.equal(e.state_dict()[k], v) for k, v in old.items())
            with pytest.raises(EngineError, match="quarantined"):
                e.generate(PROMPT, 2)
            continue
        assert not info["paused"], f"{e.name} left paused: {info}"
        state = e.state_dict()
        want = new if info["version"] == 1 else old
        assert info["version"] in (0, 1)
        assert all(torch.equal(state[k], v) for k, v in want.items()), (
            f"{e.name} serves weights version {info['version']} does not name"
        )
        assert outcome.version == info["version"]
        assert outcome.status == ("updated" if info["version"] == 1 else "unchanged")


TRAINER_SIDE = {"offload", "metas", "connect", "materialize", "pack", "release", "restore", "digests"}


@pytest.mark.parametrize(("mode", "point"), CASES, ids=[f"{m}-{s}-{c}-e{e}-b{b}" for m, (s, c, e, b) in CASES])
def test_a_fault_anywhere_leaves_no_lock_no_mixed_engine(
    mode: str, point, trainer: TinyLlama, thread_engines, make_ctx
) -> None:
    """retries=0: an engine whose update failed is never retried, so every outcome shows directly."""
    state, call, engine, bucket = point
    engines = thread_engines(2)
    old = {k: v.clone() for k, v in TinyLlama(CONFIG, seed=0).state_dict().items()}
    new = {k: v.clone() for k, v in trainer.state_dict().items()}
    faults = protocol.FaultPlan().fail_at(state, engine=engine, bucket=bucket, call=call)
    ctx = make_ctx(trainer, engines, mode=mode, faults=faults, retries=0)
    result = protocol.run(ctx)  # raises InvariantViolation if the run's own events break an invariant

    assert faults.faults[0].fired == 1
    assert ctx.lock.holder is None
    check_no_mixed_weights(engines, old, new, result)
    statuses = {n: o.status for n, o in result.engines.items()}
    assert result.ok == (set(statuses.values()) == {"updated"} and result.state == "DONE")
    assert result.ok or isinstance(result.error, protocol.DriverCallError)
    if call in TRAINER_SIDE:  # the trainer failed: the whole run fails
        assert result.state == "FAILED" and result.error.call == call and result.error.state == state
        if state == "RESTORING":  # after the commit: the version had reached every engine
            assert result.version == 1 and set(statuses.values()) == {"updated"}
        else:
            assert result.version is None and ctx.published_version == 0
            assert set(statuses.values()) <= {"unchanged", "quarantined"}
    else:  # one engine failed: the healthy one finishes and takes the version
        faulty, healthy = engines[engine].name, engines[1 - engine].name
        assert result.state == "DONE" and result.version == 1
        assert statuses[healthy] == "updated"
        lost = state == "OFFLOADING" and call == "resume_memory"  # its weight memory is in an unknown state
        touched = state in ("TRANSFERRING", "POST_PROCESSING", "VERIFYING") or call == "publish" or lost
        recovered = call in ("continue_generation", "resume_memory") and state in ("CONTINUING", "RESTORING")
        # untouched: held out of service, stale (the default policy: one version in service)
        expected = "updated" if recovered else "quarantined" if touched else "stale"
        if state == "RESTORING":  # its KV memory came back on the second try
            expected = "updated"
        assert statuses[faulty] == expected, (statuses, result.error)
        assert result.ok or result.error.engine == faulty
    ctx.close()
    assert invariants.check_trace(ctx.recorder.events) == []


def test_a_failed_engine_is_retried_and_catches_up(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    """A poisoned engine gets its whole update again (new begin, every bucket, finalize) within the run."""
    engines = thread_engines(2)
    ctx = make_ctx(trainer, engines, faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3))
    result = protocol.run(ctx)
    assert result.ok and result.version == 1
    assert result.engines["t1"].attempts == 2 and result.engines["t0"].attempts == 1
    assert all(matches(e, trainer) for e in engines)
    assert transitions(ctx, result.run_id).count("retry") == 1
    begins = [c for c in calls(ctx, result.run_id) if c["event"] == "begin" and c["engine"] == "t1"]
    assert [b["attempt"] for b in begins] == [0, 1]


def test_lost_weights_are_never_served(trainer: TinyLlama, thread_engines, make_ctx) -> None:
    """Colocated: weights released without a backup come back as zeros. If the refit then fails before
    its commit, those engines must be quarantined, not continued on zeros."""
    engines = thread_engines(2)
    for e in engines:
        e.release_memory(["weights", "kv_cache"])
    ctx = make_ctx(trainer, engines, mode="colocated", faults=protocol.FaultPlan().fail_at("pausing", engine=1))
    result = protocol.run(ctx)
    assert not result.ok
    assert {n: o.status for n, o in result.engines.items()} == {"t0": "updated", "t1": "quarantined"}
    with pytest.raises(EngineError, match="quarantined"):
        engines[1].generate(PROMPT, 2)
    ctx.faults = None
    retry = protocol.run(ctx)  # a later successful refit heals it
    assert retry.ok and retry.version == 2
    assert all(e.generate(PROMPT, 8)["output"] == greedy(trainer, PROMPT, 8) for e in engines)


# ---- property: any configuration, any single fault, invariants hold ---------------------------------


@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    mode=st.sampled_from(["colocated", "disaggregated"]),
    pause_mode=st.sampled_from(["abort", "retract"]),
    n_engines=st.integers(1, 3),
    bucket_kib=st.sampled_from([8, 64, 1024]),
    fault_at=st.one_of(st.none(), st.integers(0, 10_000)),
    in_flight=st.booleans(),
)
def test_any_refit_keeps_every_invariant(
    mode: str,
    pause_mode: str,
    n_engines: int,
    bucket_kib: int,
    fault_at: int | None,
    in_flight: bool,
    make_ctx: Callable,
) -> None:
    engines = [ReferenceEngine.in_thread(f"h{i}", CONFIG, seed=0) for i in range(n_engines)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=n_engines + bucket_kib)
    try:
        ctx = make_ctx(model, engines, mode=mode, pause_mode=pause_mode, bucket_bytes=bucket_kib << 10)
        if fault_at is not None:
            points = [
                (c["state"], c["event"], c.get("engine"), c.get("bucket"))
                for c in _dry_run_points(mode, n_engines, bucket_kib)
            ]
            state, call, engine, bucket = points[fault_at % len(points)]
            index = {f"h{i}": i for i in range(n_engines)}
            ctx.faults = protocol.FaultPlan().fail_at(state, call=call, engine=index.get(engine), bucket=bucket)
        pending = [e.submit(PROMPT, 60) for e in engines] if in_flight and mode == "disaggregated" else []
        result = protocol.run(ctx)
        assert ctx.lock.holder is None
        if fault_at is None:
            assert result.ok
        old = TinyLlama(CONFIG, seed=0).state_dict()
        check_no_mixed_weights(engines, old, model.state_dict(), result)
        for fut in pending:
            assert fut.result(timeout=30)["finish_reason"] in ("length", "abort", "quarantined")
    finally:
        for e in engines:
            e.close()


_POINT_CACHE: dict[tuple[str, int, int], list[dict]] = {}


def _dry_run_points(mode: str, n_engines: int, bucket_kib: int) -> list[dict]:
    key = (mode, n_engines, bucket_kib)
    if key not in _POINT_CACHE:
        engines = [ReferenceEngine.in_thread(f"h{i}", CONFIG, seed=0) for i in range(n_engines)]
        model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
        ctx = protocol.RefitContext(TorchSourceFor(model), Shm(), engines, mode=mode, bucket_bytes=bucket_kib << 10)  # type: ignore[arg-type]
        try:
            protocol.run(ctx)
            _POINT_CACHE[key] = calls(ctx)
        finally:
            ctx.close()
            for e in engines:
                e.close()
    return _POINT_CACHE[key]


def test_the_demo_landing_check_can_fail(trainer: TinyLlama, thread_engines) -> None:
    """The demo's check compares with the trainer; an engine that missed the refit fails it."""
    from refit.demo import PROMPTS, check_engine
    from refit.reference.model import prompt_logits

    (engine,) = thread_engines(1)
    previous = [prompt_logits(TinyLlama(CONFIG, seed=0), list(p)) for p in PROMPTS]
    missed = check_engine(engine, trainer, previous)
    assert not missed["ok"] and not missed["weights"] and missed["max_diff"] > 1e-3 and missed["min_change"] == 0.0


def test_a_hung_trainer_side_gather_is_bounded_too(trainer, thread_engines, make_ctx) -> None:
    """A source call that never returns (a stuck collective) ends the run inside the deadline,
    with an error naming the call; the engines got no byte and go back to serving."""
    import time

    engines = thread_engines(2)
    faults = protocol.FaultPlan().fail_at("transferring", bucket=0, call="pack", kind="hang")
    ctx = make_ctx(trainer, engines, deadline_s=1.0, cleanup_grace_s=0.5, faults=faults)
    t0 = time.monotonic()
    result = protocol.run(ctx)
    assert time.monotonic() - t0 < 1.0 + 0.5 + invariants.DEADLINE_SLACK_S
    assert isinstance(result.error, protocol.DeadlineExceeded) and result.error.call == "pack"
    assert {o.status for o in result.engines.values()} == {"unchanged"}
    assert ctx.lock.holder is None


def test_a_planned_fault_that_never_fires_is_reported(
    trainer: TinyLlama, thread_engines, make_ctx, caplog: pytest.LogCaptureFixture
) -> None:
    """A fault no step matched tested nothing: the run says so instead of passing silently (here a
    swap's fault in a run that does not swap: not atomic)."""
    faults = protocol.FaultPlan().fail_at("swapping", engine=1, call="swap")
    ctx = make_ctx(trainer, thread_engines(2), faults=faults)
    with caplog.at_level("WARNING", logger="refit.protocol.runner"):
        result = protocol.run(ctx)
    assert result.ok and faults.unfired()
    assert any("never fired" in r.getMessage() and "'SWAPPING'" in r.getMessage() for r in caplog.records)


def test_steps_after_one_that_overran_its_budget_are_never_started() -> None:
    """[pause, flush, begin] in one call to the reference engine whose pause hangs past the
    call's budget: the engine pauses late (it was asked to), but flush and begin never start, so
    no update session opens behind the runner's back. (Found by review of issue 20: the engine
    ran the rest of a call after the runner gave up on it.)"""
    engine = ReferenceEngine.in_thread("overrun", CONFIG, seed=0)
    lane = ThreadPoolExecutor(1)
    try:
        engine.arm_fault("hang", "pause", bucket=None, seconds=1.2, timeout=5.0)
        plan = plan_buckets(TorchSource(TinyLlama(CONFIG, seed=1)).metas(), 64 << 10)
        steps = [
            Step("pause", "PAUSING", ("retract",)),
            Step("flush", "INVALIDATING"),
            Step("begin", "INVALIDATING", (plan,)),
        ]
        results = engine.run_steps_async(steps, timeout=0.3, executor=lane).result(timeout=10)
        assert results[-1].outcome == "timeout"
        time.sleep(1.5)  # past the hang: whatever the engine would still do, it has done
        info = engine.info()
        assert info["paused"] and not info["session_open"]
    finally:
        lane.shutdown(wait=True)
        engine.close()


def test_a_run_that_hits_its_deadline_says_how_long_its_cleanup_took_past_it(
    trainer: TinyLlama, thread_engines, make_ctx
) -> None:
    """A run whose engine hangs until the deadline may return after it, by the cleanup it owed
    (the healthy engine continued, the hung one settled), within `cleanup_grace_s`; the result
    says how long past the deadline that was (`past_deadline_s`), and a run inside it says 0."""
    engines = thread_engines(2)
    plan = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, call="load", kind="hang")
    ctx = make_ctx(trainer, engines, faults=plan, deadline_s=2.0, cleanup_grace_s=3.0)
    late = protocol.run(ctx)  # (on a loaded host its cleanup may still fit inside the deadline: then 0)
    assert not late.ok and late.seconds <= ctx.deadline_s + ctx.cleanup_grace_s + 1.0
    assert late.past_deadline_s == pytest.approx(max(0.0, late.seconds - ctx.deadline_s), abs=1e-3)
    ctx.faults = None
    engines[1].info(timeout=10)  # the injected hang is over
    perturbed(trainer, seed=3)
    ctx.deadline_s = 60.0
    on_time = protocol.run(ctx)
    assert on_time.ok and on_time.past_deadline_s == 0.0


def test_a_fault_its_run_can_never_fire_fails_the_run_before_anything_moves(
    trainer: TinyLlama, thread_engines, make_ctx
) -> None:
    """A planned fault whose bucket the run's plan does not have (known once it plans), or whose
    engine it does not drive, would fire nowhere: the run fails in IDLE naming it and the plan's
    size, every engine unchanged, instead of passing with a warning afterwards."""
    engines = thread_engines(2)
    ctx = make_ctx(trainer, engines, bucket_bytes=1 << 30)  # one bucket for the whole model
    for plan, why in (
        (protocol.FaultPlan().fail_at("transferring", engine=0, bucket=1, kind="swap_qk"), "targets bucket 1, but "
         "this refit's plan has 1 bucket(s), 0 to 0 (a smaller bucket_bytes makes more)"),
        (protocol.FaultPlan().fail_at("pausing", engine=2, kind="raise"), "targets engine 2, but the run drives 2"),
    ):  # fmt: skip
        ctx.faults = plan
        result = protocol.run(ctx)
        assert not result.ok and result.error.state == "IDLE"
        assert "planned fault can never fire" in str(result.error) and why in str(result.error), result.error
        assert {o.status for o in result.engines.values()} == {"unchanged"}
        assert [e.info()["version"] for e in engines] == [0, 0]
    ctx.faults = protocol.FaultPlan().fail_at("transferring", engine=0, bucket=0, kind="raise")  # one it can fire
    protocol.run(ctx)
    assert not ctx.faults.unfired()
