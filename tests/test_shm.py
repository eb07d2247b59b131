"""The shared-memory transport: buffers mapped once, reused only after release, never leaked;
per-TP-rank parts routed from the right trainer rank; an oversized tensor in a buffer of its own."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from refit.buckets import TensorMeta, plan_buckets
from refit.drivers.base import ConnectInfo, Payload, Topology
from refit.drivers.shm import SharedMemoryReceiver, SharedMemoryTransport, leaked_segments

ONE = Topology.of(1, [("e0", 1)], colocated=False)


def _bucket(n: int, value: float) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{n}", torch.full((8, 8), value))]


def _connect(t: SharedMemoryTransport, plan, topology: Topology = ONE, rank: int = 0) -> ConnectInfo:
    return t.attach_infos([t.connect(plan, topology, rank)], topology)["e0"]


def _payload(t: SharedMemoryTransport, plan, i: int, value: float, topology: Topology = ONE) -> Payload:
    return t.payloads(plan[i], [t.pack(plan[i], _bucket(i, value))], topology)["e0"]


@pytest.mark.parametrize("arena_alive", [False, True])
def test_round_trip_through_a_receiver(tmp_path: Path, arena_alive: bool) -> None:
    """Slots reused only after release; a double release raises whether or not some model's
    `share_memory` arena lives in this process (it once passed silently when one did)."""
    from torch import nn

    from refit.drivers.shm import share_memory

    keep = nn.Linear(4, 4) if arena_alive else None
    if keep is not None:
        share_memory(keep, directory=tmp_path)
    t = SharedMemoryTransport(slots=2, directory=tmp_path)
    plan = plan_buckets([TensorMeta(f"w{i}", "float32", (8, 8)) for i in range(3)], 256)
    info = _connect(t, plan)
    assert len(leaked_segments(tmp_path)) == 2 + arena_alive  # one file per slot, created once
    rx = SharedMemoryReceiver(info)
    p0 = _payload(t, plan, 0, 1.0)
    p1 = _payload(t, plan, 1, 2.0)
    with pytest.raises(RuntimeError, match="no free buffer for bucket 2"):
        t.pack(plan[2], _bucket(2, 3.0))  # both slots wait for acks: nothing is overwritten
    got = rx.read(p0)
    rx.verify(p0, got)
    assert torch.equal(got[0][1], torch.full((8, 8), 1.0))
    t.release(0)
    with pytest.raises(RuntimeError, match="no buffer holds bucket 0"):
        t.release(0)  # a double release is a bug, not a no-op
    p2 = _payload(t, plan, 2, 3.0)
    assert p2.parts[0]["path"] == p0.parts[0]["path"]  # the released slot is the one reused
    assert torch.equal(rx.read(p2)[0][1], torch.full((8, 8), 3.0))
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))
    t.disconnect()
    assert len(leaked_segments(tmp_path)) == arena_alive  # the slots are gone; an arena stays with its model
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))  # unlinked, still mapped: no dangling read
    t.disconnect()  # idempotent


def test_a_damaged_bucket_fails_its_checksum(tmp_path: Path) -> None:
    t = SharedMemoryTransport(directory=tmp_path)
    plan = plan_buckets([TensorMeta("w0", "float32", (8, 8))], 256)
    rx = SharedMemoryReceiver(_connect(t, plan))
    p0 = _payload(t, plan, 0, 1.0)
    tensors = rx.read(p0)
    tensors[0][1][3, 3] = 7.0  # the bytes change after packing
    with pytest.raises(ValueError, match="checksum mismatch"):
        rx.verify(p0, tensors)
    t.disconnect()


def test_receiver_refuses_missing_or_resized_buffers(tmp_path: Path) -> None:
    t = SharedMemoryTransport(directory=tmp_path)
    plan = plan_buckets([TensorMeta("w", "float32", (4,))], 64)
    info = _connect(t, plan)
    path = info.parts[0]["paths"][0]
    os.truncate(path, 8)
    with pytest.raises(ValueError, match="has 8 bytes"):
        SharedMemoryReceiver(info)
    t.disconnect()
    with pytest.raises(FileNotFoundError):
        SharedMemoryReceiver(info)
    empty = SharedMemoryReceiver(ConnectInfo("shm", info.receiver, parts=({"paths": [], "slot_bytes": 64},)))
    with pytest.raises(ValueError, match="payload names buffer '/etc/passwd', not a refit shared-memory buffer"):
        empty.read(Payload("shm", plan[0], parts=({"path": "/etc/passwd"},)))


def test_buffers_are_freed_when_the_transport_is_dropped(tmp_path: Path) -> None:
    t = SharedMemoryTransport(directory=tmp_path)
    t.connect(plan_buckets([TensorMeta("w", "float32", (4,))], 64), ONE, 0)
    assert leaked_segments(tmp_path)
    del t
    gc.collect()
    assert leaked_segments(tmp_path) == []


def test_an_abandoned_buffer_is_replaced_never_reused(tmp_path: Path) -> None:
    """An engine that never answered may still read its buffer: that file is left alone and a new
    one takes its slot; the receiver maps the new file on first use."""
    t = SharedMemoryTransport(slots=1, directory=tmp_path)
    plan = plan_buckets([TensorMeta(f"w{i}", "float32", (8, 8)) for i in range(2)], 256)
    rx = SharedMemoryReceiver(_connect(t, plan))
    p0 = _payload(t, plan, 0, 1.0)
    t.abandon(0)
    p1 = _payload(t, plan, 1, 2.0)
    assert p1.parts[0]["path"] != p0.parts[0]["path"] and len(leaked_segments(tmp_path)) == 2
    assert torch.equal(rx.read(p0)[0][1], torch.full((8, 8), 1.0))  # the slow reader still sees its bucket
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))
    t.disconnect()
    assert leaked_segments(tmp_path) == []


def test_an_oversized_tensor_gets_its_own_buffer_not_bigger_slots(tmp_path: Path) -> None:
    t = SharedMemoryTransport(slots=2, directory=tmp_path)
    metas = [
        TensorMeta("small", "float32", (8, 8)),
        TensorMeta("huge", "float32", (64, 64)),
        TensorMeta("s2", "float32", (8,)),
    ]
    plan = plan_buckets(metas, 1024)
    assert [m.oversized for m in plan] == [False, True, False]
    info = _connect(t, plan)
    assert info.parts[0]["slot_bytes"] == 256  # slots fit ordinary buckets only
    rx = SharedMemoryReceiver(info)
    huge = torch.arange(64 * 64, dtype=torch.float32).view(64, 64)
    part = t.pack(plan[1], [("huge", huge)])
    assert t.buffer_bytes == 2 * 256 + 64 * 64 * 4  # two slots plus the one oversized bucket in flight
    got = rx.read(t.payloads(plan[1], [part], ONE)["e0"])
    assert torch.equal(got[0][1], huge)
    t.release(1)
    assert t.buffer_bytes == 2 * 256 and len(leaked_segments(tmp_path)) == 2  # its file is gone once acked
    t.disconnect()


def test_colocated_parts_come_from_each_tp_ranks_own_trainer_rank(tmp_path: Path) -> None:
    """Engine i's TP rank j reads trainer rank (offset_i + j): two trainer ranks, two TP=1 engines."""
    topo = Topology.of(2, [("a", 1), ("b", 1)], colocated=True)
    plan = plan_buckets([TensorMeta("w0", "float32", (8, 8))], 256)
    ranks = [SharedMemoryTransport(directory=tmp_path) for _ in range(2)]
    infos = [t.connect(plan, topo, r) for r, t in enumerate(ranks)]
    per_engine = ranks[0].attach_infos(infos, topo)
    assert per_engine["a"].parts[0]["rank"] == 0 and per_engine["b"].parts[0]["rank"] == 1
    parts = [t.pack(plan[0], _bucket(0, float(r + 1))) for r, t in enumerate(ranks)]
    payloads = ranks[0].payloads(plan[0], parts, topo)
    for name, value in (("a", 1.0), ("b", 2.0)):
        got = SharedMemoryReceiver(per_engine[name]).read(payloads[name])
        assert torch.equal(got[0][1], torch.full((8, 8), value))
    disagg = Topology.of(2, [("a", 1), ("b", 1)], colocated=False)
    assert [ranks[0].feeds(disagg, r) for r in range(2)] == [True, False]  # rank 1 only drains
    for t in ranks:
        t.disconnect()


