"""The reference engine core: a real engine with the real failure modes refit exists to prevent."""

from __future__ import annotations

import pytest
import torch

from refit.buckets import BucketManifest, TensorMeta, plan_buckets
from refit.errors import EngineError
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama, greedy, prompt_logits

from .conftest import perturbed

CFG = ModelConfig()
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def run_all(core: EngineCore) -> None:
    while core.has_work():
        core.step()


def generate(core: EngineCore, prompt: list[int], n: int = 8) -> dict:
    rid = core.submit(prompt, n)
    run_all(core)
    return core.result(rid)


def plan_for(model: TinyLlama, bucket_bytes: int = 64 << 10) -> list[BucketManifest]:
    return plan_buckets([TensorMeta.of(n, t) for n, t in model.state_dict().items()], bucket_bytes)


def refit_directly(
    core: EngineCore, model: TinyLlama, *, flush: bool = True, buckets: int | None = None, version: int = 1
) -> None:
    """Drive the engine by hand (no protocol): what a hand-written refit procedure does."""
    plan = plan_for(model)
    sd = model.state_dict()
    if flush:
        core.flush()
    core.begin(plan)
    for manifest in plan[:buckets]:
        core.load(manifest, [(n, sd[n]) for n in manifest.names])
    if buckets is None:
        core.finalize()
        core.publish(version)


@pytest.fixture
def core() -> EngineCore:
    return EngineCore(CFG, seed=0)


def test_engine_layout_is_fused_and_reads_back_unfused(core: EngineCore) -> None:
    trainer = TinyLlama(CFG, seed=0)
    assert "model.layers.0.self_attn.qkv_proj.weight" in core.params
    assert "model.layers.0.self_attn.q_proj.weight" not in core.params
    assert core.params["model.layers.0.mlp.gate_up_proj.weight"].shape == (2 * CFG.intermediate_size, CFG.hidden_size)
    state = core.hf_state_dict()
    assert state.keys() == trainer.state_dict().keys()
    assert all(torch.equal(state[k], v) for k, v in trainer.state_dict().items())


def test_engine_matches_the_trainer_tokens_and_logits(core: EngineCore) -> None:
    trainer = TinyLlama(CFG, seed=0)
    for prompt in (PROMPT, [7], list(range(30))):
        assert generate(core, prompt, 12)["output"] == greedy(trainer, prompt, 12)
        assert torch.allclose(core.score(prompt), prompt_logits(trainer, prompt), atol=1e-5, rtol=0)


def test_prefix_cache_is_used(core: EngineCore) -> None:
    trainer = TinyLlama(CFG, seed=0)
    generate(core, PROMPT)
    second = generate(core, [*PROMPT, 7, 7])
    assert second["cached_tokens"] == len(PROMPT)
    assert second["stale_kv_tokens"] == 0
    assert second["output"] == greedy(trainer, [*PROMPT, 7, 7], 8)


def test_refit_without_flush_serves_stale_kv(core: EngineCore) -> None:
    """Why INVALIDATING exists (NeMo RL#4018, miles#2782): skip the flush and a cached prefix keeps
    KV computed by the old weights, so the engine's answer is neither model's."""
    generate(core, PROMPT)  # caches PROMPT's KV under the old weights
    new = perturbed(TinyLlama(CFG, seed=0), seed=1)
    refit_directly(core, new, flush=False)
    out = generate(core, PROMPT)
    assert out["cached_tokens"] > 0 and out["stale_kv_tokens"] > 0
    assert out["output"] != greedy(new, PROMPT, 8)

    fresh = EngineCore(CFG, seed=0)
    generate(fresh, PROMPT)
    refit_directly(fresh, new, flush=True)
    out = generate(fresh, PROMPT)
    assert out["stale_kv_tokens"] == 0
    assert out["output"] == greedy(new, PROMPT, 8)


def test_continue_after_partial_transfer_serves_mixed_weights(core: EngineCore) -> None:
    """Why POISONED engines are never continued: half a refit is neither the old nor the new model."""
    old = TinyLlama(CFG, seed=0)
    new = perturbed(TinyLlama(CFG, seed=0), seed=2, scale=0.5)
    refit_directly(core, new, buckets=3)  # 3 of 8 buckets, no finalize
    core.continue_generation()  # the engine itself does not stop this: the protocol must
    state = core.hf_state_dict()
    assert any(torch.equal(state[k], old.state_dict()[k]) for k in state)
    assert any(torch.equal(state[k], new.state_dict()[k]) for k in state)
    out = generate(core, PROMPT, 12)["output"]
    assert out != greedy(old, PROMPT, 12) and out != greedy(new, PROMPT, 12)
    assert core.info()["dirty"]


