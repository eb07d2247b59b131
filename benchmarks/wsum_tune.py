"""Tune the GPU digest's launch (refit.wsum BLOCK, ITERS, WARPS) on a model-shaped state: for each
choice, the digest alone and the copy with the digest fused in, against torch's copy of the same
tensors, in one process (medians over repeats, CUDA-synchronized wall time). Every choice must give
the same digests as the first. Usage: python benchmarks/wsum_tune.py [7b|1.5b] [out.json]"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from refit import wsum
from refit.bench_gpu import SHAPES
from refit.reference.model import init_weights

# (BLOCK, ITERS, WARPS). The kernel reduces each step's sums at once; the first tuning run (results/
# wsum_tune_7b_h100_2026-12-06.json, "step_sums") also tried per-thread accumulators: 1.4-2.0x slower.
CHOICES = [(4096, 4, 8), (2048, 8, 8), (1024, 16, 4), (512, 32, 2), (4096, 8, 16)]


def timed(fn, repeats: int = 7) -> float:  # noqa: ANN001
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[2:]) * 1e3


def main() -> None:
    shape = sys.argv[1] if len(sys.argv) > 1 else "7b"
    state = init_weights(SHAPES[shape], seed=1, device="cuda")
    src = list(state.values())
    dst = [torch.empty_like(t) for t in src]
    nbytes = sum(t.numel() * t.element_size() for t in src)
    pairs = list(zip(dst, src, strict=True))
    regions = {str(i): t for i, t in enumerate(dst)}
    report = {"device": torch.cuda.get_device_name(0), "shape": shape, "bytes": nbytes, "tensors": len(src)}
    report["ms_copy"] = timed(lambda: torch._foreach_copy_(dst, src))
    rows, want = [], None
    for block, iters, warps in CHOICES:
        wsum.BLOCK, wsum.ITERS, wsum.WARPS = block, iters, warps
        lanes = wsum.gpu_lanes(src).cpu().tolist()
        written = wsum.Written(regions)
        written.copy(pairs)
        fused = written.results()
        want = want or (lanes, fused)
        ms_digest = timed(lambda: wsum.gpu_lanes(src))
        ms_fused = timed(lambda: wsum.Written(regions).copy(pairs))
        row = {
            "block": block, "iters": iters, "warps": warps, "ms_digest": round(ms_digest, 3),
            "digest_gbps": round(nbytes / ms_digest / 1e6, 1), "ms_copy_and_digest": round(ms_fused, 3),
            "fused_over_copy": round(ms_fused / report["ms_copy"], 3), "same_digests": (lanes, fused) == want,
        }  # fmt: skip
        rows.append(row)
        print(row, flush=True)
    report["choices"] = rows
    print(f"copy {report['ms_copy']:.2f} ms", flush=True)
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
