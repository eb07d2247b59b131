"""`refit bench`: measured figures against a floor (benchmarks, never asserted as time limits).

control    N reference-engine processes and a tiny model (one bucket): how long the engines stall
           (pause -> continue, read from the engines' own audit clocks) minus the transfer, per
           refit; median and p99; control round trips per refit (engine call waves outside the
           bucket loop).
transport  a >= 0.5 GB fp32 state through `protocol.run` into one engine process, corruption
           detection on: bytes / the engine's load window (first bucket in to last ack, its own
           clock), against this machine's memcpy bandwidth (one `copy_` of the same bytes in one
           process, sampled right before each timed refit).
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama

# ~0.67 GB of fp32 weights (168M parameters) for the transport bench
TRANSPORT_CONFIG = ModelConfig(
    vocab_size=32000, hidden_size=1024, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=2816
)


def _step(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _window(audit: list[dict[str, Any]], since: float) -> tuple[float, float, float, float] | None:
    """(pause start, continue end, first load start, last load end) after `since`, engine clock."""
    recent = [r for r in audit if r.get("start", r["t"]) >= since and r.get("ok")]
    pauses = [r["start"] for r in recent if r["op"] == "pause"]
    continues = [r["t"] for r in recent if r["op"] == "continue_generation"]
    loads = [r for r in recent if r["op"] == "load"]
    if not pauses or not continues or not loads:
        return None
    return min(pauses), max(continues), min(r["start"] for r in loads), max(r["t"] for r in loads)


Progress = Callable[[int, int], None]  # progress(done, total): 0 when the work starts, then after each refit


def control(
    engines: int = 8,
    refits: int = 100,
    mode: str = "disaggregated",
    warmup: int = 3,
    progress: Progress | None = None,
    ray: bool = False,
    verify: str = "digest",
) -> dict[str, Any]:
    """Stall minus transfer per refit, from the engines' own clocks (CLOCK_MONOTONIC, one host).
    `progress(done, warmup + refits)` counts warm-up refits too. `ray`: the engines are Ray actors
    (`refit.drivers.ray_actors.RayEngine`) on the connected Ray cluster. `verify`: the runs'
    `RefitContext(verify=...)`, or "alternate": refits alternate off and digest on one context, and the
    figures are given for each, with their ratio."""
    config = ModelConfig()
    model = TinyLlama(config, seed=0)
    names = [f"bench-{i}" for i in range(engines)]
    if ray:
        from refit.drivers.ray_actors import RayEngine

        pool: list[Any] = [RayEngine.start(n, config, seed=0) for n in names]
    else:
        pool = ReferenceEngine.spawn_many(names, config, seed=0)
    ctx = protocol.RefitContext(
        TorchSource(model),
        SharedMemoryTransport(),
        pool,
        mode=mode,
        bucket_bytes=4 << 20,
        deadline_s=60.0,  # type: ignore[arg-type]
    )
    controls, stalls, transfers, trips = [], [], [], []
    modes = ("off", "digest") if verify == "alternate" else (verify,)
    by_mode: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}  # (stall, control) per refit
    if progress is not None:
        progress(0, warmup + refits)
    try:
        for i in range(warmup + refits):
            _step(model, i)
            ctx.verify = modes[i % len(modes)]
            if mode == "colocated":
                for e in pool:
                    e.release_memory(["weights", "kv_cache"])
            since = time.monotonic()
            result = protocol.run(ctx).raise_for_error()
            if progress is not None:
                progress(i + 1, warmup + refits)
            if i < warmup:
                continue
            windows = [_window(e.audit(), since) for e in pool]
            if any(w is None for w in windows):
                raise RuntimeError("an engine's audit has no pause/load/continue for this refit")
            stall = max(w[1] for w in windows) - min(w[0] for w in windows)  # type: ignore[index]
            transfer = max(w[3] for w in windows) - min(w[2] for w in windows)  # type: ignore[index]
            stalls.append(stall)
            transfers.append(transfer)
            controls.append(stall - transfer)
            trips.append(result.round_trips)
            by_mode[ctx.verify].append((stall, stall - transfer))
    finally:
        ctx.close()
        for e in pool:
            e.close()
    ms = [c * 1e3 for c in controls]
    return {
        "bench": "control",
        "hosting": "ray actors" if ray else "processes",
        "engines": engines,
        "refits": refits,
        "mode": mode,
        "buckets_per_refit": result.buckets,
        "round_trips_per_refit": statistics.median(trips),
        "control_ms_median": round(statistics.median(ms), 3),
        "control_ms_p99": round(_percentile(ms, 0.99), 3),
        "stall_ms_median": round(statistics.median(stalls) * 1e3, 3),
        "transfer_ms_median": round(statistics.median(transfers) * 1e3, 3),
        "verify": verify,
        **_verify_figures(by_mode),
    }


def _verify_figures(by_mode: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Per verify mode (when a run alternated them): median stall and control ms, and the ratio of
    the verified stall to the unverified one."""
    if len(by_mode) < 2:
        return {}
    out: dict[str, Any] = {}
    for mode, pairs in by_mode.items():
        out[f"stall_ms_median_verify_{mode}"] = round(statistics.median(p[0] for p in pairs) * 1e3, 3)
        out[f"control_ms_median_verify_{mode}"] = round(statistics.median(p[1] for p in pairs) * 1e3, 3)
    out["verified_stall_ratio"] = round(out["stall_ms_median_verify_digest"] / out["stall_ms_median_verify_off"], 3)
    return out


