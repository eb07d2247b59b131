"""Collective broadcast transport: trainer rank 0 broadcasts each bucket to every engine TP rank over
a torch.distributed side group (`gloo` on CPU; the same code takes `nccl` on GPUs).

The group is built from a store the trainer opens for this connection, never by splitting the
trainer's default group (with NCCL, a default group bound to a device turns that into
ncclCommSplit, which hangs unless every rank of the default group joins). Group rank 0 is the
trainer's source rank; engine i's TP rank j is group rank 1 + rank_offset_i + j.

Lifecycle:
  CONNECTING     every trainer rank: `connect` (rank 0 opens a TCPStore on a free port, names the
                 group, allocates `slots` send buffers; the other ranks only drain). Then, at the
                 same time: rank 0 `join`s the group while every engine TP rank attaches
                 (`BroadcastReceiver`: it joins as its group rank); the group forms when all are
                 in, or fails for all after the rendezvous timeout (a receiver then raises
                 EngineError("rendezvous") unless the fault is its own).
  TRANSFERRING   every rank `pack`s bucket k (rank 0 into a free send buffer, hashing as it
                 copies; with ops="tensor" a large plain tensor is only kept, not copied; the
                 others make the same gathers and keep nothing). Then rank 0's `send(k)`
                 broadcasts (ops="bucket": the buffer; ops="tensor": `wire_ops`, one broadcast per
                 large tensor and per run of small ones, an NCCL group) while every engine's load
                 receives (the runner starts both together; a single-rank engine takes the large
                 tensors straight into its parameters, `read_into`); bucket k+1 is packed into
                 another buffer meanwhile. A buffer is released after the send finished and every
                 engine acked. A send that fails tears the group down at once and refuses later
                 sends; a member that fails breaks the group for all: the runner stops
                 streaming, tears the group down and rebuilds it without that member before
                 retrying.
  disconnect     the group and the store are dropped (a receiver blocked on a dead group sees its
                 peers go and fails; an NCCL communicator is aborted, never left to the garbage
                 collector); buffers freed. Idempotent.

NCCL (`backend="nccl"`): buffers live on the GPU (the trainer's current device; each engine TP
rank's current device), bucket checksums are off (they are computed on the host), and both sides
must agree on `NCCL_CUMEM_ENABLE` (a mismatch makes NCCL's peer-to-peer setup fail or hang): the
trainer's value travels in the connect info and an engine whose environment leaves it unset takes
it; one that sets another value is refused at attach, naming both. Streams: `send` leaves the
broadcast on NCCL's stream without making the packing stream wait for it (bucket k+1 is packed
while k is on the wire); `release` makes the stream wait for it before the buffer is packed again.
The receiver alternates two buffers and names a side stream (`copy_stream`) the engine copies a
bucket out on while the next one arrives; a buffer is received into again only after the event
`consumed()` recorded behind its copy-out (the engine's finalize syncs the whole device).
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import traceback
import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from refit.buckets import (
    BucketManifest,
    TensorEntry,
    TensorMeta,
    dtype_name,
    pack_into,
    slot_bytes,
    torch_dtype,
    unpack,
)
from refit.drivers.base import ConnectInfo, EngineSpec, LazyTensors, Payload, Receiver, Topology, Transport
from refit.drivers.slots import SlotPool
from refit.errors import EngineError

if TYPE_CHECKING:
    import torch

SOURCE_RANK = 0


def timeout_delta(seconds: float) -> datetime.timedelta:
    """A collective's or store's timeout: `seconds`, at least 50 ms."""
    return datetime.timedelta(seconds=max(float(seconds), 0.05))


def new_group(store: Any, name: str, rank: int, size: int, timeout_s: float, backend: str) -> Any:
    """A process group of `size` members made from `store` alone (no default group involved)."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(name, store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout_delta(timeout_s))
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout_delta(timeout_s)
        return dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    raise ValueError(f"backend {backend!r}: use gloo or nccl")


def close_group(group: Any, backend: str) -> None:
    """Tear a side group down now: NCCL's communicator is aborted (dropping it would leave the
    comm to the garbage collector, and a peer that died mid-collective to hang it); gloo's
    connections close with the object."""
    if group is not None and backend == "nccl":
        with contextlib.suppress(Exception):
            group.abort()


