"""Trainer ranks as participants: one leader drives the refit; every rank does its share of each
trainer-side step when told, so every rank makes the same calls (and collectives) in the same order.

  Participant   one rank's share of every trainer-side step, against its own Source and Transport
                (gather bucket k, pack what this rank feeds, send, release...). Lives on its rank.
  Ranks         the trainer ranks as the leader reaches them: `start(step)` runs one step on every
                rank and returns a future of the per-rank values. Hostings:
  LocalRanks    in-process: the participants live in the leader's process (one rank, or several
                for tests); each runs its steps on its own lanes.
  SpmdRanks     torch.distributed SPMD: every rank calls `protocol.run(ctx)`; rank 0 leads and
                posts each step as a numbered command in a TCPStore it hosts; the others follow:
                they run the command on their participant and post the reply. A leader that stops
                waiting for a rank (deadline) simply moves on: commands are numbered, never
                collective, so a late or stuck rank cannot make the next command mismatch.
  RayRanks      (refit.drivers.ray_actors, extra [ray]) trainer ranks as Ray actors: the leader is
                the driver process; each rank's actor hosts its Participant (`RankHost`); each step
                is one actor call per rank, awaited through Ray's own futures.

Each participant runs its steps on two lanes, each in order: `send` (a collective transport's
transfer) and `main` (everything else), so bucket k+1 is gathered and packed while bucket k is
on the wire, and sends are issued in bucket order on every rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from refit.buckets import BucketManifest, TensorMeta, plan_heads, tensor_identity
from refit.drivers.base import LazyTensors, Source, Topology, Transport
from refit.errors import RankError, RefitError

SEND_CALLS = frozenset({"send"})
SOURCE_CALLS = frozenset({"metas", "epoch", "offload", "restore", "logprobs"})  # the rest are the transport's
# steps whose per-rank values the trace keeps (field `per_rank`); replay answers with them
RECORDED_RESULTS = frozenset({"epoch", "digests", "logprobs"})


@dataclass(frozen=True)
class RankStep:
    """One trainer-side step as data: every rank runs `call` with `args`."""

    call: str
    state: str
    args: tuple[Any, ...] = ()
    bucket: int | None = None

    @property
    def lane(self) -> str:
        return "send" if self.call in SEND_CALLS else "main"

    @property
    def side(self) -> str:
        return "source" if self.call in SOURCE_CALLS else "transport"


@dataclass
class RankStats:
    """What one rank measured during a run."""

    rank: int
    peak_bytes: int = 0  # the most trainer memory refit held at once: buffers + gather temporaries
    steps: list[tuple[str, int | None, int]] = field(default_factory=list)  # (call, bucket, attempt) in order


class Participant:
    """One trainer rank's share of every trainer-side step.

    Steps (the leader sends them; every rank runs each one, in the order sent):
      metas()                 this rank's view of the tensors (the leader checks ranks agree)
      epoch()                 the storage epoch of this rank's source (storage-sharing transports)
      offload() / restore()   the source's colocated memory hooks
      connect(plan, topology) open this rank's side of the transport; returns its info
      join()                  collective transports: enter the group while engines attach
      pack(index, attempt, digest)
                              take bucket `index` from this rank's stream (a new attempt opens a
                              fresh stream on every rank) and pack it, or drain it when this rank
                              feeds no engine; returns this rank's part. `digest` (a kind of
                              `refit.verify`): rank 0 also takes each tensor's digest as it packs
      digests()               what rank 0 hashed since its stream opened: {"kind", "digests"}
      predigest(plan, kind)   before the pause: rank 0 queues a resident source's digests (GPU)
      logprobs(prompts, top)  verify="probe": the source's next-token log-probabilities (rank 0's)
      send(index)             collective transports: this rank's half of the transfer
      release(index) / abandon(index) / disconnect()
      end_run()               close the stream; report this run's stats
    """

    def __init__(self, source: Source, transport: Transport, rank: int = 0, world: int = 1) -> None:
        self.source = source
        self.transport = transport
        self.rank = rank
        self.world = world
        self.plan: list[BucketManifest] = []
        self.topology: Topology | None = None
        self._stream: Any = None
        self._stream_key: tuple[int, ...] | None = None
        self._next = 0
        self.stats = RankStats(rank)
        self._lock = threading.Lock()
        self._digests: Any = None  # rank 0, verify on: a refit.verify.Digests of what it sent
        self._early: tuple[str, Any, dict[str, tuple[int, int]]] | None = None  # predigest: (kind, Digests, identities)
        self._from_early: set[str] = set()  # names whose early digest still held when packed

    def run(self, step: RankStep) -> Any:
        attempt = step.args[1] if step.call == "pack" else -1
        self.stats.steps.append((step.call, step.bucket, attempt))
        return getattr(self, step.call)(*step.args)

    # ---- steps -----------------------------------------------------------------------------------

    def metas(self) -> list[TensorMeta]:
        return self.source.metas()

    def epoch(self) -> int | None:
        storages = self.source.storages()
        return None if storages is None else storages.epoch

    def prepare(self, plan: Sequence[BucketManifest]) -> None:
        """Before any engine is paused: let the transport look at a resident source's tensors."""
        if not (self.transport.wants_prepare and self.source.resident):
            return
        stream = iter(self.source.iter_buckets(plan))
        try:
            for manifest, tensors in zip(plan, stream, strict=False):
                self.transport.prepare(manifest, tensors)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()

    def logprobs(self, prompts: Sequence[Sequence[int]], top: int) -> list[dict[str, list[Any]]] | None:
        out = self.source.logprobs(prompts, top)  # every rank: a sharded forward is collective
        return out if self.rank == 0 else None

    def offload(self) -> None:
        self.source.offload()

    def restore(self) -> None:
        self._close_stream()
        self.source.restore()

    def connect(self, plan: Sequence[BucketManifest], topology: Topology) -> dict[str, Any]:
        self._close_stream()
        self.plan, self.topology = list(plan), topology
        if self.transport.shares_storages:
            self.transport.share(self.source.storages())
        info = self.transport.connect(self.plan, topology, self.rank)
        self._account(0)
        return info

    def join(self) -> None:
        self.transport.join()

    def pack(self, index: int, attempt: int, digest: str | None = None) -> dict[str, Any] | None:
        if self._stream is None or self._stream_key != (attempt,) or index == 0:
            self._open_stream(attempt)
        if index != self._next:
            raise RuntimeError(f"asked for bucket {index} but this rank's stream is at bucket {self._next}")
        try:
            tensors: LazyTensors = next(self._stream)
        except StopIteration:
            raise RuntimeError(f"the source ended before bucket {index} of {len(self.plan)}") from None
        self._next += 1
        hashed = digest is not None and self.rank == 0
        if digest is not None:
            tensors = self._hashed(tensors, digest, self.plan[index])
        self.transport.tensor_digests = {} if hashed and digest == "xxh3" else None
        try:
            part = self.transport.pack(self.plan[index], tensors)
        finally:
            self.transport.tensor_digests = None
        if hashed and self._digests is not None:
            self._digests.flush()  # a GPU's queued digests now (one launch), so the source may free the tensors
        self._account(self.transport.temp_bytes)
        return part

    def digests(self) -> dict[str, Any] | None:
        if self.rank != 0 or self._digests is None:
            return None
        out = self._digests.results()
        if self._early is not None and self._from_early:
            early = self._early[1].results()
            out.update({n: early[n] for n in self._from_early})
        return {"kind": self._digests.kind, "digests": out}

    def predigest(self, plan: Sequence[BucketManifest], kind: str) -> None:
        """Before any engine is paused: rank 0 queues the digests of a resident source's tensors
        (its own, unchanged until the run ends), so packing need not read them in the stall. A
        tensor written since (its storage or torch version counter changed) is hashed as it is
        packed instead."""
        self._early, self._from_early = None, set()
        if self.rank != 0 or not self.source.resident:
            return
        from refit.verify import Digests

        batch, ids = Digests(kind), {}
        stream = iter(self.source.iter_buckets(plan))
        try:
            for _, tensors in zip(plan, stream, strict=False):
                for name, tensor in tensors:
                    batch.add(name, tensor)
                    ids[name] = tensor_identity(tensor)
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        batch.results()  # read back now, before the pause (a GPU's: one sync), not in VERIFYING's stall
        self._early = (kind, batch, ids)

    def _hashed(self, tensors: LazyTensors, kind: str, manifest: BucketManifest) -> LazyTensors:
        """The bucket's tensors as the source gives them; once the transport has taken each one,
        rank 0 records its digest: of the full value (every rank gathers a sharded tensor once
        more, in the same order, so the collectives match) in the dtype the plan sends (a source
        may hand out tensors the transport casts on the way)."""
        from refit.buckets import torch_dtype
        from refit.verify import Digests

        if self.rank == 0 and (self._digests is None or self._digests.kind != kind):
            self._digests = Digests(kind, plan_heads(self.plan))
        dtypes = {e.meta.name: e.meta.dtype for e in manifest.entries}
        for name, tensor in tensors:
            yield name, tensor
            full = tensor.full_tensor() if hasattr(tensor, "placements") else tensor  # on every rank
            if self.rank != 0:
                continue
            early = self._early
            if early is not None and early[0] == kind and early[2].get(name) == tensor_identity(full):
                self._from_early.add(name)  # hashed before the pause, unchanged since
                continue
            packed = self.transport.tensor_digests  # the transport hashed it while packing: not read again
            if packed and name in packed and kind == "xxh3":
                self._digests.put(name, f"{packed[name]:016x}")
                continue
            want = torch_dtype(dtypes[name]) if name in dtypes else full.dtype
            self._digests.add(name, full if full.dtype == want else full.to(want))

    def send(self, index: int) -> None:
        self.transport.send(index)

    def release(self, index: int) -> None:
        self.transport.release(index)
        if index == len(self.plan) - 1:
            self._close_stream()

    def abandon(self, index: int) -> None:
        self.transport.abandon(index)

    def disconnect(self) -> None:
        self._close_stream()
        self.transport.disconnect()

    def end_run(self) -> RankStats:
        self._close_stream()
        stats, self.stats = self.stats, RankStats(self.rank)
        return stats

    # ---- internals -------------------------------------------------------------------------------

    def _account(self, temp_bytes: int) -> None:
        self.stats.peak_bytes = max(self.stats.peak_bytes, self.transport.buffer_bytes + temp_bytes)

    def _open_stream(self, attempt: int) -> None:
        self._close_stream()
        self.transport.resident_source = self.source.resident  # (once per run attempt: it may cost)
        self._stream = iter(self.source.iter_buckets(self.plan))
        self._stream_key = (attempt,)
        self._next = 0
        self._digests, self._from_early = None, set()

    def _close_stream(self) -> None:
        stream, self._stream, self._stream_key = self._stream, None, None
        close = getattr(stream, "close", None)
        if close is not None:  # a generator source releases what it holds now, not at GC
            with contextlib.suppress(ValueError):  # still running in a stuck call: left to finish
                close()


