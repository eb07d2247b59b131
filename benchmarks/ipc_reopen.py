"""What a consumer pays to open a CUDA IPC export of a buffer it opened before (issue 23: does
torch's IPC handle cache make SGLang's per-bucket reopen near free?).

The producer (this process) exports one buffer per size; a consumer process rebuilds it from the
pickled export as SGLang's receiver does (torch's `rebuild_cuda_tensor`, through SGLang's patched
form when SGLang is importable), reads one byte, and either drops it (`drop`: SGLang's updater
keeps nothing past a bucket, so torch closes the handle and the next refit opens it again) or
keeps the first rebuild alive (`keep`: torch's cache of opened handles then returns the same
mapping). Per size and mode: the median time of the rebuild + drop, over `REPEATS` exports of the
same buffer (each a fresh export, as each refit's request is). Run on a GPU machine:

    python benchmarks/ipc_reopen.py [out.json]
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

import torch
import torch.multiprocessing as mp

SIZES_MB = (64, 512, 2048, 4096)
REPEATS = 20


def _consumer(conn: Any) -> None:
    from multiprocessing.reduction import ForkingPickler

    torch.cuda.set_device(0)
    kept: list[Any] = []
    while True:
        msg = conn.recv()
        if msg is None:
            return
        mode, data = msg
        if mode == "release":
            kept.clear()
            torch.cuda.synchronize()
            conn.send(0.0)
            continue
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        tensor = ForkingPickler.loads(data)
        tensor[:1].sum().item()  # touch it (a host sync: the open is done)
        if mode == "keep" and not kept:
            kept.append(tensor)
        del tensor
        took = time.perf_counter() - t0
        conn.send(took)


def main(argv: list[str]) -> int:
    from multiprocessing.reduction import ForkingPickler

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_consumer, args=(child,), daemon=True)
    proc.start()
    rows = []
    try:
        for mb in SIZES_MB:
            buffer = torch.zeros(mb << 20, dtype=torch.uint8, device="cuda")
            for mode in ("drop", "keep"):
                times = []
                for _ in range(REPEATS):
                    parent.send((mode, bytes(ForkingPickler.dumps(buffer))))
                    times.append(parent.recv())
                parent.send(("release", None))  # let go of a kept one
                parent.recv()
                rows.append({
                    "mb": mb, "mode": mode, "ms_median": round(statistics.median(times[2:]) * 1e3, 3),
                    "ms_first": round(times[0] * 1e3, 3), "repeats": REPEATS,
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
            del buffer
            torch.cuda.empty_cache()
    finally:
        parent.send(None)
        proc.join(30)
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