SMALL_CONFIG = ModelConfig(vocab_size=1024, hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=4)


class Memcpy:
    """This machine's memcpy bandwidth for `nbytes`: one-process `copy_` with torch's default
    threads, between two buffers whose pages were touched once. Sampled right before every timed
    refit, so a ratio compares figures taken under the same load (the box's bandwidth drifts)."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.src = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)
        self.samples: list[float] = []

    def sample(self, repeats: int = 3) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.dst.copy_(self.src)
            times.append(time.perf_counter() - t0)
        gbps = self.nbytes / statistics.median(times) / 1e9
        self.samples.append(gbps)
        return gbps


def _transfer(
    model: Any,
    config: ModelConfig,
    memcpy: Memcpy,
    *,
    refits: int,
    bucket_mb: int,
    checksums: bool,
    threads: int,
    tick: Callable[[], None] = lambda: None,
) -> dict[str, Any]:
    """Refits of `model` into one fresh engine process; the transfer as the engine saw it: from its
    first bucket's arrival to its last bucket's ack, on its own clock (the finalize that rides on
    the last bucket's call is not transport)."""
    engine = ReferenceEngine.spawn("bench-transport", config, seed=0, threads=threads)
    ctx = protocol.RefitContext(
        TorchSource(model), SharedMemoryTransport(checksums=checksums), [engine], mode="disaggregated",
        bucket_bytes=bucket_mb << 20, deadline_s=600.0,
    )  # fmt: skip
    seconds, phases, floors = [], [], []
    try:
        for i in range(refits + 1):  # the first refit connects and maps the buffers: not counted
            _step(model, 100 * i + checksums)
            if i:
                floors.append(memcpy.sample())
            since = time.monotonic()
            result = protocol.run(ctx).raise_for_error()
            tick()
            if i:
                window = _window(engine.audit(), since)
                if window is None:
                    raise RuntimeError("the engine's audit shows no loads for this refit")
                seconds.append(window[3] - window[2])
                phases.append(result.phase_seconds["TRANSFERRING"])
        state = engine.state_dict(timeout=600)
        exact = all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    finally:
        ctx.close()
        engine.close()
    best = statistics.median(seconds)
    return {
        "checksums": checksums,
        "bytes": result.bytes_moved,
        "buckets": result.buckets,
        "seconds": round(best, 4),
        "seconds_all": [round(s, 4) for s in seconds],
        "transferring_phase_s": [round(s, 4) for s in phases],
        "gbps": round(result.bytes_moved / best / 1e9, 3),
        "memcpy_gbps": round(statistics.median(floors), 3),
        "memcpy_gbps_all": [round(f, 3) for f in floors],
        "ratio": round(result.bytes_moved / best / 1e9 / statistics.median(floors), 3),
        "bit_exact": exact,
    }


def transport(
    refits: int = 6,
    bucket_mb: int = 64,
    checksums: bool = True,
    threads: int = 2,
    small: bool = False,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """A >= 0.5 GB fp32 state through protocol.run into one engine process over shared memory, three
    ways: zero-copy (the trainer's weights in a `share_memory` arena) with corruption detection
    (the goal's configuration, the top-level figures), zero-copy without it, and the copying path
    (weights in ordinary memory) with it. `small`: a few-MB state, for a quick smoke run.
    `progress(done, total)` counts every refit of the three variants (connecting ones included)."""
    from refit.drivers.shm import share_memory

    config = SMALL_CONFIG if small else TRANSPORT_CONFIG
    shared = TinyLlama(config, seed=0)
    share_memory(shared)  # the trainer keeps training these in place; engines read them where they lie
    nbytes = sum(p.nbytes for p in shared.parameters())
    memcpy = Memcpy(nbytes)
    total, done = 3 * (refits + 1), 0

    def tick() -> None:
        nonlocal done
        done += 1
        if progress is not None:
            progress(done, total)

    if progress is not None:
        progress(0, total)
    args = {"refits": refits, "bucket_mb": bucket_mb, "threads": threads, "tick": tick}
    variants = {
        "zero_copy": _transfer(shared, config, memcpy, checksums=checksums, **args),
        "zero_copy_no_checksums": _transfer(shared, config, memcpy, checksums=False, **args),
    }
    del shared
    plain = TinyLlama(config, seed=0)
    variants["copy"] = _transfer(plain, config, memcpy, checksums=checksums, **args)
    del memcpy
    main = variants["zero_copy"]
    return {
        "bench": "transport",
        "transport": "shm",
        "path": "zero_copy",
        "checksums": checksums,
        "bytes": main["bytes"],
        "bucket_bytes": bucket_mb << 20,
        "buckets": main["buckets"],
        "seconds": main["seconds"],
        "gbps": main["gbps"],
        "memcpy_gbps": main["memcpy_gbps"],
        "ratio": main["ratio"],
        "engine_threads": threads,
        "bit_exact": all(v["bit_exact"] for v in variants.values()),
        "variants": variants,
    }


def write_json(report: dict[str, Any], path: str | None) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