def test_finalize_refreshes_the_served_head_and_runs_once(core: EngineCore) -> None:
    """Why POST_PROCESSING exists: until finalize the engine serves its old processed output head."""
    new = perturbed(TinyLlama(CFG, seed=0), seed=3)
    refit_directly(core, new, buckets=8)  # every bucket, but no finalize yet
    assert not torch.allclose(core.score(PROMPT), prompt_logits(new, PROMPT), atol=1e-5, rtol=0)
    assert core.finalize()["post_processed"] is True
    assert torch.allclose(core.score(PROMPT), prompt_logits(new, PROMPT), atol=1e-5, rtol=0)
    with pytest.raises(EngineError, match="no_session"):
        core.finalize()


def test_finalize_refuses_an_incomplete_session(core: EngineCore) -> None:
    new = perturbed(TinyLlama(CFG, seed=0), seed=4)
    refit_directly(core, new, buckets=2)
    with pytest.raises(EngineError, match=r"incomplete: finalize after 2 of 8 buckets; missing \[2, 3, 4, 5, 6, 7\]"):
        core.finalize()
    with pytest.raises(EngineError, match="not_ready"):
        core.publish(1)  # weights that match no version get no version label


def test_publish_needs_an_increasing_version(core: EngineCore) -> None:
    new = perturbed(TinyLlama(CFG, seed=0), seed=5)
    refit_directly(core, new, version=3)
    assert core.version == 3
    refit_directly(core, new, buckets=8)
    core.finalize()
    with pytest.raises(EngineError, match="version 3 is not newer"):
        core.publish(3)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m: m[:-1], "model tensors missing from the plan, first 'lm_head.weight'"),
        (lambda m: [*m, TensorMeta("model.extra.weight", "float32", (2,))], "unknown tensor 'model.extra.weight'"),
        (lambda m: [TensorMeta(m[0].name, "float32", (3, 3)), *m[1:]], r"model.embed_tokens.weight: shape \[3, 3\]"),
        (lambda m: [TensorMeta(m[0].name, "bfloat16", m[0].shape), *m[1:]], "dtype bfloat16 != model float32"),
        (None, "duplicate tensor 'model.embed_tokens.weight' \\(buckets 0 and 8\\)"),
    ],
)
def test_begin_validates_the_whole_plan_before_any_byte(core: EngineCore, mutate, message: str) -> None:
    """Bad names/shapes/dtypes/duplicates/missing tensors are refused before anything is applied."""
    metas = [TensorMeta.of(n, t) for n, t in TinyLlama(CFG, seed=0).state_dict().items()]
    before = core.score(PROMPT)
    if mutate is None:  # a source that sends one tensor twice (plan_buckets itself refuses that)
        plan = plan_buckets(metas, 64 << 10)
        plan.append(BucketManifest(len(plan), plan[0].entries[:1], plan[0].entries[0].meta.nbytes))
    else:
        plan = plan_buckets(mutate(metas), 64 << 10)
    with pytest.raises(EngineError, match=message):
        core.begin(plan)
    assert core.session is None
    assert torch.equal(core.score(PROMPT), before)


def test_load_refuses_out_of_session_unplanned_and_repeated_buckets(core: EngineCore) -> None:
    model = perturbed(TinyLlama(CFG, seed=0), seed=6)
    plan, sd = plan_for(model), model.state_dict()
    bucket = [(n, sd[n]) for n in plan[0].names]
    with pytest.raises(EngineError, match="no_session"):
        core.load(plan[0], bucket)
    core.begin(plan)
    core.load(plan[0], bucket)
    with pytest.raises(EngineError, match="already loaded"):
        core.load(plan[0], bucket)
    with pytest.raises(EngineError, match="bucket 2 arrived before bucket 1"):
        core.load(plan[2], [(n, sd[n]) for n in plan[2].names])
    with pytest.raises(EngineError, match="session_broken: bucket 1 refused: bucket 2 arrived before bucket 1"):
        core.load(plan[1], [(n, sd[n]) for n in plan[1].names])  # once refused, the session takes nothing more
    assert core.session.loaded == {0}

    core.quarantine("start over")
    core.begin(plan)
    with pytest.raises(EngineError, match="truncated or reordered"):
        core.load(plan[0], [(n, sd[n]) for n in plan[0].names][:-1])
    core.quarantine("start over")
    core.begin(plan)
    with pytest.raises(EngineError, match="does not match the plan"):
        core.load(BucketManifest(99, plan[1].entries, plan[1].nbytes), [])


