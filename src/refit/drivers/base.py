"""The three driver roles a refit composes, and the data they exchange.

  Source        trainer side, one per trainer rank: offload/restore, metadata, the bucket stream.
  Transport     trainer side, one per trainer rank: plans buckets, owns buffers or a group, packs
                (and, for collective transports, sends); `Receiver` is its engine side.
  EngineDriver  controls one rollout engine (which may span several TP ranks) from the leader.

The runner (`refit.protocol`) calls them in the order of the state table; docs/drivers.md gives
the contract per role, state, side and rank. Drivers never decide the phase order, never publish
versions on their own and never touch the lock: they do one thing and report how it went.
Capabilities are class attributes the runner reads before it starts.

Engine calls are `Step`s: small records (call, run state, arguments, bucket). A driver runs a list
of consecutive steps in one call (`run_steps`) and reports one `StepResult` per step, stopping at
the first failure; the runner records each as its own event in its own state. The default runs
one engine call per step on that engine's ordered lane; a driver whose engine can run them in one
round trip overrides `run_steps_async` (sending them at once and handing back its own future).
"""

from __future__ import annotations

import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from refit.buckets import BucketManifest, TensorMeta, plan_buckets

if TYPE_CHECKING:
    import torch

    from refit.protocol.lock import EngineLock

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]
LazyTensors = Iterable[tuple[str, "torch.Tensor"]]

# ---- the engine set a transport connects -----------------------------------------------------------


@dataclass(frozen=True)
class EngineSpec:
    """One engine as a transport sees it: its name, how many TP ranks receive, and the index of its
    first TP rank among every engine TP rank of the set (`rank_offset`)."""

    name: str
    tp: int
    rank_offset: int


@dataclass(frozen=True)
class Topology:
    """The trainer ranks and the engine set of one connection.

    Routing (which trainer rank feeds which engine TP rank) follows the deployment: colocated,
    engine i's TP rank j sits on the device of trainer rank (rank_offset_i + j) and receives from
    it (SGLang's per-TP-rank payload list; wrapped around when there are fewer trainer ranks);
    disaggregated, rank 0 (the source rank) feeds every engine and the other ranks only drain the
    collectives the source needs. A transport may route otherwise (see Transport.route).
    """

    world: int
    engines: tuple[EngineSpec, ...]
    colocated: bool
    timeout_s: float = 60.0  # how long a rendezvous (a collective group forming) may take

    @classmethod
    def of(
        cls, world: int, engines: Sequence[tuple[str, int]], *, colocated: bool, timeout_s: float = 60.0
    ) -> Topology:
        specs, offset = [], 0
        for name, tp in engines:
            specs.append(EngineSpec(name, tp, offset))
            offset += tp
        return cls(world, tuple(specs), colocated, timeout_s)

    @property
    def engine_ranks(self) -> int:
        """Every engine TP rank of the set."""
        return sum(e.tp for e in self.engines)

    def default_route(self, engine: EngineSpec, tp_rank: int) -> int:
        return (engine.rank_offset + tp_rank) % self.world if self.colocated else 0


@dataclass(frozen=True)
class ConnectInfo:
    """What one engine needs to attach: the transport kind, the import path of the engine-side
    receiver class, fields every TP rank shares and one `parts` entry per TP rank (index = TP
    rank). Picklable, JSON-safe."""

    kind: str
    receiver: str
    fields: dict[str, Any] = field(default_factory=dict)
    parts: tuple[dict[str, Any], ...] = ({},)


@dataclass(frozen=True)
class Payload:
    """One bucket as one engine receives it: the manifest, shared fields and one `parts` entry per
    engine TP rank (SGLang's `serialized_named_tensors` list has the same shape)."""

    kind: str
    manifest: BucketManifest
    fields: dict[str, Any] = field(default_factory=dict)
    parts: tuple[dict[str, Any], ...] = ({},)


@dataclass(frozen=True)
class Storages:
    """The memory a source's tensors lie in, offered for sharing once (zero copy): `tensors` are
    the tensors the source hands out (each stands for its whole storage). `epoch` identifies those
    storages (the storage objects and the memory they hold now): it changes when the trainer
    reallocates any of them, and a connection made for another epoch is never reused."""

    tensors: tuple[Any, ...]

    @property
    def epoch(self) -> int:
        return storage_epoch(self.tensors)


