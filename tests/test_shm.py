"""The shared-memory transport: buffers mapped once, reused only after release, never leaked."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from refit.drivers.base import ConnectInfo, Payload
from refit.drivers.buckets import TensorMeta, plan_buckets
from refit.drivers.shm import SharedMemoryReceiver, SharedMemoryTransport, leaked_segments


def _bucket(n: int, value: float) -> list[tuple[str, torch.Tensor]]:
    return [(f"w{n}", torch.full((8, 8), value))]


def test_round_trip_through_a_receiver(tmp_path: Path) -> None:
    t = SharedMemoryTransport(slots=2, directory=tmp_path)
    plan = plan_buckets([TensorMeta(f"w{i}", "float32", (8, 8)) for i in range(3)], 256)
    info = t.connect(plan, n_engines=1)
    assert len(leaked_segments(tmp_path)) == 2  # one file per slot, created once
    rx = SharedMemoryReceiver(info)
    p0 = t.pack(plan[0], _bucket(0, 1.0))
    p1 = t.pack(plan[1], _bucket(1, 2.0))
    with pytest.raises(RuntimeError, match="no free buffer for bucket 2"):
        t.pack(plan[2], _bucket(2, 3.0))  # both slots wait for acks: nothing is overwritten
    assert torch.equal(rx.read(p0)[0][1], torch.full((8, 8), 1.0))
    t.release(p0)
    with pytest.raises(RuntimeError, match="holds bucket None"):
        t.release(p0)  # a double release is a bug, not a no-op
    p2 = t.pack(plan[2], _bucket(2, 3.0))
    assert p2.fields["slot"] == p0.fields["slot"]
    assert torch.equal(rx.read(p2)[0][1], torch.full((8, 8), 3.0))
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))
    t.disconnect()
    assert leaked_segments(tmp_path) == []
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))  # unlinked, still mapped: no dangling read
    t.disconnect()  # idempotent


def test_receiver_refuses_missing_or_resized_buffers(tmp_path: Path) -> None:
    t = SharedMemoryTransport(directory=tmp_path)
    plan = plan_buckets([TensorMeta("w", "float32", (4,))], 64)
    info = t.connect(plan, 1)
    path = info.fields["paths"][0]
    os.truncate(path, 8)
    with pytest.raises(ValueError, match="has 8 bytes"):
        SharedMemoryReceiver(info)
    t.disconnect()
    with pytest.raises(FileNotFoundError):
        SharedMemoryReceiver(info)
    empty = SharedMemoryReceiver(ConnectInfo("shm", info.receiver, {"paths": [], "slot_bytes": 64}))
    with pytest.raises(ValueError, match="payload names buffer '/etc/passwd', not a refit shared-memory buffer"):
        empty.read(Payload("shm", plan[0], {"slot": 0, "path": "/etc/passwd"}))


def test_buffers_are_freed_when_the_transport_is_dropped(tmp_path: Path) -> None:
    t = SharedMemoryTransport(directory=tmp_path)
    t.connect(plan_buckets([TensorMeta("w", "float32", (4,))], 64), 1)
    assert leaked_segments(tmp_path)
    del t
    gc.collect()
    assert leaked_segments(tmp_path) == []


def test_an_abandoned_buffer_is_replaced_never_reused(tmp_path: Path) -> None:
    """An engine that never answered may still read its buffer: that file is left alone and a new
    one takes its slot; the receiver maps the new file on first use."""
    t = SharedMemoryTransport(slots=1, directory=tmp_path)
    plan = plan_buckets([TensorMeta(f"w{i}", "float32", (8, 8)) for i in range(2)], 256)
    rx = SharedMemoryReceiver(t.connect(plan, 1))
    p0 = t.pack(plan[0], _bucket(0, 1.0))
    t.abandon(p0)
    p1 = t.pack(plan[1], _bucket(1, 2.0))
    assert p1.fields["path"] != p0.fields["path"] and len(leaked_segments(tmp_path)) == 2
    assert torch.equal(rx.read(p0)[0][1], torch.full((8, 8), 1.0))  # the slow reader still sees its bucket
    assert torch.equal(rx.read(p1)[0][1], torch.full((8, 8), 2.0))
    t.disconnect()
    assert leaked_segments(tmp_path) == []
