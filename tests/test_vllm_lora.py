"""LoRA refits into vLLM 0.33.0: the driver (`refit.drivers.vllm`, `refit.drivers.vllm_lora`)
against the emulated server (`refit.testing.vllm_server`: its runtime LoRA routes, which exist
only with VLLM_ALLOW_RUNTIME_LORA_UPDATING, and /v1/models and /v1/completions by adapter name).
Each version is written to a directory the server reads, as vLLM's worker reads one. The oracle
for what is served is transformers + PEFT with the same adapter (rsLoRA too: vLLM honours it)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from refit import invariants, protocol
from refit.errors import ConfigError
from refit.reference.model import ModelConfig
from refit.testing import check_lora_driver
from refit.testing.vllm_server import EmulatedVLLMEngine

from .lora_support import greedy, peft_model, train

pytestmark = pytest.mark.e2e
ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
PROMPT = [1, 2, 3, 4]


def _engine(name: str = "v0", tmp: Any = None, **kw: Any) -> EmulatedVLLMEngine:
    kw.setdefault("lora", {"max_lora_rank": 8})
    kw.setdefault("env", ENV)
    kw.setdefault("config", ModelConfig(max_seq_len=4096))
    engine = EmulatedVLLMEngine.start(name, in_thread=True, **kw)
    if tmp is not None:
        engine.lora_dir = tmp / name
    return engine


def _ctx(model: Any, engines: list[Any], **kw: Any) -> protocol.RefitContext:
    from refit.drivers.lora_source import LoraSource
    from refit.drivers.shm import SharedMemoryTransport

    kw.setdefault("max_staleness", 1)
    kw.setdefault("verify", "off")
    transport = kw.pop("transport", None) or SharedMemoryTransport()
    return protocol.RefitContext(LoraSource(model, name="policy"), transport, engines, deadline_s=30, **kw)


def _listed(e: EmulatedVLLMEngine) -> list[str]:
    return [c["id"] for c in httpx.get(e.url + "/v1/models", timeout=10).json()["data"][1:]]


def test_lora_refits_into_vllm_serve_each_version_from_its_own_directory(tmp_path: Any) -> None:
    """Four LoRA refits (rsLoRA) into two servers: each version is written to its own directory and
    loaded by name (never in place); tokens equal PEFT's under that version; a request started on
    v1 keeps v1's tokens to its last though v1's name is unloaded under it (vLLM's unload removes
    the name only); at most 2 names listed; directories two versions back removed; a client naming
    an unloaded version gets vLLM's 404; the trace checks clean."""
    model = peft_model(use_rslora=True)
    engines = [_engine("v0", tmp_path), _engine("v1", tmp_path)]
    ctx = _ctx(model, engines)
    try:
        snaps = {1: train(model, 1)}
        first = protocol.run(ctx).raise_for_error()
        assert first.bytes_moved == sum(t.numel() * t.element_size() for t in snaps[1].values())
        long = engines[0].submit(PROMPT, 1200, adapter="policy")
        time.sleep(0.3)
        for step in (2, 3):
            snaps[step] = train(model, step)
            protocol.run(ctx).raise_for_error()
        assert not long.done() or long.result()["adapter_version"] == 1
        for step in (4,):
            snaps[step] = train(model, step)
            protocol.run(ctx).raise_for_error()
        old = long.result(timeout=120)
        assert old["finish_reason"] == "length" and old["adapter_version"] == 1 and len(old["output"]) == 1200
        assert old["output"][:60] == greedy(model, snaps[1], PROMPT, 60)
        for e in engines:
            assert _listed(e) == ["policy@v3", "policy@v4"]
            assert sorted(p.name for p in e.lora_dir.iterdir()) == ["policy@v2", "policy@v3", "policy@v4"]
            out = e.generate(PROMPT, 6, adapter="policy")
            assert out["adapter_version"] == 4 and out["output"] == greedy(model, snaps[4], PROMPT, 6)
        stale = httpx.post(engines[0].url + "/v1/completions", json={"model": "policy@v1", "prompt": PROMPT,
                           "max_tokens": 2}, timeout=30)  # fmt: skip
        assert stale.status_code == 404 and "The model `policy@v1` does not exist" in stale.text
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"max_staleness": 0}, "needs max_staleness >= 1"),
        ({"max_staleness": None}, "needs max_staleness >= 1"),
        ({"verify": "digest"}, "reports no checksums of a loaded adapter"),
    ],
)
def test_what_vllm_can_never_do_is_refused_when_the_context_is_made(kw: Any, needle: str) -> None:
    e = _engine()
    try:
        with pytest.raises(ConfigError, match=needle):
            _ctx(peft_model(), [e], **kw)
    finally:
        e.close()


def test_a_lora_refit_into_vllm_takes_shared_memory_only() -> None:
    from refit.drivers.sglang_transport import SGLangTensorTransport

    e = _engine()
    try:
        with pytest.raises(ConfigError, match="for a LoRA refit; it receives \\['shm'\\]"):
            _ctx(peft_model(), [e], transport=SGLangTensorTransport())
    finally:
        e.close()


@pytest.mark.parametrize(
    ("kw", "peft_r", "needle"),
    [
        ({"env": {"VLLM_SERVER_DEV_MODE": "1"}}, 4, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"),
        ({"lora": None}, 4, "LoRA is not enabled on the server"),
        ({}, 16, "rank 16 is above the server's --max-lora-rank 8"),
    ],
)
def test_what_this_vllm_server_cannot_load_fails_the_run_before_any_byte(kw: Any, peft_r: int, needle: str) -> None:
    e = _engine(**kw)
    ctx = _ctx(peft_model(r=peft_r), [e])
    try:
        result = protocol.run(ctx)
        assert not result.ok and needle in str(result.error) and result.bytes_moved == 0
        assert _listed(e) == [] and ctx.lock.holder is None
        assert e.generate(PROMPT, 2)["output"]  # the base model serves on
    finally:
        ctx.close()
        e.close()


def test_the_vllm_driver_passes_the_lora_kit() -> None:
    """`refit.testing.check_lora_driver` on the vLLM driver: LoRA refits with raise, corrupt or hang
    in each state and requests in flight, checked against PEFT per version."""
    check_lora_driver(_engine, max_examples=3, staleness=(1, 2), verify="off")