def storage_epoch(tensors: Iterable[Any]) -> int:
    """A cheap identity of the storages `tensors` lie in: each storage's object, address, size and
    device. Reallocating (a new tensor, `resize_`, a move between devices) changes it; writing in
    place (an optimizer step) does not."""
    seen = []
    for t in tensors:
        st = t.untyped_storage()
        seen.append((int(st._cdata), int(st.data_ptr()), int(st.nbytes()), str(st.device)))
    return hash(tuple(sorted(set(seen)))) & ((1 << 63) - 1)


# ---- steps -------------------------------------------------------------------------------------------

ENGINE_CALLS = (
    "probe", "resume_memory", "release_memory", "attach", "detach", "pause", "flush", "begin", "load", "finalize",
    "publish", "continue_generation", "quarantine", "verify",
)  # fmt: skip


@dataclass(frozen=True)
class Step:
    """One engine call as data: which call, in which run state, with which arguments."""

    call: str
    state: str
    args: tuple[Any, ...] = ()
    bucket: int | None = None


@dataclass
class StepResult:
    """How one step went. `outcome`: ok | error | timeout. `error` is the exception (errors are
    data); `done_at` is when the driver returned (CLOCK_MONOTONIC, comparable with engine audits)."""

    outcome: str
    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0
    done_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


def outcome_of(exc: BaseException) -> str:
    return "timeout" if isinstance(exc, TimeoutError) else "error"


# ---- roles -------------------------------------------------------------------------------------------


class Source(ABC):
    """Trainer side, one per trainer rank: produces the new weights, named as the engine names them.

    Lifecycle, per state (every rank makes the same calls in the same order: the leader decides):
      run start                    `metas()`: names, dtypes and *global* shapes of every tensor,
                                   in send order (the leader checks every rank agrees).
      OFFLOADING (colocated only)  `offload()`: free the training memory the engine needs.
      TRANSFERRING                 `iter_buckets(plan)`: one item per manifest, in plan order;
                                   each item is an iterable of (name, tensor) that may be lazy.
                                   Tensors may be sharded (DTensor): the transport gathers them
                                   straight into its buffer, on every rank, in manifest order, so
                                   collectives match even on a rank that owns nothing of a tensor.
                                   A retry starts a fresh iterator on every rank.
      RESTORING, or the abort path `restore()`: back to training placement; idempotent. Called on
                                   every exit of a colocated run that called `offload()`.
      run start, verify="probe"    `logprobs(prompts, top)` (optional): the reference the engines'
                                   probe answers are compared with.
    `storages()`: the storages its tensors lie in, for a transport that shares them once at connect
    (`Transport.shares_storages`); None (the default) when it hands out tensors it makes anew.
    """

    kind: ClassVar[str] = "source"

    @property
    def resident(self) -> bool:
        """True when iterating the buckets only hands out tensors the trainer already holds (no
        gather, no conversion): a transport may then look at them before any engine is paused.
        Must be cheap and make no collective (ranks may answer it a different number of times)."""
        return False

    def storages(self) -> Storages | None:
        """The storages `iter_buckets` hands out tensors of, or None. Cheap, no collective."""
        return None

    def offload(self) -> None:  # noqa: B027 - optional hook, default: nothing to free
        """Free what the colocated engine needs."""

    def restore(self) -> None:  # noqa: B027 - optional hook
        """Undo `offload()`."""

    @abstractmethod
    def metas(self) -> list[TensorMeta]:
        """Every tensor the refit sends, in order."""

    @abstractmethod
    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[LazyTensors]:
        """Named tensors for each manifest of `plan`, in order."""

    def logprobs(self, prompts: Sequence[Sequence[int]], top: int) -> list[dict[str, list[Any]]]:
        """verify="probe": per prompt, the model's `top` most likely next tokens and their
        log-probabilities ({"ids", "logprobs"}), with the weights it is about to send. Run on every
        rank (a sharded model's forward is collective) before the run offloads anything."""
        raise NotImplementedError(f"{type(self).__name__} cannot score prompts: use verify='digest' or 'off'")


