"""vLLM's transports (vLLM 0.33's packed weight transfer), in the flattened layout.

vLLM's packed weight transfer concatenates tensors as raw uint8 with no padding, exactly as
SGLang's flattened buckets (`refit.drivers.flattened`); its consumer rebuilds the boundaries from
names/dtype_names/shapes (NCCL: a chunk closes once its size exceeds packed_buffer_size_bytes,
which refit sets to its largest bucket, so one bucket is one chunk) or from tensor_sizes (IPC).
Offsets must be aligned for each dtype (vLLM's consumer fails otherwise, and its producer does not
notice): `plan_flattened`'s ordering does it. So each transport is SGLang's with vLLM's fields:

  `VLLMBroadcastTransport` (kind ``vllm_nccl``), disaggregated: SGLang's broadcast transport on
  vLLM's group (`refit.drivers.vllm_nccl` speaks vLLM's NCCL rendezvous for a real server).
  `VLLMIPCTransport` (kind ``vllm_ipc``), colocated: SGLang's tensor transport, one shared buffer
  per bucket and one handle per engine TP rank's device; `VLLMIPCReceiver` is its engine side in
  refit's emulated vLLM server.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from refit.buckets import BucketManifest
from refit.drivers.base import ConnectInfo, Payload, Receiver, Topology
from refit.drivers.broadcast import SOURCE_RANK
from refit.drivers.flattened import REF_COUNTER_ARGS, check_flattened, deserialize, metadata_of, reconstruct, serialize
from refit.drivers.sglang_transport import SGLangBroadcastTransport, SGLangTensorTransport

if TYPE_CHECKING:
    import torch


class VLLMBroadcastTransport(SGLangBroadcastTransport):
    """Disaggregated transport for vLLM's NCCL weight transfer (`init_weight_transfer_engine` with
    master_address/master_port, then `update_weights` while trainer rank 0 broadcasts): packed, one
    uint8 broadcast per bucket; unpacked, one per tensor in `names` order. Engine i's workers are
    ranks 1 + rank_offset_i + j (vLLM's rank_offset + TP rank, one DP replica per engine).

    Backend ``nccl``: what a real vLLM server joins. The trainer speaks vLLM's rendezvous itself
    (`refit.drivers.vllm_nccl`: vLLM's StatelessProcessGroup store key and pickled ncclUniqueId,
    the NCCL library through ctypes as vLLM's own wrapper calls it, vLLM's one-element all-reduce
    warm-up). It needs a CUDA build of torch and a GPU on the trainer.
    Backend ``gloo``: the CPU stand-in that refit's emulated vLLM server joins (vLLM's own
    receiver is NCCL-only)."""

    kind = "vllm_nccl"

    def __init__(self, slots: int = 2, *, backend: str = "gloo", host: str | None = None, packed: bool = True) -> None:
        super().__init__(slots, backend=backend, host=host, flattened=packed, group_name="vllm_weight_transfer")
        if backend == "nccl":
            from refit.drivers.vllm_nccl import vllm_group

            self.make_group = vllm_group

    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]:
        if self.backend == "nccl" and rank == SOURCE_RANK:
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(
                    "VLLMBroadcastTransport(backend='nccl') sends from a GPU: this trainer's torch sees no CUDA "
                    "device. A real vLLM server needs it; backend='gloo' only reaches refit's emulated vLLM server"
                )
        return super().connect(plan, topology, rank)

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        infos = super().attach_infos(rank_infos, topology)
        extra = {
            "packed": self.flattened,
            "packed_buffer_size_bytes": max(int(rank_infos[SOURCE_RANK].get("slot_bytes", 1)), 1),
            "packed_num_buffers": self.slots,
        }
        return {name: ConnectInfo(i.kind, i.receiver, {**i.fields, **extra}, i.parts) for name, i in infos.items()}


def device_key(tensor: torch.Tensor, tp_rank: int) -> str:
    """The key vLLM's IPC receiver looks its handle up by: the physical GPU's UUID (CUDA), or, for
    a CPU buffer (refit's emulated server only), ``cpu:<TP rank>``."""
    import torch

    if tensor.device.type == "cuda":
        return str(torch.cuda.get_device_properties(tensor.device).uuid)
    return f"cpu:{tp_rank}"


def ipc_args(buffer: torch.Tensor) -> Any:
    """What vLLM rebuilds a shared buffer from: CUDA, `reduce_tensor`'s rebuild_cuda_tensor args
    (vLLM overwrites the device index); CPU, the buffer serialized by shared-memory name (vLLM
    itself cannot open those: they serve refit's emulated server)."""
    if buffer.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(buffer)[1]
    return serialize(buffer)


class VLLMIPCTransport(SGLangTensorTransport):
    """Colocated transport for vLLM's IPC weight transfer, packed: each bucket is one shared uint8
    buffer; `update_weights` carries names/dtype_names/shapes, `tensor_sizes` and one handle per
    engine TP rank's device (`ipc_handles_pickled`)."""

    kind = "vllm_ipc"

    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]:
        return {
            e.name: ConnectInfo(self.kind, f"{__name__}:VLLMIPCReceiver", fields={"packed": True}, parts=({},) * e.tp)
            for e in topology.engines
        }

    payload_fields: ClassVar[dict[str, Any]] = {"packed": True}

    def _export(self, view: torch.Tensor, manifest: BucketManifest, tp_rank: int) -> Any:
        args = ipc_args(view)
        if view.is_cuda:
            self._counted(manifest.index, tp_rank, [(args[REF_COUNTER_ARGS[0]], int(args[REF_COUNTER_ARGS[1]]))])
        return device_key(view, tp_rank), args

    def _part(self, export: Any) -> dict[str, Any]:
        key, args = export
        return {"device": key, "args": args}


class VLLMIPCReceiver(Receiver):
    """Engine side of `VLLMIPCTransport` in refit's emulated vLLM server (one TP rank): looks its
    handle up by its device key and returns views of the bucket, as vLLM's packed IPC consumer
    splits it by `tensor_sizes`."""

    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]:
        handles = payload.fields.get("handles") or {}
        key = f"cpu:{self.tp_rank}"
        if key not in handles:
            raise ValueError(f"IPC handle not found for device {key}. Available: {sorted(handles)}")
        buffer = deserialize(handles[key])
        check_flattened(payload.manifest)
        return reconstruct({"flattened_tensor": buffer, "metadata": metadata_of(payload.manifest)}, payload.manifest)
