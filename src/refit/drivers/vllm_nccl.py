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
the trainer need not have vLLM), the NCCL library called directly through ctypes as vLLM's own
pynccl_wrapper calls it (torch's `torch.cuda.nccl` bindings fail on Python 3.12: they parse the
unique id with a '#' format without PY_SSIZE_T_CLEAN, seen on the H200 with torch 2.11), and the
warm-up. Lifecycle: built at the transport's `join` while the engines' init calls are in flight
(all block until every rank joined); `broadcast` per bucket on a side stream, ordered after the
caller's stream; `abort` (ncclCommAbort) on a failed send or at disconnect.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
from typing import Any

VLLM_UNIQUE_ID = ("vllm.distributed.device_communicators.pynccl_wrapper", "ncclUniqueId")
UNIQUE_ID_BYTES = 128  # sizeof(ncclUniqueId)
UNIQUE_ID_KEY = "broadcast_from/0/0"  # StatelessProcessGroup.broadcast_obj: the first object rank 0 sends


class _UniqueIdRef:
    """Stands for vLLM's ncclUniqueId class in the pickle (written by name, never imported)."""


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
    from refit.drivers.pickling import ByNamePickler

    buf = io.BytesIO()
    ByNamePickler(buf, {_UniqueIdRef: VLLM_UNIQUE_ID}).dump(_UniqueId(bytes(uid)))
    return buf.getvalue()


def publish_unique_id(store: Any, uid: bytes) -> None:
    """Rank 0's `broadcast_obj(unique_id, src=0)`: every worker reads it from `store`."""
    store.set(UNIQUE_ID_KEY, unique_id_pickle(uid))


class _NcclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


NCCL_DTYPES = {  # ncclDataType_t (nccl.h)
    "int8": 0, "uint8": 1, "bool": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5, "float16": 6,
    "float32": 7, "float64": 8, "bfloat16": 9,
}  # fmt: skip
NCCL_SUM = 0
NCCL_IN_PROGRESS = 7  # ncclInProgress: a non-blocking communicator is still working
NCCL_UNDEF_INT = -(2**31)  # NCCL_CONFIG_UNDEF_INT (INT_MIN): the library's default


class _NcclConfig(ctypes.Structure):
    """ncclConfig_t as NCCL 2.17 lays it out (nccl.h `ncclConfig_v21700`); later releases read an
    older config by its `size` and `version`."""

    _fields_ = [
        ("size", ctypes.c_size_t), ("magic", ctypes.c_uint), ("version", ctypes.c_uint), ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int), ("minCTAs", ctypes.c_int), ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
    ]  # fmt: skip

    @classmethod
    def non_blocking(cls) -> _NcclConfig:
        return cls(ctypes.sizeof(cls), 0xCAFEBEEF, 21700, 0, NCCL_UNDEF_INT, NCCL_UNDEF_INT, NCCL_UNDEF_INT, None)


class NcclLibrary:
    """The few NCCL calls vLLM's workers make, through ctypes (as vllm/distributed/device_communicators/
    pynccl_wrapper.py does). The library: REFIT_NCCL_SO, else the one the CUDA build of torch loads
    (the nvidia-nccl wheel), else libnccl.so.2 on the loader's path."""

    def __init__(self, path: str | None = None) -> None:
        import os

        candidates = [path, os.environ.get("REFIT_NCCL_SO"), *_wheel_nccl(), "libnccl.so.2"]
        errors = []
        for candidate in [c for c in candidates if c]:
            try:
                self.lib = ctypes.CDLL(candidate)
                break
            except OSError as exc:
                errors.append(f"{candidate}: {exc}")
        else:
            raise RuntimeError("no NCCL library could be loaded (set REFIT_NCCL_SO): " + "; ".join(errors))
        c = ctypes
        self.lib.ncclGetErrorString.restype = c.c_char_p
        self.lib.ncclGetUniqueId.argtypes = [c.POINTER(_NcclUniqueId)]
        self.lib.ncclCommInitRank.argtypes = [c.POINTER(c.c_void_p), c.c_int, _NcclUniqueId, c.c_int]
        self.lib.ncclAllReduce.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_void_p, c.c_void_p]
        self.lib.ncclBroadcast.argtypes = [c.c_void_p, c.c_void_p, c.c_size_t, c.c_int, c.c_int, c.c_void_p, c.c_void_p]
        self.lib.ncclCommAbort.argtypes = [c.c_void_p]
        if hasattr(self.lib, "ncclCommInitRankConfig"):
            self.lib.ncclCommInitRankConfig.argtypes = [
                c.POINTER(c.c_void_p), c.c_int, _NcclUniqueId, c.c_int, c.POINTER(_NcclConfig),
            ]  # fmt: skip
        if hasattr(self.lib, "ncclCommGetAsyncError"):
            self.lib.ncclCommGetAsyncError.argtypes = [c.c_void_p, c.POINTER(c.c_int)]
        self.blocking = True

    def check(self, rc: int, what: str) -> None:
        if rc == NCCL_IN_PROGRESS and not self.blocking:  # enqueued; its errors surface asynchronously
            return
        if rc != 0:
            raise RuntimeError(f"NCCL {what} failed: {self.lib.ncclGetErrorString(rc).decode()} (code {rc})")

    def unique_id(self) -> bytes:
        uid = _NcclUniqueId()
        self.check(self.lib.ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
        return bytes(uid.internal)

    def init_rank(self, world: int, uid: bytes, rank: int, *, timeout: float) -> Any:
        """ncclCommInitRank, bounded: a non-blocking communicator (ncclCommInitRankConfig) polled
        until it is ready, aborted at `timeout` (a worker that never joins cannot hang the
        trainer); a library without it: the blocking call on a thread, given up at `timeout`."""
        import threading
        import time

        comm = ctypes.c_void_p()
        raw = _NcclUniqueId()
        ctypes.memmove(raw.internal, uid, UNIQUE_ID_BYTES)
        if hasattr(self.lib, "ncclCommInitRankConfig") and hasattr(self.lib, "ncclCommGetAsyncError"):
            config = _NcclConfig.non_blocking()
            rc = self.lib.ncclCommInitRankConfig(ctypes.byref(comm), world, raw, rank, ctypes.byref(config))
            if rc not in (0, NCCL_IN_PROGRESS):
                self.check(rc, "ncclCommInitRankConfig")
            self.settle(comm, time.monotonic() + timeout, "ncclCommInitRankConfig")
            self.blocking = False
            return comm
        box: dict[str, int] = {}
        worker = threading.Thread(
            target=lambda: box.setdefault("rc", self.lib.ncclCommInitRank(ctypes.byref(comm), world, raw, rank)),
            name="refit-nccl-init", daemon=True,
        )  # fmt: skip
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            raise TimeoutError(f"ncclCommInitRank: {world - 1} workers did not join within {timeout:.3g}s")
        self.check(box["rc"], "ncclCommInitRank")
        return comm

    def settle(self, comm: Any, deadline: float, what: str) -> None:
        """Wait until a non-blocking communicator is done with `what`; abort it past `deadline`."""
        import time

        state = ctypes.c_int(NCCL_IN_PROGRESS)
        while True:
            self.lib.ncclCommGetAsyncError(comm, ctypes.byref(state))
            if state.value == 0:
                return
            if state.value != NCCL_IN_PROGRESS:
                self.lib.ncclCommAbort(comm)
                self.check(state.value, what)
            if time.monotonic() > deadline:
                self.lib.ncclCommAbort(comm)
                raise TimeoutError(f"NCCL {what}: not done by its deadline (the communicator was aborted)")
            time.sleep(0.005)

    def all_reduce(self, tensor: Any, comm: Any, stream: Any) -> None:
        self.check(
            self.lib.ncclAllReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _dtype(tensor), NCCL_SUM,
                                   comm, stream.cuda_stream),
            "ncclAllReduce",
        )  # fmt: skip

    def broadcast(self, tensor: Any, comm: Any, stream: Any) -> None:
        self.check(
            self.lib.ncclBroadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), _dtype(tensor), 0, comm,
                                   stream.cuda_stream),
            "ncclBroadcast",
        )  # fmt: skip

    def abort(self, comm: Any) -> None:
        self.lib.ncclCommAbort(comm)


