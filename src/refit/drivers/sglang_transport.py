"""SGLang's transports, in its flattened-bucket format (`refit.drivers.flattened`).

Colocated (`SGLangTensorTransport`, kind ``sglang_tensor``): each trainer rank packs a bucket
into a shared buffer and serializes it (`flattened.serialize`) once per engine TP rank it feeds,
for SGLang's `update_weights_from_tensor` with `load_format="flattened_bucket"`. CPU buffers
travel by shared-memory name; CUDA buffers as CUDA IPC handles in SGLang's form. A buffer whose
consumer still holds its CUDA export at the ack is replaced, never rewritten.

Disaggregated (`SGLangBroadcastTransport`, kind ``sglang_broadcast``): trainer rank 0 broadcasts
each bucket on a group laid out as SGLang's `init_custom_process_group` builds it (a TCPStore
rendezvous, `PrefixStore(group_name)`, then the keys `_new_process_group_helper` adds), without
touching the trainer's default group. With `flattened=True` one uint8 broadcast per bucket (SGLang
`load_format="flattened_bucket"`), else one broadcast per tensor in list order.

Lifecycle (both), per state:
  run start     `plan`: `plan_flattened` (contiguous buckets, aligned by ordering).
  CONNECTING    `connect`: buffers (and, for broadcast, the store) for this engine set;
                `attach_infos`: what the engine side opens (SGLang: nothing for tensors,
                `/init_weights_update_group` for broadcast).
  TRANSFERRING  `pack(k)`: copy bucket k into a free buffer; tensors: serialize it for each engine
                TP rank this rank feeds (a bucket whose tensors already lie in one storage in the
                planned layout, `TorchSource.flatten_into`, is sent as a view of that storage:
                nothing is copied, no buffer taken); broadcast: `send(k)` while the engines receive.
                `release(k)` after every engine acked; `abandon(k)`: the buffer is replaced.
  disconnect    buffers and group dropped; idempotent.

The receivers (`FlattenedTensorReceiver`, `SGLangBroadcastReceiver`) are the engine side that
refit's emulated SGLang server and the reference engine open by this module's path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from refit.buckets import BucketManifest, TensorMeta, pack_into, slot_bytes, torch_dtype
from refit.drivers.base import ConnectInfo, EngineSpec, LazyTensors, Payload, Receiver, Topology, Transport
from refit.drivers.broadcast import (
    SOURCE_RANK,
    BroadcastReceiver,
    BroadcastTransport,
    broadcast_from_source,
    timeout_delta,
)
from refit.drivers.flattened import (
    FLATTENED_BUCKET,
    check_flattened,
    deserialize,
    ipc_refs,
    metadata_of,
    plan_flattened,
    reconstruct,
    serialize,
    shared_buffer,
)
from refit.drivers.slots import SlotPool

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
HELD_GRACE_S = 0.2  # how long a consumer's reference counter may take to come down after its ack

# ---- colocated: tensors by reference -------------------------------------------------------------


class SGLangTensorTransport(Transport):
    """Colocated transport in SGLang's `update_weights_from_tensor` + `flattened_bucket` format."""

    kind = "sglang_tensor"

    def __init__(self, slots: int = 2, *, device: str = "cpu", decoder: str = "refit") -> None:
        """`device`: where buffers live (cpu: shared memory by name; cuda: CUDA IPC). `decoder`
        (engine side of the reference emulator): ``refit`` or ``sglang`` (SGLang's own code)."""
        if not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if decoder not in ("refit", "sglang"):
            raise ValueError(f"decoder {decoder!r}: use refit or sglang")
        self.slots = slots
        self.device = device
        self.decoder = decoder
        self.temp_bytes = 0
        self._own: dict[int, torch.Tensor] = {}
        self._slot_bytes = 0
        self._pool = self._new_pool(0)
        self._consumers: list[tuple[str, int]] = []
        self._connected = False
        self._counters: dict[int, list[tuple[str, bytes, int]]] = {}  # bucket -> (consumer, CUDA ref counter)
        self.held: list[dict[str, Any]] = []  # buffers a consumer still held at its ack (never rewritten)
        self._resident: dict[int, torch.Tensor] = {}  # bucket -> the view of the trainer's memory, until released
        self._metadata: dict[int, tuple[BucketManifest, list[Any]]] = {}  # bucket -> (manifest, SGLang's records)
        self.resident_buckets = 0  # buckets sent as views of the trainer's memory, this connection

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_flattened(metas, bucket_bytes)

    @property
    def connected(self) -> bool:
        return self._connected

    @property
    def buffer_bytes(self) -> int:
        return len(self._pool.buffers) * self._slot_bytes + sum(int(t.numel()) for t in self._own.values())

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        return shared_buffer(nbytes, self.device)

    def _new_pool(self, count: int) -> SlotPool[torch.Tensor]:
        return SlotPool(  # lazy: a trainer whose buckets are its own memory never needs one
            count, functools.partial(shared_buffer, self._slot_bytes, self.device), owner=type(self).__name__, lazy=True
        )

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        self.disconnect()
        for manifest in plan:
            check_flattened(manifest)
        self._consumers = [
            (e.name, j) for e in topology.engines for j in range(e.tp) if self.route(topology, e, j) == rank
        ]
        if self._consumers:
            self._slot_bytes = slot_bytes(plan)
            self._pool = self._new_pool(self.slots)
        self._connected = True
        return {}

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        return {
            e.name: ConnectInfo(
                self.kind,
                f"{__name__}:FlattenedTensorReceiver",
                fields={"decoder": self.decoder, "device": self.device},
                parts=({},) * e.tp,
            )
            for e in topology.engines
        }

    payload_fields: ClassVar[dict[str, Any]] = {"load_format": FLATTENED_BUCKET}

    def _export(self, view: torch.Tensor, manifest: BucketManifest, tp_rank: int) -> Any:
        """What one consumer (an engine TP rank) receives of a packed bucket: its own serialization
        (its CUDA export's reference counter kept, for the check at release)."""
        counters: list[tuple[bytes, int]] = []
        kept = self._metadata.get(manifest.index)
        if kept is None or kept[0] is not manifest:  # records built once per manifest (a plan is kept)
            kept = self._metadata[manifest.index] = (manifest, metadata_of(manifest))
        out = serialize({"flattened_tensor": view, "metadata": kept[1]}, counters)
        self._counted(manifest.index, tp_rank, counters)
        return out

    def _counted(self, index: int, tp_rank: int, counters: Sequence[tuple[bytes, int]]) -> None:
        self._counters.setdefault(index, []).extend((f"TP rank {tp_rank}", h, o) for h, o in counters)

    def _part(self, export: Any) -> dict[str, Any]:
        """One engine TP rank's `Payload.parts` entry from its export."""
        return {"serialized": export}

    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None:
        if not self._connected:
            raise RuntimeError(f"{type(self).__name__}: pack() before connect()")
        if not self._consumers:  # same gathers as the ranks that feed an engine, nothing kept
            self.temp_bytes = pack_into(None, manifest, tensors).temp_bytes
            return None
        view = None
        if self.resident_source:  # the trainer's own tensors, unchanged until the run ends: may be looked at first
            tensors = list(tensors)
            view = self._in_place(manifest, tensors)
        if view is not None:  # the bucket is already laid out in the trainer's memory: send that
            self._resident[manifest.index] = view
            self.resident_buckets += 1
            try:
                exports = {f"{name}/{j}": self._export(view, manifest, j) for name, j in self._consumers}
            except BaseException:
                self.release(manifest.index)
                raise
            self.temp_bytes = 0
            return {"exports": exports}
        buffer = self._buffer_for(manifest)
        try:
            packed = pack_into(buffer, manifest, tensors)
            view = buffer[: manifest.nbytes]
            exports = {f"{name}/{j}": self._export(view, manifest, j) for name, j in self._consumers}
        except BaseException:
            self.release(manifest.index)
            raise
        self.temp_bytes = packed.temp_bytes
        return {"exports": exports}

    def _in_place(self, manifest: BucketManifest, tensors: Sequence[tuple[str, Any]]) -> torch.Tensor | None:
        """A uint8 view of the bucket in the trainer's own memory, when its tensors lie, in form
        (dtype, shape, contiguous, on this transport's device), in one storage at the manifest's
        offsets from one base; else None (the bucket is packed into a buffer). Asked only of a
        resident source (`resident_source`: a lazy one, Megatron's bridge, may reuse a tensor's
        memory once the next is taken, so its tensors are copied one at a time as before). On CPU
        only a storage already in named shared memory qualifies (sharing would move the trainer's
        own)."""
        import torch

        entries = manifest.entries
        if len(tensors) != len(entries):
            return None
        storage, base = None, 0
        for (name, tensor), entry in zip(tensors, entries, strict=True):
            meta = entry.meta
            if (
                name != meta.name or hasattr(tensor, "placements") or tensor.dtype != torch_dtype(meta.dtype)
                or tuple(tensor.shape) != meta.shape or not tensor.is_contiguous()
            ):  # fmt: skip
                return None
            st = tensor.untyped_storage()
            at = tensor.data_ptr() - st.data_ptr() - entry.offset
            if storage is None:
                if st.device.type != torch.device(self.device).type or at < 0:
                    return None
                if st.device.type == "cpu" and not st.is_shared():
                    return None
                storage, base = st, at
            elif st.data_ptr() != storage.data_ptr() or at != base:
                return None
        if storage is None or base + manifest.nbytes > storage.nbytes():
            return None
        # (made per bucket, kept only until its release: no view outlives the refit to pin memory
        # the trainer has since moved its tensors out of)
        return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, base, (manifest.nbytes,), (1,))

    def _buffer_for(self, manifest: BucketManifest) -> torch.Tensor:
        if manifest.oversized:
            self._own[manifest.index] = self._new_buffer(manifest.nbytes)
            return self._own[manifest.index]
        return self._pool.take(manifest.index)

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        out = {}
        for e in topology.engines:
            per_rank = []
            for j in range(e.tp):
                part = parts[self.route(topology, e, j)] or {}
                per_rank.append(self._part(part["exports"][f"{e.name}/{j}"]))
            out[e.name] = Payload(self.kind, manifest, dict(self.payload_fields), tuple(per_rank))
        return out

    def release(self, index: int) -> None:
        """Every engine acked bucket `index`: its buffer may be written again, unless a consumer
        still holds a reference to it (CUDA: torch's counter of that export is not back to 0). An
        engine that acks before its copies from our buffer ran, keeping the tensors it was given,
        would read the next bucket's bytes: that buffer is replaced instead, never rewritten
        (torch keeps the old memory alive until the consumer lets go). SGLang answers from TP rank 0
        once every rank passed a barrier, while ranks 1.. drop their references just after it: a
        counter still up at the ack gets `HELD_GRACE_S` to come down before it counts as held."""
        held = [c for c in self._counters.pop(index, []) if _still_held(c[1], c[2])]
        end = time.monotonic() + HELD_GRACE_S
        while held and time.monotonic() < end:
            time.sleep(0.0002)
            held = [c for c in held if _still_held(c[1], c[2])]
        if held and self._resident.pop(index, None) is not None:
            who = ", ".join(sorted({c[0] for c in held}))
            raise RuntimeError(
                f"bucket {index}: {who} still held the trainer's own memory (a bucket laid out in place) at its ack; "
                "it cannot be replaced, and the trainer's next step would write under its reads"
            )
        if self._resident.pop(index, None) is not None:
            return
        if held:
            self.held.append({"bucket": index, "consumers": sorted({c[0] for c in held})})
            log.warning(
                "bucket %d: %s still held its CUDA buffer at the ack; the buffer is replaced, never rewritten",
                index, ", ".join(sorted({c[0] for c in held})),
            )  # fmt: skip
            self.abandon(index)
            return
        if self._own.pop(index, None) is not None:
            return
        if index in self._pool:
            self._pool.release(index)

    def abandon(self, index: int) -> None:
        """An engine may still read the buffer: it is never written again (a fresh one replaces it).
        A bucket sent as the trainer's own memory cannot be replaced: the connection is not reused."""
        if self._resident.pop(index, None) is not None:
            self._counters.pop(index, None)
            return
        if self._own.pop(index, None) is not None or index not in self._pool:
            return
        self._pool.abandon(index)

    def disconnect(self) -> None:
        self._pool, self._own, self._consumers, self._counters = self._new_pool(0), {}, [], {}
        self._resident, self.resident_buckets = {}, 0
        self._connected = False


