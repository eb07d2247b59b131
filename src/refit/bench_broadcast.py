"""`refit bench broadcast`: disaggregated refits over NCCL between two GPUs against the broadcast
floor (a benchmark, never a timed test). Needs two CUDA devices on one host: the trainer is this
process on GPU 0; the receivers are processes on GPU 1.

For each shape (the 7B and 1.5B states of `refit.bench_gpu`), in one run:
  raw      back-to-back `broadcast` of preallocated bucket buffers (the same bucket sizes), one
           peer process receiving into its own preallocated buffers: the floor
  seed     the seed documents' path: per bucket the sender flattens into a new buffer and the
           receiver allocates one, receives, copies the slices out, both sync the host per bucket
  refit    `protocol.run` (disaggregated, abort pause) into a reference-engine process on GPU 1
           over `BroadcastTransport(backend="nccl")` (per-tensor broadcasts from the trainer's
           tensors straight into the engine's parameters; `direct_share`: the share of tensors
           that went that way): transfer (first bucket's load start -> its copies landed, engine
           clock) and the whole stall (pause start -> continue end)
Ratios are to the raw floor. bit_exact: after the last refit, every HF tensor's xxHash3 as the
engine holds it equals the trainer's (the seed path is checked the same way in its peer).

`python -m refit.bench_broadcast peer JSON` is the peer process (started by this module).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from refit import protocol
from refit.bench_gpu import SHAPES, _step, refit_times
from refit.buckets import BucketManifest, TensorMeta, plan_buckets, tensor_digest
from refit.drivers.broadcast import BroadcastTransport, broadcast_from_source, close_group, new_group
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import init_weights

PATHS = ("raw", "seed", "refit")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(state: dict[str, torch.Tensor], bucket_bytes: int) -> list[BucketManifest]:
    return plan_buckets([TensorMeta.of(n, t) for n, t in state.items()], bucket_bytes)


def _pair(port: int, rank: int, timeout_s: float = 120.0) -> Any:
    """A two-member NCCL group from its own store (rank 0: this process, GPU 0; rank 1: the peer)."""
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, 2, is_master=rank == 0, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    return store, new_group(store, "bench", rank, 2, timeout_s, "nccl")


def _sides(
    plan: list[BucketManifest], state: dict[str, torch.Tensor] | None, mode: str, group: Any, rank: int, repeats: int
) -> list[float]:
    """Both sides of the raw and seed paths (the same code on each rank); seconds per repeat."""
    device = torch.device("cuda", torch.cuda.current_device())
    slot = max(m.nbytes for m in plan)
    buffers = [torch.empty(slot, dtype=torch.uint8, device=device) for _ in range(2)]
    times = []
    for _ in range(repeats + 1):
        broadcast_from_source(group, torch.zeros(1, device=device))  # line both sides up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, m in enumerate(plan):
            if mode == "raw":
                broadcast_from_source(group, buffers[i % 2][: m.nbytes])
                continue
            if rank == 0:  # the seed sender: flatten into a new buffer, send, wait
                assert state is not None
                flat = torch.cat([state[n].reshape(-1).view(torch.uint8) for n in m.names])
                broadcast_from_source(group, flat)
            else:  # the seed receiver: a new buffer, receive, copy the slices out, wait
                assert state is not None
                flat = torch.empty(m.nbytes, dtype=torch.uint8, device=device)
                broadcast_from_source(group, flat)
                offset = 0
                for n in m.names:
                    t = state[n]
                    t.view(-1).view(torch.uint8).copy_(flat[offset : offset + t.numel() * t.element_size()])
                    offset += t.numel() * t.element_size()
            torch.cuda.synchronize()
            del flat
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[1:]


def peer(spec: dict[str, Any]) -> None:
    """The receiving process of the raw and seed paths (GPU 1)."""
    torch.cuda.set_device(int(spec["device"]))
    config = SHAPES[spec["shape"]]
    state = {n: torch.empty_like(t, device="cuda") for n, t in init_weights(config, 0, device="cuda").items()}
    torch.cuda.empty_cache()  # set-up, before any timing
    plan = _plan(state, int(spec["bucket_bytes"]))
    store, group = _pair(int(spec["port"]), 1)
    try:
        _sides(plan, None, "raw", group, 1, int(spec["repeats"]))
        _sides(plan, state, "seed", group, 1, int(spec["repeats"]))
        digests = {n: tensor_digest(t) for n, t in state.items()}
        print(json.dumps({"digests": digests}), flush=True)
    finally:
        close_group(group, "nccl")
        del store


def _floor_and_seed(shape: str, state: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> dict[str, Any]:
    port = _free_port()
    spec = {"device": 1, "shape": shape, "bucket_bytes": bucket_bytes, "port": port, "repeats": repeats}
    proc = subprocess.Popen(
        [sys.executable, "-m", "refit.bench_broadcast", "peer", json.dumps(spec)], stdout=subprocess.PIPE, text=True
    )
    plan = _plan(state, bucket_bytes)
    store, group = _pair(port, 0)
    try:
        raw = _sides(plan, None, "raw", group, 0, repeats)
        seed = _sides(plan, state, "seed", group, 0, repeats)
        out, _ = proc.communicate(timeout=300)
    finally:
        close_group(group, "nccl")
        del store
        if proc.poll() is None:
            proc.kill()
    got = json.loads(out.strip().splitlines()[-1])["digests"]
    want = {n: tensor_digest(t) for n, t in state.items()}
    return {"raw": raw, "seed": seed, "seed_bit_exact": got == want, "buckets": len(plan)}


def _refit(
    config: Any, state: dict[str, torch.Tensor], *, refits: int, bucket_bytes: int, tick: Callable[[str], None]
) -> dict[str, Any]:
    engine = ReferenceEngine.spawn("bcast", config, seed=0, device="cuda:1")
    ctx = protocol.RefitContext(
        TorchSource(state), BroadcastTransport(backend="nccl"), [engine], mode="disaggregated", pause_mode="abort",
        bucket_bytes=bucket_bytes, deadline_s=300.0,
        verify="off",  # the GPU digest (fused into the engine's copy) is not built yet: CUDA weights hash on the host
    )  # fmt: skip
    stalls, transfers, pre, post = [], [], [], []
    try:
        for i in range(refits + 1):  # the first refit connects (the group forms): not counted
            _step(state)
            torch.cuda.synchronize()
            since = time.monotonic()
            result = protocol.run(ctx).raise_for_error()
            tick(f"refit {i + 1}/{refits + 1}")
            if i == 0:
                continue
            times = refit_times(engine, since)
            stalls.append(times["stall"])
            transfers.append(times["transfer"])
            pre.append(times["pre"])
            post.append(times["post"])
        got = engine.digests(timeout=600)
        want = {n: tensor_digest(t) for n, t in state.items()}
        direct = engine.info()["direct_tensors"]
    finally:
        ctx.close()
        engine.close()
    return {
        "stall": stalls, "transfer": transfers, "bit_exact": got == want, "buckets": result.buckets,
        "pre": statistics.median(pre), "post": statistics.median(post),
        "direct_share": round(direct / ((refits + 1) * len(state)), 3),
    }  # fmt: skip


def broadcast(
    shapes: tuple[str, ...] = ("7b", "1.5b"), *, refits: int = 5, bucket_mb: int = 512,
    tick: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:  # fmt: skip
    if torch.cuda.device_count() < 2:
        raise RuntimeError("refit bench broadcast needs two CUDA devices on this host")
    torch.cuda.set_device(0)
    bucket_bytes = bucket_mb << 20
    report: dict[str, Any] = {
        "bench": "broadcast", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
        "bucket_bytes": bucket_bytes, "refits": refits, "date": time.strftime("%Y-%m-%d"), "shapes": {},
        "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "NCCL_CUMEM_ENABLE")},
    }  # fmt: skip
    for shape in shapes:
        config = SHAPES[shape]
        state = init_weights(config, seed=1, device="cuda")
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        tick(f"{shape}: {len(state)} tensors, {nbytes / 1e9:.2f} GB: raw and seed paths")
        base = _floor_and_seed(shape, state, bucket_bytes, refits)
        tick(f"{shape}: refit path")
        ours = _refit(config, state, refits=refits, bucket_bytes=bucket_bytes, tick=tick)
        raw = statistics.median(base["raw"])

        def row(seconds: float, exact: bool | None, **extra: Any) -> dict[str, Any]:
            return {
                "ms": round(seconds * 1e3, 3), "gbps": round(nbytes / seconds / 1e9, 1),  # noqa: B023
                "ratio_to_raw": round(seconds / raw, 3), "bit_exact": exact, **extra,  # noqa: B023
            }  # fmt: skip

        rows = {
            "raw": row(raw, None),
            "seed": row(statistics.median(base["seed"]), base["seed_bit_exact"]),
            "refit_transfer": row(
                statistics.median(ours["transfer"]), ours["bit_exact"], direct_share=ours["direct_share"]
            ),
            "refit_stall": row(
                statistics.median(ours["stall"]),
                ours["bit_exact"],
                ms_pause_to_first_load=round(ours["pre"] * 1e3, 3),
                ms_landed_to_continued=round(ours["post"] * 1e3, 3),
            ),
        }
        report["shapes"][shape] = {"tensors": len(state), "bytes": nbytes, "buckets": base["buckets"], "paths": rows}
        del state
        torch.cuda.empty_cache()  # between shapes, outside every timed region
    seven = report["shapes"].get("7b", {}).get("paths")
    if seven:
        report["goal"] = {
            "transfer_over_raw": seven["refit_transfer"]["ratio_to_raw"], "transfer_goal": 1.05,
            "stall_over_raw": seven["refit_stall"]["ratio_to_raw"], "stall_goal": 1.15,
            "stall_faster_than_seed": round(1 - seven["refit_stall"]["ms"] / seven["seed"]["ms"], 3),
            "transfer_faster_than_seed": round(1 - seven["refit_transfer"]["ms"] / seven["seed"]["ms"], 3),
            "faster_than_seed_goal": 0.15,
        }  # fmt: skip
    return report


def table(report: dict[str, Any]) -> str:
    lines = [f"refit bench broadcast: {report['device']} x2, torch {report['torch']}, "
             f"{report['bucket_bytes'] >> 20} MiB buckets"]  # fmt: skip
    for shape, s in report["shapes"].items():
        lines.append(f"  {shape}: {s['tensors']} tensors, {s['bytes'] / 1e9:.2f} GB in {s['buckets']} buckets")
        lines.append(f"    {'path':<16} {'ms':>8} {'GB/s':>7} {'x raw':>6}  bit-exact")
        for path, r in s["paths"].items():
            lines.append(
                f"    {path:<16} {r['ms']:>8.2f} {r['gbps']:>7.0f} {r['ratio_to_raw']:>6.2f}  {r['bit_exact']}"
            )
    goal = report.get("goal")
    if goal:
        lines.append(
            f"  goal (7b): transfer <= 1.05 x raw: {goal['transfer_over_raw']:.3f}; stall <= 1.15 x raw: "
            f"{goal['stall_over_raw']:.3f}; faster than seed by >= 15 %: stall {goal['stall_faster_than_seed']:.1%}, "
            f"transfer {goal['transfer_faster_than_seed']:.1%}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "peer":
        peer(json.loads(sys.argv[2]))
    else:
        print("usage: python -m refit.bench_broadcast peer JSON (started by `refit bench broadcast`)", file=sys.stderr)
        sys.exit(2)