CUMEM = "NCCL_CUMEM_ENABLE"


def align_cumem(trainer: str | None) -> None:
    """Make this process's NCCL_CUMEM_ENABLE the trainer's, or refuse a conflicting one."""
    mine = os.environ.get(CUMEM)
    if trainer is None or mine == trainer:
        return
    if mine is None:
        os.environ[CUMEM] = trainer
        return
    raise EngineError(
        "bad_request",
        f"{CUMEM} is {mine!r} in this engine and {trainer!r} in the trainer: NCCL needs the same on both sides",
    )


@functools.cache
def _options() -> Any:
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank = SOURCE_RANK
    return opts


def broadcast_from_source(group: Any, tensor: torch.Tensor, *, wait: bool = True) -> Any:
    """Broadcast from the source rank. `wait`: the caller's stream (gloo: the host) waits for it;
    otherwise the Work is returned and nothing waits (NCCL: the collective runs on its own stream,
    and the caller orders any reuse of `tensor` on `work.wait()`)."""
    work = group.broadcast([tensor], _options())
    if wait:
        work.wait()
    return work


def _broadcast_each(group: Any, tensors: Sequence[torch.Tensor], nccl: bool) -> Any:
    """One broadcast per tensor, in order (empty ones skipped by every member); each side passes
    the entry's own dtype and shape (no byte views: a view costs microseconds on a GPU, and a
    bucket may hold hundreds of tensors). NCCL: as one group (one launch) whose Work is
    returned, nothing waits; gloo: each in turn, waited."""
    tensors = [t for t in tensors if t.numel()]
    if not nccl:
        for t in tensors:
            broadcast_from_source(group, t)
        return None
    group._start_coalescing()
    try:
        for t in tensors:
            broadcast_from_source(group, t, wait=False)
    finally:
        work = group._end_coalescing()
    return work


DIRECT_BYTES = 16 << 20  # ops="tensor": tensors this large or larger go as their own broadcast


def wire_ops(manifest: BucketManifest, direct_bytes: int) -> list[int | tuple[int, int]]:
    """ops="tensor": the bucket's broadcasts, in order, as both sides make them: an entry of
    `direct_bytes` or more is its own (its index; the entry's dtype and shape); each run of
    smaller entries between them is one uint8 broadcast of their byte range in the bucket."""
    out: list[int | tuple[int, int]] = []
    for i, e in enumerate(manifest.entries):
        if e.meta.nbytes >= direct_bytes:
            out.append(i)
        elif out and isinstance(out[-1], tuple):
            out[-1] = (out[-1][0], e.offset + e.meta.nbytes)
        else:
            out.append((e.offset, e.offset + e.meta.nbytes))
    return out