def _still_held(handle: bytes, offset: int) -> bool:
    """Whether a consumer still holds a CUDA export (an unreadable or impossible counter counts as
    held: the buffer is replaced, never rewritten under a reader)."""
    try:
        return ipc_refs(handle, offset) != 0
    except (OSError, ValueError):
        return True


class FlattenedTensorReceiver(Receiver):
    """Engine side (one TP rank): decodes its own serialized entry and returns views of the bucket.
    With ``decoder: sglang`` it decodes with SGLang's own `MultiprocessingSerializer` and
    `FlattenedTensorBucket` (SGLang must be importable in the engine's process). A CUDA bucket's
    handle is opened per bucket (torch's CUDA IPC: the open waits on the sender's event). As
    SGLang's updater does, it keeps nothing: the engine copies out of the views and drops them
    before its ack (SGLang: TP rank 0 before its answer, ranks 1.. just after; see `release`),
    and torch's IPC deleter synchronizes the engine's stream when the last reference goes, so the
    copies have run when the sender hears the ack. No sync of its own: an
    extra one would hide an engine (or a receiver) that keeps a reference past its ack. With
    ``decoder: refit`` each bucket's metadata is also checked against its manifest (offsets
    included); SGLang's code checks nothing of the kind, so ``sglang`` does not either."""

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        return self._read(payload)

    def _read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        data = payload.parts[self.tp_rank].get("serialized")
        if data is None:
            raise ValueError(f"bucket {payload.manifest.index}: no serialized entry for TP rank {self.tp_rank}")
        if self.info.fields.get("decoder") == "sglang":
            from sglang.srt.utils import MultiprocessingSerializer
            from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

            if str(self.info.fields.get("device", "cpu")).startswith("cuda"):  # a CUDA engine: its own process
                from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

                monkey_patch_torch_reductions()  # tp_worker's deserialize_own_rank does it first: its rebuild needs it
            obj = MultiprocessingSerializer.deserialize(data)
            # as SGLang: no check of the offsets against a manifest (the engine's load checks each
            # tensor's name, shape and dtype, as SGLang's loader would)
            bucket = FlattenedTensorBucket(flattened_tensor=obj["flattened_tensor"], metadata=obj["metadata"])
            return bucket.reconstruct_tensors()
        return reconstruct(deserialize(data), payload.manifest, as_sglang=payload.fields.get("metadata") == "sglang")


