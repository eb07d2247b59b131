"""A head tied to the embedding, into vLLM 0.33. Inside a weight-update session vLLM unties it
(`initialize_layerwise_reload` gives each layer a Parameter of its own): both names load, and
the tensor they share ends up holding the later of the two in stream order. The emulator's rule
is held against vLLM's own session code (run in its own process: `tests.vllm_tied_loader`).
refit's torch source sends a tied head once, under the embedding's name, as `named_parameters()`
lists it; a trainer whose head is a tensor of its own overwrites the served embedding on a server
that ties them, as vLLM does, and verification by vLLM's checksums names it."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from refit import protocol
from refit.buckets import BucketManifest, TensorEntry, TensorMeta
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm_transport import VLLMBroadcastTransport, VLLMIPCTransport
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig, TinyLlama, init_weights
from refit.testing.vllm_server import TIED_HEAD, EmulatedVLLMEngine

from .conftest import SMALL_BUCKET, perturbed

pytestmark = pytest.mark.e2e

TIED = ModelConfig(tie_word_embeddings=True, model_type="qwen2", qkv_bias=True)
EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
VALUES = {EMBED: 1.0, HEAD: 2.0, NORM: 3.0}
CASES = [
    [[EMBED, NORM, HEAD]],  # one request: the head after the embedding
    [[EMBED], [NORM, HEAD]],  # the head in a later request (refit's last bucket, before sources sent it once)
    [[EMBED, NORM]],  # no head: what refit sends now
    [[EMBED, HEAD], [NORM]],
]


def vllms_session(cases: list[list[list[str]]]) -> list[list[float] | str]:
    spec = json.dumps({"cases": cases})
    done = subprocess.run(
        [sys.executable, "-m", "tests.vllm_tied_loader", spec], capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def emulated_session(calls: list[list[str]]) -> list[float]:
    """The reference engine behind the emulator, loading the same names as requests (one bucket
    each; every other tensor of the model in a first bucket) with the emulator's `tied_head`: the
    values it serves under the embedding's name and as its head."""
    core = EngineCore(TIED, seed=0)
    state = init_weights(TIED, seed=1)
    state.update({n: torch.full_like(state[EMBED], v) if n == HEAD else torch.full_like(state[n], v)
                  for n, v in VALUES.items()})  # fmt: skip
    groups = [[n for n in state if n not in VALUES], *calls]
    plan, tensors = [], []
    for k, names in enumerate(groups):
        entries, offset = [], 0
        for n in names:
            meta = TensorMeta.of(n, state[n])
            entries.append(TensorEntry(meta, offset))
            offset += meta.nbytes
        plan.append(BucketManifest(k, tuple(entries), offset))
        tensors.append([(n, state[n]) for n in names])
    core.pause("abort")
    core.begin(plan)
    for m, t in zip(plan, tensors, strict=True):
        core.load(m, t, **TIED_HEAD)
    core.finalize()
    return [float(core.params[EMBED].flatten()[0]), float(core.head_serving.flatten()[0])]


def test_the_emulators_tied_head_is_vllms_own_session() -> None:
    """Request by request, what the engine behind the emulator serves under both names is what
    vLLM's own weight-update session leaves in the tensor they share."""
    theirs = vllms_session(CASES)
    assert [emulated_session(calls) for calls in CASES] == theirs
    assert theirs == [[2.0, 2.0], [2.0, 2.0], [1.0, 1.0], [2.0, 2.0]]  # the later of the two wins; none raises


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


def _untied_state(model: TinyLlama, scale: float) -> dict[str, torch.Tensor]:
    """The trainer's state with its head a tensor of its own: `scale` times the embedding."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state[HEAD] = state[EMBED] * scale
    return state


@pytest.mark.parametrize("scale", [1.0, 0.5], ids=["equal", "differs"])
def test_a_head_of_its_own_is_loaded_over_the_embedding_and_verification_judges_it(engines, scale: float) -> None:
    """A trainer that sends its head as a tensor of its own, in another bucket than its embedding,
    into vLLMs that tie them: vLLM loads the head into the tensor they share (the later of the
    two). Equal to the embedding: the same bytes, verified. Different (an untied trainer): the
    served embedding is the head now; vLLM's checksums name the embedding, nothing publishes and
    neither engine serves those weights."""
    engines += [EmulatedVLLMEngine.start(f"u{i}", config=TIED, backend="nccl") for i in range(2)]
    model = perturbed(TinyLlama(TIED, seed=0), seed=3)
    ctx = _ctx(TorchSource(_untied_state(model, scale)), engines, "nccl", SMALL_BUCKET)
    try:
        result = protocol.run(ctx)
    finally:
        ctx.close()
    assert result.buckets > 2
    if scale == 1.0:
        assert result.ok, result.error
        assert all(o.verify and o.verify["ok"] for o in result.engines.values())
        return
    assert not result.ok and result.version is None
    for outcome in result.engines.values():
        assert outcome.status == "quarantined" and not outcome.verify["ok"]
        assert any("embed_tokens" in n for n in outcome.verify["mismatched"])


def test_a_tied_trainer_into_an_engine_whose_head_is_its_own_is_refused_naming_the_tie() -> None:
    """The other mismatch: a tied trainer sends its head once, as the embedding; a reference
    engine whose head is its own refuses the plan before any byte moves, saying why and how to
    send both names; with `send_aliases=True` the refit goes through and serves the trainer's head."""
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import SharedMemoryTransport

    untied = dataclasses.replace(TIED, tie_word_embeddings=False)
    engine = ReferenceEngine.in_thread("own", untied, seed=0)
    model = perturbed(TinyLlama(TIED, seed=0), seed=6)
    try:
        for send_aliases in (False, True):
            ctx = protocol.RefitContext(
                TorchSource(model, send_aliases=send_aliases),
                SharedMemoryTransport(),
                [engine],
                bucket_bytes=SMALL_BUCKET,
            )
            try:
                result = protocol.run(ctx)
            finally:
                ctx.close()
            if not send_aliases:
                assert not result.ok and result.engines["own"].status == "unchanged"
                assert "send_aliases=True" in str(result.error) and "'lm_head.weight'" in str(result.error)
            else:
                assert result.ok, result.error
                assert torch.equal(engine.state_dict()[HEAD], model.lm_head.weight.detach())
    finally:
        engine.close()
