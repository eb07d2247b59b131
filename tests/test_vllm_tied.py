"""A head tied to the embedding, into vLLM 0.33: its loader (model_executor/models/utils.py
`AutoWeightsLoader`) skips `lm_head.weight` within a `load_weights` call that also loads
`model.embed_tokens.weight`, and raises for a call that holds the head without it. The
emulator's rule is held against vLLM's own loader (run in its own process: `tests.vllm_tied_loader`);
refit's torch source sends a tied head once, under the embedding's name, as `named_parameters()`
lists it (so bucketing can never split the pair), and a trainer whose head is its own tensor,
into a server that ties it, fails as vLLM fails: with vLLM's words, and nothing served."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from refit import protocol
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm_transport import VLLMBroadcastTransport, VLLMIPCTransport
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama
from refit.testing.vllm_server import EmulatedVLLMEngine, _load_calls

from .conftest import SMALL_BUCKET, perturbed

pytestmark = pytest.mark.e2e

TIED = ModelConfig(tie_word_embeddings=True, model_type="qwen2", qkv_bias=True)
EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
CASES = [
    [[HEAD]],  # the head alone (refit's last bucket, before sources sent it once)
    [[EMBED, NORM, HEAD]],  # with the embedding in one call: skipped
    [[EMBED], [NORM, HEAD]],  # the embedding in an earlier call of the same request: raises all the same
    [[NORM]],  # no head at all
    [[HEAD, EMBED]],  # the head first, its embedding later in the same call: skipped
]


def vllms_loader(model: str, cases: list[list[list[str]]]) -> list[str | None]:
    spec = json.dumps({"model": model, "cases": cases})
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_tied_loader", spec], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("model_type", ["qwen2", "llama"])
def test_the_emulators_tied_head_rule_is_vllms_own(model_type: str) -> None:
    """Call by call, the reference engine behind the emulator refuses exactly where vLLM's loader
    raises, in vLLM's words (its model class named as vLLM names it)."""
    config = dataclasses.replace(TIED, model_type=model_type, qkv_bias=model_type == "qwen2")
    core = EngineCore(config, seed=0)
    ours = [core._tied_alone(calls) for calls in CASES]
    theirs = vllms_loader({"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}[model_type], CASES)
    assert ours == theirs
    assert [a is not None for a in theirs] == [True, False, True, False, False]


def test_a_request_is_grouped_into_loader_calls_as_vllms_receivers_group_it() -> None:
    """IPC: one call per request; NCCL unpacked: one per tensor; NCCL packed: a chunk closes once
    its bytes exceed the buffer (packed_tensor.py `packed_nccl_broadcast_consumer`)."""
    from refit.buckets import TensorMeta

    metas = [TensorMeta(n, "float32", (s,)) for n, s in (("a", 100), ("b", 100), ("c", 300), ("d", 1))]  # 400 B each
    assert _load_calls("ipc", True, metas, 10) == [["a", "b", "c", "d"]]
    assert _load_calls("nccl", False, metas, 10) == [["a"], ["b"], ["c"], ["d"]]
    assert _load_calls("nccl", True, metas, 800) == [["a", "b", "c"], ["d"]]  # 400, 800 (not over), 2000: closes
    assert _load_calls("nccl", True, metas, 1 << 30) == [["a", "b", "c", "d"]]


@pytest.fixture
def engines() -> Iterator[list[EmulatedVLLMEngine]]:
    made: list[EmulatedVLLMEngine] = []
    yield made
    for e in made:
        e.close()


def _ctx(source: TorchSource, engines: list[EmulatedVLLMEngine], backend: str, bucket: int) -> protocol.RefitContext:
    mode = "colocated" if backend == "ipc" else "disaggregated"
    transport = VLLMIPCTransport() if backend == "ipc" else VLLMBroadcastTransport()
    return protocol.RefitContext(
        source, transport, engines, mode=mode, bucket_bytes=bucket, deadline_s=60.0, verify="digest"
    )


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_a_tied_trainer_sends_its_head_once_and_the_tied_vllm_serves_it(engines, backend: str) -> None:
    """A tied trainer (its head is its embedding's Parameter) into tied vLLM servers, in small
    buckets: `lm_head.weight` is never sent, every refit is verified by vLLM's checksums, and the
    head each server serves is the trainer's."""
    engines += [EmulatedVLLMEngine.start(f"t{i}", config=TIED, backend=backend) for i in range(2)]
    model = TinyLlama(TIED, seed=0)
    ctx = _ctx(TorchSource(model), engines, backend, SMALL_BUCKET)
    try:
        for step in (1, 2):
            perturbed(model, seed=step)
            result = protocol.run(ctx)
            assert result.ok, result.error
            assert result.buckets > 2 and all(o.verify and o.verify["ok"] for o in result.engines.values())
        sent = [n for r, b in engines[0].server.received if r == "/update_weights" for n in b["update_info"]["names"]]
        assert EMBED in sent and HEAD not in sent
        for e in engines:
            logits = e.score([3, 1, 4, 1, 5])
            with torch.no_grad():
                want = model(torch.tensor([[3, 1, 4, 1, 5]]))[0]
            assert float((logits - want).abs().max()) <= 1e-4
    finally:
        ctx.close()


def _untied_state(model: TinyLlama) -> dict[str, torch.Tensor]:
    """The trainer's state with its head a tensor of its own (equal to the embedding, or not)."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[HEAD] = state[EMBED].clone()
    return state


def test_a_head_of_its_own_in_another_bucket_fails_as_vllm_fails_and_nothing_is_served(engines) -> None:
    """A trainer whose head is a tensor of its own (here equal to its embedding), in small buckets
    into a vLLM that ties it: the head arrives in a request without the embedding; vLLM's loader
    raises and its answer (HTTP 500) is the refit's error; the server's weights are no version's,
    so neither engine serves."""
    engines += [EmulatedVLLMEngine.start(f"u{i}", config=TIED, backend="nccl") for i in range(2)]
    model = perturbed(TinyLlama(TIED, seed=0), seed=3)
    ctx = _ctx(TorchSource(_untied_state(model)), engines, "nccl", SMALL_BUCKET)
    try:
        result = protocol.run(ctx)
    finally:
        ctx.close()
    assert not result.ok and result.version is None
    text = str(result.error)
    assert "500" in text and "'lm_head.weight' was skipped because it is tied to 'model.embed_tokens.weight'" in text
    assert "Qwen2ForCausalLM" in text
    assert {o.status for o in result.engines.values()} <= {"quarantined", "failed"}
    for e in engines:
        assert e.server.engine.info()["weights_released"]  # vLLM's layers are left on the meta device


def test_a_head_of_its_own_in_the_embeddings_request_is_skipped_and_verified(engines) -> None:
    """The same trainer in one bucket: the head comes in the embedding's request, vLLM's loader
    skips it, the server serves its embedding as the head, and verification passes because the
    head sent equals it (a head that differed would be named: tests/test_vllm_checksums.py)."""
    engines += [EmulatedVLLMEngine.start("w0", config=TIED, backend="nccl")]
    model = perturbed(TinyLlama(TIED, seed=0), seed=4)
    ctx = _ctx(TorchSource(_untied_state(model)), engines, "nccl", 64 << 20)
    try:
        result = protocol.run(ctx)
    finally:
        ctx.close()
    assert result.ok, result.error
    assert result.buckets == 1 and result.engines["w0"].verify["ok"]
