"""Runs SGLang 0.5.23's own `gpu_tensor_hash` (kernels/ops/memory/gpu_tensor_hash.py: its Triton
kernels, launches and reduction, unchanged) on a CPU, under Triton's interpreter.

Invoked by tests/test_sglang_tile_hash.py in a subprocess with TRITON_INTERPRET=1 and the real Triton
on its path (scripts/setup installs it into .venv/triton-interpreter, apart from the venv, whose
SGLang imports see a stand-in `triton`). `gpu_tensor_hash` asserts `tensor.is_cuda`; the tensors
here are handed to it as a subclass that answers True, and the interpreter runs the kernels on the
host memory behind them.

    python tests/sglang_tile_kernel.py IN.pt OUT.json
IN.pt: a list of (tensor, {kwargs for gpu_tensor_hash}); OUT.json: the hashes, as 16 hex digits,
and refit's own Triton kernel's hashes of the same tensors ("refit_kernel").
"""

from __future__ import annotations

import json
import os
import sys

import torch


class OnDevice(torch.Tensor):
    """A host tensor that says it is on CUDA, for gpu_tensor_hash's asserts."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def main(src: str, dst: str) -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("TRITON_INTERPRET=1 is needed: without a GPU only Triton's interpreter runs the kernels")
    import triton
    from sglang.kernels.ops.memory.gpu_tensor_hash import gpu_tensor_hash

    cases = torch.load(src)
    out = [f"{gpu_tensor_hash(t.as_subclass(OnDevice), **kw):016x}" for t, kw in cases]
    mine = [_refit_kernel(t, kw.get("tile_words", 8192)) for t, kw in cases]
    with open(dst, "w") as f:
        json.dump({"hashes": out, "refit_kernel": mine, "self_check": _self_check(), "triton": triton.__version__}, f)


def _self_check() -> bool:
    """The check refit makes before using its kernel on a device (`_triton_ok`), made here."""
    from refit.drivers import sglang_tile_hash as th

    return th._triton_ok(torch.device("cpu"))


def _refit_kernel(t: torch.Tensor, tile: int) -> str:
    """refit's own Triton kernel (`refit.drivers.sglang_tile_hash._kernel`, used on CUDA) run by
    the interpreter on the host tensor, in three pieces: what `TileHash` does with it on a GPU."""
    from refit.drivers import sglang_tile_hash as th

    h = th.TileHash(tile=tile, torch_ops=True)  # torch tensors reach the lanes
    h._lanes, h._device = th._Triton(*h._seeds, torch.device("cpu")), torch.device("cpu")
    flat = t.reshape(-1)
    for k in range(3):
        h.update(flat[len(flat) * k // 3 : len(flat) * (k + 1) // 3])
    return h.hexdigest()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
