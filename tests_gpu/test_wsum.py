"""The GPU digest (`refit.wsum`, verification's kind on CUDA transports): the Triton kernel equals
the host implementation bit for bit, whatever the size, dtype, layout or alignment; a refit over
CUDA IPC into a reference engine on the GPU is verified with it, and a silent fault is caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from refit import invariants, protocol
from refit.drivers.ipc import IPCTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama
from refit.verify import Digests, digest
from refit.wsum import host_digest

assert torch.cuda.is_available(), "tests_gpu needs a CUDA device"

CFG = ModelConfig(vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512)
CFG_BF16 = dataclasses.replace(CFG, dtype="bfloat16")


def _cases() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(3 << 20, generator=g)
    out = [
        ("empty", torch.empty(0)),
        ("one byte", torch.tensor([7], dtype=torch.uint8)),
        ("three bytes", torch.tensor([1, 2, 3], dtype=torch.uint8)),
        ("a word", torch.tensor([1.5])),
        ("bf16 odd", base[:4097].to(torch.bfloat16)),  # 8194 bytes: not a whole number of words
        ("one block", base[:4096]),
        ("blocks and a tail", base[: 4096 * 3 + 5]),
        ("12 MiB", base),
        ("bf16 matrix", base[: 1024 * 1000].view(1024, 1000).to(torch.bfloat16)),
        ("transposed", base[: 512 * 300].view(512, 300).t()),
        ("uint8", torch.randint(0, 255, (100003,), dtype=torch.uint8, generator=g)),
    ]
    return out


@pytest.mark.parametrize(("label", "tensor"), _cases(), ids=[c[0] for c in _cases()])
def test_the_kernel_equals_the_host_bit_for_bit(label: str, tensor: torch.Tensor) -> None:
    assert digest(tensor.cuda(), "wsum") == host_digest(tensor)


def test_a_view_two_bytes_off_a_word_and_a_batch_with_one_sync() -> None:
    buf = torch.randn(10001).to(torch.bfloat16)
    view = buf.cuda()[1:]  # data_ptr % 4 == 2: hashed from an aligned copy
    assert view.data_ptr() % 4 == 2 and digest(view, "wsum") == host_digest(buf[1:])
    batch = Digests("wsum")
    tensors = {f"t{i}": torch.randn(1000 + i, device="cuda") for i in range(50)}
    for name, t in tensors.items():
        batch.add(name, t)
    assert batch.results() == {n: host_digest(t.cpu()) for n, t in tensors.items()}


def test_changes_are_seen_on_the_gpu() -> None:
    t = torch.randn(1 << 20, device="cuda")
    flipped = t.clone()
    flipped.view(torch.int32)[123456] ^= 1
    swapped = t.clone()
    swapped[[10, 20]] = t[[20, 10]]
    assert len({digest(x, "wsum") for x in (t, flipped, swapped, t.to(torch.bfloat16))}) == 4


def test_hashing_while_copying_equals_hashing_what_was_written() -> None:
    """`Written` on CUDA (the fused copy-and-hash kernel, aligned and unaligned rows): each region
    written whole has the digest of its bytes as they are now; a piece written at an offset is
    credited there; a region partly written, or written by a copy the kernel cannot take (two
    bytes off a word), is left to be read back."""
    from refit.wsum import Written

    g = torch.Generator().manual_seed(1)
    dev = "cuda"
    arena = torch.zeros(1 << 20, dtype=torch.uint8, device=dev)
    regions = {
        "a": torch.zeros(999, 37, device=dev),  # 36,963 words: whole 16-byte vectors and a 3-word tail
        "b": torch.zeros(4099, dtype=torch.bfloat16, device=dev),  # not a whole number of words
        "c": arena[16 : 16 + 4 * 5003].view(torch.float32),  # 16-byte aligned in the arena
        "d": arena[65540 : 65540 + 4 * 777].view(torch.float32),  # 4-byte but not 16-byte aligned
        "e": torch.zeros(64, 64, device=dev),  # written in two pieces, the second one first
        "f": torch.zeros(256, device=dev),  # only half written: read back
    }
    written = Written(regions)
    src = {k: torch.randn(v.shape, generator=g).to(v.dtype).to(dev) for k, v in regions.items()}
    written.copy([(regions["a"], src["a"]), (regions["c"], src["c"]), (regions["d"], src["d"])])
    written.copy([(regions["b"], src["b"]), (regions["e"][32:], src["e"][32:]), (regions["e"][:32], src["e"][:32])])
    written.copy([(regions["f"][:128], src["f"][:128])])
    torch.cuda.synchronize()
    for k in "acde":
        assert torch.equal(regions[k], src[k]), k
    got = written.results()
    assert sorted(written.missed()) == ["b", "f"]  # b: 8198 bytes, copied by torch; f: half
    assert got == {k: host_digest(regions[k].cpu()) for k in "acde"}
    written.stage()  # the lanes staged to pinned host memory, as a finalize does before its sync
    torch.cuda.current_stream().synchronize()
    assert written.results() == got
    written.copy([(regions["f"][128:], src["f"][128:])])  # f's other half, after staging: now whole
    torch.cuda.synchronize()
    assert written.missed() == ["b"]  # the staged lanes are stale (they lack f's second half): not read
    assert written.results() == {**got, "f": host_digest(regions["f"].cpu())}


@pytest.mark.parametrize(
    ("kind", "point"),
    [("flip", "served"), ("flip", "written"), ("swap_qk", "written"), ("downcast", "written"), ("skip", "written"),
     ("stale_head", "written"), ("late_copy", "written"), ("late_copy", "served")],
)  # fmt: skip
def test_the_fault_matrix_on_a_cuda_engine_over_ipc(kind: str, point: str) -> None:
    """Every silent fault, injected for real in a CUDA reference engine fed over CUDA IPC, caught
    and named before it publishes: hashed as the engine writes (the default) or read back. The one
    exception, by design: a bit flipped in the engine's memory after its write is seen only when
    read back (docs/verify.md)."""
    model = TinyLlama(CFG, seed=0).cuda()  # float32, sent as bfloat16: staged, in buffers the transport reuses
    engines = [ReferenceEngine.spawn(f"v{i}", CFG_BF16, seed=0, device="cuda") for i in range(2)]
    at_finalize = kind == "stale_head"
    plan = protocol.FaultPlan().fail_at(
        "post_processing" if at_finalize else "transferring", engine=1, bucket=None if at_finalize else 1, kind=kind
    )
    ctx = protocol.RefitContext(
        TorchSource(model, dtype=torch.bfloat16), IPCTransport(signal_bytes=0), engines, mode="colocated",
        pause_mode="abort", bucket_bytes=256 << 10, retries=0, faults=plan, digest_point=point,
    )  # fmt: skip
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        result = protocol.run(ctx)
        want = {k: v.to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
        wrong = [n for n, t in engines[1].state_dict().items() if not torch.equal(t.cpu(), want[n])]
        tokens = [1, 2, 3, 4, 5]
        assert not torch.equal(engines[0].score(tokens), engines[1].score(tokens))  # the fault is real
        good, bad = result.engines["v0"], result.engines["v1"]
        assert good.status == "updated" and good.verify["ok"] and good.verify["compared"] > 0
        assert good.verify["read_back"] == (0 if point == "written" else good.verify["compared"])
        if kind == "flip" and point == "written":
            assert bad.status == "updated" and len(wrong) == 1  # written right, changed after: not seen
        elif kind == "stale_head":
            assert bad.status == "quarantined" and bad.verify["mismatched"] == ["lm_head.weight"] and wrong == []
        else:
            assert bad.status == "quarantined" and wrong and set(bad.verify["mismatched"]) == set(wrong)
        start = next(e for e in ctx.recorder.events if e.get("event") == "start")
        assert start["digest"] == "wsum" and start["digest_point"] == point
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_silent_fault_on_a_cuda_engine_over_ipc_is_caught(retries: int) -> None:
    model = TinyLlama(CFG, seed=0).cuda()
    engines = [ReferenceEngine.spawn(f"v{i}", CFG, seed=0, device="cuda") for i in range(2)]
    plan = protocol.FaultPlan().fail_at("transferring", engine=1, bucket=1, kind="flip")
    ctx = protocol.RefitContext(
        TorchSource(model), IPCTransport(signal_bytes=0), engines, mode="colocated", pause_mode="abort",
        bucket_bytes=64 << 10, retries=retries, faults=plan, digest_point="served",
    )  # fmt: skip
    try:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        result = protocol.run(ctx)
        good, bad = result.engines["v0"], result.engines["v1"]
        assert good.status == "updated" and good.verify["ok"] and good.verify["compared"] > 0
        if retries:
            assert bad.status == "updated" and bad.attempts == 2 and bad.verify["ok"]
        else:
            assert bad.status == "quarantined" and len(bad.verify["mismatched"]) == 1
        start = next(e for e in ctx.recorder.events if e.get("event") == "start")
        assert start["digest"] == "wsum"
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()
