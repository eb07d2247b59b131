"""The engine process of tests_gpu/test_sglang_receiver.py (a module of its own, so a spawned
process can import it by name): SGLang 0.5.23's receiver code per TP rank, a slow copy, an ack."""

from __future__ import annotations

from typing import Any

import torch


def engine(conn: Any, mode: str, sleep_cycles: int) -> None:
    """The engine process: SGLang's receiver code, a slow copy, then the ack in `mode`'s order."""
    torch.cuda.set_device(0)
    metas = conn.recv()
    params = {n: torch.empty(shape, dtype=torch.bfloat16, device="cuda") for n, shape in metas}
    conn.send({n: p for n, p in params.items()})  # torch's own CUDA IPC (before SGLang's patch)
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    def load(data: bytes) -> tuple[Any, Any]:
        """SGLang's per-rank update: its own decode, then the engine's copies (queued behind the
        sleep); like SGLang's updater, nothing of it outlives the call unless the caller keeps it."""
        monkey_patch_torch_reductions()  # what deserialize_own_rank does first
        obj = MultiprocessingSerializer.deserialize(data)
        bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
        named = bucket.reconstruct_tensors()
        torch.cuda._sleep(sleep_cycles)  # the copies below wait behind this on the engine's stream
        for name, t in named:
            params[name].copy_(t)
        return obj, named

    kept: list[Any] = []
    while True:
        msg = conn.recv()
        if msg[0] == "bucket":
            if mode == "drop":
                load(msg[1])  # SGLang: references dropped before the answer
            else:
                kept.append(load(msg[1]))
                if mode == "keep_sync":
                    torch.cuda.current_stream().synchronize()
            conn.send("ack")
        elif msg[0] == "settle":  # end of a refit: let go of everything, finish the copies
            kept.clear()
            torch.cuda.synchronize()
            conn.send("settled")
        else:
            return