class Ranks(ABC):
    """The trainer ranks as the leader reaches them."""

    world: int = 1
    leader: bool = True
    remote: bool = False  # every rank lives in another process: the leader holds no source of its own

    @abstractmethod
    def start(self, step: RankStep, *, timeout: float) -> Future[list[Any]]:
        """Run `step` on every rank; the future holds the per-rank values in rank order, or a
        RankError naming the first rank that failed."""

    @property
    def connected(self) -> bool | None:
        """For a hosting whose ranks all live in other processes: whether every rank's transport is
        connected, as of their last answers. None: the leader's own transport (`ctx.transport`,
        rank 0's) tells."""
        return None

    def finish(self, result: Any) -> None:  # noqa: B027 - SPMD followers receive the run's result
        """The run is over: hand `result` to the ranks that follow."""

    def follow(self, deadline_s: float) -> Any:
        raise RuntimeError("this process leads the refit: call protocol.run on the leader, not follow()")

    def close(self) -> None:  # noqa: B027
        """Stop the ranks' lanes (followers leave their loop)."""


def combine(futures: Sequence[Future[Any]]) -> Future[list[Any]]:
    """One future for every rank's: their values in order, or the first rank's error (by rank).
    Public for hosts of ranks (refit.drivers.ray_actors)."""
    out: Future[list[Any]] = Future()
    left = [len(futures)]
    lock = threading.Lock()

    def done(_: Future[Any]) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        for rank, f in enumerate(futures):
            if f.cancelled():  # the lanes were shut down (the context closed) before it ran
                out.set_exception(RankError(rank, "cancelled: the trainer ranks were closed"))
                return
            exc = f.exception()
            if exc is not None:
                out.set_exception(exc if isinstance(exc, RankError | TimeoutError) else RankError(rank, _text(exc)))
                return
        out.set_result([f.result() for f in futures])

    if not futures:
        out.set_result([])
    for f in futures:
        f.add_done_callback(done)
    return out


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


