"""Two GPUs (run by benchmarks/gpu.sh only when the machine has two): a trainer on GPU 0 and a
reference engine process on GPU 1, refit over the NCCL broadcast transport."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from refit import protocol
from refit.drivers.broadcast import BroadcastTransport
from refit.drivers.reference import ReferenceEngine
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama, greedy

assert torch.cuda.device_count() >= 2, "tests_gpu/test_two_gpu.py needs two GPUs"

CFG = ModelConfig(
    vocab_size=512, hidden_size=256, num_layers=3, num_heads=8, num_kv_heads=2, intermediate_size=512,
    qkv_bias=True, dtype="bfloat16", model_type="qwen2",
)  # fmt: skip


@pytest.mark.parametrize(("ops", "direct_bytes"), [("tensor", 0), ("tensor", 32 << 10), ("bucket", 0)])
def test_nccl_broadcast_refit_gpu0_to_gpu1(ops: str, direct_bytes: int) -> None:
    """ops="tensor" (the default over NCCL): each bucket goes as one NCCL group of broadcasts,
    tensors of `direct_bytes` or more from the trainer's parameters straight into the engine's,
    runs of smaller ones packed (32 KiB: a mix in this model); "bucket": packed, one broadcast
    per bucket, copied out on the engine's side stream."""
    torch.cuda.set_device(0)
    model = TinyLlama(CFG, seed=0).cuda()
    engine = ReferenceEngine.spawn("gpu1", CFG, seed=0, device="cuda:1")
    transport = BroadcastTransport(backend="nccl", ops=ops, direct_bytes=direct_bytes)
    ctx = protocol.RefitContext(
        TorchSource(model), transport, [engine], mode="disaggregated", pause_mode="abort", bucket_bytes=64 << 10,
        deadline_s=120,
    )  # fmt: skip
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    direct = sum(n >= direct_bytes for n in sizes) if ops == "tensor" else 0
    assert ops == "bucket" or 0 < direct <= len(sizes)
    try:
        for i in range(3):
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(-1.0 if i % 2 else 1.0).add_(0.01)
            result = protocol.run(ctx).raise_for_error()
            assert result.buckets > 4
            state = engine.state_dict(timeout=120)
            for k, v in model.state_dict().items():
                assert torch.equal(state[k], v.detach().cpu()), k
            assert engine.generate([1, 2, 3], 6)["output"] == greedy(model, [1, 2, 3], 6)
            assert engine.info()["direct_tensors"] == (i + 1) * direct
    finally:
        ctx.close()
        engine.close()


# ---- the ncclCommSplit regression (NeMo RL #3189) ------------------------------------------------

