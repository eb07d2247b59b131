"""Where the verified stall's extra time goes, engine side: an in-process reference engine core on
the GPU (the 7B shape) loads a refit's buckets with and without hashing as it writes, and each
call's host time (until it returns, nothing synced) and its time until the GPU is idle are
reported per mode, medians over alternating refits.

    python benchmarks/verify_stall.py [--refits 30] [--shape 7b] [--bucket-mb 2048] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from refit.bench_gpu import SHAPES, _step
from refit.buckets import TensorMeta, plan_buckets
from refit.reference.engine import EngineCore
from refit.reference.model import init_weights


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--refits", type=int, default=30)
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--bucket-mb", type=int, default=2048)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out")
    args = ap.parse_args()
    from refit.reference.model import ModelConfig

    config = SHAPES[args.shape] if args.shape in SHAPES else ModelConfig(num_layers=28, qkv_bias=True)
    state = init_weights(config, seed=1, device=args.device)
    plan = plan_buckets([TensorMeta.of(n, t) for n, t in state.items()], args.bucket_mb << 20)
    core = EngineCore(config, seed=0, device=args.device)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    modes = {"off": None, "written": "wsum"}
    times: dict[str, dict[str, list[float]]] = {m: {} for m in modes}

    def timed(mode: str, key: str, fn, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        t0 = time.perf_counter()
        out = fn(*a, **k)
        times[mode].setdefault(key, []).append(time.perf_counter() - t0)
        return out

    for i in range(2 * args.refits + 2):
        mode = list(modes)[i % 2]
        _step(state)
        sync()
        core.pause("abort")
        t0 = time.perf_counter()
        timed(mode, "begin", core.begin, plan, modes[mode])
        for m in plan:
            timed(mode, "load_host", core.load, m, [(e.meta.name, state[e.meta.name]) for e in m.entries])
        timed(mode, "loads_host_total", lambda: None)
        times[mode]["loads_host_total"][-1] = time.perf_counter() - t0
        timed(mode, "finalize", core.finalize)  # syncs: the copies have landed
        if modes[mode]:
            report = timed(mode, "verify", core.verify, "wsum")
            assert report["read_back"] == 0, report["read_back"]
        core.continue_generation()
        times[mode].setdefault("total", []).append(time.perf_counter() - t0)
        if i < 2:
            for d in times[mode].values():
                d.clear()
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    out = {
        "device": device, "shape": args.shape, "buckets": len(plan), "refits": args.refits,
        "ms": {m: {k: round(statistics.median(v) * 1e3, 3) for k, v in t.items()} for m, t in times.items()},
    }  # fmt: skip
    if args.device == "cuda":
        core = None
        torch.cuda.empty_cache()
        out["runner_profile"] = runner_profile(config, state, args.refits, args.bucket_mb)
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


def runner_profile(config, state, refits: int, bucket_mb: int) -> dict:  # noqa: ANN001
    """The trainer's side of whole refits (process engine, CUDA IPC) under cProfile, per mode:
    the functions with the most own time, and the runner's phase medians."""
    import cProfile
    import io
    import pstats

    from refit import protocol
    from refit.drivers.ipc import IPCTransport
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.torch_source import TorchSource

    engine = ReferenceEngine.spawn("prof", config, seed=0, device="cuda")
    ctx = protocol.RefitContext(
        TorchSource(state), IPCTransport(), [engine], mode="colocated", pause_mode="abort",
        bucket_bytes=bucket_mb << 20, deadline_s=300.0,
    )  # fmt: skip
    settings = {"off": ("off", "auto"), "written": ("digest", "auto")}
    profs = {m: cProfile.Profile() for m in settings}
    phases: dict[str, list[dict[str, float]]] = {m: [] for m in settings}
    try:
        for i in range(2 * refits + 2):
            mode = list(settings)[i % 2]
            _step(state)
            torch.cuda.synchronize()
            ctx.verify, ctx.digest_point = settings[mode]
            if i >= 2:
                profs[mode].enable()
            result = protocol.run(ctx)
            profs[mode].disable()
            result.raise_for_error()
            if i >= 2:
                phases[mode].append(result.phase_seconds)
    finally:
        ctx.close()
        engine.close()
    report = {}
    for mode, prof in profs.items():
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        report[mode] = {
            "phase_ms": {
                k: round(statistics.median(p.get(k, 0.0) for p in phases[mode]) * 1e3, 3) for k in phases[mode][-1]
            },
            "top_tottime": text.getvalue().splitlines()[:60],
        }
    return report


if __name__ == "__main__":
    main()