def _dtype(tensor: Any) -> int:
    from refit.buckets import dtype_name

    name = dtype_name(tensor.dtype)
    if name not in NCCL_DTYPES:
        raise ValueError(f"NCCL has no data type for {name}")
    return NCCL_DTYPES[name]


def _wheel_nccl() -> list[str]:
    """The NCCL the CUDA build of torch depends on (the nvidia-nccl-cu* wheel), if installed."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec("nvidia")
    roots = list(spec.submodule_search_locations or []) if spec else []
    return [p for root in roots for p in sorted(glob.glob(f"{root}/nccl/lib/libnccl.so*"))]


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

    def __init__(
        self,
        store: Any,
        world: int,
        *,
        timeout_s: float = 60.0,
        unique_id: bytes | None = None,
        nccl: NcclLibrary | None = None,
    ) -> None:
        import time

        import torch

        self.nccl = nccl or NcclLibrary()
        self.device = torch.device("cuda", torch.cuda.current_device())
        uid = unique_id if unique_id is not None else self.nccl.unique_id()
        publish_unique_id(store, uid)
        deadline = time.monotonic() + timeout_s
        with torch.cuda.device(self.device):
            self.comm = self.nccl.init_rank(int(world), uid, 0, timeout=timeout_s)  # every worker joined
            self.stream = torch.cuda.Stream(self.device)
            warm = torch.zeros(1, dtype=torch.float32, device=self.device)  # PyNcclCommunicator's warm-up
            stream = torch.cuda.current_stream()
            self.nccl.all_reduce(warm, self.comm, stream)
            done = torch.cuda.Event()
            done.record(stream)
            while not done.query():  # a worker that skips the warm-up would hang a synchronize
                if time.monotonic() > deadline:
                    self.abort()
                    raise TimeoutError(
                        f"vLLM's NCCL warm-up all-reduce: not every worker took part within {timeout_s:.3g}s"
                    )
                time.sleep(0.001)

    def broadcast(self, tensors: list[Any], opts: Any = None) -> _Done:
        import torch

        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        for t in tensors:
            self.nccl.broadcast(t, self.comm, self.stream)
        event = torch.cuda.Event()
        event.record(self.stream)
        return _Done(event)

    def abort(self) -> None:
        """ncclCommAbort: a peer gone mid-broadcast cannot hang the trainer's stream."""
        comm, self.comm = getattr(self, "comm", None), None
        if comm is not None:
            with contextlib.suppress(Exception):
                self.nccl.abort(comm)


def vllm_group(store: Any, name: str, rank: int, size: int, timeout_s: float, backend: str) -> Any:
    """The transport's `make_group` for vLLM over NCCL: rank 0 only (the trainer)."""
    if backend != "nccl" or rank != 0:
        raise ValueError("vllm_group: the trainer is rank 0 of vLLM's NCCL group")
    return VLLMNcclGroup(store, size, timeout_s=timeout_s)
