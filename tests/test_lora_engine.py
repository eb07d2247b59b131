"""LoRA adapters in the reference engine, with `transformers` + PEFT as the oracle: a tiny HF model
wrapped by PEFT (random A and B, so the update is not zero) gives the logits and greedy tokens the
engine must give under that adapter, unmerged, and the merged model (`merge_and_unload`) the same
within tolerance. Then the version lifecycle: requests pinned to a version keep it while a newer
one loads and publishes, a retired version is freed once its last request finishes, at most
`max_live` versions serve, and what is not an adapter of the spec is refused by name."""

from __future__ import annotations

import re
import time
from typing import Any

import peft
import pytest
import torch

from refit.buckets import TensorMeta, plan_buckets
from refit.errors import EngineError
from refit.invariants.adapters import adapter_records, check_adapter_moves, check_adapter_served
from refit.reference.engine import EngineCore
from refit.reference.lora import LORA_TARGETS, LoraSpec
from refit.reference.model import ModelConfig

from .test_model_families import PROMPTS, hf_greedy, hf_logits, hf_model, logit_tolerance

ALL = list(LORA_TARGETS)


def _engine(model: Any, **kwargs: Any) -> EngineCore:
    """An engine serving the HF model's weights, loaded by hand (begin, load, finalize, publish);
    a model PEFT wrapped in place gives its base weights."""
    core = EngineCore(ModelConfig.from_hf(model.config), seed=0, **kwargs)
    sd = {
        n.replace(".base_layer.", "."): t.detach().clone() for n, t in model.state_dict().items() if ".lora_" not in n
    }
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in sd.items()], 64 << 10)
    core.pause("abort")
    core.begin(plan)
    for m in plan:
        core.load(m, [(n, sd[n]) for n in m.names])
    core.finalize()
    core.publish(1)
    core.continue_generation()
    return core


