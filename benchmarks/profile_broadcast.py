"""Where a disaggregated NCCL refit's host time goes (issue 11 probe, two GPUs on one host).

For each shape, a reference engine on GPU 1 is refit over `BroadcastTransport(backend="nccl")`
from this process on GPU 0 (one connecting refit, then `--refits` timed ones); for the last one it
prints the engine's own timeline (each audited call's start and end, ms after the pause began)
and the trainer's hottest functions (cProfile, by own time).

    python benchmarks/profile_broadcast.py [--shapes 1.5b,7b] [--refits 3] [--ops tensor]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from refit import protocol
from refit.bench_gpu import SHAPES, _step
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import init_weights


def timeline(engine: ReferenceEngine, since: float, title: str) -> None:
    audit = [a for a in engine.audit() if a.get("start", a["t"]) >= since]
    t0 = min(a.get("start", a["t"]) for a in audit if a["op"] == "pause")
    print(f"== {title}: engine timeline (ms after the pause began)")
    for a in audit:
        start = 1e3 * (a.get("start", a["t"]) - t0)
        print(f"  {a['op']:<20} {start:8.3f} -> {1e3 * (a['t'] - t0):8.3f}  bucket {a.get('bucket')}")
    print(f"  copies landed at {1e3 * (engine.info()['copies_landed_at'] - t0):.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1.5b,7b")
    ap.add_argument("--refits", type=int, default=3)
    ap.add_argument("--ops", default="tensor")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        state = init_weights(config, seed=1, device="cuda")
        engine = ReferenceEngine.spawn("prof", config, seed=0, device="cuda:1")
        ctx = protocol.RefitContext(
            TorchSource(state), BroadcastTransport(backend="nccl", ops=args.ops), [engine], mode="disaggregated",
            pause_mode="abort", bucket_bytes=512 << 20, deadline_s=300.0,
        )  # fmt: skip
        try:
            for i in range(args.refits + 1):
                _step(state)
                torch.cuda.synchronize()
                since = time.monotonic()
                prof = cProfile.Profile() if i == args.refits else None
                if prof:
                    prof.enable()
                protocol.run(ctx).raise_for_error()
                if prof:
                    prof.disable()
                if i >= args.refits - 1:
                    timeline(engine, since, f"{shape}, refit {i}" + (" (profiled)" if prof else ""))
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"== {shape}: trainer cProfile (last refit), by own time")
            print(out.getvalue())
        finally:
            ctx.close()
            engine.close()
        del state
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
