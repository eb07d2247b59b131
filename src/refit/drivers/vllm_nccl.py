"""vLLM 0.33's NCCL weight-transfer rendezvous, trainer side (group rank 0), without vLLM.

What a vLLM worker does at `POST /init_weight_transfer_engine` with master_address/master_port
(vllm/distributed/weight_transfer/nccl_common.py `worker_init_process_group`):
  1. `StatelessProcessGroup.create(master_address, master_port, rank, world_size)`
     (vllm/distributed/utils.py): a TCPStore client; group rank 0 runs the store's server;
  2. `PyNcclCommunicator(pg, device)` (vllm/distributed/device_communicators/pynccl.py): rank 0
     draws an `ncclUniqueId` and `pg.broadcast_obj`s it: the store key "broadcast_from/0/0" holds
     the pickled ctypes structure, which every other rank reads; then `ncclCommInitRank(world,
     id, rank)`, then a one-element float32 all-reduce (the warm-up every rank must join, or all
     of them wait);
  3. each worker's group rank is rank_offset + dp_index * (TP * PP) + its rank
     (nccl_common.py `_worker_group_rank`); world_size counts the trainer's one rank and every
     worker.
Then `update_weights` receives, per call, one broadcast per tensor in `names` order (unpacked) or
one per packed chunk, from rank 0.

Here rank 0 is refit's trainer: the same store key and pickle (vLLM's class named, not imported:
the trainer need not have vLLM), torch's own NCCL bindings (`torch.cuda.nccl`: unique_id,
init_rank, all_reduce, broadcast) for the communicator, and the warm-up. Lifecycle: built at the
transport's `join` while the engines' init calls are in flight (all block until every rank
joined); `broadcast` per bucket on a side stream, ordered after the caller's stream; `abort` on a
failed send or at disconnect.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any

VLLM_UNIQUE_ID = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj: the first object rank 0 sends


class _UniqueIdRef:
    """Stands for vLLM's ncclUniqueId class in the pickle (written by name, never imported)."""


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if obj is _UniqueIdRef:
            module, name = VLLM_UNIQUE_ID
            self.save(module)
            self.save(name)
            self.write(pickle.STACK_GLOBAL)
            self.memoize(obj)
            return
        super().save(obj, save_persistent_id)


class _UniqueId:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw

    def __reduce__(self) -> tuple[Any, ...]:
        import _ctypes

        return _ctypes._unpickle, (_UniqueIdRef, ({}, self.raw))  # what a ctypes Structure reduces to


def unique_id_pickle(uid: bytes) -> bytes:
    """`pickle.dumps(ncclUniqueId holding uid)`, as vLLM's rank 0 writes it to the store."""
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id is {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.DEFAULT_PROTOCOL).dump(_UniqueId(bytes(uid)))
    return buf.getvalue()


def publish_unique_id(store: Any, uid: bytes) -> None:
    """Rank 0's `broadcast_obj(unique_id, src=0)`: every worker reads it from `store`."""
    store.set(UNIQUE_ID_KEY, unique_id_pickle(uid))


class _Done:
    """The Work of a broadcast on the group's stream: `wait` orders the caller's stream after it."""

    def __init__(self, event: Any) -> None:
        self.event = event

    def wait(self) -> bool:
        import torch

        torch.cuda.current_stream().wait_event(self.event)
        return True


class VLLMNcclGroup:
    """Trainer rank 0 of a vLLM worker group (see the module docstring). `broadcast([t], opts)`
    has the shape of a torch ProcessGroup's, so refit's broadcast transport drives it as one."""

    def __init__(self, store: Any, world: int, *, unique_id: bytes | None = None) -> None:
        import torch
        from torch.cuda import nccl

        if not nccl.is_available([torch.empty(1, device="cuda")]):
            raise RuntimeError("this torch has no NCCL: vLLM's weight transfer needs a CUDA build of torch")
        self.device = torch.device("cuda", torch.cuda.current_device())
        uid = unique_id if unique_id is not None else nccl.unique_id()
        publish_unique_id(store, uid)
        with torch.cuda.device(self.device):
            self.comm = nccl.init_rank(int(world), uid, 0)  # returns once every worker called ncclCommInitRank
            self.stream = torch.cuda.Stream(self.device)
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # PyNcclCommunicator's warm-up
            nccl.all_reduce([warm], streams=[torch.cuda.current_stream()], comms=[self.comm])
            torch.cuda.current_stream().synchronize()

    def broadcast(self, tensors: list[Any], opts: Any = None) -> _Done:
        import torch
        from torch.cuda import nccl

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        nccl.broadcast(tensors, root=0, streams=[self.stream], comms=[self.comm])
        event = torch.cuda.Event()
        event.record(self.stream)
        return _Done(event)

    def abort(self) -> None:
        """Drop the communicator (torch destroys it: ncclCommDestroy)."""
        with contextlib.suppress(Exception):
            del self.comm


def vllm_group(store: Any, name: str, rank: int, size: int, timeout_s: float, backend: str) -> Any:
    """The transport's `make_group` for vLLM over NCCL: rank 0 only (the trainer)."""
    if backend != "nccl" or rank != 0:
        raise ValueError("vllm_group: the trainer is rank 0 of vLLM's NCCL group")
    return VLLMNcclGroup(store, size)
