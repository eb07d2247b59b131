"""Regressions from real refit bugs (shared/reference/anchor-*.md). Each test reproduces the
situation of an upstream issue against refit and asserts what refit does instead."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from refit import invariants, protocol
from refit.buckets import TensorMeta, plan_buckets
from refit.drivers.base import Payload, Topology
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryReceiver, SharedMemoryTransport, leaked_segments
from refit.drivers.torch_source import TorchSource
from refit.errors import EngineError
from refit.reference.model import TinyLlama, greedy, prompt_logits

from .conftest import CONFIG, SMALL_BUCKET, matches, perturbed

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def calls(ctx: protocol.RefitContext, event: str, engine: str | None = None) -> list[dict]:
    return [
        e for e in ctx.recorder.events
        if e["kind"] == "call" and e["event"] == event and (engine is None or e.get("engine") == engine)
    ]  # fmt: skip


@pytest.fixture
def two(thread_engines) -> list[ReferenceEngine]:
    return thread_engines(2)


@pytest.fixture
def refit_ctx(make_ctx) -> Callable[..., protocol.RefitContext]:
    return make_ctx


def test_nemo_rl_4018_prefix_cache_is_never_stale_after_a_refit(trainer, two, refit_ctx) -> None:
    """NVIDIA-NeMo/RL#4018: async GRPO served prefix KV computed by weights up to 17 steps old
    (also RLinf PR#96, lmdeploy#4917). refit flushes after pause and before any bucket, every time."""
    ctx = refit_ctx(trainer, two)
    for step in range(3):
        for e in two:
            e.generate(PROMPT, 4)  # fill the prefix cache under the current weights
        perturbed(trainer, seed=step)
        assert protocol.run(ctx).ok
        for e in two:
            out = e.generate(PROMPT, 8)
            assert out["stale_kv_tokens"] == 0 and out["output"] == greedy(trainer, PROMPT, 8)


def test_miles_1967_lock_is_released_when_the_transfer_fails(trainer, two, refit_ctx) -> None:
    """radixark/miles#1967: the rollout-engine lock leaked when a broadcast failed, so the next
    sync spun forever. refit releases the lock on every exit."""
    ctx = refit_ctx(trainer, two, faults=protocol.FaultPlan().fail_at("transferring", bucket=3, call="pack"))
    failed = protocol.run(ctx)
    assert failed.state == "FAILED" and ctx.lock.holder is None
    ctx.faults = None
    t0 = time.monotonic()
    assert protocol.run(ctx).ok
    assert time.monotonic() - t0 < 5.0


def test_nemo_rl_3612_a_failed_refit_publishes_no_version(trainer, two, refit_ctx) -> None:
    """NeMo RL (Megatron path, noted in the #3612 review) and slime bump the weight version at the
    start of each refit, so failed refits are labelled too. refit publishes only at commit."""
    ctx = refit_ctx(
        trainer, two, faults=protocol.FaultPlan().fail_at("post_processing", call="finalize", engine=0), retries=0
    )
    ctx.faults.fail_at("post_processing", call="finalize", engine=1)
    result = protocol.run(ctx)
    assert result.state == "FAILED" and result.version is None and ctx.published_version == 0
    assert all(e.info()["version"] == 0 for e in two)
    ctx.faults = None
    assert protocol.run(ctx).version == 2  # strictly increasing; the failed number is never reused


def test_miles_890_finalize_runs_even_when_the_update_fails(trainer, two, refit_ctx) -> None:
    """radixark/miles#890 (and NeMo RL's end_weight_update in finally): post-processing was not
    invoked on some paths. refit finalizes every engine whose begin succeeded, exactly once."""
    ctx = refit_ctx(trainer, two, faults=protocol.FaultPlan().fail_at("transferring", bucket=2, call="pack"))
    result = protocol.run(ctx)
    assert result.state == "FAILED"
    for e in two:
        assert len(calls(ctx, "begin", e.name)) == 1 and len(calls(ctx, "finalize", e.name)) == 1


def test_nemo_rl_3545_finalize_refreshes_processed_weights(trainer, two, refit_ctx) -> None:
    """NVIDIA-NeMo/RL#3545: a repacked (processed) layout silently kept stale weights. The reference
    engine serves a processed head that only finalize rebuilds; after a refit the logits match."""
    assert protocol.run(refit_ctx(trainer, two)).ok
    for e in two:
        assert torch.allclose(e.score(PROMPT), prompt_logits(trainer, PROMPT), atol=1e-5, rtol=0)


class SlowCopy(ReferenceEngine):
    """Takes its time copying each bucket out (a busy engine)."""

    def load(self, payload: Payload, *, timeout: float) -> None:
        time.sleep(0.02)
        super().load(payload, timeout=timeout)


def test_slime_929_a_buffer_is_not_reused_before_the_engine_copied_it(trainer, refit_ctx) -> None:
    """THUDM/slime#929: the producer's buffer was freed or overwritten before the engine copied it.
    With slow engines and two buffers, refit still waits for every ack; checksums stay clean."""
    engines = [SlowCopy.in_thread(f"slow{i}", CONFIG, seed=0) for i in range(2)]
    try:
        ctx = refit_ctx(trainer, engines)
        assert protocol.run(ctx).ok  # a reused buffer would fail a checksum
        assert all(matches(e, trainer) for e in engines)
        assert invariants.check_paired([e for e in ctx.recorder.events if e.get("run")]) == []
    finally:
        for e in engines:
            e.close()


def test_miles_1724_a_recovered_engine_does_not_serve_before_its_first_refit(trainer, refit_ctx) -> None:
    """radixark/miles#1724 (PR#1805), NeMo RL#3661: a replacement engine took traffic before it had
    the current weights. A recovered engine starts out of service; the refit brings it current."""
    engine = ReferenceEngine.in_thread("recovered", CONFIG, seed=0, serving=False)
    try:
        with pytest.raises(EngineError, match="awaiting its first refit"):
            engine.generate(PROMPT, 2)
        assert protocol.run(refit_ctx(trainer, [engine])).ok
        assert engine.generate(PROMPT, 8)["output"] == greedy(trainer, PROMPT, 8)
    finally:
        engine.close()


def test_miles_2782_in_place_pause_is_refused(trainer, two) -> None:
    """radixark/miles#2782: in_place pause skips the flush, so the radix cache keeps pre-update KV.
    refit refuses in_place for engines that cannot make that KV fresh, before anything runs."""
    with pytest.raises(protocol.ConfigError, match="in_place"):
        protocol.RefitContext(TorchSource(trainer), SharedMemoryTransport(), two, pause_mode="in_place")


def test_slime_2134_an_empty_bucket_travels(tmp_path) -> None:
    """THUDM/slime#2134: an empty colocated bucket on some ranks broke the gather. Zero-size
    tensors and an all-empty bucket pack, checksum and unpack like any other."""
    tensors = [("a", torch.empty(0, 4)), ("b", torch.empty(0)), ("c", torch.ones(3))]
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in tensors], 1)
    topo = Topology.of(1, [("e", 1)], colocated=False)
    t = SharedMemoryTransport(directory=tmp_path)
    rx = SharedMemoryReceiver(t.attach_infos([t.connect(plan, topo, 0)], topo)["e"])
    source = dict(tensors)
    for manifest in plan:
        part = t.pack(manifest, [(n, source[n]) for n in manifest.names])
        payload = t.payloads(manifest, [part], topo)["e"]
        got = rx.read(payload)
        rx.verify(payload, got)
        assert all(torch.equal(v, source[n]) for n, v in got)
        t.release(manifest.index)
    t.disconnect()