def test_tensors_in_a_shared_arena_travel_by_reference(tmp_path: Path) -> None:
    """After share_memory(model) the trainer's parameters live in one shared file: a bucket of them
    takes no slot and no copy; the engine reads them in place, bit-exact, checksum verified. A
    tensor the trainer reallocated since (outside the arena) is copied as usual."""
    from torch import nn

    from refit.drivers.shm import share_memory
    from refit.drivers.torch_source import TorchSource

    model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
    weight = model[0].weight
    path = share_memory(model, directory=tmp_path)
    assert Path(path).exists() and model[0].weight is weight  # the same Parameter, now backed by the arena
    source = TorchSource(model)
    t = SharedMemoryTransport(directory=tmp_path)
    plan = t.plan(source.metas(), 1 << 20)
    rx = SharedMemoryReceiver(_connect(t, plan))
    ((manifest, tensors),) = zip(plan, source.iter_buckets(plan), strict=True)
    part = t.pack(manifest, tensors)
    assert part["refs"] and all(r is not None for r in part["refs"]) and "path" not in part  # no slot taken
    payload = t.payloads(manifest, [part], ONE)["e0"]
    got = rx.read(payload)
    rx.verify(payload, got)
    assert all(torch.equal(v, model.state_dict()[n]) for n, v in got)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # training in place: the engine's view sees the arena, not a stale copy
    assert torch.equal(rx.read(payload)[0][1], model[0].weight)
    t.release(0)
    with pytest.raises(RuntimeError, match="no buffer holds bucket 0"):
        t.release(0)  # sent by reference, released once: a second release is a bug here too
    model[1].weight = nn.Parameter(torch.zeros(8, 16))  # reallocated outside the arena
    ((manifest, tensors),) = zip(plan, source.iter_buckets(plan), strict=True)
    part = t.pack(manifest, tensors)
    refs = dict(zip(manifest.names, part["refs"], strict=True))
    assert refs["1.weight"] is None and refs["0.weight"] is not None and "path" in part  # copied into a slot
    got = dict(rx.read(t.payloads(manifest, [part], ONE)["e0"]))
    assert torch.equal(got["1.weight"], torch.zeros(8, 16)) and torch.equal(got["0.weight"], model[0].weight)
    t.release(0)
    t.disconnect()


