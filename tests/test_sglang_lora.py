"""LoRA refits into SGLang 0.5.23: the driver (`refit.drivers.sglang`, `refit.drivers.sglang_lora`)
against the emulated scheduler behind SGLang's own HTTP app, tokenizer-side LoRA code and
registry (tests/sglang_app.py: `TokenizerControlMixin`'s load, load-from-tensors and unload,
`TokenizerManager`'s per-request resolution, `LoRARegistry`'s counters). The oracle for what is
served is transformers + PEFT with the same adapter."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
import torch

from refit import invariants, protocol
from refit.errors import ConfigError
from refit.reference.model import ModelConfig, TinyLlama
from refit.testing import check_lora_driver
from refit.testing.sglang_server import EmulatedSGLangEngine

from .sglang_app import SGLangAppServer

pytestmark = pytest.mark.e2e
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA = {"max_lora_rank": 8, "lora_target_modules": TARGETS}
PROMPT = [1, 2, 3, 4]


def _peft(r: int = 4, **kw: Any) -> Any:
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=kw.pop("targets", TARGETS),
                             init_lora_weights=False, **kw)  # fmt: skip
    return peft.get_peft_model(TinyLlama(ModelConfig(), seed=0), config).eval()


def _train(model: Any, step: int) -> dict[str, torch.Tensor]:
    """One 'training step' of the adapter; returns a snapshot of it (the oracle of that version)."""
    import peft

    gen = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    return {n: t.detach().clone() for n, t in peft.get_peft_model_state_dict(model).items()}


def _greedy(model: Any, snapshot: dict[str, torch.Tensor], prompt: list[int], n: int) -> list[int]:
    import copy

    import peft

    oracle = copy.deepcopy(model)
    peft.set_peft_model_state_dict(oracle, snapshot)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(oracle(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _engine(name: str = "s0", **kw: Any) -> EmulatedSGLangEngine:
    kw.setdefault("lora", LORA)
    kw.setdefault("config", ModelConfig(max_seq_len=4096))  # (room for a long request; same tokens as the PEFT model's)
    return EmulatedSGLangEngine.start(name, in_thread=True, server=SGLangAppServer, **kw)


def _ctx(model: Any, engines: list[Any], **kw: Any) -> protocol.RefitContext:
    from refit.drivers.lora_source import LoraSource
    from refit.drivers.sglang_transport import SGLangTensorTransport

    kw.setdefault("max_staleness", 1)
    kw.setdefault("verify", "off")
    return protocol.RefitContext(LoraSource(model, name="policy"), SGLangTensorTransport(), engines,
                                 deadline_s=30, **kw)  # fmt: skip


def _listed(e: EmulatedSGLangEngine) -> list[str]:
    """The adapters SGLang's own /v1/models lists (its LoRA registry)."""
    return [c["id"] for c in httpx.get(e.url + "/v1/models", timeout=10).json()["data"][1:]]