def test_nemo_rl_2417_non_contiguous_tensors_are_sent_correctly(two, refit_ctx) -> None:
    """NVIDIA-NeMo/RL#2417/#2418 (view(-1) crashed) and radixark/miles#1608 (non-contiguous tensors
    passed to broadcast). A state dict of transposed views refits bit-exactly."""
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=9)
    views = {k: v.t().contiguous().t() if v.dim() == 2 else v for k, v in model.state_dict().items()}
    assert any(not v.is_contiguous() for v in views.values())
    assert protocol.run(refit_ctx(views, two)).ok
    assert all(matches(e, model) for e in two)


def test_slime_1420_no_engine_continues_while_another_is_still_receiving(trainer, two, refit_ctx) -> None:
    """THUDM/slime#1420 (missing barrier before continue_generation) and #555 (serving before the
    weights were fully synchronized). Every engine's last bucket and finalize precede any continue."""
    ctx = refit_ctx(trainer, two)
    assert protocol.run(ctx).ok
    first_continue = min(c["seq"] for c in calls(ctx, "continue_generation"))
    assert max(c["seq"] for c in calls(ctx, "load") + calls(ctx, "finalize")) < first_continue


def test_sglang_14062_flush_is_not_refused_by_running_requests(trainer, two, refit_ctx) -> None:
    """sgl-project/sglang#14062, #12099, AReaL#140: updating with requests running made the cache
    flush fail and killed the scheduler. refit pauses (retract) first, so the flush succeeds."""
    futures = [e.submit(PROMPT, 100) for e in two]
    time.sleep(0.05)
    ctx = refit_ctx(trainer, two, mode="disaggregated", pause_mode="retract")
    assert protocol.run(ctx).ok
    assert [c["outcome"] for c in calls(ctx, "flush")] == ["ok", "ok"]
    assert all(f.result(timeout=30)["finish_reason"] == "length" for f in futures)