class Transport(ABC):
    """Moves buckets from trainer ranks into engine TP ranks. Trainer side, one instance per rank
    (the leader's also assembles what every engine receives); the engine side is `Receiver`.

    Lifecycle, per state:
      run start      `plan(metas, bucket_bytes)` (leader): bucket manifests with this wire format's
                     offsets and alignment; a tensor larger than a bucket travels alone. With a
                     resident source, `prepare(manifest, tensors)` on every rank, per bucket,
                     before any engine is paused (work that needs no engine: digests).
      CONNECTING     `connect(plan, topology, rank)` on every rank: allocate buffers (or open a
                     rendezvous) for this engine set; returns what this rank contributes.
                     `attach_infos(rank_infos, topology)` (leader, pure): one ConnectInfo per
                     engine. A `collective` transport then runs `join()` on every rank while the
                     engines attach (a group forms only when every member is in). The runner
                     reuses a connection across refits while the engines and plan fit.
      TRANSFERRING   `pack(manifest, tensors)` on every rank: gather/copy one bucket into a free
                     buffer (a rank that feeds nobody drains: `feeds(rank)` False); returns this
                     rank's part. `payloads(manifest, parts, topology)` (leader, pure): what each
                     engine receives. A collective transport's `send(index)` runs while the
                     engines' loads run (the trainer's half of the transfer). `release(index)`
                     after every engine acked (and the send finished); only then is the buffer
                     reused. `abandon(index)` when an engine may still read it: never reused.
      disconnect     `disconnect()`: free everything; idempotent, safe after any failure.

    `slots`: buckets in flight at once (2: pack bucket k+1 while engines copy bucket k).
    `collective`: one failed member breaks the group for all (all-or-nothing per bucket):
    recovery tears it down and reconnects without that member.
    `shares_storages`: `share(source.storages())` runs on every rank right before `connect`, and
    the runner reads every rank's storage epoch at each run start (and after connecting): a
    connection is reused only while the epochs are the ones it shared.
    """

    kind: ClassVar[str] = "transport"
    collective: ClassVar[bool] = False
    shares_storages: ClassVar[bool] = False
    slots: int = 2
    # set by the rank when it starts streaming a run: `Source.resident` (the tensors `pack` gets are
    # the trainer's own, valid and unchanged until the run ends); any other source may reuse or
    # free a tensor's memory once the next one is taken, so a transport must copy it in `pack`
    resident_source: bool = False
    temp_bytes: int = 0  # the largest temporary (gather, cast) the last `pack` needed
    digest_kind: str = "xxh3"  # the `refit.verify` digest its runs verify with (a GPU transport: "wsum")
    # set by the rank while it records what it sends (verification): a transport that hashes the
    # bytes it packs anyway puts each tensor's `tensor_digest` here by name, so it is not read twice
    tensor_digests: dict[str, int] | None = None

    def plan(self, metas: Sequence[TensorMeta], bucket_bytes: int) -> list[BucketManifest]:
        return plan_buckets(metas, bucket_bytes)

    def route(self, topology: Topology, engine: EngineSpec, tp_rank: int) -> int:
        """The trainer rank whose part engine TP rank `tp_rank` receives."""
        return topology.default_route(engine, tp_rank)

    def feeds(self, topology: Topology, rank: int) -> bool:
        return any(self.route(topology, e, j) == rank for e in topology.engines for j in range(e.tp))

    @abstractmethod
    def connect(self, plan: Sequence[BucketManifest], topology: Topology, rank: int) -> dict[str, Any]: ...

    @abstractmethod
    def attach_infos(self, rank_infos: Sequence[dict[str, Any]], topology: Topology) -> dict[str, ConnectInfo]: ...

    def share(self, storages: Storages | None) -> None:  # noqa: B027 - only storage-sharing transports
        """The storages the next `connect` shares with the engines (`shares_storages`)."""

    def join(self) -> None:  # noqa: B027 - only collective transports rendezvous
        """Enter the group while the engines attach (collective transports)."""

    @property
    def wants_prepare(self) -> bool:
        """True when `prepare` has work to do before the engines are paused."""
        return False

    def prepare(self, manifest: BucketManifest, tensors: LazyTensors) -> None:  # noqa: B027 - optional
        """At run start, before any engine is paused, with a resident source: precompute what needs
        no engine (digests of tensors that will travel by reference), to take it out of the stall."""

    @abstractmethod
    def pack(self, manifest: BucketManifest, tensors: LazyTensors) -> dict[str, Any] | None: ...

    @abstractmethod
    def payloads(
        self, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
    ) -> dict[str, Payload]: ...

    def send(self, index: int) -> None:  # noqa: B027 - only collective transports send
        """The trainer's half of a collective transfer of bucket `index`."""

    @abstractmethod
    def release(self, index: int) -> None: ...

    def abandon(self, index: int) -> None:  # noqa: B027 - optional: default keeps the buffer busy
        """Never reuse bucket `index`'s buffer (an engine may still read it); replace it if possible."""

    @abstractmethod
    def disconnect(self) -> None: ...

    @property
    @abstractmethod
    def connected(self) -> bool: ...

    @property
    def buffer_bytes(self) -> int:
        """Bytes of trainer memory this rank's buffers hold now (for the peak-memory account)."""
        return 0