def test_flush_refuses_while_requests_hold_kv(core: EngineCore) -> None:
    """Refused while a running request holds KV, unless it is held in place (kv="keep"): then the
    prefix cache is cleared and the request keeps its own KV."""
    rid = core.submit(PROMPT, 50)
    core.step()  # prefilled: the request now holds KV
    with pytest.raises(EngineError, match="flush_refused: 1 running requests hold KV"):
        core.flush()
    core.pause("in_place")  # frozen with its KV: the prefix cache goes, its own KV stays
    assert core.flush() == {"flushed_tokens": len(PROMPT), "kept_kv_requests": 1}
    assert core.running[0].kv is not None and core.cache.size == 0
    core.continue_generation()
    core.step()
    with pytest.raises(EngineError, match="flush_refused"):  # no longer held: refused again
        core.flush()
    core.pause("retract")  # KV dropped, request requeued: allowed
    assert core.flush()["flushed_tokens"] == 0
    core.continue_generation()
    run_all(core)
    assert core.result(rid)["num_retractions"] == 1
    assert len(core.result(rid)["output"]) == 50
    assert core.result(rid)["stale_kv_tokens"] == 0  # the epoch never changed: no stale KV


def test_pause_modes(core: EngineCore) -> None:
    trainer = TinyLlama(CFG, seed=0)
    a = core.submit(PROMPT, 40)
    core.step()
    assert core.pause("abort") == {"aborted": 1}
    assert core.result(a)["finish_reason"] == "abort" and len(core.result(a)["output"]) == 1
    core.continue_generation()

    b = core.submit(PROMPT, 20)
    core.step()
    core.step()
    assert core.pause("retract") == {"retracted": 1}
    assert not core.has_work()  # paused: nothing runs
    core.continue_generation()
    run_all(core)
    assert core.result(b)["output"] == greedy(trainer, PROMPT, 20)  # recomputed, same answer


def test_retracted_requests_finish_on_the_new_weights(core: EngineCore) -> None:
    new = perturbed(TinyLlama(CFG, seed=0), seed=7)
    rid = core.submit(PROMPT, 30)
    for _ in range(5):
        core.step()
    core.pause("retract")
    refit_directly(core, new)
    core.continue_generation()
    run_all(core)
    out = core.result(rid)
    assert out["weight_versions"][:5] == [0] * 5 and set(out["weight_versions"][5:]) == {1}
    assert out["stale_kv_tokens"] == 0
    assert out["output"][5:] == greedy(new, PROMPT + out["output"][:5], 25)


def test_memory_release_and_resume(core: EngineCore) -> None:
    core.release_memory(["weights", "kv_cache"])
    rid = core.submit(PROMPT, 2)
    assert not core.has_work()  # no weights: nothing runs
    with pytest.raises(EngineError, match="weights_released"):
        core.hf_state_dict()
    assert core.resume_memory(["weights"]) == {"weights_intact": False, "resumed": ["weights"]}
    assert core.info()["dirty"]  # zeros match no version
    assert all(float(t.abs().sum()) == 0.0 for t in core.hf_state_dict().values())
    core.resume_memory(["kv_cache"])
    run_all(core)
    assert core.result(rid)["finish_reason"] == "length"

    other = EngineCore(CFG, seed=0)
    before = other.hf_state_dict()
    other.release_memory(["weights"], cpu_backup=True)
    assert other.resume_memory(["weights"]) == {"weights_intact": True, "resumed": ["weights"]}
    assert all(torch.equal(before[k], v) for k, v in other.hf_state_dict().items())


def test_quarantined_engine_refuses_to_serve_until_a_complete_refit(core: EngineCore) -> None:
    rid = core.submit(PROMPT, 30)
    core.step()
    core.quarantine("test")
    assert core.result(rid)["finish_reason"] == "quarantined"
    with pytest.raises(EngineError, match="quarantined"):
        core.submit(PROMPT, 2)
    with pytest.raises(EngineError, match="quarantined"):
        core.continue_generation()
    new = perturbed(TinyLlama(CFG, seed=0), seed=8)
    refit_directly(core, new)
    core.continue_generation()
    assert generate(core, PROMPT)["output"] == greedy(new, PROMPT, 8)


