"""On a GPU: SGLang's CUDA checksum as refit reproduces it (`refit.drivers.sglang_tile_hash`: refit's
Triton kernel, and its torch integer ops) against SGLang 0.5.23's own `gpu_tensor_hash` (its Triton kernels, from
the wheel carried in .whl), at the sizes a 7B checkpoint holds (more than 1024 tiles: SGLang's
reduction runs two levels), whole and in the pieces a fused parameter is built from; and the
trainer's layout checksums (`LayoutDigests`) taken on the GPU equal those taken on the host. The
time each hash takes goes to $OUT/sglang_tile_hash.json when OUT is set (a figure, not a limit)."""

from __future__ import annotations

import json
import os
import time

import torch
from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash  # the wheel; missing fails here

from refit.drivers import sglang_checksums as sc
from refit.drivers.sglang_tile_hash import TileHash, tile_hash
from refit.reference.model import ModelConfig, TinyLlama

assert torch.cuda.is_available(), "tests_gpu needs a CUDA device"


def _timed(fn: object, reps: int = 3) -> tuple[object, float]:
    out = fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn()  # type: ignore[operator]
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t0) / reps


def _torch_ops(t: torch.Tensor) -> str:
    h = TileHash(torch_ops=True)
    h.update(t)
    return h.hexdigest()


def test_refits_cuda_checksum_is_sglangs_gpu_tensor_hash() -> None:
    from refit.drivers import sglang_tile_hash as th

    assert th._triton_ok(torch.device("cuda"))  # refit's kernel passes its probe here: tile_hash uses it
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = {
        "one byte": torch.tensor([7], dtype=torch.uint8, device="cuda"),
        "bf16 odd": torch.randn(4097, device="cuda", generator=g).to(torch.bfloat16),
        "3 tiles and a tail": torch.randn(8192 * 3 + 5, device="cuda", generator=g),
        "q_proj 7B": torch.randn(3584, 3584, device="cuda", generator=g).to(torch.bfloat16),
        "embedding 7B": torch.randn(152064, 3584, device="cuda", generator=g).to(torch.bfloat16),  # 33k tiles
        "transposed": torch.randn(1000, 700, device="cuda", generator=g).t(),
    }
    figures = {}
    for name, t in cases.items():
        want, theirs = _timed(lambda t=t: gpu_tensor_hash(t))
        mine, ours = _timed(lambda t=t: tile_hash(t))  # refit's Triton kernel
        assert mine == f"{want:016x}", name
        ops, torch_s = _timed(lambda t=t: _torch_ops(t), reps=1)
        assert ops == mine, name
        host = TileHash()
        host.update(t.cpu())
        assert host.hexdigest() == mine, name
        gib = t.numel() * t.element_size() / 2**30
        figures[name] = {"gib": gib, "sglang_s": theirs, "refit_triton_s": ours, "refit_torch_ops_s": torch_s}
    # a fused qkv parameter of one TP rank, hashed from three separate tensors on the device
    q, k, v = (torch.randn(r, 3584, device="cuda", generator=g).to(torch.bfloat16) for r in (1792, 256, 256))
    assert tile_hash(q, k, v) == f"{gpu_tensor_hash(torch.cat([q, k, v])):016x}"
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "sglang_tile_hash.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": figures}, f, indent=1)


def test_the_trainers_layout_checksums_on_the_gpu_equal_the_hosts() -> None:
    state = dict(TinyLlama(ModelConfig(vocab_size=250), seed=0).to(torch.bfloat16).state_dict())
    on_gpu, on_host = sc.LayoutDigests(sc.kind_for(2, "cuda")), sc.LayoutDigests(sc.kind_for(2, "cuda"))
    for name in reversed(list(state)):
        on_gpu.add(name, state[name].cuda())
        on_host.add(name, state[name])
    assert on_gpu.results() == on_host.results() == sc.expected(state, 2, "sglang-cuda")
