"""On the H200: refit's SGLang-format CUDA payloads rebuilt by SGLang 0.5.23's own receiver code in
another process, and SGLang's ack order against refit's reuse of its send buffers.

The engine process runs what SGLang's `update_weights_from_tensor` runs per TP rank
(managers/tp_worker.py `deserialize_own_rank`: `monkey_patch_torch_reductions()` then
`MultiprocessingSerializer.deserialize`; model_runner_components/weight_updater.py
`_update_weights_from_flattened_bucket`: `FlattenedTensorBucket(...).reconstruct_tensors()`), then
copies into its own weights on its current stream queued behind a GPU sleep (~0.1 s), and acks.
The trainer is refit's `SGLangTensorTransport` (2 persistent CUDA slots): at each ack it releases
the bucket's slot and packs the next bucket into it at once. Per refit every weight is new, so a
bucket overwritten before the engine's copy ran shows as wrong bytes. How the engine acks:

  drop       SGLang's own order: its references dropped, then the ack (torch's IPC deleter syncs
             the engine's stream when the last one goes);
  keep       a reference kept past the ack, no sync (an engine, or a receiver, that holds on);
  keep_sync  a reference kept, but the stream synced before the ack.

`protect`: refit's check at release (a consumer still holding the export, by torch's IPC counter,
gets a fresh buffer instead of a rewrite). Off: that check is bypassed, to show what it prevents.
Figures go to $OUT/sglang_receiver.json when OUT is set.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
import sglang  # noqa: F401 - the wheel travels in .whl (docs/benchmarks.md); a missing one fails here, not skips
import torch
import torch.multiprocessing as mp
from tests_gpu.sglang_engine import engine  # importable by name in the spawned engine process

from refit.buckets import TensorMeta
from refit.drivers import flattened as fl
from refit.drivers import sglang_transport
from refit.drivers.base import Topology
from refit.drivers.sglang_transport import SGLangTensorTransport

TENSORS = 8
ELEMS = 128 << 20  # bf16: 256 MiB a tensor, 2 GiB in all
BUCKET = 512 << 20
REFITS = 20
SLEEP_CYCLES = 200_000_000  # ~0.1 s at the H200's ~2 GHz


def _weights(refit: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(1000 + refit)
    return {f"w{i}": torch.randn(ELEMS, generator=gen, device="cuda").to(torch.bfloat16) for i in range(TENSORS)}


def _run(mode: str, protect: bool, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    if not protect:
        monkeypatch.setattr(sglang_transport, "_still_held", lambda handle, offset: False)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine, args=(child, mode, SLEEP_CYCLES), daemon=True)
    proc.start()
    transport = SGLangTensorTransport(slots=2, device="cuda")
    try:
        metas = [TensorMeta(f"w{i}", "bfloat16", (ELEMS,)) for i in range(TENSORS)]
        plan = transport.plan(metas, BUCKET)
        topology = Topology.of(1, [("e0", 1)], colocated=True)
        transport.connect(plan, topology, 0)
        parent.send([(m.name, m.shape) for m in metas])
        engine_params = parent.recv()
        exact, seconds = 0, []
        for refit in range(REFITS):
            want = _weights(refit)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for manifest in plan:
                part = transport.pack(manifest, [(n, want[n]) for n in manifest.names])
                if refit == 0 and manifest.index == 0:  # torch's counter of the export reads 1 in transit
                    (_, handle, offset), *_ = transport._counters[0]
                    assert fl.ipc_refs(handle, offset) == 1
                payload = transport.payloads(manifest, [part], topology)["e0"]
                parent.send(("bucket", payload.parts[0]["serialized"]))
                assert parent.recv() == "ack"
                transport.release(manifest.index)  # the next bucket may be packed into this slot now
            seconds.append(time.perf_counter() - t0)
            parent.send(("settle",))
            assert parent.recv() == "settled"
            exact += all(torch.equal(engine_params[n], want[n]) for n in want)
        return {
            "mode": mode, "protect": protect, "refits": REFITS, "bit_exact": exact, "buckets_per_refit": len(plan),
            "replaced_buffers": len(transport.held), "refit_s_median": sorted(seconds)[len(seconds) // 2],
        }  # fmt: skip
    finally:
        parent.send(("stop",))
        proc.join(30)
        transport.disconnect()


def _record(row: dict[str, Any]) -> None:
    out = os.environ.get("OUT")
    if out:
        path = os.path.join(out, "sglang_receiver.json")
        rows = []
        if os.path.exists(path):
            with open(path) as f:
                rows = json.load(f)
        with open(path, "w") as f:
            json.dump([*rows, row], f, indent=1)
    print("SUMMARY", json.dumps(row))


def test_sglangs_receiver_rebuilds_refits_payloads_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's own code opens refit's payloads (its patched rebuild, the GPU named by UUID) and
    every one of 20 refits lands bit-exact with the engine's copy slowed: SGLang drops its
    references before acking, so no buffer is replaced and none is rewritten early."""
    row = _run("drop", True, monkeypatch)
    _record(row)
    assert row["bit_exact"] == REFITS and row["replaced_buffers"] == 0