class Lanes:
    """A participant's two ordered lanes (main, send); public for hosts of ranks."""

    def __init__(self, participant: Participant) -> None:
        self.participant = participant
        prefix = f"refit-rank{participant.rank}"
        self._lanes = {
            "main": ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-main"),
            "send": ThreadPoolExecutor(1, thread_name_prefix=f"{prefix}-send"),
        }

    def submit(self, step: RankStep) -> Future[Any]:
        rank = self.participant.rank

        def call() -> Any:
            try:
                return self.participant.run(step)
            except RankError:
                raise
            except Exception as exc:
                raise RankError(rank, _text(exc)) from exc

        return self._lanes[step.lane].submit(call)

    def shutdown(self) -> None:
        for lane in self._lanes.values():
            lane.shutdown(wait=False, cancel_futures=True)


class LocalRanks(Ranks):
    """In-process hosting: every participant lives in this process."""

    def __init__(self, participants: Sequence[Participant]) -> None:
        if not participants:
            raise ValueError("LocalRanks needs at least one participant")
        self.participants = list(participants)
        self.world = len(self.participants)
        self._lanes = [Lanes(p) for p in self.participants]

    def start(self, step: RankStep, *, timeout: float) -> Future[list[Any]]:
        return combine([lanes.submit(step) for lanes in self._lanes])

    def close(self) -> None:
        for lanes in self._lanes:
            lanes.shutdown()


