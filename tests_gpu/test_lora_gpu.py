"""GPU check of LoRA refits (run on the lent GPU by benchmarks/issue23_gpu.sh with TESTS; CI has no
GPU and never collects this folder): a CUDA engine takes each adapter version over CUDA IPC (one
fused copy-and-hash pass per bucket, the checks and copy plan of the trainer's stable views kept
between refits) and over shared memory (host tensors into the GPU), verify compares the digests
it hashed as it copied with the trainer's, and each version's greedy tokens equal those of an
engine that loaded the same tensors by hand on the same GPU."""

from __future__ import annotations

import pytest
import torch

from refit import protocol
from refit.bench_gpu import lora_state
from refit.drivers.ipc import IPCTransport
from refit.drivers.lora_source import LoraSource
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig

assert torch.cuda.is_available(), "tests_gpu needs a CUDA device"

CFG = ModelConfig(
    vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512,
    dtype="bfloat16", model_type="qwen2", qkv_bias=True, tie_word_embeddings=True,
)  # fmt: skip
PROMPT = [5, 6, 7, 8, 9]


def _by_hand(version: int, spec: object, adapter: dict[str, torch.Tensor]) -> list[int]:
    core = EngineCore(CFG, seed=0, device="cuda")
    core.stage_adapter("policy", version, spec)
    core.load_adapter("policy", [(n, t.clone()) for n, t in adapter.items()])
    core.publish_adapter("policy")
    rid = core.submit(PROMPT, 12, adapter="policy")
    while core.has_work():
        core.step()
    return core.result(rid)["output"]


@pytest.mark.parametrize("transport", ["ipc", "shm"])
def test_lora_refits_on_cuda_verify_what_they_copied_and_serve_each_version(transport: str) -> None:
    spec, adapter = lora_state(CFG, r=8, device="cuda")
    if transport == "shm":
        adapter = {n: t.cpu() for n, t in adapter.items()}
    engine = ReferenceEngine.spawn("gpu-lora", CFG, seed=0, device="cuda")
    ctx = protocol.RefitContext(
        LoraSource(adapter, name="policy", spec=spec),
        IPCTransport(same_devices=True) if transport == "ipc" else SharedMemoryTransport(), [engine],
        mode="disaggregated", max_staleness=1, verify="digest", bucket_bytes=64 << 10,
    )  # fmt: skip
    outputs = []
    try:
        for step in range(4):
            with torch.no_grad():  # a training step, in place: the trainer's same tensors, new bytes
                for t in adapter.values():
                    t.mul_(-1.25)
            torch.cuda.synchronize()
            result = protocol.run(ctx).raise_for_error()  # verify: the engine's digests equal the trainer's
            assert result.bytes_moved == sum(t.numel() * t.element_size() for t in adapter.values())
            got = engine.generate(PROMPT, 12, adapter="policy")
            assert got["output"] == _by_hand(step + 1, spec, adapter), step
            outputs.append(got["output"])
            assert (engine.info()["copy_span_s"] or 0) > 0  # the copies were timed on the GPU
    finally:
        ctx.close()
        engine.close()
    assert len({tuple(o) for o in outputs}) > 1  # the versions differ in what they serve


def test_a_discarded_cuda_version_gives_its_slab_to_the_next_one_which_verifies_and_serves() -> None:
    """A version staged and loaded (its copies queued on the GPU) then discarded, as a failed run's
    cleanup does: its slab is pooled only once those copies landed, and the next version stages into
    that very memory, hashes what it writes and serves the same tokens as a by-hand engine."""
    from refit.buckets import TensorMeta, plan_buckets
    from refit.verify import Digests

    spec, adapter = lora_state(CFG, r=8, device="cuda")
    core = EngineCore(CFG, seed=0, device="cuda")
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in adapter.items()], 64 << 10)
    lists = {m.index: [(n, adapter[n]) for n in m.names] for m in plan}
    head = {"name": "policy", **spec.to_dict(), "max_live": 1}
    for version in (1, 2, 3):
        with torch.no_grad():
            for t in adapter.values():
                t.mul_(-1.25)
        torch.cuda.synchronize()
        core.begin(plan, "wsum", adapter={**head, "version": version})
        slab = core.lora.staged("policy").slab
        for m in plan:
            core.load(m, lists[m.index], keep=True)
        if version == 2:  # the failed run: its queued copies into the slab, then the discard
            core.discard()
            assert core.lora.staged("policy") is None
            discarded = slab
            continue
        if version == 3:
            assert slab is discarded  # the discarded version's memory, reused
        core.finalize()
        want = Digests("wsum")
        for n, t in adapter.items():
            want.add(n, t)
        assert core.verify("wsum")["digests"] == want.results()
        core.publish(version)
        rid = core.submit(PROMPT, 12, adapter="policy")
        while core.has_work():
            core.step()
        assert core.result(rid)["output"] == _by_hand(version, spec, adapter)