# ---- disaggregated: broadcast on SGLang's group layout --------------------------------------------

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def sglang_group(store: Any, group_name: str, rank: int, size: int, timeout_s: float, backend: str) -> Any:
    """A process group keyed as SGLang's `init_custom_process_group` keys it (PrefixStore(group_name),
    then `_new_process_group_helper`'s "<group_name>/" and "<device>/"), built from `store` alone:
    never split from the default group, whatever device it is bound to."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    if backend == "gloo":
        group = dist.ProcessGroupGloo(dist.PrefixStore("cpu/", prefixed), rank, size, timeout_delta(timeout_s))
    elif backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout_delta(timeout_s)
        opts.is_high_priority_stream = False
        group = dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", prefixed), rank, size, opts)
    else:
        raise ValueError(f"backend {backend!r}: use gloo or nccl")
    group._set_sequence_number_for_group()
    return group


class SGLangBroadcastTransport(BroadcastTransport):
    """Disaggregated transport for SGLang's `init_weights_update_group` +
    `update_weights_from_distributed`: trainer rank 0 is group rank 0, engine i's TP rank j is
    rank 1 + rank_offset_i + j (SGLang's `rank_offset + tp_rank`)."""

    kind = "sglang_broadcast"
    make_group = staticmethod(sglang_group)

    def __init__(
        self,
        slots: int = 2,
        *,
        backend: str = "gloo",
        host: str | None = None,
        flattened: bool = True,
        group_name: str = DEFAULT_GROUP,
    ) -> None:
        super().__init__(slots, backend=backend, host=host, checksums=False, ops="bucket")
        self.flattened = flattened
        self.group_name = group_name

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_flattened(metas, bucket_bytes)

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        for manifest in plan:
            check_flattened(manifest)
        info = super().connect(plan, topology, rank)
        if self._sender:
            info["group"] = self._info["group"] = self.group_name
        return info

    def route(self, topology: Topology, engine: EngineSpec, tp_rank: int) -> int:
        return SOURCE_RANK

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        shared = dict(rank_infos[SOURCE_RANK])
        return {
            e.name: ConnectInfo(
                self.kind,
                f"{__name__}:SGLangBroadcastReceiver",
                fields={**shared, "rank_offset": 1 + e.rank_offset, "flattened": self.flattened},
                parts=tuple({"rank": 1 + e.rank_offset + j} for j in range(e.tp)),
            )
            for e in topology.engines
        }

    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]:
        fields = {"load_format": FLATTENED_BUCKET if self.flattened else None, "group_name": self.group_name}
        return {e.name: Payload(self.kind, manifest, fields, parts=({},) * e.tp) for e in topology.engines}

    def _send(self, index: int) -> None:
        manifest, buffer = self._sending(index)
        if self.flattened:
            broadcast_from_source(self._group, buffer[: manifest.nbytes])
            return
        for entry in manifest.entries:  # one broadcast per tensor, in list order
            m = entry.meta
            broadcast_from_source(
                self._group, buffer[entry.offset : entry.offset + m.nbytes].view(torch_dtype(m.dtype))
            )


class SGLangBroadcastReceiver(BroadcastReceiver):
    """Engine side of `SGLangBroadcastTransport` (one TP rank), as SGLang's weight updater does it:
    joins the group at attach (`init_custom_process_group`'s layout) and receives each bucket as
    one uint8 buffer (flattened) or one tensor at a time."""

    make_group = staticmethod(sglang_group)

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        import torch

        manifest = payload.manifest
        if payload.fields.get("load_format") == FLATTENED_BUCKET:
            check_flattened(manifest)
            buffer = torch.empty(manifest.nbytes, dtype=torch.uint8)
            broadcast_from_source(self._group, buffer)
            return [
                (
                    e.meta.name,
                    buffer[e.offset : e.offset + e.meta.nbytes].view(torch_dtype(e.meta.dtype)).view(e.meta.shape),
                )
                for e in manifest.entries
            ]
        out = []
        for entry in manifest.entries:
            m = entry.meta
            tensor = torch.empty(m.shape, dtype=torch_dtype(m.dtype))
            broadcast_from_source(self._group, tensor)
            out.append((m.name, tensor))
        return out