def _peft(model: Any, r: int = 8, alpha: float = 16, targets: list[str] = ALL, seed: int = 5, **kw: Any) -> Any:
    """`model` wrapped by PEFT with random A and B (PEFT's default B is zero: no update to see)."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False, **kw)  # fmt: skip
    return peft.get_peft_model(model, config).eval()


def _adapter(pm: Any) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in peft.get_peft_model_state_dict(pm).items()]


def _load(core: EngineCore, name: str, version: int, pm: Any, **kw: Any) -> None:
    core.stage_adapter(name, version, pm.peft_config["default"], **kw)
    core.load_adapter(name, _adapter(pm))
    core.publish_adapter(name)


def _run(core: EngineCore, prompt: list[int], n: int, adapter: str | None = None) -> dict[str, Any]:
    rid = core.submit(prompt, n, adapter=adapter)
    while core.has_work():
        core.step()
    return core.result(rid)


@pytest.mark.parametrize(
    ("family", "dtype", "targets", "rslora"),
    [
        ("llama", torch.float32, ALL, False),
        ("qwen2", torch.float32, ["q_proj", "v_proj"], True),  # fused q/k/v with k untouched; rsLoRA's scale
        ("qwen2", torch.bfloat16, ALL, False),  # PEFT keeps bf16 adapters in float32 (autocast_adapter_dtype)
        ("llama", torch.float32, ["gate_proj", "down_proj"], False),
    ],
    ids=["llama-fp32-all", "qwen2-fp32-qv-rslora", "qwen2-bf16-all", "llama-fp32-gate-down"],
)
def test_the_engine_under_an_adapter_gives_what_transformers_and_peft_give(
    family: str, dtype: torch.dtype, targets: list[str], rslora: bool
) -> None:
    model = hf_model(family, dtype, seed=1, attention_bias=False)
    core = _engine(model, batch_decode=True)
    base = {i: hf_logits(model, p) for i, p in enumerate(PROMPTS[:6])}
    pm = _peft(model, targets=targets, use_rslora=rslora)
    adapter = _adapter(pm)
    assert {t.dtype for _, t in adapter} == {torch.float32}  # PEFT's own choice, kept as sent
    core.stage_adapter("tuned", 1, pm.peft_config["default"], dtype="float32")
    core.load_adapter("tuned", adapter)
    core.publish_adapter("tuned")
    merged = pm.merge_and_unload() if dtype == torch.float32 else None  # (bf16 merge rounds the sum in bf16)
    for i, prompt in enumerate(PROMPTS[:6]):
        with torch.no_grad():
            want = pm(torch.tensor([prompt])).logits[0].float() if merged is None else None
        if merged is not None:
            want = hf_logits(merged, prompt)
        got = core.score(prompt, adapter="tuned").float()
        tol = logit_tolerance(dtype, want)
        assert (got - want).abs().max() <= tol, (i, float((got - want).abs().max()), tol)
        assert (want - base[i]).abs().max() > 5 * tol  # the adapter changes the logits: the check could fail
        assert (core.score(prompt).float() - base[i]).abs().max() <= tol  # no adapter named: the base model
    oracle = merged if merged is not None else pm
    for prompt in PROMPTS[:6]:  # greedy decoding through the engine's scheduler, batched, cache and all
        want_tokens, gap = hf_greedy(oracle, prompt, 6)
        out = _run(core, prompt, 6, adapter="tuned")
        assert out["adapter"] == "tuned" and out["adapter_version"] == 1
        if gap > 4 * logit_tolerance(dtype, torch.ones(1) * 8):
            assert out["output"] == want_tokens, prompt


def test_unmerged_equals_peft_bit_for_bit_on_one_rank_in_fp32() -> None:
    """The engine's update is PEFT's computation (x cast to the adapter's dtype, A then B, times
    the scale, added to the base output), so in fp32 on one rank the logits are equal exactly."""
    model = hf_model("llama", torch.float32, seed=2)
    core = _engine(model)
    pm = _peft(model, r=4, alpha=32)
    _load(core, "a", 1, pm)
    for prompt in PROMPTS[:4]:
        with torch.no_grad():
            want = pm(torch.tensor([prompt])).logits[0]
        assert torch.equal(core.score(prompt, adapter="a"), want)


def test_a_request_keeps_its_version_while_a_newer_one_loads_and_publishes() -> None:
    model = hf_model("llama", torch.float32, seed=3)
    core = _engine(model, batch_decode=True, max_running=4)
    pm1 = _peft(model, seed=1)
    spec = pm1.peft_config["default"]
    v1 = _adapter(pm1)
    v2 = [(n, t + 0.3 * torch.randn(t.shape, generator=torch.Generator().manual_seed(9))) for n, t in v1]
    core.stage_adapter("policy", 1, spec, max_live=2)
    core.load_adapter("policy", v1)
    core.publish_adapter("policy")
    prompt = [5, 6, 7, 8]
    old = core.submit(prompt, 24, adapter="policy")
    for _ in range(4):
        core.step()
    # version 2 stages, loads in two buckets and publishes while `old` decodes between the steps
    core.stage_adapter("policy", 2, spec)
    core.load_adapter("policy", v2[: len(v2) // 2])
    core.step()
    core.load_adapter("policy", v2[len(v2) // 2 :])
    core.step()
    core.publish_adapter("policy")
    new = core.submit(prompt, 24, adapter="policy")
    nbytes = sum(t.numel() * t.element_size() for _, t in v1)
    assert core.info()["adapters"]["policy"]["1"] == {"state": "RETIRED", "pinned": 1, "bytes": nbytes}
    while core.has_work():
        core.step()
    a, b = core.result(old), core.result(new)
    assert (a["adapter_version"], b["adapter_version"]) == (1, 2)
    assert a["finish_reason"] == b["finish_reason"] == "length"
    # each equals a fresh engine serving only its version, and the two differ
    for out, weights in ((a, v1), (b, v2)):
        fresh = _engine(model)
        fresh.stage_adapter("policy", 1, spec)
        fresh.load_adapter("policy", weights)
        fresh.publish_adapter("policy")
        assert _run(fresh, prompt, 24, adapter="policy")["output"] == out["output"]
    assert a["output"] != b["output"]
    # version 1 was freed when `old` finished; its moves are in the engine's audit, in order
    assert list(core.info()["adapters"]["policy"]) == ["2"]
    moves = [(r["adapter_version"], r["event"]) for r in core.audit if r["op"] == "adapter"]
    assert moves == [(1, "stage"), (1, "complete"), (1, "publish"), (2, "stage"), (2, "complete"),
                     (1, "supersede"), (2, "publish"), (1, "unload")]  # fmt: skip
    unload = next(r for r in core.audit if r["op"] == "adapter" and r["event"] == "unload")
    assert unload["seq"] > a["token_seqs"][-1]  # freed after its last token, not before


def test_at_most_max_live_versions_serve_and_a_publish_waits_for_the_oldest_to_drain() -> None:
    model = hf_model("llama", torch.float32, seed=4)
    core = _engine(model, max_running=4)
    pm = _peft(model, seed=1)
    spec, weights = pm.peft_config["default"], _adapter(pm)
    _load(core, "p", 1, pm, max_live=2)
    pinned = core.submit([1, 2, 3], 40, adapter="p")
    core.step()
    _load(core, "p", 2, pm, max_live=2)  # 2 live: version 1 (retired, 1 request) and version 2
    assert sorted(core.info()["adapters"]["p"]) == ["1", "2"]
    core.stage_adapter("p", 3, spec, max_live=2)  # staging is not serving: allowed beside them
    core.load_adapter("p", weights)
    core.lora.complete("p")
    assert core.lora.drain("p") == {"ready": False, "pinned": 1, "going": [1]}
    with pytest.raises(EngineError, match=r"more than 2 versions live; version 1 still has 1 requests") as info:
        core.lora.publish("p")
    assert info.value.kind == "busy" and info.value.no_effect
    late = core.submit([4, 5], 4, adapter="p")  # the live version (2) is not going: new requests are admitted
    while core.has_work():
        core.step()
    assert core.result(pinned)["adapter_version"] == 1 and core.result(pinned)["finish_reason"] == "length"
    assert core.result(late)["adapter_version"] == 2
    assert core.lora.drain("p")["ready"]  # the oldest drained (freed at its last token)
    core.lora.publish("p")
    assert sorted(core.info()["adapters"]["p"]) == ["3"]  # version 2, retired with no request, freed at once


def test_with_one_live_version_new_requests_wait_unpinned_until_the_publish() -> None:
    """max_live 1 (max_staleness 0): the version to go is the live one, so while it drains new
    requests naming the adapter wait (never pinned to it), then run under the new version."""
    model = hf_model("llama", torch.float32, seed=8)
    core = _engine(model, max_running=4)
    pm = _peft(model, seed=1)
    spec, weights = pm.peft_config["default"], _adapter(pm)
    _load(core, "p", 1, pm, max_live=1)
    old = core.submit([1, 2, 3], 10, adapter="p")
    core.step()
    core.stage_adapter("p", 2, spec, max_live=1)
    core.load_adapter("p", weights)
    core.lora.complete("p")
    assert core.lora.drain("p")["ready"] is False
    new = core.submit([1, 2, 3], 4, adapter="p")
    base = core.submit([1, 2, 3], 4)  # the base model and other adapters are not held
    while core.has_work():
        core.step()
    assert core.result(old)["finish_reason"] == "length" and core.result(base)["finish_reason"] == "length"
    assert core.result(new)["finish_reason"] is None and not core.has_work()  # waiting, unpinned
    assert core.lora.drain("p") == {"ready": True, "pinned": 0, "going": [1]}
    core.lora.publish("p")
    while core.has_work():
        core.step()
    assert core.result(new)["adapter_version"] == 2 and core.result(new)["finish_reason"] == "length"
    assert list(core.info()["adapters"]["p"]) == ["2"]


def test_the_prefix_cache_is_kept_per_adapter_version() -> None:
    """KV computed under the base model (or another version) is never read under an adapter."""
    model = hf_model("llama", torch.float32, seed=5)
    core = _engine(model)
    pm = _peft(model)
    _load(core, "a", 1, pm)
    prompt = list(range(20, 40))
    _run(core, prompt, 2)  # caches the prompt's KV under the base weights
    first = _run(core, prompt, 4, adapter="a")
    again = _run(core, prompt, 4, adapter="a")
    assert first["cached_tokens"] == 0 and again["cached_tokens"] == len(prompt) - 1
    assert first["output"] == again["output"] == hf_greedy(pm, prompt, 4)[0]
    assert core.flush()["flushed_tokens"] == 2 * len(prompt)


def test_what_is_not_an_adapter_of_its_spec_is_refused_by_name() -> None:
    model = hf_model("llama", torch.float32, seed=6)
    core = _engine(model)
    pm = _peft(model, targets=["q_proj", "v_proj"])
    spec, weights = pm.peft_config["default"], _adapter(pm)
    name0, t0 = weights[0]
    with pytest.raises(EngineError, match="not loaded"):
        core.submit([1, 2], 2, adapter="nope")
    core.stage_adapter("a", 1, spec)
    with pytest.raises(EngineError, match=r"has shape \(8, 65\), expected \(8, 64\)"):
        core.load_adapter("a", [(name0, torch.zeros(8, 65))])
    with pytest.raises(EngineError, match=re.escape("is torch.float16, expected torch.float32")):
        core.load_adapter("a", [(name0, t0.half())])
    k_name = name0.replace("q_proj", "k_proj")  # a projection the spec does not target
    with pytest.raises(EngineError, match=re.escape(f"{k_name!r} is not a tensor of its spec")):
        core.load_adapter("a", [(k_name, t0)])
    core.load_adapter("a", weights[:-1])
    with pytest.raises(EngineError, match=r"1 tensors never landed \(.*v_proj.lora_B.weight") as info:
        core.publish_adapter("a")
    assert info.value.kind == "incomplete" and core.info()["adapters"]["a"]["1"]["state"] == "STAGING"
    core.discard_adapter("a")
    assert core.info()["adapters"] == {}
    with pytest.raises(EngineError, match="use_dora=True"):
        core.stage_adapter("d", 1, {**spec.to_dict(), "use_dora": True})
    with pytest.raises(EngineError, match="embed_tokens"):
        core.stage_adapter("e", 1, {"r": 4, "lora_alpha": 8, "target_modules": ["embed_tokens"]})
    _load(core, "a", 2, pm)
    with pytest.raises(EngineError, match="version 2: not newer than the live version 2"):
        core.stage_adapter("a", 2, spec)
    assert LoraSpec.from_dict(spec).scale == 16 / 8


def test_the_adapter_invariants_pass_a_real_history_and_name_each_tampering() -> None:
    model = hf_model("llama", torch.float32, seed=7)
    core = _engine(model, batch_decode=True, max_running=4)
    pm = _peft(model, seed=1)
    spec, weights = pm.peft_config["default"], _adapter(pm)
    rids = []
    for version in range(1, 6):
        core.stage_adapter("p", version, spec, max_live=2)
        core.load_adapter("p", weights)
        core.publish_adapter("p")
        rids.append(core.submit([version, 2, 3], 6, adapter="p"))
        for _ in range(3):
            core.step()
    while core.has_work():
        core.step()
    records = adapter_records(core.audit)
    requests = [core.result(r) for r in rids]
    assert [r["adapter_version"] for r in requests] == [1, 2, 3, 4, 5]
    assert check_adapter_moves(records) == [] and check_adapter_served(records, requests) == []

    def names(violations: list[Any]) -> list[str]:
        return [f"{v.invariant}: {v.message}" for v in violations]

    no_complete = [r for r in records if not (r["event"] == "complete" and r["adapter_version"] == 3)]
    assert any("p v3: publish before its load was complete" in m for m in names(check_adapter_moves(no_complete)))
    no_unload = [r for r in records if not (r["event"] == "unload" and r["adapter_version"] == 1)]
    assert any(
        "adapter_live: engine engine: p: 3 versions servable" in m for m in names(check_adapter_moves(no_unload))
    )
    late = [{**requests[0], "token_seqs": [*requests[0]["token_seqs"][:-1], 10_000]}]
    assert any("under p v1, unloaded at" in m for m in names(check_adapter_served(records, late)))
    early = [{**requests[2], "token_seqs": [0, *requests[2]["token_seqs"][1:]]}]
    assert any("token at 0 under p v3, published at" in m for m in names(check_adapter_served(records, early)))


def test_a_request_arriving_between_drain_and_publish_waits_for_the_new_version() -> None:
    """max_live 1, the live version idle: drain answers ready and from then on holds new requests
    for the adapter, so one arriving before the publish is not pinned to the going version (which
    would make the publish refuse "busy" on a healthy engine)."""
    model = hf_model("llama", torch.float32, seed=9)
    core = _engine(model, max_running=4)
    pm = _peft(model, seed=1)
    spec, weights = pm.peft_config["default"], _adapter(pm)
    _load(core, "p", 1, pm, max_live=1)
    core.stage_adapter("p", 2, spec, max_live=1)
    core.load_adapter("p", weights)
    core.lora.complete("p")
    assert core.lora.drain("p")["ready"] is True
    late = core.submit([1, 2, 3], 4, adapter="p")
    core.step()
    assert core.result(late)["output"] == [] and core.info()["adapters"]["p"]["1"]["pinned"] == 0
    core.lora.publish("p")  # not busy
    while core.has_work():
        core.step()
    assert core.result(late)["adapter_version"] == 2


def test_each_adapter_has_its_own_bound_and_each_stage_sets_it() -> None:
    model = hf_model("llama", torch.float32, seed=10)
    core = _engine(model, max_running=4)
    pm = _peft(model, seed=1)
    _load(core, "a", 1, pm, max_live=1)
    _load(core, "b", 1, pm, max_live=3)
    assert core.lora.max_live == {"a": 1, "b": 3}
    pinned = core.submit([1, 2, 3], 30, adapter="a")
    core.step()
    _load(core, "a", 2, pm)  # no bound now (max_staleness None): publishing beside a pinned version is fine
    assert core.lora.max_live["a"] is None and sorted(core.info()["adapters"]["a"]) == ["1", "2"]
    while core.has_work():
        core.step()
    assert core.result(pinned)["adapter_version"] == 1 and list(core.info()["adapters"]["a"]) == ["2"]


def test_a_lora_refit_refuses_an_engine_whose_base_weights_are_no_versions() -> None:
    """A full refit cut off mid-bucket leaves the base weights mixed (dirty), or a quarantine: an
    adapter cannot bring such an engine into service, so its LoRA session is refused, changing nothing."""
    model = hf_model("llama", torch.float32, seed=11)
    core = _engine(model)
    pm = _peft(model)
    spec = {**pm.peft_config["default"].to_dict(), "name": "p", "version": 1}
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in _adapter(pm)], 1 << 20)
    core.dirty = True
    with pytest.raises(EngineError, match="base weights match no version; a full refit first") as info:
        core.begin(plan, None, True, spec)
    assert info.value.kind == "not_serving" and info.value.no_effect and core.session is None
    assert core.probe(1, "p")["serving"] is False
    core.dirty = False
    core.quarantine("a failed full refit")
    with pytest.raises(EngineError, match=r"are quarantined \(a failed full refit\)"):
        core.begin(plan, None, True, spec)


def test_a_draining_hold_nothing_follows_up_lapses_by_itself() -> None:
    """max_staleness 0: the run drains (new requests for the adapter held), runs out of time, and
    its cleanup's discard never reaches the engine: the held requests wait only for the hold the
    drain asked for (the run's time left and its grace), then run on the live version; the engine's
    loop wakes for it unasked."""
    import time

    from refit import protocol
    from refit.drivers.lora_source import LoraSource
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport
    from refit.protocol.faults import FaultPlan
    from refit.reference.client import start_thread
    from refit.reference.model import TinyLlama

    class Slow(EngineCore):  # 10 ms a decode step: the long requests outlast the run's deadline
        def step(self, go: bool | None = None) -> None:
            time.sleep(0.01)
            super().step(go)

    engine = ReferenceEngine(start_thread("e0", ModelConfig(), 0, core=Slow, max_running=2))
    pm = _peft(TinyLlama(ModelConfig(), seed=0))
    ctx = protocol.RefitContext(
        LoraSource(pm, name="p"), SharedMemoryTransport(), [engine], max_staleness=0, deadline_s=1.0,
        cleanup_grace_s=4.0,
    )  # fmt: skip
    try:
        protocol.run(ctx).raise_for_error()
        longs = [engine.submit([1, 2, 3], 100, adapter="p") for _ in range(2)]  # pinned to v1 past the deadline
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_" in n:
                    p.add_(0.1)
        ctx.faults = FaultPlan().fail_at("aborting", engine=0, call="discard", kind="raise")
        result = protocol.run(ctx)
        assert not result.ok and result.engines["e0"].status == "failed"
        assert "p" in engine.info()["adapters_held"]  # held for the drain, and nothing lifted it
        waiting = engine.submit([4, 5, 6], 3, adapter="p")
        assert all(f.result(timeout=30)["finish_reason"] == "length" for f in longs)  # then the engine is idle
        assert waiting.result(timeout=15)["adapter_version"] == 1  # the hold lapsed, and the idle engine woke for it
    finally:
        ctx.close()
        engine.close()


def _session_parts() -> tuple[Any, EngineCore, Any, list[tuple[str, torch.Tensor]], Any, dict[int, Any]]:
    """An engine serving a tiny llama, a PEFT adapter of it (spec, tensors), its plan in 16 KiB
    buckets and the trainer's tensors as one list per bucket (a receiver's stable views)."""
    model = hf_model("llama", torch.float32, seed=7)
    core = _engine(model)
    pm = _peft(model, seed=2)
    weights = _adapter(pm)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in weights], 16 << 10)
    by_name = dict(weights)
    lists = {m.index: [(n, by_name[n]) for n in m.names] for m in plan}
    return model, core, pm.peft_config["default"], weights, plan, lists


def _refit(core: EngineCore, plan: Any, tensors: dict[str, list[tuple[str, torch.Tensor]]], adapter: dict[str, Any],
           digest: str | None = "wsum") -> dict[str, Any]:  # fmt: skip
    """A LoRA refit's engine calls (what the reference driver sends): stage, load each bucket (the
    same lists each time: a receiver's stable views), finalize, verify, publish."""
    core.begin(plan, digest, adapter=adapter)
    for m in plan:
        core.load(m, tensors[m.index], keep=True)
    core.finalize()
    report = core.verify("wsum")
    core.publish(adapter["version"])
    return report