# ---- SPMD over torch.distributed -----------------------------------------------------------------------

_END = "__end__"
_CLOSE = "__close__"


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(seconds, 0.001))


def follow_error(rank: int, waited: float, deadline_s: float, exc: BaseException) -> str:
    """Why a follower's wait for the leader's next command ended (`waited` seconds in): the wait
    ran out, or, well before it could, the leader's store went away (its process exited)."""
    if waited >= 0.9 * deadline_s:
        return (
            f"rank {rank}: the leader (rank 0) sent no command for {waited:.1f}s (the run's deadline); "
            "call protocol.run(ctx) on every rank"
        )
    return (
        f"rank {rank}: lost the leader's (rank 0) store after waiting {waited:.1f}s for its next command, well "
        f"inside the {deadline_s:.1f}s deadline ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}): the "
        "leader's process exited or closed its context"
    )


class SpmdRanks(Ranks):
    """SPMD hosting: every rank runs `protocol.run(ctx)`; rank 0 leads through numbered commands in
    a TCPStore it hosts (rendezvous once, when every rank builds its context)."""

    def __init__(self, participant: Participant, store: Any, rank: int, world: int, tag: str) -> None:
        self.participant = participant
        self.store = store
        self.rank = rank
        self.world = world
        self.leader = rank == 0
        self.tag = tag
        self._seq = 0
        self._lanes = Lanes(participant)
        self._waiters = ThreadPoolExecutor(4, thread_name_prefix="refit-spmd") if self.leader else None
        self._stale: list[str] = []
        self._ends: list[str] = []  # end-of-run messages, deleted once every rank answered a later step
        self._local = threading.local()  # a store client blocks its connection while it waits: one per thread

    def _client(self) -> Any:
        client = getattr(self._local, "store", None)
        if client is None:
            client = self._local.store = self.store.clone()
        return client

    @classmethod
    def create(cls, source: Source, transport: Transport, *, timeout_s: float = 300.0) -> SpmdRanks:
        """Collective: every rank of the default process group calls it (RefitContext does)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        group = dist.new_group(backend="gloo")  # a fresh gloo group: never a split of the default one
        try:
            if rank == 0:
                host = os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname())
                store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False, timeout=_td(timeout_s))
                box: list[Any] = [(host, store.port, uuid.uuid4().hex[:8])]
            else:
                box = [None]
            dist.broadcast_object_list(box, src=0, group=group)
            host, port, tag = box[0]
            if rank != 0:
                store = dist.TCPStore(host, port, world, is_master=False, timeout=_td(timeout_s))
        finally:
            dist.destroy_process_group(group)
        return cls(Participant(source, transport, rank, world), store, rank, world, tag)

    def _key(self, kind: str, seq: int, rank: int | None = None) -> str:
        return f"refit/{self.tag}/{kind}/{seq}" + ("" if rank is None else f"/{rank}")

    # ---- leader --------------------------------------------------------------------------------

    def _post(self, message: Any) -> int:
        seq = self._seq
        self._seq += 1
        self.store.set(self._key("c", seq), pickle.dumps(message))
        return seq

    def start(self, step: RankStep, *, timeout: float) -> Future[list[Any]]:
        seq = self._post(step)
        local = self._lanes.submit(step)
        assert self._waiters is not None
        remote = self._waiters.submit(self._collect, seq, timeout)
        out: Future[list[Any]] = Future()

        def done(_: Future[Any]) -> None:
            if not (local.done() and remote.done()):
                return
            for f in (local, remote):
                if f.cancelled():
                    if not out.done():
                        out.set_exception(RankError(0, "cancelled: the trainer ranks were closed"))
                    return
                exc = f.exception()
                if exc is not None:
                    if not out.done():
                        out.set_exception(exc)
                    return
            if not out.done():
                out.set_result([local.result(), *remote.result()])

        local.add_done_callback(done)
        remote.add_done_callback(done)
        return out

    def _collect(self, seq: int, timeout: float) -> list[Any]:
        store = self._client()
        keys = [self._key("r", seq, r) for r in range(1, self.world)]
        try:
            store.wait(keys, _td(timeout))
        except Exception as exc:
            missing = [r for r, k in enumerate(keys, start=1) if not store.check([k])]
            self._stale.extend([*keys, self._key("c", seq)])
            raise TimeoutError(
                f"trainer ranks {missing} did not answer within {timeout:.3g}s: they died, are stuck, or never "
                f"called protocol.run(ctx) (every rank must call protocol.run(ctx) and ctx.close()): "
                f"{type(exc).__name__}"
            ) from None
        values = []
        for rank, raw in enumerate(store.multi_get(keys), start=1):
            ok, value = pickle.loads(raw)
            if not ok:
                raise value if isinstance(value, BaseException) else RankError(rank, str(value))
            values.append(value)
        done = [k for k in self._ends if int(k.rsplit("/", 1)[1]) < seq]  # every rank has read these
        self._ends = [k for k in self._ends if k not in done]
        for k in [*keys, self._key("c", seq), *done]:
            store.delete_key(k)
        return values

    def finish(self, result: Any) -> None:
        if self.leader:
            self._ends.append(self._key("c", self._post((_END, result))))

    def close(self) -> None:
        if self.leader:
            with contextlib.suppress(Exception):
                self._post((_CLOSE, None))
            for k in self._stale:
                with contextlib.suppress(Exception):
                    self.store.delete_key(k)
        self._lanes.shutdown()
        if self._waiters is not None:
            self._waiters.shutdown(wait=False, cancel_futures=True)

    # ---- followers -----------------------------------------------------------------------------

    def follow(self, deadline_s: float) -> Any:
        """Run the leader's commands until it ends the run (returns its result) or closes."""
        if self.leader:
            return super().follow(deadline_s)
        waited_since = time.monotonic()
        while True:
            key = self._key("c", self._seq)
            try:
                self.store.wait([key], _td(deadline_s))
            except Exception as exc:
                raise RefitError(follow_error(self.rank, time.monotonic() - waited_since, deadline_s, exc)) from None
            message = pickle.loads(self.store.get(key))
            seq = self._seq
            self._seq += 1
            waited_since = time.monotonic()
            if isinstance(message, tuple) and message and message[0] in (_END, _CLOSE):
                return message[1]
            self._lanes.submit(message).add_done_callback(lambda f, s=seq: self._reply(s, f))

    def _reply(self, seq: int, fut: Future[Any]) -> None:
        exc = fut.exception()
        body = (True, fut.result()) if exc is None else (False, exc)
        try:
            raw = pickle.dumps(body)
        except Exception as err:  # an unpicklable value or error still gets a reply
            raw = pickle.dumps((False, RankError(self.rank, f"reply could not be pickled: {err}")))
        with contextlib.suppress(Exception):  # the leader is gone: nothing to tell
            self._client().set(self._key("r", seq, self.rank), raw)


def default_ranks(source: Source, transport: Transport) -> Ranks:
    """SPMD when torch.distributed runs more than one rank, in-process otherwise."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return SpmdRanks.create(source, transport)
    return LocalRanks([Participant(source, transport)])


__all__ = [
    "Lanes",
    "LocalRanks",
    "Participant",
    "RankStats",
    "RankStep",
    "Ranks",
    "SpmdRanks",
    "combine",
    "default_ranks",
]