def test_digests_taken_before_the_pause_are_dropped_once_the_tensor_changes(tmp_path: Path) -> None:
    """`prepare` hashes arena tensors before any engine is paused; pack reuses a digest only while
    the tensor is unwritten (torch's version counter): a weight trained in place after prepare is
    hashed again, so the checksum always names the bytes the engine reads, never stale ones."""
    from torch import nn

    from refit.buckets import checksum
    from refit.drivers.shm import share_memory
    from refit.drivers.torch_source import TorchSource

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    share_memory(model, directory=tmp_path)
    source = TorchSource(model)
    assert source.resident
    t = SharedMemoryTransport(directory=tmp_path)
    assert t.wants_prepare and not SharedMemoryTransport(directory=tmp_path, checksums=False).wants_prepare
    plan = t.plan(source.metas(), 1 << 20)
    rx = SharedMemoryReceiver(_connect(t, plan))
    for change in (False, True):
        ((manifest, tensors),) = zip(plan, source.iter_buckets(plan), strict=True)
        t.prepare(manifest, tensors)
        assert set(t._digests) == set(manifest.names)  # every arena tensor hashed ahead
        if change:
            with torch.no_grad():
                model[0].weight.mul_(-3.0)  # written after prepare: its early digest is stale
        ((manifest, tensors),) = zip(plan, source.iter_buckets(plan), strict=True)
        part = t.pack(manifest, tensors)
        assert part["xxh3"] == checksum(model.state_dict().items())  # the bytes as they are now
        payload = t.payloads(manifest, [part], ONE)["e0"]
        rx.verify(payload, rx.read(payload))  # the receiver's own hash agrees
        t.release(0)
        assert not t._digests  # a digest is used once
    t.disconnect()