def test_a_lora_session_hashes_what_it_writes_and_each_new_version_reuses_a_freed_versions_memory() -> None:
    from refit.verify import Digests

    model, core, spec, weights, plan, lists = _session_parts()
    assert len(plan) > 1
    adapter = {"name": "p", **LoraSpec.from_dict(spec).to_dict(), "max_live": 1}
    slabs = []
    for version in range(1, 5):
        with torch.no_grad():
            for _, t in weights:  # a training step, in place: the same tensors, new bytes
                t.mul_(-1.5)
        report = _refit(core, plan, lists, {**adapter, "version": version})
        want = Digests("wsum")
        for n, t in weights:
            want.add(n, t)
        # every tensor hashed as the loads copied it (nothing read back), equal to the trainer's bytes
        assert report["digests"] == want.results() and report["read_back"] == 0
        slab = core.lora.live("p").slab
        slabs.append(slab)
        rid = core.submit([3, 4, 5], 6, adapter="p")
        while core.has_work():
            core.step()
        fresh = _engine(model)  # the version as a fresh engine serves it, loaded by hand
        fresh.stage_adapter("p", 1, spec)
        fresh.load_adapter("p", [(n, t.clone()) for n, t in weights])
        fresh.publish_adapter("p")
        assert core.result(rid)["output"] == _run(fresh, [3, 4, 5], 6, adapter="p")["output"]
    # max_live 1: each publish frees the version before it, and the next one stages into its memory
    assert slabs[0] is slabs[2] and slabs[1] is slabs[3] and slabs[0] is not slabs[1]
    assert core.lora.pooled_bytes() == slabs[0].flat.numel() * 4 and len(core.info()["adapters"]["p"]) == 1
    # a recycled slab holds an old version's bytes: a version missing one tensor is refused, never served
    core.begin(plan, "wsum", adapter={**adapter, "version": 5})
    for m in plan[:-1]:
        core.load(m, lists[m.index], keep=True)
    with pytest.raises(EngineError, match="missing") as info:
        core.finalize()
    assert info.value.kind == "incomplete" and list(core.info()["adapters"]["p"]) == ["4"]
    # digests from memory (no hashing session) equal the hashed ones
    assert _refit(core, plan, lists, {**adapter, "version": 6}, digest=None)["digests"] == want.results()
    # the kept copy plans hold the receiver's views: a receiver going away (`forget_kept`) drops them all
    slabs = [core.lora.live("p").slab, *[s for free in core.lora._free.values() for s in free]]
    assert any(s.plans for s in slabs)
    core.forget_kept()
    assert not any(s.plans for s in slabs)