def routed_payloads(
    transport: Transport, manifest: BucketManifest, parts: Sequence[dict[str, Any] | None], topology: Topology
) -> dict[str, Payload]:
    """Each engine's payload when every engine TP rank reads the part of the trainer rank routed
    to it (`Transport.route`): colocated transports whose ranks each pack their own part."""
    out = {}
    for e in topology.engines:
        mine = tuple(parts[transport.route(topology, e, j)] for j in range(e.tp))
        if any(p is None for p in mine):
            raise RuntimeError(
                f"{transport.kind} transport: no trainer rank packed bucket {manifest.index} for {e.name}"
            )
        out[e.name] = Payload(transport.kind, manifest, parts=mine)  # type: ignore[arg-type]
    return out


class Receiver(ABC):
    """Engine side of a transport, built in each engine TP rank's process from its ConnectInfo
    and TP rank. `read(payload)` returns views of the bucket's tensors (full HF tensors) that stay
    valid until the engine acknowledges the bucket; `close()` detaches."""

    def __init__(self, info: ConnectInfo, tp_rank: int = 0) -> None:
        self.info = info
        self.tp_rank = tp_rank

    @property
    def part(self) -> dict[str, Any]:
        return self.info.parts[self.tp_rank]

    @abstractmethod
    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]: ...

    def writes_into(self, payload: Payload) -> Collection[str]:
        """The tensors of this bucket the receiver can receive straight into the engine's memory
        (`read_into`) when the engine offers a place for them; none by default."""
        return ()

    def read_into(self, payload: Payload, into: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """`read`, where the receiver writes each tensor named in `into` (a subset of
        `writes_into(payload)`) straight into that tensor (the engine's own, whole and of the
        entry's shape and dtype) and returns it for that name: no copy-out."""
        return self.read(payload)

    def expected(self, payload: Payload) -> int | None:
        """The bucket's checksum (refit.buckets.checksum) as the sender computed it, if sent."""
        return None

    def verify(self, payload: Payload, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Raise ValueError when the bytes read are not the bytes sent (before any is applied)."""
        from refit.buckets import checksum

        want = self.expected(payload)
        if want is not None and checksum(tensors) != want:
            raise ValueError(
                f"bucket {payload.manifest.index}: checksum mismatch, the bytes changed after the sender hashed them "
                "(in transit, or written during the refit)"
            )

    copy_stream: Any = None  # a CUDA stream the engine copies this receiver's tensors out on (None: its own)
    # True: `read` hands back the very same list of views for a bucket whose references did not
    # change (views of memory opened once, at attach), so the engine may keep that bucket's checked
    # copies and skip the per-tensor work next time; False: the engine keeps nothing of a bucket
    # (its views may hold a buffer the sender reuses once they are dropped)
    stable_views: bool = False

    def consumed(self, payload: Payload) -> None:  # noqa: B027 - optional hook
        """The engine has applied (queued every copy out of) this bucket: a transport whose buffers
        a device reads asynchronously orders the sender's reuse on it. Called before the ack."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Detach from the transport's buffers."""


def hashes_writes(driver: EngineDriver, kind: str | None) -> bool:
    """Whether `driver` can hash the `kind` digest as it writes (`written_digests`), and its
    `begin` takes the kind (a subclass whose override does not is treated as one that cannot)."""
    if kind is None or kind not in driver.written_digests:
        return False
    try:
        params = inspect.signature(driver.begin).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


class EngineDriver(ABC):
    """Controls one rollout engine from the leader; talks to it across its own boundary.

    Lifecycle, per state (every call blocks until done, raises on failure, honours `timeout`):
      first engine call      `probe(target_version)`: the engine's version, incarnation and
                             whether an update session was left open (closing it); refuses, with
                             no effect, when the engine already holds `target_version` or newer.
      OFFLOADING (colocated) `resume_memory(["weights"])`: its weight memory back; returns
                             {"weights_intact": bool} (False: contents lost).
      CONNECTING             `attach(info)`: every TP rank opens its part of the transport once.
      PAUSING                `pause(mode)`.
      INVALIDATING           `flush()`: drop every KV/prefix cache entry; `begin(plan)`: validate
                             the whole plan (names, shapes, dtypes, coverage), open the session.
      TRANSFERRING           `load(payload)`: every TP rank copies its shard of the bucket;
                             returning is the acknowledgement (no rank reads the buffer after).
      POST_PROCESSING        `finalize()`: exactly once per session, after the last bucket.
      VERIFYING (verify on)  `verify(kind, probe)`: {"kind", "digests": {HF name: digest}} of the
                             weights as the engine will serve them (`refit.verify`, kind None: no
                             digests), computed engine-side, and with `probe` ([prompt, token ids]
                             pairs) "logprobs": per prompt, the next-token log-probabilities at
                             those ids, from a forward with those weights.
      CONTINUING             `publish(version)` (refused unless the session acked every planned
                             bucket and finalized), `continue_generation()`.
      RESTORING (colocated)  `resume_memory(["kv_cache"])`.
      QUARANTINING           `quarantine(reason)`: out of service until a refit completes.
      atomic runs (`stages`) STAGING `stage(plan)`: as `begin`, into a second copy of the weights
                             while generation goes on serving the first (loads, finalize and
                             verify then act on the copy); SWAPPING, paused and flushed: `swap()`
                             serves the copy (publish follows); any state: `discard()` drops the
                             copy, leaving the served weights exactly as they were. Its probe
                             reports "staging_bytes" (what a copy needs), "free_bytes" (None:
                             unknown) and "pool" (engines naming one pool share that memory).
      LoRA refits            (`serves_adapters`) as an atomic run with `stage(plan, kind, adapter)`:
                             ({"name", "version", "r", "lora_alpha", "target_modules",
                             "use_rslora", "dtype", "max_live"}) opens a new version of that
                             adapter beside the live ones; loads, finalize and verify act on it;
                             `publish(version)` makes it the version new requests naming the
                             adapter get (requests pinned to older ones keep theirs; an older
                             one is unloaded once none uses it); nothing pauses, flushes or
                             swaps. `probe(version, adapter)` reports the adapter's live version;
                             DRAINING `drain()`: whether it may go live within max_staleness + 1.
      abort before pausing   `release_memory(["weights"])` (colocated): give back what OFFLOADING
                             took, so the engine is as it was before the run.
      disconnect             `detach()`.

    A driver should raise `refit.errors.EngineError` with a kind in `NO_EFFECT_KINDS` when the
    engine refused a request before changing anything, and kind ``rendezvous`` when its attach
    failed only because a collective group did not form (another member is to blame).

    Capabilities (class attributes): `pause_modes` the engine supports; `supports_in_place_pause`
    (held in place, each request keeps its own KV while the flush clears the prefix cache, so no
    request started after the update reuses an old entry: `kv="keep"`; otherwise the runner
    refuses `in_place`, with `no_in_place` as the reason);
    `transports` (kinds it can receive); `memory_tags`; `begin_moves_weights` (a successful, or
    unknown, `begin` leaves the weights unusable until a complete update finishes: vLLM's layerwise
    reload moves them to the meta device; the runner then never continues the engine without one);
    `digest_kinds` (the `refit.verify` digest kinds its `verify` reports; empty: it cannot report
    what it serves, so a run that verifies by digest refuses it); `written_digests` (kinds it can
    hash as it writes: `begin(plan, kind)` asks it to, and its `verify` then reads back only what
    was not written whole); `probes` (its `verify` answers a probe, even while paused);
    `holds_requests` (`quarantine(reason, keep_requests=True)` keeps its requests waiting instead
    of ending them: the version policy's hold of an engine merely behind; without it a hold ends
    them as a quarantine does); `stages` (atomic runs: `stage`, `swap`, `discard`; otherwise
    the runner refuses `atomic=True`, with `no_stage` as the reason); `serves_adapters` (LoRA
    refits: versions of an adapter loaded at runtime, chosen per request); `holds_adapters_locally`
    (the version policy's hold of an adapter lives in the driver, whose `generate` refuses it: the
    run sets it even on an engine it could not reach, and the driver keeps it until a refit
    publishes there; such a driver's `live_adapter(name)` says, with no call, which version it
    serves, so an engine merely one version behind is not held for being out of reach).
    """

    supports_in_place_pause: ClassVar[bool] = False
    no_in_place: ClassVar[str | None] = None  # why `supports_in_place_pause` is False, for the refusal
    begin_moves_weights: ClassVar[bool] = False
    pause_modes: ClassVar[frozenset[str]] = frozenset({"abort", "retract"})
    transports: ClassVar[frozenset[str]] = frozenset()
    memory_tags: ClassVar[frozenset[str]] = frozenset({"weights", "kv_cache"})
    digest_kinds: ClassVar[frozenset[str]] = frozenset()
    written_digests: ClassVar[frozenset[str]] = frozenset()
    probes: ClassVar[bool] = False
    holds_requests: ClassVar[bool] = False
    stages: ClassVar[bool] = False
    serves_adapters: ClassVar[bool] = False
    holds_adapters_locally: ClassVar[bool] = False
    no_stage: ClassVar[str | None] = None  # why `stages` is False, for the refusal
    no_digests: ClassVar[str | None] = None  # why `digest_kinds` is empty, for the refusal (optional)

    name: str

    @property
    def tp_size(self) -> int:
        """TP ranks that receive weights (each gets full tensors and keeps its shard)."""
        return 1

    @property
    def incarnation(self) -> str:
        """Changes when the engine restarts, so the runner reconnects to the new process. Must be
        cheap and local (no I/O): the probe checks it against the engine itself."""
        return self.name

    def probe(self, target_version: int, *, timeout: float) -> dict[str, Any]:
        """{"version": int | None, "serving": bool, "incarnation": str, "closed_session": bool};
        the default knows nothing (the runner then trusts its own record)."""
        return {}

    @abstractmethod
    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]: ...

    def release_memory(self, tags: Sequence[str], *, timeout: float) -> None:  # noqa: B027 - optional
        """Give memory back (colocated abort before pausing)."""

    @abstractmethod
    def attach(self, info: ConnectInfo, *, timeout: float) -> None: ...

    @abstractmethod
    def detach(self, *, timeout: float) -> None: ...

    @abstractmethod
    def pause(self, mode: PauseMode, *, timeout: float) -> None: ...

    @abstractmethod
    def flush(self, *, timeout: float) -> None: ...

    @abstractmethod
    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        """Validate `plan` and open the session. A driver with `written_digests` also takes the
        digest kind to compute while writing: `begin(plan, kind, *, timeout)`."""

    @abstractmethod
    def load(self, payload: Payload, *, timeout: float) -> None: ...

    @abstractmethod
    def finalize(self, *, timeout: float) -> None: ...

    @abstractmethod
    def publish(self, version: int, *, timeout: float) -> None: ...

    @abstractmethod
    def continue_generation(self, *, timeout: float) -> None: ...

    @abstractmethod
    def quarantine(self, reason: str, *, timeout: float) -> None: ...

    # (a driver with `holds_requests` takes `quarantine(reason, keep_requests: bool = False, *, timeout)`)

    def stage(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        """Atomic runs (`stages`): open a session into a second copy of the weights (as `begin`;
        with `written_digests`, `stage(plan, kind, *, timeout)`)."""
        from refit.errors import EngineError

        raise EngineError("unsupported", f"{type(self).__name__} has no staged sessions")

    def drain(self, hold_s: float, *, timeout: float) -> dict[str, Any]:
        """LoRA refits (`serves_adapters`), DRAINING: {"ready": whether the finalized adapter
        version may go live within max_staleness + 1 now, "pinned": requests still on the versions
        it would push out, optionally "eta_s": when they will have ended at the latest (the runner
        asks again then instead of polling)}. Generation goes on; asked again until ready. It may
        wait inside the call for those requests to end, answering before `timeout` (the runner
        gives DRAINING's calls a budget that leaves the publish its time). Where the version to go
        is the live one, new requests naming the adapter wait until the publish, the discard, or
        `hold_s` seconds (the run's time left and its cleanup grace), whichever comes first."""
        from refit.errors import EngineError

        raise EngineError("unsupported", f"{type(self).__name__} serves no adapters")

    adapter_transports: frozenset[str] | None = None  # LoRA refits: the transports for them (None: `transports`)

    def no_adapter(self, adapter: dict[str, Any], *, verify: str, max_live: int | None) -> str | None:
        """LoRA refits (`serves_adapters`): why this engine can never take this one (its adapter
        spec, the run's verify mode, max_staleness + 1), or None; checked when a run starts."""
        return None

    def swap(self, *, timeout: float) -> None:
        """Atomic runs: serve the finalized staged copy (paused and flushed)."""
        from refit.errors import EngineError

        raise EngineError("unsupported", f"{type(self).__name__} has no staged sessions")

    def discard(self, *, timeout: float) -> None:
        """Atomic runs: drop the staged copy, if any; the served weights stay as they were."""
        from refit.errors import EngineError

        raise EngineError("unsupported", f"{type(self).__name__} has no staged sessions")

    def verify(self, kind: str | None, probe: Sequence[Any] | None = None, *, timeout: float) -> dict[str, Any]:
        """Digests of the weights as the engine will serve them (see `digest_kinds`), and the
        probe's log-probabilities (see `probes`)."""
        from refit.errors import EngineError

        raise EngineError("unsupported", f"{type(self).__name__} cannot report digests of its weights")

    # ---- batching --------------------------------------------------------------------------------

    def run_steps(self, steps: Sequence[Step], *, timeout: float) -> list[StepResult]:
        """Run consecutive steps, stopping at the first that fails; one result per step run.
        Default: one engine call per step, all within `timeout`."""
        end = time.monotonic() + timeout
        results: list[StepResult] = []
        for step in steps:
            t0 = time.monotonic()
            try:
                value = getattr(self, step.call)(*step.args, timeout=max(end - t0, 0.0))
            except Exception as exc:
                now = time.monotonic()
                results.append(StepResult(outcome_of(exc), error=exc, seconds=now - t0, done_at=now))
                break
            now = time.monotonic()
            results.append(StepResult("ok", value, seconds=now - t0, done_at=now))
        return results

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Executor) -> Future[list[StepResult]]:
        """Start `run_steps` and return its future. Override to hand back the engine's own future
        (a reply matched by id, a Ray ObjectRef) instead of holding one of `executor`'s threads.
        A call queued behind another on `executor` (an engine's lane) gets what is left of its
        budget when it starts, so it returns within `timeout` of being made."""
        end = time.monotonic() + timeout  # the budget counts from the call, not from when a lane frees up
        return executor.submit(lambda: self.run_steps(steps, timeout=max(end - time.monotonic(), 0.0)))

    # ---- optional hooks ------------------------------------------------------------------------

    def engine_lock(self) -> EngineLock | None:
        """The lock the engines themselves host (e.g. a rollout manager's lock actor), if any.
        When None for every engine, the context uses a process-wide lock per engine set."""
        return None

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        """Make the engine really hang / die / receive corrupted bytes on its next `call` (fault
        injection). Return False when unsupported: the fault is then simulated at the boundary."""
        return False

    def recorded_moves(self, moves: Sequence[Mapping[str, Any]]) -> None:
        """LoRA refits: the run recorded these adapter moves (an answer's `adapter_moves`) in its
        trace. A driver whose engine reports each move until acknowledged acknowledges them (the
        reference driver: with its next call); an answer the run did not record (it came past its
        budget) is then reported again. Default: nothing."""
        return None

    def audit(self, *, timeout: float) -> list[dict[str, Any]] | None:
        """What the engine itself did (see refit.invariants.check_engine_audit), or None when the
        engine keeps no such record. The conformance kit checks it against what the driver said."""
        return None

    @property
    def alive(self) -> bool:
        """False once the driver knows its engine is gone (a restart is needed)."""
        return True