ROLE = """
import datetime, json, os, sys, time, torch, torch.distributed as dist
sys.path.insert(0, {src!r})
from refit.drivers.broadcast import broadcast_from_source, new_group, close_group
cfg = json.loads(sys.argv[1])
torch.cuda.set_device(cfg["gpu"])
if cfg["role"] in ("rank0", "rank1"):  # the trainer's default group, bound to a device (eager NCCL init)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{cfg['default_port']}}", rank=cfg["rank"],
                            world_size=2, device_id=torch.device("cuda", cfg["gpu"]),
                            timeout=datetime.timedelta(seconds=120))
if cfg["role"] == "rank1":
    time.sleep(cfg["busy_s"])  # a trainer rank busy elsewhere: it takes part in no refit call
elif cfg["mode"] == "naive":  # the source rank makes its weight-update group from the default group
    dist.new_group([0])
    print("formed", flush=True)
else:  # refit's way: a group of its own store (trainer rank 0 + an engine), never from the default group
    store = dist.TCPStore("127.0.0.1", cfg["side_port"], 2, is_master=cfg["role"] == "rank0",
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
    group = new_group(store, "side", 0 if cfg["role"] == "rank0" else 1, 2, 60.0, "nccl")
    t = torch.full((1024,), 7.0 if cfg["role"] == "rank0" else 0.0, device="cuda")
    broadcast_from_source(group, t)
    torch.cuda.synchronize()
    print("got", float(t.sum()), flush=True)
    close_group(group, "nccl")
"""


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(cfg: dict[str, object]) -> subprocess.Popen[str]:
    code = ROLE.format(src=str(Path(__file__).resolve().parents[1] / "src"))
    return subprocess.Popen(
        [sys.executable, "-c", code, json.dumps(cfg)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def test_a_naive_side_group_hangs_beside_a_bound_default_group_and_refits_does_not() -> None:
    """The trainer's default group is NCCL with a bound device on both ranks. A weight-update group
    made from it by the source rank alone (`new_group`: a split or a barrier over the default
    group) does not form while the other rank trains: shown bounded, 20 s. refit's group (its own
    store: trainer rank 0 and an engine on GPU 1) forms and broadcasts beside the same default
    group."""
    base = {"default_port": _free_port(), "side_port": _free_port(), "busy_s": 40}
    naive = [_start({**base, "role": "rank0", "rank": 0, "gpu": 0, "mode": "naive"}),
             _start({**base, "role": "rank1", "rank": 1, "gpu": 1, "mode": "naive"})]  # fmt: skip
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            naive[0].communicate(timeout=20)  # still inside new_group after 20 s: it hangs
    finally:
        for p in naive:
            p.kill()
            p.communicate()
    base = {"default_port": _free_port(), "side_port": _free_port(), "busy_s": 40}
    ours = [_start({**base, "role": "rank0", "rank": 0, "gpu": 0, "mode": "refit"}),
            _start({**base, "role": "rank1", "rank": 1, "gpu": 1, "mode": "refit"}),
            _start({**base, "role": "engine", "gpu": 1, "mode": "refit"})]  # fmt: skip
    try:
        out0, _ = ours[0].communicate(timeout=60)
        out2, _ = ours[2].communicate(timeout=60)
        assert ours[0].returncode == 0 and "got 7168.0" in out0, out0[-2000:]
        assert ours[2].returncode == 0 and "got 7168.0" in out2, out2[-2000:]
    finally:
        for p in ours:
            p.kill()
            p.communicate()


# ---- failure drill: the engine process killed mid-broadcast --------------------------------------


def test_engine_killed_mid_broadcast_then_a_fresh_engine_refits() -> None:
    """The engine process dies (SIGKILL) when bucket 3 arrives, while the trainer's NCCL broadcast
    of it is queued. The run ends inside its deadline with the engine failed, nothing published,
    the communicator aborted (the trainer's GPU stream drains) and the lock released; a refit into
    a fresh engine then succeeds bit for bit."""
    torch.cuda.set_device(0)
    model = TinyLlama(CFG, seed=0).cuda()
    dead = ReferenceEngine.spawn("doomed", CFG, seed=0, device="cuda:1")
    kill = protocol.FaultPlan().fail_at("transferring", engine=0, bucket=3, kind="kill")
    ctx = protocol.RefitContext(
        TorchSource(model), BroadcastTransport(backend="nccl"), [dead], mode="disaggregated", pause_mode="abort",
        bucket_bytes=64 << 10, deadline_s=30, faults=kill,
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        result = protocol.run(ctx)
        took = time.monotonic() - t0
        assert not result.ok and result.version is None
        assert result.engines["doomed"].status == "failed"
        assert took < 30 + 10
        assert not ctx.transport.connected
        done = threading.Event()
        threading.Thread(target=lambda: (torch.cuda.synchronize(), done.set()), daemon=True).start()
        assert done.wait(30), "the trainer's GPU work did not drain after the communicator was aborted"
        assert ctx.lock is not None and ctx.lock.holder is None
    finally:
        ctx.close()
        dead.close()
    fresh = ReferenceEngine.spawn("fresh", CFG, seed=0, device="cuda:1")
    ctx = protocol.RefitContext(
        TorchSource(model), BroadcastTransport(backend="nccl"), [fresh], mode="disaggregated", pause_mode="abort",
        bucket_bytes=64 << 10, deadline_s=60,
    )  # fmt: skip
    try:
        protocol.run(ctx).raise_for_error()
        state = fresh.state_dict(timeout=120)
        for k, v in model.state_dict().items():
            assert torch.equal(state[k], v.detach().cpu()), k
    finally:
        ctx.close()
        fresh.close()