def test_miles_1497_retract_then_flush_works_with_a_waiting_queue(trainer, refit_ctx) -> None:
    """radixark/miles#1497/#1750, sgl-project/sglang#32153: after a retract pause the waiting queue
    was non-empty, the flush was refused and the job died. Retracted requests hold no KV: the flush
    goes through and they finish under the new weights."""
    engine = ReferenceEngine.in_thread("busy", CONFIG, seed=0)
    try:
        futures = [engine.submit(PROMPT, 60) for _ in range(12)]  # more than max_running: some wait
        time.sleep(0.05)
        ctx = refit_ctx(trainer, [engine], mode="disaggregated", pause_mode="retract")
        result = protocol.run(ctx)
        assert result.ok and calls(ctx, "flush")[0]["outcome"] == "ok"
        outs = [f.result(timeout=60) for f in futures]
        assert all(o["finish_reason"] == "length" and o["weight_versions"][-1] == 1 for o in outs)
    finally:
        engine.close()


def test_nemo_rl_3929_a_hung_pause_is_bounded_by_the_deadline(trainer, refit_ctx) -> None:
    """NVIDIA-NeMo/RL#3929 (an unbounded pause ray.get outside the refit deadline) and #4019 (no
    refit deadline at all). A pause that never returns ends the run inside deadline + grace."""
    engines = [ReferenceEngine.in_thread(f"hp{i}", CONFIG, seed=0) for i in range(2)]
    try:
        ctx = refit_ctx(trainer, engines, version=0, deadline_s=1.0, cleanup_grace_s=0.5)
        engines[1].arm_fault("hang", "pause", bucket=None, seconds=3.0, timeout=5)
        t0 = time.monotonic()
        result = protocol.run(ctx)
        assert time.monotonic() - t0 <= 1.0 + 0.5 + invariants.DEADLINE_SLACK_S
        assert isinstance(result.error, protocol.DeadlineExceeded) and result.error.engine == "hp1"
        assert "'pause'" in str(result.error)  # the call that never answered carried the pause
        assert ctx.lock.holder is None
    finally:
        for e in engines:
            e.close()