def test_a_bounded_adapter_reserves_its_versions_memory_once_and_a_kept_plan_is_checked_once() -> None:
    """The first version of a spec with max_live = 2 reserves two more slabs: every later version
    stages into one of those three (no allocation on the serving thread after the first refit).
    A plan is checked whole once: the same manifest objects again (what the wire's memo hands
    back) are not re-checked, but another plan, or the same plan for another spec, is."""
    from refit.verify import Digests

    model, core, spec, weights, plan, lists = _session_parts()
    by_name = dict(weights)
    adapter = {"name": "p", **LoraSpec.from_dict(spec).to_dict(), "max_live": 2}
    checks = []
    real = core._check_adapter_plan
    core._check_adapter_plan = lambda p, staged: (checks.append(len(p)), real(p, staged))[1]  # counts its calls
    slabs = set()
    for version in range(1, 7):
        with torch.no_grad():
            for _, t in weights:  # a training step, in place
                t.mul_(-1.5)
        report = _refit(core, plan, lists, {**adapter, "version": version})
        want = Digests("wsum")
        for n, t in weights:
            want.add(n, t)
        assert report["digests"] == want.results() and report["read_back"] == 0  # hashed as copied, right
        slabs.add(id(core.lora.live("p").slab))
        if version == 1:  # two more reserved, written once (zeros) so first copies into them cost no more
            pooled = core.lora._free[next(iter(core.lora._free))]
            first = {id(core.lora.live("p").slab)} | {id(s) for s in pooled}
            assert core.lora.pooled_bytes() == 2 * core.lora.live("p").nbytes
            assert all(not s.flat.any() for s in pooled)
            # and the copies of these very bucket lists into them already checked and planned
            assert all(id(lists[m.index]) in s.plans for s in pooled for m in plan)
    assert len(first) == 3 and slabs <= first  # max_live + 1 slabs in all, none allocated after the first refit
    assert checks == [len(plan)]  # the same manifests: checked the first time only
    again = plan_buckets([TensorMeta.of(n, t) for n, t in weights], 16 << 10)  # equal, but other objects
    _refit(core, again, {m.index: [(n, by_name[n]) for n in m.names] for m in again}, {**adapter, "version": 7})
    assert checks == [len(plan), len(again)]
    # the same manifests for a spec of another rank: checked, and refused naming a tensor
    other = {**adapter, "version": 8, "r": 4}
    with pytest.raises(EngineError, match="lora_A") as info:
        core.begin(again, "wsum", adapter=other)
    assert info.value.kind == "bad_manifest" and len(checks) == 3 and core.lora.staged("p") is None
    # no bound: nothing reserved
    fresh = _engine(model)
    fresh.begin(plan, "wsum", adapter={**adapter, "version": 1, "max_live": None})
    assert fresh.lora.pooled_bytes() == 0