def test_bad_requests_are_refused(core: EngineCore) -> None:
    with pytest.raises(EngineError, match="bad_request"):
        core.submit([], 3)
    with pytest.raises(EngineError, match="bad_request"):
        core.submit([CFG.vocab_size], 3)
    with pytest.raises(EngineError, match="max_seq_len"):
        core.submit(PROMPT, CFG.max_seq_len)
    with pytest.raises(EngineError, match="pause mode 'sleep'"):
        core.pause("sleep")
    with pytest.raises(EngineError, match="unknown memory tags"):
        core.release_memory(["cuda_graph_pool"])


def test_hosted_engine_settles_generations_outside_its_lock_and_closes_promptly() -> None:
    """HostedEngine (the TP=1 engine of a Ray engine actor): a generation's done-callback that
    calls the engine again (a rollout loop chaining its next prompt) must not deadlock it; close()
    during generation returns promptly and fails what is still running (found by an adversarial
    review: the callback ran under the engine's lock, and close waited for every generation)."""
    import threading

    from refit.errors import EngineDied
    from refit.reference.engine import EngineCore
    from refit.reference.server import HostedEngine

    from .conftest import CONFIG

    engine = HostedEngine(EngineCore(CONFIG, 0), "hosted")
    chained: list[dict] = []
    done = threading.Event()

    def next_prompt(fut) -> None:
        chained.append(engine.call("info"))  # calls the engine from the settling thread
        if len(chained) < 3:
            engine.call_async("generate", [1, 2, 3], 4).add_done_callback(next_prompt)
        else:
            done.set()

    engine.call_async("generate", [5, 6], 4).add_done_callback(next_prompt)
    assert done.wait(30), "a callback calling the engine deadlocked it"
    long = [engine.call_async("generate", [7] * 4, 200) for _ in range(20)]
    engine.close()  # not run to the end: they fail (run to the end, they would all be ok)
    for fut in long:
        assert isinstance(fut.exception(timeout=10), EngineDied)


