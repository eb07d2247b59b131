"""Bucket 0 rides the pause wave in the steady state (`_Run.ride_first_bucket`): a context (colocated
or not) over a point-to-point transport whose engines are where its last run left them sends each
engine's probe, pause, flush, begin and load of bucket 0 as one request, so the engines stall one
round trip less. Anywhere else the wave stays as it was. The fault matrix's steady-state part
(tests/test_fault_matrix.py) covers faults in that wave."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from refit import protocol
from refit.cli import main
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.replay import replay

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed


def _batches(events: list[dict[str, Any]], run: str, engine: str) -> dict[str, int | None]:
    """The batch (engine request) each of `engine`'s pause and load-of-bucket-0 went in, in `run`."""
    out = {}
    for e in events:
        mine = e.get("run") == run and e.get("kind") == "call" and e.get("engine") == engine
        if mine and (e["event"] == "pause" or (e["event"] == "load" and e.get("bucket") == 0 and "load" not in out)):
            out[e["event"]] = e.get("batch")
    return out


def _run_ids(events: list[dict[str, Any]]) -> list[str]:
    return [e["run"] for e in events if (e.get("kind"), e.get("event")) == ("run", "start")]


def test_bucket_0_rides_the_pause_wave_once_the_engines_are_known(tmp_path: Path) -> None:
    engines = [ReferenceEngine.in_thread(f"r{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    trace = tmp_path / "ride.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, deadline_s=30, trace=trace
    )
    try:
        results = []
        for seed in (2, 3):
            results.append(protocol.run(ctx))
            assert results[-1].ok and all(matches(e, model) for e in engines)
            perturbed(model, seed=seed)
        ctx.close()
    finally:
        for e in engines:
            e.close()
    events = list(ctx.recorder.events)
    first, second = _run_ids(events)
    for e in engines:
        connected = _batches(events, first, e.name)  # the first run connects: bucket 0 goes after the pause wave
        assert connected["load"] != connected["pause"]
        steady = _batches(events, second, e.name)
        assert steady["load"] == steady["pause"] is not None
    assert results[0].buckets == results[1].buckets > 3 and results[1].round_trips == 2
    assert main(["check", str(trace)]) == 0  # invariants and the replayed decisions
    assert replay(trace).divergence is None


def _rides(ctx: protocol.RefitContext, model: TinyLlama) -> list[bool]:
    out = []
    for seed in (2, 3):
        result = protocol.run(ctx)
        assert result.ok, result.error
        assert all(matches(e, model) for e in ctx.engines)
        events = [e for e in ctx.recorder.events if e.get("run") == _run_ids(list(ctx.recorder.events))[-1]]
        name = ctx.engines[0].name
        batches = _batches(events, events[0]["run"], name)
        out.append(batches.get("load") == batches.get("pause"))
        perturbed(model, seed=seed)
    return out


def test_bucket_0_rides_colocated_but_not_collective_or_after_a_failed_engine() -> None:
    engines = [ReferenceEngine.in_thread(f"n{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    version = 0
    try:
        for transport, mode, rides in (
            (SharedMemoryTransport(), "colocated", [False, True]),  # the first run connects
            (BroadcastTransport(), "disaggregated", [False, False]),
        ):
            ctx = protocol.RefitContext(
                TorchSource(model), transport, engines, mode=mode, bucket_bytes=SMALL_BUCKET, deadline_s=30,
                version=version,
            )  # fmt: skip
            assert _rides(ctx, model) == rides, (type(transport).__name__, mode)
            if mode == "colocated":  # the ride's wave resumed the weights' memory before the load
                for e in engines:
                    ops = [r["op"] for r in e.audit()]
                    ops = ops[len(ops) - 1 - ops[::-1].index("probe") :]  # the last run's
                    assert ops.index("resume_memory") < ops.index("load"), ops
            version = ctx.published_version
            ctx.close()
        # an engine quarantined by the last run (its version unknown to the context): no ride
        ctx = protocol.RefitContext(
            TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET, deadline_s=30,
            call_timeout_s=5, retries=0, version=version,
        )  # fmt: skip
        assert protocol.run(ctx).ok
        ctx.faults = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, kind="corrupt")
        assert protocol.run(ctx).engines["n1"].status == "quarantined"
        ctx.faults = None
        assert _rides(ctx, model) == [False, True]  # the next run refits n1 in full; the one after rides
        ctx.close()
    finally:
        for e in engines:
            e.close()


def test_no_ride_after_another_run_took_the_lock_so_a_refusing_probe_moves_nothing() -> None:
    """Context B, sharing the engines' lock, refits e0 past A's next version between two runs of
    A. A's next run must not ride (the lock was taken by someone else in between): e0's probe
    refuses and no byte reaches e1 or e2, which keep serving (found by an adversarial review:
    with the ride, they were loaded and then quarantined)."""
    engines = [ReferenceEngine.in_thread(f"s{i}", CONFIG, seed=0) for i in range(3)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    a = protocol.RefitContext(TorchSource(model), SharedMemoryTransport(), engines, bucket_bytes=SMALL_BUCKET)
    b = protocol.RefitContext(
        TorchSource(perturbed(TinyLlama(CONFIG, seed=0), seed=9)), SharedMemoryTransport(), engines[:1],
        bucket_bytes=SMALL_BUCKET, version=10, lock=a.lock,
    )  # fmt: skip
    try:
        assert protocol.run(a).ok
        assert protocol.run(b).ok  # e0 now holds version 11
        perturbed(model, seed=2)
        refused = protocol.run(a)
        assert not refused.ok and "already hold version" in str(refused.error)
        assert {n: o.status for n, o in refused.engines.items()} == {
            "s0": "unchanged",
            "s1": "unchanged",
            "s2": "unchanged",
        }
        served = TinyLlama(CONFIG, seed=0)
        served.load_state_dict(perturbed(TinyLlama(CONFIG, seed=0), seed=1).state_dict())
        for e in engines[1:]:
            info = e.info()
            assert not info["quarantined"] and not info["paused"] and not info["dirty"] and info["version"] == 1
            assert matches(e, served)
    finally:
        a.close()
        b.close()
        for e in engines:
            e.close()


def test_an_engine_killed_in_a_riding_one_bucket_wave_is_failed_cleanly(tmp_path: Path) -> None:
    """A one-bucket plan's finalize and verify ride the pause wave too: an engine killed in that
    wave finalized nothing, and nothing says it did (found by an adversarial review: the run raised
    finalize_once); the other engine takes the version, the trace checks and replays."""
    from refit.drivers.ipc import IPCTransport

    engines = [ReferenceEngine.in_thread(f"k{i}", CONFIG, seed=0) for i in range(2)]
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=1)
    trace = tmp_path / "kill.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(share_cpu=True), engines, mode="colocated", bucket_bytes=SMALL_BUCKET,
        deadline_s=8, call_timeout_s=2.0, trace=trace,
    )  # fmt: skip
    try:
        assert protocol.run(ctx).buckets == 1  # IPC's 2 GiB signals: the whole model is one bucket
        perturbed(model, seed=2)
        ctx.faults = protocol.FaultPlan().fail_at("INVALIDATING", engine=1, kind="kill")
        result = protocol.run(ctx)
        assert {n: o.status for n, o in result.engines.items()} == {"k0": "updated", "k1": "failed"}
        assert matches(engines[0], model) and ctx.lock.holder is None
    finally:
        ctx.close()
        for e in engines:
            e.close()
    assert main(["check", str(trace)]) == 0
    assert replay(trace).divergence is None