def test_a_trainer_step_that_never_returns_ends_the_run_inside_deadline_and_grace() -> None:
    """A hung trainer rank (its source blocks in bucket 2). The run returns its failed result
    inside deadline + grace (it overran by about 1 s and raised InvariantViolation(deadline)
    before: slack and floors were still waited on a rank that had stopped answering), the lock is
    released and the engine, holding part of the new weights, is quarantined."""
    release = threading.Event()
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=3)

    class Stuck(TorchSource):
        def iter_buckets(self, plan):  # type: ignore[no-untyped-def]
            for i, bucket in enumerate(super().iter_buckets(plan)):
                if i == 2:
                    release.wait(30)
                yield bucket

    engine = ReferenceEngine.in_thread("stuck", CONFIG, seed=0)
    # zero_copy off: with it, the transport hashes ahead in IDLE (`prepare`) whenever some arena lives
    # in this process (another test's, in the same pytest worker), and the source would block there
    transport = SharedMemoryTransport(zero_copy=False)
    ctx = protocol.RefitContext(
        Stuck(model), transport, [engine], bucket_bytes=SMALL_BUCKET, deadline_s=2.0, cleanup_grace_s=1.0
    )
    try:
        t0 = time.monotonic()
        result = protocol.run(ctx)  # no InvariantViolation
        took = time.monotonic() - t0
        assert took <= 2.0 + 1.0 + 0.3, took
        assert not result.ok and result.state == "FAILED" and result.error.call == "pack"
        assert ctx.lock.holder is None
        assert result.engines["stuck"].status == "quarantined" and engine.info()["quarantined"]
        release.set()  # the rank comes back: its queued teardown then runs and frees the segments
        ctx.close()
        assert not invariants.check_trace(ctx.recorder.events)
        deadline = time.monotonic() + 10
        while leaked_segments(pid=os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leaked_segments(pid=os.getpid()) == []
    finally:
        release.set()
        ctx.close()
        engine.close()


def test_slime_1487_connect_is_bounded_by_the_deadline(trainer, refit_ctx) -> None:
    """THUDM/slime#1487 (rebuilt groups silently used a 10-minute default timeout) and
    sgl-project/sglang#4096 (hang after init_weights_update_group). A hung attach is bounded."""
    engines = [ReferenceEngine.in_thread(f"hc{i}", CONFIG, seed=0) for i in range(2)]
    try:
        # (a 0.3 s call timeout once timed out the healthy engine too on a loaded 2-core machine)
        ctx = refit_ctx(trainer, engines, version=0, deadline_s=10.0, call_timeout_s=1.0)
        engines[0].arm_fault("hang", "attach", bucket=None, seconds=4.0, timeout=5)
        t0 = time.monotonic()
        result = protocol.run(ctx)
        elapsed = time.monotonic() - t0
        assert elapsed < 3.5, elapsed  # bounded by the call's timeout, before the hang ends
        assert result.engines["hc0"].status == "failed" and result.engines["hc1"].status == "updated"
        assert result.error.state == "CONNECTING" and result.error.call == "attach"
    finally:
        for e in engines:
            e.close()


def test_slime_2104_an_engine_failure_is_reported_and_repaired(trainer, two, refit_ctx) -> None:
    """THUDM/slime#2104: a failed apply on an engine was ignored and the sender's snapshot advanced,
    leaving permanent silent drift. refit reports exactly which engine holds which version, and the
    next refit brings the lagging engine current with a full update."""
    ctx = refit_ctx(trainer, two, retries=0, faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=4))
    result = protocol.run(ctx)
    assert {n: (o.status, o.version) for n, o in result.engines.items()} == {
        "t0": ("updated", 1), "t1": ("quarantined", None),
    }  # fmt: skip
    perturbed(trainer, seed=77)
    ctx.faults = None
    result = protocol.run(ctx)
    assert result.ok and {o.version for o in result.engines.values()} == {2}
    assert all(matches(e, trainer) for e in two)


def test_miles_1444_a_replaced_engine_gets_a_fresh_connection(trainer, two, refit_ctx) -> None:
    """radixark/miles#1444: after a reconfiguration the trainer kept a stale engine connection and
    broadcast into a dead group. A new incarnation makes refit reconnect before sending."""
    ctx = refit_ctx(trainer, two)
    assert protocol.run(ctx).ok
    two[1].close()
    replacement = ReferenceEngine.in_thread(two[1].name, CONFIG, seed=0, serving=False)
    try:
        ctx.engines[1] = replacement
        result = protocol.run(ctx)
        assert result.ok
        connects = [c for c in calls(ctx, "connect") if c["run"] == result.run_id]
        assert len(connects) == 1 and matches(replacement, trainer)
    finally:
        replacement.close()


