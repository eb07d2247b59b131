"""GPU checks (run on the lent H200 by benchmarks/gpu.sh; CI has no GPU and never collects this
folder): the reference engine on CUDA, refits through both CUDA IPC paths and the storage epoch,
and the NCCL side group next to a default group bound to a device."""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

from refit import protocol
from refit.buckets import TensorMeta
from refit.drivers.broadcast import BroadcastTransport, new_group
from refit.drivers.ipc import IPCTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama, greedy, prompt_logits

assert torch.cuda.is_available(), "tests_gpu needs a CUDA device"

CFG = ModelConfig(vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512)
BF16 = ModelConfig(
    vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512,
    qkv_bias=True, dtype="bfloat16", model_type="qwen2", tie_word_embeddings=True,
)  # fmt: skip
PROMPTS = [[1, 2, 3, 4], [7, 8, 9], [100, 200, 300, 400, 5]]


def _step(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen, device="cuda", dtype=torch.float32).to(p.dtype))


def _check(engine: ReferenceEngine, model: TinyLlama) -> None:
    state = engine.state_dict(timeout=120)
    want = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    assert sorted(state) == sorted(k for k in want if k in state)
    for k, v in state.items():
        assert torch.equal(v.view(torch.uint8) if v.dtype != torch.uint8 else v, want[k].view(torch.uint8)), k
    for prompt in PROMPTS:
        assert engine.generate(prompt, 8)["output"] == greedy(model, prompt, 8)
        got = engine.score(prompt)
        assert torch.allclose(got.float().cpu(), prompt_logits(model, prompt).float().cpu(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("config", [CFG, BF16], ids=["fp32", "bf16-tied"])
@pytest.mark.parametrize("path", ["ipc", "flattened"])
def test_cuda_refit_bit_exact_tokens_equal(path: str, config: ModelConfig) -> None:
    """Path (b) (storages shared once) and path (a) (SGLang flattened buckets, persistent
    buffers) into a reference engine on the same GPU: weights bit for bit, greedy tokens equal."""
    model = TinyLlama(config, seed=0).cuda()
    engine = ReferenceEngine.spawn("gpu", config, seed=0, device="cuda")
    transport = IPCTransport(signal_bytes=0) if path == "ipc" else SGLangTensorTransport(device="cuda")
    ctx = protocol.RefitContext(
        TorchSource(model), transport, [engine], mode="colocated", pause_mode="abort", bucket_bytes=64 << 10
    )
    try:
        for i in range(3):
            _step(model, i)
            result = protocol.run(ctx).raise_for_error()
            assert result.buckets > 4
            _check(engine, model)
        if path == "ipc":
            assert result.trainer_peak_bytes == 0  # every tensor by reference: no staging buffer
        else:  # the engine let go of every bucket's buffer before its ack: slots were reused, never replaced
            assert transport.held == []
    finally:
        ctx.close()
        engine.close()


def _connected(result: protocol.RefitResult) -> bool:
    return any(call == "connect" for call, _, _ in result.rank_stats[0].steps)


def test_reallocated_storages_get_a_fresh_connect(tmp_path: object) -> None:
    """A trainer that reallocates its parameters (new storages: a new epoch) is reconnected: the
    engine opens the new handles and never copies from the old ones."""
    model = TinyLlama(CFG, seed=0).cuda()
    engine = ReferenceEngine.spawn("gpu", CFG, seed=0, device="cuda")
    trace = f"{tmp_path}/t.jsonl"
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(signal_bytes=0), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=64 << 10, trace=trace,
    )  # fmt: skip
    try:
        protocol.run(ctx).raise_for_error()
        _step(model, 1)
        assert not _connected(protocol.run(ctx).raise_for_error())
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()  # new storages
                p.add_(0.01)
        result = protocol.run(ctx).raise_for_error()
        assert _connected(result)
        _check(engine, model)
    finally:
        ctx.close()
        engine.close()


def test_staged_tensors_on_cuda() -> None:
    """A source that casts (float32 -> bfloat16) hands out new tensors: they go through the
    transport's staging buffers (two, reused only after the engine's copy ran), bit-exact."""
    config = BF16
    model = TinyLlama(ModelConfig(**{**config.to_dict(), "dtype": "float32"}), seed=0).cuda()
    engine = ReferenceEngine.spawn("gpu", config, seed=0, device="cuda")
    ctx = protocol.RefitContext(
        TorchSource(model, dtype=torch.bfloat16), IPCTransport(signal_bytes=0), [engine], mode="colocated",
        pause_mode="abort", bucket_bytes=32 << 10,
    )  # fmt: skip
    try:
        for i in range(2):
            _step(model, 10 + i)
            result = protocol.run(ctx).raise_for_error()
            assert result.trainer_peak_bytes > 0
            state = engine.state_dict(timeout=120)
            for k, v in model.state_dict().items():
                if k in state:
                    assert torch.equal(state[k], v.detach().to(torch.bfloat16).cpu()), k
    finally:
        ctx.close()
        engine.close()


def test_batched_decoding_on_cuda_gives_the_per_request_tokens_and_refits_atomically() -> None:
    """`batch_decode` on CUDA (what the atomic bench row decodes with): 6 requests through 4 slots
    give the one-request-per-forward engine's greedy tokens (fp32); an atomic refit over path (b)
    while they decode lands bit for bit and the requests go on at the new version."""
    config = ModelConfig(**{**CFG.to_dict(), "max_seq_len": 2048})
    engines = [
        ReferenceEngine.spawn(n, config, seed=0, device="cuda", max_running=4, batch_decode=b)
        for n, b in (("one", False), ("batched", True))
    ]
    prompts = [[i + 1, 2 * i + 3, 5, 7] for i in range(6)]
    try:
        futures = [[e.submit(p, 40) for p in prompts] for e in engines]
        one, batched = ([f.result(timeout=120) for f in fs] for fs in futures)
        assert [r["output"] for r in one] == [r["output"] for r in batched]
        model = TinyLlama(CFG, seed=0).cuda()
        _step(model, 3)
        ctx = protocol.RefitContext(
            TorchSource(model), IPCTransport(same_devices=True), [engines[1]], mode="disaggregated", atomic=True,
            pause_mode="in_place", kv="keep",
        )  # fmt: skip
        try:
            running = [engines[1].submit(p, 1800) for p in prompts[:4]]  # one slot each
            while engines[1].info()["tokens_sampled"] < 6 * 40 + 60:
                time.sleep(0.001)
            protocol.run(ctx).raise_for_error()
            results = [f.result(timeout=120) for f in running]
        finally:
            ctx.close()
        assert all(r["weight_versions"][0] == 0 and r["weight_versions"][-1] == 1 for r in results)
        assert engines[1].info()["tokens_while_staged"] > 0
        _check(engines[1], model)
    finally:
        for e in engines:
            e.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_nccl_side_group_beside_a_bound_default_group() -> None:
    """The trainer's default group is NCCL, initialised with a bound device (what turns a naive
    `new_group` into ncclCommSplit). refit's side group is made from its own store, never from
    the default group: it forms and broadcasts on its own, and is aborted on disconnect. One GPU
    allows a group of one (two NCCL ranks cannot share a GPU): the two-rank case waits for the
    two-GPU machine."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1,
        device_id=torch.device("cuda", 0), timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
        group = new_group(store, "side", 0, 1, 30.0, "nccl")
        t = torch.arange(16, device="cuda", dtype=torch.float32)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        group.broadcast([t], opts).wait()
        torch.cuda.synchronize()
        assert torch.equal(t, torch.arange(16, device="cuda", dtype=torch.float32))
        group.abort()
        transport = BroadcastTransport(backend="nccl")
        from refit.drivers.base import Topology

        topo = Topology.of(1, [], colocated=False, timeout_s=30)
        plan = transport.plan([TensorMeta("w", "float32", (4, 4))], 1 << 20)
        info = transport.connect(plan, topo, 0)
        assert info["backend"] == "nccl" and info.get("nccl_cumem") == os.environ.get("NCCL_CUMEM_ENABLE")
        assert transport._pool.buffers[0].is_cuda
        transport.join()  # a group of one: forms at once, without the default group
        transport.disconnect()
        assert not transport.connected
    finally:
        dist.destroy_process_group()
