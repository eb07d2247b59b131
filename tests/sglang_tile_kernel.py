"""Runs SGLang 0.5.23's own `gpu_tensor_hash` (kernels/ops/memory/gpu_tensor_hash.py: its Triton
kernels, launches and reduction, unchanged) on a CPU, under Triton's interpreter.

Invoked by tests/test_sglang_tile_hash.py in a subprocess with TRITON_INTERPRET=1 and the real Triton
on its path (scripts/setup installs it into .venv/triton-interpreter, apart from the venv, whose
SGLang imports see a stand-in `triton`). `gpu_tensor_hash` asserts `tensor.is_cuda`; the tensors
here are handed to it as a subclass that answers True, and the interpreter runs the kernels on the
host memory behind them.

    python tests/sglang_tile_kernel.py IN.pt OUT.json
IN.pt: a list of (tensor, {kwargs for gpu_tensor_hash}); OUT.json: the hashes, as 16 hex digits.
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
    with open(dst, "w") as f:
        json.dump({"hashes": out, "triton": triton.__version__}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