def test_nemo_rl_oversized_param_travels_in_its_own_bucket(trainer, two, refit_ctx) -> None:
    """NeMo RL test_refit_oversized_param: DeepSeek-V3's embed_tokens (1.73 GiB) was larger than the
    1.65 GiB IPC buffer. A tensor larger than the bucket size gets its own, larger buffer."""
    embed = trainer.state_dict()["model.embed_tokens.weight"]
    ctx = refit_ctx(trainer, two, bucket_bytes=embed.nbytes // 2)
    assert protocol.run(ctx).ok and all(matches(e, trainer) for e in two)
    plan = next(e for e in ctx.recorder.events if e["kind"] == "plan")["manifests"]
    assert ["model.embed_tokens.weight"] in [m["names"] for m in plan]


def test_miles_2589_a_version_update_does_not_abort_in_flight_requests(trainer, two, refit_ctx) -> None:
    """radixark/miles#2589/#2296: /update_weight_version aborted every in-flight request by default
    right after a retract pause. Requests paused by refit survive and finish on the new version."""
    futures = [e.submit(PROMPT, 120) for e in two]
    time.sleep(0.05)
    assert protocol.run(refit_ctx(trainer, two, mode="disaggregated", pause_mode="retract")).ok
    for f in futures:
        out = f.result(timeout=30)
        assert out["finish_reason"] == "length" and out["weight_versions"][-1] == 1


def test_nemo_rl_3612_the_engines_error_text_reaches_the_caller(two, refit_ctx) -> None:
    """NeMo RL #3612 review: refits failed with "unknown error" because SGLang's message field was
    dropped. The engine's own message is in the result's error."""
    bad = {**TinyLlama(CONFIG, seed=0).state_dict(), "model.norm.weight": torch.ones(65)}
    result = protocol.run(refit_ctx(bad, two))
    assert "model.norm.weight: shape [65] != model [64]" in str(result.error)


def test_sglang_17107_a_shape_mismatch_names_the_tensor_and_both_shapes(two, refit_ctx) -> None:
    """sgl-project/sglang#17107: a bucketed update failed with a bare shape mismatch. The plan is
    validated up front and the error names the tensor, the sent shape and the model's."""
    bad = {**TinyLlama(CONFIG, seed=0).state_dict(), "model.layers.1.mlp.up_proj.weight": torch.zeros(64, 128)}
    result = protocol.run(refit_ctx(bad, two))
    assert "model.layers.1.mlp.up_proj.weight: shape [64, 128] != model [128, 64]" in str(result.error)
    assert {o.status for o in result.engines.values()} == {"unchanged"}


def test_slime_1731_nothing_leaks_across_many_refits(trainer, two, refit_ctx) -> None:
    """THUDM/slime#1731 (IPC cache leak across syncs), vllm#51258 (packed IPC leaked its staging
    buffer). Thirty refits leave exactly the live buffers and no new file descriptors."""
    ctx = refit_ctx(trainer, two)
    assert protocol.run(ctx).ok
    fds = len(os.listdir("/proc/self/fd"))
    for step in range(30):
        perturbed(trainer, seed=step)
        assert protocol.run(ctx).ok
    assert len(leaked_segments(pid=os.getpid())) == ctx.transport.slots
    assert len(os.listdir("/proc/self/fd")) <= fds


def test_nemo_rl_flush_failure_stops_the_bytes(trainer, two, refit_ctx) -> None:
    """NeMo RL's unit tests require that a failed flush aborts before any byte moves. An engine
    whose flush fails gets no bucket: its old weights are intact, and under the default policy
    (one version in service) it is held out of service until a refit reaches it."""
    ctx = refit_ctx(
        trainer, two, retries=0, faults=protocol.FaultPlan().fail_at("invalidating", engine=1, call="flush")
    )
    result = protocol.run(ctx)
    assert calls(ctx, "load", "t1") == []
    assert result.engines["t1"].status == "stale" and result.engines["t0"].status == "updated"
    assert two[1].info()["version"] == 0 and not result.engines["t1"].serving


def test_nemo_rl_fail_closed_a_partially_updated_engine_is_never_resumed(trainer, two, refit_ctx) -> None:
    """NeMo RL #3612 resumes generation on every path (so an engine can serve a partial update);
    its integration branch fails closed. refit fails closed: the engine is quarantined."""
    ctx = refit_ctx(trainer, two, retries=0, faults=protocol.FaultPlan().fail_at("transferring", engine=0, bucket=5))
    protocol.run(ctx)
    assert calls(ctx, "continue_generation", "t0") == []
    with pytest.raises(EngineError, match="quarantined"):
        two[0].generate(PROMPT, 2)


def test_sglang_session_left_open_by_a_hang_does_not_block_the_next_refit(trainer, two, refit_ctx) -> None:
    """SGLang keeps the weight-update session in the scheduler, so a driver that gave up mid-update
    left it open and every later begin failed ("already open"). The engine that hung is quarantined,
    which voids its session; the next refit updates it."""
    ctx = refit_ctx(
        trainer,
        two,
        call_timeout_s=1.0,  # (0.3 s: a loaded 2-core machine once kept the healthy engine past it)
        faults=protocol.FaultPlan().fail_at("transferring", engine=1, bucket=3, kind="hang"),
    )
    first = protocol.run(ctx)
    assert first.engines["t1"].status == "failed"
    time.sleep(2.5)  # the hung engine wakes up and works through what it was sent (quarantine last)
    ctx.faults = None
    perturbed(trainer, seed=5)
    second = protocol.run(ctx)
    assert second.ok and all(matches(e, trainer) for e in two)
