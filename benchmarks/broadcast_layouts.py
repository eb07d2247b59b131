"""Where a disaggregated NCCL refit's time goes (issue 11 probe, two GPUs on one host).

The same 7B-shaped (or `--shape`) bucket stream (refit.bench_gpu's state, 512 MiB buckets) is sent from GPU 0 to
GPU 1 in several layouts; the receiver's wall time per pass (from a line-up broadcast to the last
copy landed) is reported, median of the repeats, with a bit-exact check of the last layout.

  raw           preallocated buffers broadcast back to back (no pack, no copy-out): the floor
  serial        sender: pack bucket k into a buffer, broadcast, the stream waits; receiver:
                receive, then copy the tensors out on the same stream (what refit does today)
  send_overlap  the sender packs k+1 on its stream while k is on the wire (no stream wait on the
                broadcast; a buffer is reused only once its broadcast is done)
  recv_overlap  the receiver copies k out on a side stream while k+1 arrives in the other buffer
  both          both of the above
  direct_T[g]   no pack and no copy-out for tensors of T MiB or more: each is broadcast straight
                from the trainer's tensor into the receiver's (one op each); the smaller ones
                between them are packed into the buffer as before and go as one op per run;
                `g`: a bucket's ops go as one NCCL group (coalesced)

    python benchmarks/broadcast_layouts.py [--repeats N] [--json PATH]     (spawns GPU 1's side)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from refit.bench_broadcast import _free_port, _pair, _plan
from refit.bench_gpu import SHAPES
from refit.buckets import tensor_digest
from refit.drivers.broadcast import close_group
from refit.reference.model import init_weights

LAYOUTS = (
    "raw",
    "serial",
    "send_overlap",
    "recv_overlap",
    "both",
    "direct_0",
    "direct_4",
    "direct_16",
    "direct_64",
    "direct_0g",
    "direct_16g",
)


def _bcast(group: Any, tensor: torch.Tensor, *, wait: bool) -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    work = group.broadcast([tensor], opts)
    if wait:
        work.wait()  # the current stream waits for the broadcast
    return work


def _views(buffer: torch.Tensor, manifest: Any, state: dict[str, torch.Tensor]) -> tuple[list[Any], list[Any]]:
    dst, src = [], []
    for e in manifest.entries:
        t = state[e.meta.name]
        n = t.numel() * t.element_size()
        dst.append(buffer[e.offset : e.offset + n].view(t.dtype).view(t.shape))
        src.append(t)
    return dst, src


def _segments(manifest: Any, threshold: int) -> list[tuple[str, Any]]:
    """("big", entry) for a tensor sent straight; ("small", [entries]) for a run packed together."""
    out: list[tuple[str, Any]] = []
    for e in manifest.entries:
        if e.meta.nbytes >= threshold:
            out.append(("big", e))
        elif out and out[-1][0] == "small":
            out[-1][1].append(e)
        else:
            out.append(("small", [e]))
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def direct_pass(layout: str, rank: int, group: Any, plan: list[Any], state: dict[str, torch.Tensor], bufs: list[Any],
                side: torch.cuda.Stream) -> float:  # fmt: skip
    grouped = layout.endswith("g")
    threshold = int(layout.split("_")[1].rstrip("g")) << 20
    _bcast(group, torch.zeros(1, device="cuda"), wait=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    works: list[Any] = [None, None]
    copied: list[Any] = [None, None]
    for k, m in enumerate(plan):
        slot = k % 2
        segs = _segments(m, threshold)
        small = [e for kind, x in segs if kind == "small" for e in x]
        if rank == 0:
            if works[slot] is not None:
                works[slot].wait()
            if small:
                dst, src = _views(bufs[slot], _Sub(small), state)
                torch._foreach_copy_(dst, src)
        elif copied[slot] is not None:
            torch.cuda.current_stream().wait_event(copied[slot])
        if grouped:
            group._start_coalescing()
        work = None
        for kind, x in segs:
            buf = bufs[slot]
            t = _flat(state[x.meta.name]) if kind == "big" else buf[x[0].offset : x[-1].offset + x[-1].meta.nbytes]
            work = _bcast(group, t, wait=False)
        if grouped:
            work = group._end_coalescing()
        if rank == 0:
            works[slot] = work
        else:
            work.wait()
            if small:
                src, dst = _views(bufs[slot], _Sub(small), state)
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch._foreach_copy_(dst, src)
                    ev = torch.cuda.Event()
                    ev.record(side)
                copied[slot] = ev
    for w in works:
        if w is not None:
            w.wait()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


class _Sub:
    def __init__(self, entries: list[Any]) -> None:
        self.entries = entries


def one_pass(layout: str, rank: int, group: Any, plan: list[Any], state: dict[str, torch.Tensor], bufs: list[Any],
             side: torch.cuda.Stream) -> float:  # fmt: skip
    if layout.startswith("direct"):
        return direct_pass(layout, rank, group, plan, state, bufs, side)
    send_overlap = layout in ("send_overlap", "both")
    recv_overlap = layout in ("recv_overlap", "both")
    _bcast(group, torch.zeros(1, device="cuda"), wait=True)  # line both sides up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    works: list[Any] = [None, None]  # the broadcast last made from each buffer (sender)
    copied: list[Any] = [None, None]  # the copy-out last made from each buffer (receiver)
    for k, m in enumerate(plan):
        buf = bufs[k % 2][: m.nbytes]
        if layout == "raw":
            _bcast(group, buf, wait=True)
            continue
        if rank == 0:
            if send_overlap and works[k % 2] is not None:
                works[k % 2].wait()  # the buffer's last broadcast is done before it is refilled
            dst, src = _views(bufs[k % 2], m, state)
            torch._foreach_copy_(dst, src)
            works[k % 2] = _bcast(group, buf, wait=not send_overlap)
        else:
            if recv_overlap and copied[k % 2] is not None:
                torch.cuda.current_stream().wait_event(copied[k % 2])  # its last copy-out read it
            _bcast(group, buf, wait=True)
            src, dst = _views(bufs[k % 2], m, state)
            if recv_overlap:
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    torch._foreach_copy_(dst, src)
                    ev = torch.cuda.Event()
                    ev.record(side)
                copied[k % 2] = ev
            else:
                torch._foreach_copy_(dst, src)
    for w in works:
        if w is not None:
            w.wait()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def side_main(rank: int, port: int, repeats: int, bucket_mb: int, shape: str = "7b") -> dict[str, Any]:
    torch.cuda.set_device(rank)
    config = SHAPES[shape]
    state = init_weights(config, seed=1, device="cuda")
    if rank == 1:
        state = {n: torch.empty_like(t) for n, t in state.items()}
    plan = _plan(state, bucket_mb << 20)
    slot = max(m.nbytes for m in plan)
    bufs = [torch.empty(slot, dtype=torch.uint8, device="cuda") for _ in range(2)]
    side = torch.cuda.Stream()
    store, group = _pair(port, rank)
    out: dict[str, Any] = {"buckets": len(plan), "bytes": sum(t.numel() * t.element_size() for t in state.values())}
    try:
        for layout in LAYOUTS:
            times = [one_pass(layout, rank, group, plan, state, bufs, side) for _ in range(repeats + 1)][1:]
            out[layout] = {"ms": round(statistics.median(times) * 1e3, 3), "all_ms": [round(t * 1e3, 2) for t in times]}
        out["digest"] = {n: tensor_digest(t) for n, t in state.items()}
    finally:
        close_group(group, "nccl")
        del store
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=512)
    ap.add_argument("--shape", default="7b")
    ap.add_argument("--json")
    ap.add_argument("--side", type=int, default=None)
    ap.add_argument("--port", type=int, default=None)
    args = ap.parse_args()
    if args.side is not None:
        print(json.dumps(side_main(args.side, args.port, args.repeats, args.bucket_mb, args.shape)), flush=True)
        return 0
    port = _free_port()
    argv = [sys.executable, __file__, "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb)]
    argv += ["--shape", args.shape]
    argv += ["--port", str(port)]
    peer = subprocess.Popen([*argv, "--side", "1"], stdout=subprocess.PIPE, text=True, env=os.environ)
    mine = side_main(0, port, args.repeats, args.bucket_mb, args.shape)
    theirs = json.loads(peer.communicate(timeout=600)[0].strip().splitlines()[-1])
    report = {
        "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "bucket_mb": args.bucket_mb,
        "shape": args.shape,
        "buckets": mine["buckets"], "bytes": mine["bytes"], "bit_exact": mine["digest"] == theirs["digest"],
        "receiver_ms": {k: theirs[k]["ms"] for k in LAYOUTS}, "sender_ms": {k: mine[k]["ms"] for k in LAYOUTS},
        "receiver_all_ms": {k: theirs[k]["all_ms"] for k in LAYOUTS},
    }  # fmt: skip
    raw = report["receiver_ms"]["raw"]
    report["ratio_to_raw"] = {k: round(v / raw, 3) for k, v in report["receiver_ms"].items()}
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
