"""Where a disaggregated NCCL refit's host time goes (issue 11 probe, two GPUs on one host).

For each shape and send-slot count, a reference engine on GPU 1 is refit over
`BroadcastTransport(backend="nccl")` from this process on GPU 0 (one connecting refit, then
`--refits` timed ones, each timed on the engine's clock as `refit bench broadcast` does). It prints
the median transfer and stall, the engine's own timeline of the last refit (each audited call's
start and end, ms after the pause began) and, with `--cprofile`, the leader thread's hottest
functions in one more refit.

    python benchmarks/profile_broadcast.py [--shapes 1.5b,7b] [--slots 2,3] [--refits 5] [--cprofile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import time

import torch

from refit import protocol
from refit.bench_gpu import SHAPES, _step, refit_times
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
    ap.add_argument("--slots", default="2")
    ap.add_argument("--refits", type=int, default=5)
    ap.add_argument("--direct-mb", type=int, default=16)
    ap.add_argument("--cprofile", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.cuda.set_device(0)
    for shape in args.shapes.split(","):
        config = SHAPES[shape]
        state = init_weights(config, seed=1, device="cuda")
        for slots in (int(x) for x in args.slots.split(",")):
            engine = ReferenceEngine.spawn("prof", config, seed=0, device="cuda:1")
            transport = BroadcastTransport(slots, backend="nccl", direct_bytes=args.direct_mb << 20)
            ctx = protocol.RefitContext(
                TorchSource(state), transport, [engine], mode="disaggregated", pause_mode="abort",
                bucket_bytes=512 << 20, deadline_s=300.0,
            )  # fmt: skip
            transfers, stalls = [], []
            try:
                for i in range(args.refits + 1):
                    _step(state)
                    torch.cuda.synchronize()
                    since = time.monotonic()
                    protocol.run(ctx).raise_for_error()
                    if i:
                        t = refit_times(engine, since)
                        transfers.append(t["transfer"] * 1e3)
                        stalls.append(t["stall"] * 1e3)
                print(
                    f"== {shape} slots={slots} direct>={args.direct_mb} MiB: transfer median "
                    f"{statistics.median(transfers):.2f} ms {[round(x, 2) for x in transfers]}, stall median "
                    f"{statistics.median(stalls):.2f} ms"
                )
                timeline(engine, since, f"{shape} slots={slots}, last refit")
                if args.cprofile:
                    _step(state)
                    torch.cuda.synchronize()
                    prof = cProfile.Profile()
                    prof.enable()
                    protocol.run(ctx).raise_for_error()
                    prof.disable()
                    out = io.StringIO()
                    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
                    print(f"== {shape}: leader thread cProfile (one more refit), by own time\n{out.getvalue()}")
            finally:
                ctx.close()
                engine.close()
        del state
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