def test_versions_freed_two_at_a_time_keep_their_memory_for_the_next_stages() -> None:
    """max_live 2 with requests pinned to each version: two versions may be freed between two
    stages (a retired one's last request ends, then a publish unloads another) and none between
    the next two. Every freed slab is kept for the stages to come, so a version never stages into
    memory allocated on the serving thread after the first refit: three slabs in all (a freed slab
    beyond the first kept was dropped, and a later stage allocated one, before)."""
    _model, core, spec, _weights, plan, lists = _session_parts()
    adapter = {"name": "p", **LoraSpec.from_dict(spec).to_dict(), "max_live": 2}

    def until_done(rid: int) -> None:
        while core.result(rid)["finish_reason"] is None:
            core.step()

    _refit(core, plan, lists, {**adapter, "version": 1})
    first = {id(core.lora.live("p").slab)} | {id(s) for free in core.lora._free.values() for s in free}
    a = core.submit([3, 4, 5], 4, adapter="p")  # on version 1
    core.step()
    _refit(core, plan, lists, {**adapter, "version": 2})
    b = core.submit([3, 4, 5], 30, adapter="p")  # on version 2
    core.step()
    until_done(a)  # version 1 (retired) freed
    _refit(core, plan, lists, {**adapter, "version": 3})
    c = core.submit([3, 4, 5], 30, adapter="p")  # on version 3; version 2 retired, still serving b
    core.step()
    core.begin(plan, "wsum", adapter={**adapter, "version": 4})  # stages while 2 and 3 both serve
    staged = core.lora.staged("p")
    assert staged is not None and id(staged.slab) in first, "a fourth slab, allocated on the serving thread"
    for m in plan:
        core.load(m, lists[m.index], keep=True)
    core.finalize()
    until_done(b)  # version 2 drains: version 4 may go live within 2
    core.publish(4)
    until_done(c)
    assert core.result(b)["adapter_version"] == 2 and core.result(c)["adapter_version"] == 3
    assert sorted(core.info()["adapters"]["p"]) == ["4"]


