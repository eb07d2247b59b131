"""Two GPUs (run by benchmarks/gpu.sh only when the machine has two): a trainer on GPU 0 and a
reference engine process on GPU 1, refit over the NCCL broadcast transport."""

from __future__ import annotations

import torch

from refit import protocol
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama, greedy

assert torch.cuda.device_count() >= 2, "tests_gpu/test_two_gpu.py needs two GPUs"

CFG = ModelConfig(
    vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512,
    qkv_bias=True, dtype="bfloat16", model_type="qwen2",
)  # fmt: skip


def test_nccl_broadcast_refit_gpu0_to_gpu1() -> None:
    torch.cuda.set_device(0)
    model = TinyLlama(CFG, seed=0).cuda()
    engine = ReferenceEngine.spawn("gpu1", CFG, seed=0, device="cuda:1")
    ctx = protocol.RefitContext(
        TorchSource(model), BroadcastTransport(backend="nccl"), [engine], mode="disaggregated",
        pause_mode="abort", bucket_bytes=64 << 10, deadline_s=120,
    )  # fmt: skip
    try:
        for i in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0 if i % 2 else 1.0).add_(0.01)
            result = protocol.run(ctx).raise_for_error()
            assert result.buckets > 4
            state = engine.state_dict(timeout=120)
            for k, v in model.state_dict().items():
                assert torch.equal(state[k], v.detach().cpu()), k
            assert engine.generate([1, 2, 3], 6)["output"] == greedy(model, [1, 2, 3], 6)
    finally:
        ctx.close()
        engine.close()