def test_a_client_closed_from_several_threads_closes_its_pipe_once() -> None:
    """An emulated server's death closes its engine client on a thread while its restart closes it
    too: a second close of the same fd could close a new engine's freshly opened pipe (EBADF)."""
    import threading

    from refit.reference.client import await_ready, launch_process

    client = await_ready(launch_process("closing", ModelConfig(), seed=0))
    closes = []
    channel_close = client._channel.close

    def counted() -> None:
        closes.append(threading.current_thread().name)
        channel_close()

    client._channel.close = counted  # type: ignore[method-assign]
    start = threading.Barrier(4)

    def close() -> None:
        start.wait()
        client.close()

    threads = [threading.Thread(target=close) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(closes) == 1, closes
    assert client.process.poll() is not None  # the engine process is gone


def test_the_engines_audit_is_bounded_and_still_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived engine's audit record does not grow without bound: past twice `AUDIT_KEEP`
    records, those before a quiet point (a continue, no session open) are dropped behind one
    `truncated` record counting them; the engine-side invariants read what is left as a whole
    history, and still find a violation recorded after the cut."""
    from refit import invariants, protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.drivers.torch_source import TorchSource
    from refit.reference import engine as engine_module

    monkeypatch.setattr(engine_module, "AUDIT_KEEP", 40)
    engine = ReferenceEngine.in_thread("a0", CFG, seed=0)
    model = TinyLlama(CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(model), SharedMemoryTransport(), [engine], bucket_bytes=64 << 10)
    sizes = []
    try:
        for step in range(12):
            perturbed(model, seed=step)
            assert protocol.run(ctx).ok
            sizes.append(len(engine.audit()))
        records = engine.audit()
    finally:
        ctx.close()
        engine.close()
    per_refit = sizes[1] - sizes[0]
    assert (
        per_refit > 10 and max(sizes) < 80 + per_refit
    )  # bounded: never past twice the kept count by more than a refit
    head = records[0]
    assert head["op"] == "truncated" and head["dropped"] + len(records) - 1 == sizes[0] + 11 * per_refit
    assert records[1]["op"] == "continue_generation"
    assert invariants.check_engine_audit(records, engine="a0") == []
    loads = [i for i, r in enumerate(records) if r["op"] == "load"]
    forged = [r for i, r in enumerate(records) if r["op"] != "flush" or i > loads[-1]]  # every kept flush dropped
    assert any(v.invariant == "kv_fresh" for v in invariants.check_engine_audit(forged, engine="a0"))


def test_an_engine_processs_audit_spans_each_calls_whole_turn_on_its_thread() -> None:
    """An engine process stamps each audited call with when its thread read the request and when
    the answer left: the span generation waited for it (decoding the request and sending the
    answer included), around the handler's own start and end."""
    from refit import protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.drivers.torch_source import TorchSource

    engine = ReferenceEngine.spawn("s0", CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(TinyLlama(CFG, seed=1)), SharedMemoryTransport(), [engine])
    try:
        assert protocol.run(ctx).ok
        records = [r for r in engine.audit() if "start" in r]
    finally:
        ctx.close()
        engine.close()
    assert {"begin", "load", "finalize", "publish"} <= {r["op"] for r in records}
    for r in records:  # (a batch of steps: each from the end of the one before; the last one's answer)
        assert r["received"] <= r["start"] <= r["t"] <= r.get("answered", r["t"]), r
    assert {"probe", "begin", "verify", "continue_generation"} <= {r["op"] for r in records if "answered" in r}


def test_a_trainer_model_the_engine_was_not_started_with_is_refused_naming_from_hf() -> None:
    """README's first snippet starts engines with no config (the reference TinyLlama). A trainer
    whose model differs is refused before any byte, and the error says what the engine holds and
    how to start it for the trainer's model (`ModelConfig.from_hf`)."""
    from refit import protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.drivers.torch_source import TorchSource

    other = ModelConfig(hidden_size=32, num_heads=2, num_kv_heads=1, intermediate_size=64, num_layers=3)
    engine = ReferenceEngine.in_thread("e0", CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(TinyLlama(other, seed=0)), SharedMemoryTransport(), [engine])
    try:
        result = protocol.run(ctx)
    finally:
        ctx.close()
        engine.close()
    assert not result.ok and result.bytes_moved == 0
    text = str(result.error)
    assert "the trainer's model does not fit this engine's (llama: 2 layers, hidden 64, vocab" in text, text
    assert "ModelConfig.from_hf(model.config)" in text and "shape" in text


def _one_refit(config: ModelConfig, source: object) -> object:
    """One shared-memory refit from `source` into a fresh in-thread engine serving `config`."""
    from refit import protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport

    engine = ReferenceEngine.in_thread("e0", config, seed=0)
    ctx = protocol.RefitContext(source, SharedMemoryTransport(), [engine])
    try:
        return protocol.run(ctx)
    finally:
        ctx.close()
        engine.close()


def test_a_trainer_in_another_dtype_is_refused_naming_the_cast_that_fixes_it() -> None:
    """fp32 master weights into engines started from a bf16 config (`from_hf` takes the config's
    dtype, not the parameters'): refused before any byte, naming `TorchSource(dtype=...)`; with
    that cast the same refit goes through."""
    import dataclasses

    from refit.drivers.torch_source import TorchSource

    bf16 = dataclasses.replace(CFG, dtype="bfloat16")
    model = TinyLlama(CFG, seed=0)  # float32
    result = _one_refit(bf16, TorchSource(model))
    assert not result.ok and result.bytes_moved == 0
    text = str(result.error)
    assert "the trainer sends another dtype than this engine serves (bfloat16)" in text, text
    assert "TorchSource(model, dtype=torch.bfloat16)" in text and "dtype float32 != model bfloat16" in text
    assert _one_refit(bf16, TorchSource(model, dtype=torch.bfloat16)).ok


def test_a_wrapped_models_prefixed_names_are_refused_naming_the_rename_that_fixes_them() -> None:
    """A trainer module holding the model under an attribute ("policy.model.layers...") sends the
    right tensors under prefixed names: the error says so and names `TorchSource(rename=...)`
    (it pointed at ModelConfig.from_hf, which does not help); with the rename the refit goes through."""
    from refit.drivers.torch_source import TorchSource

    wrapper = torch.nn.Module()
    wrapper.policy = TinyLlama(CFG, seed=0)
    result = _one_refit(CFG, TorchSource(wrapper))
    assert not result.ok and result.bytes_moved == 0
    text = str(result.error)
    assert "carry a prefix ('policy.')" in text and "rename=lambda n: n.removeprefix('policy.')" in text, text
    assert _one_refit(CFG, TorchSource(wrapper, rename=lambda n: n.removeprefix("policy."))).ok