def test_adapter_moves_are_kept_until_acknowledged_and_acks_cannot_drop_unreported_ones() -> None:
    """`AdapterTable.ack` (the driver's acknowledgement of the last move it handed to the run): the
    moves after it are reported again; an ack of another epoch (nothing recorded of this table
    yet, or a replaced engine's) has every kept move reported again; an ack past the last move
    reported drops none that no answer carried; a malformed ack is a bad request."""
    model = hf_model("llama", torch.float32, seed=7)
    core = _engine(model)
    pm = _peft(model, seed=2)

    def numbers(moves: list[dict[str, Any]]) -> list[int]:
        return [m["n"] for m in moves]

    _load(core, "p", 1, pm)  # stage, complete, publish: moves 1..3
    epoch = core.lora.epoch
    assert numbers(core.lora.report()) == [1, 2, 3] and core.lora.report() == []
    core.ack_moves(("", 0))  # a caller that has recorded nothing of this table: all again
    assert numbers(core.lora.report()) == [1, 2, 3]
    core.ack_moves((epoch, 1))  # it recorded move 1: 2 and 3 again
    assert numbers(core.lora.report()) == [2, 3]
    _load(core, "p", 2, pm)  # moves 4.. not reported yet
    core.ack_moves((epoch, 10**6))  # it cannot have recorded more than was reported (3)
    assert numbers(core.lora.report())[0] == 4
    core.ack_moves(("another-engine", 99))
    assert numbers(core.lora.report())[0] == 4  # 1..3 were dropped by the ack of 3 above
    for bad in (("x", float("inf")), ("x", "nope"), ("x",), 7):
        with pytest.raises(EngineError) as info:
            core.ack_moves(bad)
        assert info.value.kind == "bad_request"


