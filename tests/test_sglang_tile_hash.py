"""SGLang's checksum of a parameter on CUDA (`gpu_tensor_hash`), as `refit.drivers.sglang_tile_hash`
reproduces it, against SGLang 0.5.23's own kernels: run by Triton's interpreter on this CPU
(tests/sglang_tile_kernel.py; on a GPU, tests_gpu/test_sglang_tile_hash_gpu.py runs them for real).
All three of refit's paths are checked: numpy on the host, torch integer ops, and refit's own
Triton kernel (what a GPU runs; here under the interpreter)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from refit.drivers import sglang_checksums as sc
from refit.drivers.sglang_tile_hash import TileHash, tile_hash
from refit.reference.model import ModelConfig, TinyLlama

ROOT = Path(__file__).resolve().parent.parent
TRITON = Path(os.environ.get("REFIT_TRITON_INTERPRETER", ROOT / ".venv" / "triton-interpreter"))


def sglang_hashes(cases: list[tuple[torch.Tensor, dict[str, Any]]], tmp: Path, *, mine: bool = False) -> Any:
    """SGLang's `gpu_tensor_hash` of each case, computed by its own kernels under the interpreter
    (`mine`: and refit's own Triton kernel's, as a second list)."""
    if not (TRITON / "triton").is_dir():
        raise AssertionError(f"Triton for the interpreter is not at {TRITON}: run scripts/setup (it installs it there)")
    src, dst = tmp / "cases.pt", tmp / "hashes.json"
    torch.save(cases, src)
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join([str(TRITON), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(
        [sys.executable, str(ROOT / "tests" / "sglang_tile_kernel.py"), str(src), str(dst)],
        env=env, check=True, timeout=600, capture_output=True,
    )  # fmt: skip
    got = json.loads(dst.read_text())
    assert got["self_check"] is True  # the probe refit checks its kernel with agrees with the torch ops
    return (got["hashes"], got["refit_kernel"]) if mine else got["hashes"]


def _mine(t: torch.Tensor, *, torch_ops: bool, tile: int = 8192, pieces: int = 1) -> str:
    h = TileHash(tile=tile, torch_ops=torch_ops)
    flat = t.reshape(-1)
    bounds = [len(flat) * k // pieces for k in range(pieces + 1)]
    for a, b in itertools.pairwise(bounds):
        h.update(flat[a:b])
    return h.hexdigest()


def test_the_cuda_checksum_is_sglangs_own_kernel(tmp_path: Path) -> None:
    """Odd byte counts (the last word zero-padded), one to three 8192-word tiles, every dtype a
    checkpoint holds; then small tiles, so that SGLang's tree reduction runs three levels deep;
    each hashed whole and in unaligned pieces, by both of refit's paths."""
    g = torch.Generator().manual_seed(0)
    cases: list[tuple[torch.Tensor, dict[str, Any]]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8):
        for n in (0, 1, 3, 5, 1000, 8192 * 2 + 7, 8192 * 3 * 4 // torch.empty(0, dtype=dtype).element_size()):
            cases.append(((torch.randn(n, generator=g) * 40).to(dtype), {}))
    big = torch.randn(256 * 70 + 3, generator=g)
    cases.append((big, {"tile_words": 256, "reduce_chunk": 4}))  # 71 tiles: 71 -> 18 -> 5 -> 2 -> 1
    want, kernel = sglang_hashes(cases, tmp_path, mine=True)
    assert kernel == want  # refit's Triton kernel (its CUDA path), run by the interpreter
    for (t, kw), expect in zip(cases, want, strict=True):
        tile = kw.get("tile_words", 8192)
        for torch_ops in (False, True):
            for pieces in (1, 3):
                assert _mine(t, torch_ops=torch_ops, tile=tile, pieces=pieces) == expect, (t.dtype, t.numel(), pieces)
    assert len(set(want)) == len(want) - 4  # the five dtypes' empty tensors all hash to 0; nothing else collides


def test_sglangs_fused_parameters_hash_from_the_trainers_pieces(tmp_path: Path) -> None:
    """Each parameter SGLang would hold on each of 2 TP ranks (this rank's q, k and v rows fused,
    its vocabulary rows with zero padding, ...), hashed by refit from the trainer's separate
    tensors, equals SGLang's kernel over the parameter built whole."""
    state = dict(TinyLlama(ModelConfig(vocab_size=250), seed=0).to(torch.bfloat16).state_dict())
    params = list(sc.sglang_params(state, 2, "sglang-cuda"))
    want = sglang_hashes([(torch.cat([p.reshape(-1) for p in pieces]), {}) for _, pieces in params], tmp_path)
    expected = sc.expected(state, 2, "sglang-cuda")
    assert {key: expected[key] for key, _ in params} == dict(zip([k for k, _ in params], want, strict=True))
    digests = sc.LayoutDigests(sc.kind_for(2, "cuda"))
    for name in reversed(list(state)):  # a fused part before the parts it follows waits for them
        digests.add(name, state[name])
    assert digests.results() == expected
    assert tile_hash(state["model.norm.weight"]) != sc.checksum(state["model.norm.weight"])  # not the host hash


def test_a_digest_leaves_the_hash_as_it_was() -> None:
    """As hashlib's: pieces may follow a digest (a carried partial word is padded for the digest only)."""
    h = TileHash()
    h.update(torch.tensor([1, 1], dtype=torch.uint8))
    first = h.hexdigest()
    assert h.hexdigest() == first == tile_hash(torch.tensor([1, 1], dtype=torch.uint8))
    h.update(torch.tensor([1, 1], dtype=torch.uint8))
    assert h.hexdigest() == tile_hash(torch.ones(4, dtype=torch.uint8))


def test_pieces_on_two_devices_are_refused() -> None:
    h = TileHash()
    h.update(torch.ones(4))
    with pytest.raises(ValueError, match="one device per tensor"):
        h.update(torch.ones(4, device="meta"))