def test_lora_refits_into_sglang_serve_each_version_and_unload_the_old_after_its_requests() -> None:
    """Four LoRA refits into two servers: each version is a name SGLang loads from tensors and
    serves by `lora_path`; tokens equal PEFT's under that version; a request started on v1 keeps
    v1 to its last token while v2 goes live, and the refit that pushes v1 out (max_staleness 1)
    waits in DRAINING for it (SGLang's unload answers when its requests have finished); the
    servers hold at most 2 versions; bytes moved are the adapter's; the trace checks clean."""
    model = _peft()
    engines = [_engine("s0"), _engine("s1")]
    ctx = _ctx(model, engines)
    try:
        snaps = {1: _train(model, 1)}
        first = protocol.run(ctx).raise_for_error()
        nbytes = sum(t.numel() * t.element_size() for t in snaps[1].values())
        assert first.bytes_moved == nbytes
        long = engines[0].submit(PROMPT, 1200, adapter="policy")  # pinned to v1 (its name) at admission
        ended: dict[str, float] = {}
        long.add_done_callback(lambda _: ended.setdefault("long", time.monotonic()))
        time.sleep(0.3)
        snaps[2] = _train(model, 2)
        protocol.run(ctx).raise_for_error()
        assert _listed(engines[0]) == ["policy@v1", "policy@v2"]
        for e in engines:
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 2 and out["output"] == _greedy(model, snaps[2], PROMPT, 6)
        snaps[3] = _train(model, 3)
        box: dict[str, Any] = {}

        def third() -> None:
            box["r"] = protocol.run(ctx)
            ended["third"] = time.monotonic()

        assert not long.done()
        worker = threading.Thread(target=third)
        worker.start()
        old = long.result(timeout=120)
        worker.join(timeout=120)
        result = box["r"].raise_for_error()
        # DRAINING: v1's unload answered only once the request on it had finished
        assert ended["third"] >= ended["long"] and result.phase_seconds.get("DRAINING", 0) > 0
        assert old["finish_reason"] == "length" and old["adapter_version"] == 1 and len(old["output"]) == 1200
        assert old["output"][:60] == _greedy(model, snaps[1], PROMPT, 60)  # v1's tokens, though v2 went live
        assert result.bytes_moved == nbytes
        snaps[4] = _train(model, 4)
        protocol.run(ctx).raise_for_error()
        for e in engines:
            assert _listed(e) == ["policy@v3", "policy@v4"]
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 4 and out["output"] == _greedy(model, snaps[4], PROMPT, 6)
        # a client naming an unloaded version gets SGLang's own refusal (its implicit reload of a
        # tensor adapter, path "__tensor__", cannot work), never the old weights
        stale = httpx.post(engines[0].url + "/generate", json={"input_ids": PROMPT, "lora_path": "policy@v1",
                           "sampling_params": {"max_new_tokens": 2}}, timeout=30)  # fmt: skip
        assert stale.status_code == 400 and "Failed to implicitly load LoRA adapter policy@v1" in stale.text
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
        moves = invariants.adapters.trace_adapter_moves(ctx.recorder.events)
        assert {m["event"] for m in moves["s0"]} >= {"stage", "complete", "publish", "supersede", "unload"}
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize(
    ("kw", "peft_kw", "needle"),
    [
        ({"max_staleness": 0}, {}, "needs max_staleness >= 1"),
        ({"max_staleness": None}, {}, "needs max_staleness >= 1"),
        ({"verify": "digest"}, {}, "reports no checksums of a loaded adapter"),
        ({}, {"use_rslora": True}, "SGLang scales every adapter by lora_alpha / r"),
    ],
)
def test_what_sglang_can_never_do_is_refused_when_the_context_is_made(kw: Any, peft_kw: Any, needle: str) -> None:
    e = _engine()
    try:
        with pytest.raises(ConfigError, match=needle):
            _ctx(_peft(**peft_kw), [e], **kw)
        assert _listed(e) == []
    finally:
        e.close()


@pytest.mark.parametrize(
    ("lora", "peft_kw", "needle"),
    [
        (None, {}, "LoRA is not enabled on the server"),
        (LORA, {"r": 16}, "rank 16 is above the server's --max-lora-rank 8"),
        ({"max_lora_rank": 8, "lora_target_modules": ["q_proj", "v_proj"]}, {}, "outside the server's --lora-target"),
    ],
)
def test_what_this_server_cannot_load_fails_the_run_before_any_byte(lora: Any, peft_kw: Any, needle: str) -> None:
    """Known only from the server's /server_info: the run fails in CONNECTING or STAGING, nothing
    moved, nothing loaded, the lock free; the server serves on."""
    e = EmulatedSGLangEngine.start("s0", in_thread=True, server=SGLangAppServer, **({"lora": lora} if lora else {}))
    ctx = _ctx(_peft(**peft_kw), [e])
    try:
        result = protocol.run(ctx)
        assert not result.ok and needle in str(result.error) and result.bytes_moved == 0
        assert _listed(e) == [] and ctx.lock.holder is None
        assert e.generate(PROMPT, 2)["output"]  # the base model serves on
    finally:
        ctx.close()
        e.close()


def test_a_load_sglang_cannot_decode_kills_the_server_and_the_run_ends_inside_its_deadline() -> None:
    """A payload SGLang's scheduler cannot decode raises outside any handler
    (tp_worker.py deserialize_own_rank): the server dies. The run fails with the engine lost,
    within its deadline; the next run finds nothing listening and says so."""
    from refit.protocol.faults import FaultPlan

    model = _peft()
    e = _engine()
    ctx = _ctx(model, [e])
    try:
        protocol.run(ctx).raise_for_error()
        _train(model, 2)
        ctx.faults = FaultPlan().fail_at("transferring", call="load", kind="kill")
        t0 = time.monotonic()
        result = protocol.run(ctx)
        assert not result.ok and time.monotonic() - t0 < 30
        assert result.engines["s0"].status == "failed"
        ctx.faults = None
        again = protocol.run(ctx)
        assert not again.ok and "s0" in str(again.error)
    finally:
        ctx.close()
        e.close()


def test_the_sglang_driver_passes_the_lora_kit() -> None:
    """`refit.testing.check_lora_driver` on the SGLang driver against SGLang's own app: LoRA refits
    with raise, corrupt or hang in each state and requests in flight; what each server serves is
    checked against PEFT per version (max_staleness 1 or 2: SGLang refuses 0 and None)."""
    from refit.drivers.sglang_transport import SGLangTensorTransport

    check_lora_driver(_engine, max_examples=3, staleness=(1, 2), transport=SGLangTensorTransport, verify="off")