def test_a_parked_drains_hold_counts_from_its_first_look() -> None:
    """max_live 1: the version to go is the live one, so the drain holds new requests naming the
    adapter for `hold_s` at most. Parked (a request still on the live version) and looked at again
    after it ends, the drain answers ready and its hold still ends `hold_s` after the first look:
    the second look does not start the hold again (a caller that never follows up is not held
    past what it asked)."""
    from refit.reference.server import EngineServer, Parked, encode

    _model, core, spec, _weights, plan, lists = _session_parts()
    adapter = {"name": "p", **LoraSpec.from_dict(spec).to_dict(), "max_live": 1}
    _refit(core, plan, lists, {**adapter, "version": 1})
    rid = core.submit([3, 4, 5], 20, adapter="p")
    core.step()
    core.begin(plan, "wsum", adapter={**adapter, "version": 2})
    for m in plan:
        core.load(m, lists[m.index], keep=True)
    core.finalize()
    server = EngineServer(core, "e", in_process=True)
    server.parks = True
    parked = server.dispatch("steps", encode(([("drain", (2.0,))], 30.0, None), {}))
    assert isinstance(parked, Parked)
    first = core.lora.draining["p"]  # the hold the first look set
    time.sleep(0.3)
    while core.result(rid)["finish_reason"] is None:
        core.step()
    assert core.drained()
    out = server.resume(parked)
    assert out[0][0] is True and out[0][1]["ready"] is True and out[0][2] >= 0.3  # the call's time: its wait too
    assert abs(core.lora.draining["p"] - first) < 0.05  # not 0.3 s (and more) later
    assert len([r for r in core.audit if r.get("op") == "drain"]) == 2  # two looks on the engine's record