def _send_buffer(nbytes: int, backend: str) -> torch.Tensor:
    """A send buffer: host memory for gloo, the trainer's current GPU for NCCL."""
    import torch

    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _typed(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    """Entry's place in a bucket buffer, as its dtype and shape."""
    meta = entry.meta
    return buffer[entry.offset : entry.offset + meta.nbytes].view(torch_dtype(meta.dtype)).view(meta.shape)


class BroadcastTransport(Transport):
    kind = "broadcast"
    collective = True
    make_group = staticmethod(new_group)  # how the side group is built from the store (a wire layout may differ)

    def __init__(
        self,
        slots: int | None = None,
        *,
        backend: str = "gloo",
        host: str | None = None,
        checksums: bool | None = None,
        ops: str | None = None,
        direct_bytes: int = DIRECT_BYTES,
    ) -> None:
        """`backend`: gloo (CPU tensors) or nccl (CUDA tensors, two GPUs or more). `host`: the
        address engines reach the trainer's store at (default MASTER_ADDR, else this host).
        `checksums`: xxHash3 per bucket (default on for gloo; NCCL buffers are on the GPU: none).
        `ops`: how a bucket goes on the wire. "bucket": one broadcast of the packed buffer.
        "tensor": one broadcast per tensor of `direct_bytes` or more (NCCL: a bucket's broadcasts
        as one group), sent from where it lies when it is a plain contiguous tensor of its dtype
        on the buffers' device (else packed first) and received straight into an engine's
        parameter where it takes it (`Receiver.read_into`): no pack and no copy-out; each run of
        smaller tensors between them is packed and goes as one broadcast (many small collectives
        cost more than the copies). A bucket with a checksum (gloo's default) is still received
        through the buffer, to be verified before it is applied: pass `checksums=False` to
        receive straight in. Default: tensor for nccl, bucket for gloo.
        `slots`: send buffers of a bucket each on the trainer, and so the buckets in flight.
        Default 3 for ops="tensor" over nccl (a third bucket in flight keeps the link busy while
        the host issues hundreds of broadcasts: 7B-shaped on two H200s, 44.0 -> 42.1 ms), else 2."""
        ops = ops or ("tensor" if backend == "nccl" else "bucket")
        if slots is None:
            slots = 3 if (ops, backend) == ("tensor", "nccl") else 2
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend {backend!r}: use gloo or nccl")
        if backend == "nccl" and checksums:
            raise ValueError("checksums are computed on the host: an NCCL broadcast (GPU buffers) has none")
        if ops not in ("bucket", "tensor"):
            raise ValueError(f"ops {ops!r}: use bucket or tensor")
        if not isinstance(direct_bytes, int) or isinstance(direct_bytes, bool) or direct_bytes < 0:
            raise ValueError(f"direct_bytes must be an integer >= 0, got {direct_bytes!r}")
        self.slots = slots
        self.backend = backend
        self.digest_kind = "wsum" if backend == "nccl" else "xxh3"  # verification hashes where the bytes are
        self.ops = ops
        self.direct_bytes = direct_bytes
        self.host = host
        self.checksums = backend == "gloo" if checksums is None else checksums
        self.temp_bytes = 0
        self._sender = False
        self._store: Any = None
        self._group: Any = None
        self._works: dict[int, Any] = {}  # NCCL: bucket -> its broadcast, waited on before the buffer is reused
        self._refs: dict[int, list[Any]] = {}  # ops="tensor": bucket -> per entry, the tensor sent as it lies (or None)
        self._broken: str | None = None  # the send that failed: the group is not used again
        self._pack_views: dict[tuple[Any, ...], torch.Tensor] = {}  # typed views into the send buffers
        self._info: dict[str, Any] = {}
        self._own: dict[int, torch.Tensor] = {}
        self._slot_bytes = 0
        self._pool = self._new_pool(0)
        self._plan: dict[int, BucketManifest] = {}

    @property
    def connected(self) -> bool:
        return bool(self._info)

    @property
    def buffer_bytes(self) -> int:
        return len(self._pool.buffers) * self._slot_bytes + sum(int(t.numel()) for t in self._own.values())

    def route(self, topology: Topology, engine: EngineSpec, tp_rank: int) -> int:
        return SOURCE_RANK  # one source rank broadcasts to every engine TP rank

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        self.disconnect()
        self._sender = rank == SOURCE_RANK
        self._plan = {m.index: m for m in plan}
        if not self._sender:
            self._info = {"rank": rank}
            return {}
        import torch.distributed as dist

        host = self.host or os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
        world = 1 + topology.engine_ranks
        self._store = dist.TCPStore(
            host, 0, world, is_master=True, wait_for_workers=False, timeout=timeout_delta(topology.timeout_s)
        )
        self._slot_bytes = slot_bytes(plan)
        self._pool = self._new_pool(self.slots)
        self._info = {
            "addr": host, "port": self._store.port, "group": f"refit-{uuid.uuid4().hex[:12]}", "world": world,
            "timeout_s": topology.timeout_s, "backend": self.backend, "slot_bytes": self._slot_bytes, "ops": self.ops,
            "direct_bytes": self.direct_bytes,
        }  # fmt: skip
        if self.backend == "nccl":
            self._info["nccl_cumem"] = os.environ.get(CUMEM)
        return dict(self._info)

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        shared = rank_infos[SOURCE_RANK]
        receiver = f"{__name__}:BroadcastReceiver"
        return {
            e.name: ConnectInfo(
                self.kind,
                receiver,
                fields=dict(shared),
                parts=tuple({"rank": 1 + e.rank_offset + j} for j in range(e.tp)),
            )
            for e in topology.engines
        }

    def join(self) -> None:
        self._broken = None
        if self._sender:
            info = self._info
            self._group = self.make_group(
                self._store, info["group"], SOURCE_RANK, info["world"], info["timeout_s"], self.backend
            )

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self.connected:
            raise RuntimeError("broadcast transport: pack() before connect()")
        if not self._sender:  # the same gathers as the source rank, nothing kept
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        index = manifest.index
        try:
            if self.ops == "tensor":  # a buffer only if some tensor must be packed
                packed = pack_into(
                    lambda: self._buffer_for(manifest), manifest, tensors, hash_bytes=self.checksums, refer=self._refer,
                    views=None if manifest.oversized else self._pack_views,  # (an oversized bucket's buffer is its own)
                    per_tensor=self.tensor_digests,
                )  # fmt: skip
                if packed.refs is not None:
                    self._refs[index] = packed.refs
            else:
                packed = pack_into(
                    self._buffer_for(manifest), manifest, tensors, hash_bytes=self.checksums,
                    per_tensor=self.tensor_digests,
                )  # fmt: skip
        except BaseException:
            if index in self._pool or index in self._own or index in self._refs:  # give back what it took
                self.release(index)
            raise
        self.temp_bytes = packed.temp_bytes
        return {} if packed.checksum is None else {"xxh3": packed.checksum}

    def _refer(self, meta: TensorMeta, tensor: Any) -> Any:
        """The tensor itself, when it can be sent as it lies (ops="tensor"): the trainer's own
        (a resident source), a plain contiguous tensor of the entry's dtype on the buffers'
        device. Kept until its broadcast is released."""
        import torch

        if meta.nbytes < self.direct_bytes or not self.resident_source:
            return None  # packed with its neighbours, or the source may reuse its memory once the next is taken
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        plain = hasattr(tensor, "is_contiguous") and not hasattr(tensor, "placements")
        if not plain or tensor.device != device or dtype_name(tensor.dtype) != meta.dtype or not tensor.is_contiguous():
            return None
        return tensor.detach() if tensor.requires_grad else tensor

    def _empty(self, nbytes: int) -> torch.Tensor:
        return _send_buffer(nbytes, self.backend)

    def _new_pool(self, count: int) -> SlotPool[torch.Tensor]:
        return SlotPool(
            count, functools.partial(_send_buffer, self._slot_bytes, self.backend), owner="broadcast transport"
        )

    def _buffer_for(self, manifest: BucketManifest) -> torch.Tensor:
        if manifest.oversized:
            buffer = self._own[manifest.index] = self._empty(manifest.nbytes)
            return buffer
        return self._pool.take(manifest.index)

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        fields = dict(parts[SOURCE_RANK] or {})
        return {e.name: Payload(self.kind, manifest, fields, parts=({},) * e.tp) for e in topology.engines}

    def send(self, index: int) -> None:
        """Broadcast bucket `index`. A send that fails tears the group down at once: no member's
        place in the stream is known (one may hold part of a bucket), so no later broadcast may be
        matched against another receive, and members already waiting for the next bucket fail
        now instead of at their timeout. Later sends are refused until the group is formed again."""
        if not self._sender:
            return
        if self._broken is not None:
            raise RuntimeError(f"broadcast transport: bucket {index} not sent, the group broke at {self._broken}")
        try:
            self._send(index)
        except BaseException as exc:
            self._broken = f"bucket {index} ({type(exc).__name__}: {exc})"
            close_group(self._group, self.backend)
            # the last reference dropped closes a gloo group's connections (its abort does not):
            # every peer blocked on it fails. The traceback's frames hold it too: cleared.
            self._group = None
            traceback.clear_frames(exc.__traceback__)
            raise

    def _send(self, index: int) -> None:
        nccl = self.backend == "nccl"  # the stream packing the next bucket does not wait for this one
        if self.ops == "tensor":
            manifest = self._plan[index]
            refs = self._refs.get(index)
            buffer: Any = None
            wire = []
            for op in wire_ops(manifest, self.direct_bytes):
                ref = refs[op] if refs is not None and isinstance(op, int) else None
                if ref is not None:
                    wire.append(ref)
                    continue
                if buffer is None:
                    buffer = self._buffer_of(index)
                wire.append(buffer[op[0] : op[1]] if isinstance(op, tuple) else _typed(buffer, manifest.entries[op]))
            work = _broadcast_each(self._group, wire, nccl)
        else:
            manifest, buffer = self._sending(index)
            work = broadcast_from_source(self._group, buffer[: manifest.nbytes], wait=not nccl)
        if nccl:
            self._works[index] = work

    def _sending(self, index: int) -> tuple[BucketManifest, torch.Tensor]:
        """Bucket `index`'s manifest and the buffer it was packed into, once the group formed."""
        return self._plan[index], self._buffer_of(index)

    def _buffer_of(self, index: int) -> torch.Tensor:
        if self._group is None:
            raise RuntimeError(f"{type(self).__name__}: send() before the group formed (join)")
        buffer = self._own.get(index)
        if buffer is None:
            buffer = self._pool.buffer_of(index)
        return buffer

    def release(self, index: int) -> None:
        if not self._sender:
            return
        work = self._works.pop(index, None)
        if work is not None:  # what is written into its buffer or tensors next is ordered after its broadcast
            work.wait()
        self._refs.pop(index, None)
        if self._own.pop(index, None) is None and index in self._pool:  # (ops="tensor": maybe no buffer)
            self._pool.release(index)

    def abandon(self, index: int) -> None:
        """A send still in flight keeps its tensor alive; this rank never writes into it again."""
        self._works.pop(index, None)  # the Work keeps its tensors alive until the broadcast ends
        self._refs.pop(index, None)
        if not self._sender or self._own.pop(index, None) is not None or index not in self._pool:
            return
        self._pool.abandon(index)
        self._pack_views = {}  # they hold the buffer given up

    def disconnect(self) -> None:
        self._broken = None
        close_group(self._group, self.backend)
        self._group = None  # dropping the group closes its connections: peers blocked on it fail
        self._store = None
        self._pool, self._own, self._info, self._plan = self._new_pool(0), {}, {}, {}
        self._works, self._refs, self._pack_views = {}, {}, {}


class BroadcastReceiver(Receiver):
    """One engine TP rank's side: joins the group at attach (blocking until it forms), receives
    each bucket into a reusable buffer and returns views into it."""

    make_group = staticmethod(new_group)

    def __init__(self, info: ConnectInfo, tp_rank: int = 0) -> None:
        super().__init__(info, tp_rank)
        import torch
        import torch.distributed as dist

        f = info.fields
        nccl = f.get("backend") == "nccl"
        if nccl:
            align_cumem(f.get("nccl_cumem"))
        try:
            store = dist.TCPStore(
                f["addr"], int(f["port"]), int(f["world"]), is_master=False, timeout=timeout_delta(f["timeout_s"])
            )
            self._group = self.make_group(
                store, f["group"], int(self.part["rank"]), int(f["world"]), f["timeout_s"], f["backend"]
            )
        except (RuntimeError, OSError, ValueError) as exc:  # the group did not form (a member is missing)
            raise EngineError("rendezvous", f"group {f.get('group')} did not form: {exc}") from exc
        self._store = store
        self._backend = str(f.get("backend"))
        self._ops = str(f.get("ops", "bucket"))
        self._direct_bytes = int(f.get("direct_bytes", DIRECT_BYTES))
        self._broken: str | None = None  # the read that failed
        self._last_ops: tuple[Any, list[int | tuple[int, int]]] = (None, [])
        self._device = torch.device("cuda", torch.cuda.current_device()) if nccl else None
        # NCCL: two buffers, and the engine copies out of one on a side stream (`copy_stream`) while
        # the next bucket arrives in the other; a buffer is received into again only once its
        # copy-out is done (`consumed` records it). gloo: one host buffer, copied out in place.
        # Each is allocated when a bucket first needs it (ops="tensor" into a single-rank engine: never).
        slots = 2 if nccl else 1
        self._slot_bytes = int(f.get("slot_bytes", 0))
        self._buffers: list[torch.Tensor | None] = [None] * slots
        self._copied: list[Any] = [None] * slots
        self._slot: dict[int, int] = {}  # bucket index -> the buffer it was received into
        self._next = 0
        self._views: dict[tuple[int, int], tuple[BucketManifest, list[tuple[str, torch.Tensor]]]] = {}
        self.copy_stream = torch.cuda.Stream(self._device) if nccl else None

    def writes_into(self, payload: Payload) -> list[str]:
        ops = self._wire_ops(payload.manifest)
        entries = payload.manifest.entries
        return [entries[op].meta.name for op in ops or () if isinstance(op, int)]

    def _wire_ops(self, manifest: BucketManifest) -> list[int | tuple[int, int]] | None:
        """ops="tensor": the bucket's broadcasts (`wire_ops`), made once per manifest object (the
        engine asks `writes_into` and then reads the same payload); None for ops="bucket"."""
        if self._ops != "tensor":
            return None
        if self._last_ops[0] is not manifest:
            self._last_ops = (manifest, wire_ops(manifest, self._direct_bytes))
        return self._last_ops[1]

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        return self.read_into(payload, {})

    def read_into(self, payload: Payload, into: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Receive the bucket; with ops="tensor", each tensor named in `into` straight into that
        tensor (the engine's parameter), the others into the buffer at their offsets."""
        import torch

        manifest = payload.manifest
        entries = manifest.entries
        ops = self._wire_ops(manifest)
        direct = {i for i in ops if isinstance(i, int) and entries[i].meta.name in into} if ops else set()
        slot = self._next
        self._next = (self._next + 1) % len(self._buffers)
        if self._broken is not None:  # a member's place in the stream is unknown: never receive again
            raise RuntimeError(f"bucket {manifest.index} not read: the group broke at {self._broken}")
        buffer = None if len(direct) == len(entries) else self._buffer(slot, manifest.nbytes)
        views = None if buffer is None else self._unpacked(buffer, slot, manifest)
        try:
            if ops is not None:
                wire = [
                    buffer[op[0] : op[1]]  # type: ignore[index]
                    if isinstance(op, tuple)
                    else (into[entries[op].meta.name] if op in direct else views[op][1])  # type: ignore[index]
                    for op in ops
                ]
                work = _broadcast_each(self._group, wire, self._backend == "nccl")
                if work is not None:
                    work.wait()  # the current stream waits for the bytes
            else:
                assert buffer is not None
                broadcast_from_source(self._group, buffer[: manifest.nbytes])
        except BaseException as exc:
            self._broken = f"bucket {manifest.index} ({type(exc).__name__}: {exc})"
            raise
        if self.copy_stream is not None:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self._device))  # the bytes are in
            if buffer is not None and buffer is self._buffers[slot]:  # its copy-out must end before reuse
                self._slot[manifest.index] = slot
        if views is None:
            return [(e.meta.name, into[e.meta.name]) for e in entries]
        if not direct:
            return list(views)
        return [(name, into[name]) if i in direct else (name, view) for i, (name, view) in enumerate(views)]

    def _unpacked(self, buffer: torch.Tensor, slot: int, manifest: BucketManifest) -> list[tuple[str, torch.Tensor]]:
        """The bucket's tensors as views into `buffer`; those into a kept buffer are kept (same manifest)."""
        if buffer is not self._buffers[slot]:
            return unpack(buffer, manifest)
        key = (slot, manifest.index)
        kept = self._views.get(key)
        if kept is None or kept[0] != manifest:
            kept = self._views[key] = (manifest, unpack(buffer, manifest))
        return kept[1]

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        """Buffer `slot` (allocated on first need), free once its last bucket's copy-out read it; or
        an oversized bucket's own, kept alive for the copy-out on the side stream."""
        import torch

        if nbytes > self._slot_bytes:
            own = torch.empty(nbytes, dtype=torch.uint8, device=self._device)
            if self.copy_stream is not None:
                own.record_stream(self.copy_stream)  # freed only after the copies queued there ran
            return own
        buffer = self._buffers[slot]
        if buffer is None:
            buffer = self._buffers[slot] = torch.empty(self._slot_bytes, dtype=torch.uint8, device=self._device)
        elif self._copied[slot] is not None:
            torch.cuda.current_stream(self._device).wait_event(self._copied[slot])
            self._copied[slot] = None
        return buffer

    def consumed(self, payload: Payload) -> None:
        import torch

        slot = self._slot.pop(payload.manifest.index, None)
        if self.copy_stream is not None and slot is not None:
            event = torch.cuda.Event()
            event.record(self.copy_stream)
            self._copied[slot] = event

    def expected(self, payload: Payload) -> int | None:
        return payload.fields.get("xxh3")

    def close(self) -> None:
        close_group(self._group, self._backend)
        self._group = None
        self._store = None