def test_a_write_the_version_counter_misses_fails_loudly_and_the_retry_hashes_anew(tmp_path: Path) -> None:
    """Writes through `.data` (or numpy views, or CPU fused Adam) do not bump torch's version
    counter, so a digest taken by prepare goes stale unseen. The real engine's verify catches it
    (`corrupted`, naming a write during the refit as a cause), and the in-run retry hashes every
    bucket anew rather than reusing the other stale digests: the run ends with the trainer's
    current bytes, bit-exact, nothing published over mixed weights."""
    from refit import protocol
    from refit.drivers.reference import ReferenceEngine
    from refit.drivers.shm import share_memory
    from refit.drivers.torch_source import TorchSource
    from refit.reference.model import TinyLlama
    from refit.trace import load_trace

    from .conftest import CONFIG, SMALL_BUCKET, perturbed

    trace = tmp_path / "trace.jsonl"

    def load_errors(result: protocol.RefitResult) -> list[str]:
        _, events, _ = load_trace(trace)
        return [
            e["error"] for e in events
            if e.get("run") == result.run_id and e.get("event") == "load" and e.get("outcome") == "error"
        ]  # fmt: skip

    model = TinyLlama(CONFIG, seed=0)
    share_memory(model, directory=tmp_path)
    transport = SharedMemoryTransport(directory=tmp_path)
    pack = transport.pack
    writes: list[int] = []

    def write_behind_the_counter_then_pack(manifest, tensors):  # the trainer writes during the run
        if not writes:  # after prepare hashed every bucket, before the first pack
            for p in model.parameters():
                p.data.mul_(-1.0)  # .data: torch's version counter does not move
            writes.append(manifest.index)
        return pack(manifest, tensors)

    transport.pack = write_behind_the_counter_then_pack  # type: ignore[method-assign]
    engine = ReferenceEngine.spawn("stale", CONFIG, seed=1)
    ctx = protocol.RefitContext(
        TorchSource(model), transport, [engine], mode="disaggregated", bucket_bytes=SMALL_BUCKET, retries=1,
        trace=str(trace),
    )  # fmt: skip
    try:
        perturbed(model, 1)
        first = protocol.run(ctx)
        assert first.ok and writes == [0], first.error
        errors = load_errors(first)
        assert errors and "corrupted" in errors[0] and "written during the refit" in errors[0]  # caught, not loaded
        state = engine.state_dict(timeout=30)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())  # current bytes, every bucket
        writes.clear()
        writes.append(-1)  # no more writes: the next run reuses prepared digests and loads clean
        perturbed(model, 2)
        second = protocol.run(ctx).raise_for_error()
        assert not load_errors(second)
        state = engine.state_dict(timeout=30)
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    finally:
        ctx.close()
        engine.close()


def test_connect_keeps_the_digests_prepare_took(tmp_path: Path) -> None:
    """prepare runs before connect; connect's own cleanup must not throw its work away."""
    from torch import nn

    from refit.drivers.shm import share_memory
    from refit.drivers.torch_source import TorchSource

    model = nn.Linear(32, 32)
    share_memory(model, directory=tmp_path)
    source = TorchSource(model)
    t = SharedMemoryTransport(directory=tmp_path)
    plan = t.plan(source.metas(), 1 << 20)
    ((manifest, tensors),) = zip(plan, source.iter_buckets(plan), strict=True)
    t.prepare(manifest, tensors)
    _connect(t, plan)
    assert set(t._digests) == {"weight", "bias"}
    t.disconnect()
    assert not t._digests


def test_only_a_plain_module_or_state_dict_is_resident() -> None:
    """prepare looks at a source before the pause only when that costs no gather: a callable source
    (it may gather, and is documented as called once per refit) and a cast are not resident."""
    from torch import nn

    from refit.drivers.torch_source import TorchSource

    model = nn.Linear(4, 4)
    calls: list[int] = []

    def gathered() -> dict[str, torch.Tensor]:
        calls.append(1)
        return model.state_dict()

    assert TorchSource(model).resident and TorchSource(model.state_dict()).resident
    assert not TorchSource(gathered).resident and not calls
    assert not TorchSource(model, dtype=torch.bfloat16).resident