def test_an_engine_that_keeps_a_reference_corrupts_without_refits_check(monkeypatch: pytest.MonkeyPatch) -> None:
    row = _run("keep", False, monkeypatch)
    _record(row)
    assert row["bit_exact"] < REFITS  # buffers rewritten under its queued copies


def test_refits_check_at_release_keeps_a_holding_engine_bit_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    row = _run("keep", True, monkeypatch)
    _record(row)
    assert row["bit_exact"] == REFITS and row["replaced_buffers"] > 0


def test_an_engine_that_syncs_before_its_ack_needs_no_check(monkeypatch: pytest.MonkeyPatch) -> None:
    row = _run("keep_sync", False, monkeypatch)
    _record(row)
    assert row["bit_exact"] == REFITS


def test_vllm_nccl_group_calls_on_one_gpu() -> None:
    """The trainer's side of vLLM's rendezvous through the NCCL library (ctypes, as vLLM's
    pynccl_wrapper), as a one-rank group (NCCL refuses two ranks on one GPU; the two-GPU run is not
    lent): the unique id published as vLLM reads it, ncclCommInitRank, the warm-up all-reduce, a
    bf16 broadcast and its Work, ncclCommAbort."""
    import torch.distributed as dist

    from refit.drivers.vllm_nccl import UNIQUE_ID_KEY, VLLMNcclGroup

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    group = VLLMNcclGroup(store, 1)
    raw = store.get(UNIQUE_ID_KEY)
    assert b"ncclUniqueId" in raw and b"vllm.distributed.device_communicators.pynccl_wrapper" in raw
    t = torch.arange(1024, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    group.broadcast([t]).wait()
    torch.cuda.synchronize()
    assert torch.equal(t, torch.arange(1024, device="cuda", dtype=torch.float32).to(torch.bfloat16))
    group.abort()


def test_vllm_nccl_join_without_workers_ends_at_its_timeout() -> None:
    """No vLLM worker ever joins: the trainer's join gives up at its timeout (a non-blocking NCCL
    communicator, aborted), instead of blocking its rank's thread forever; the next group forms."""
    import time

    import torch.distributed as dist

    from refit.drivers.vllm_nccl import VLLMNcclGroup

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        VLLMNcclGroup(store, 2, timeout_s=3.0)
    took = time.monotonic() - t0
    print("SUMMARY", json.dumps({"nccl_join_timeout_s": 3.0, "gave_up_after_s": round(took, 2)}))
    assert took < 6.0
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    group = VLLMNcclGroup(store, 1, timeout_s=10.0)
    t = torch.ones(16, device="cuda")
    group.broadcast([t]).wait()
    torch.cuda.synchronize()
    group.abort()
