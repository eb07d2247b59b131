"""The three driver roles a refit composes: Source (trainer side), Transport (moves a bucket) and
EngineDriver (controls one rollout engine).

The runner (`refit.protocol`) calls them in the order of the state table; each role documents
below which method runs in which state, and on which side. Drivers never decide the phase order,
never publish versions on their own and never touch the lock: they do one thing and report how
it went by returning or raising. Capabilities are class attributes the runner reads before it
starts (for example, a pause mode an engine cannot make KV-safe is refused up front).

Every EngineDriver method blocks until the engine has done the thing, raises on failure, and
takes `timeout`: the seconds left in the run's deadline. A driver must not wait past it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from refit.drivers.buckets import BucketManifest, TensorMeta

if TYPE_CHECKING:
    import torch

    from refit.protocol.lock import EngineLock

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

NamedTensors = Sequence[tuple[str, "torch.Tensor"]]


class Source(ABC):
    """Trainer side: produces the new weights, named as the engine names them.

    Lifecycle, per state:
      OFFLOADING (colocated only)  `offload()`: free the training memory the engine needs
                                   (gradients, optimizer state); idempotent.
      CONNECTING                   `metas()`: names, dtypes and global shapes of every tensor to
                                   send, in send order; the runner plans buckets from them.
      TRANSFERRING                 `iter_buckets(plan)`: yields each bucket's named tensors in
                                   plan order (gathering shards if needed). A yielded tensor must
                                   stay unchanged until the next one is requested.
      RESTORING, or the abort path `restore()`: back to training placement; idempotent. Called
                                   on every exit of a colocated run that called `offload()`.
    """

    kind: ClassVar[str] = "source"

    def offload(self) -> None:  # noqa: B027 - optional hook, default: nothing to free
        """Free what the colocated engine needs."""

    def restore(self) -> None:  # noqa: B027 - optional hook
        """Undo `offload()`."""

    @abstractmethod
    def metas(self) -> list[TensorMeta]:
        """Every tensor the refit sends, in order."""

    @abstractmethod
    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[NamedTensors]:
        """Named tensors for each manifest of `plan`, in order."""


@dataclass(frozen=True)
class ConnectInfo:
    """What an engine needs to attach to a transport: its kind, the import path of the engine-side
    receiver class, and transport-specific fields (paths, addresses...). Picklable, JSON-safe."""

    kind: str
    receiver: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Payload:
    """One packed bucket as the engine receives it: the manifest plus transport-specific fields."""

    kind: str
    manifest: BucketManifest
    fields: dict[str, Any] = field(default_factory=dict)


class Transport(ABC):
    """Moves buckets from the trainer into engines. Trainer side; the engine side is `Receiver`.

    Lifecycle, per state:
      CONNECTING     `connect(plan, n_engines)`: allocate buffers once for this engine set (sized
                     from the plan); returns the ConnectInfo each engine attaches to. The runner
                     reuses the connection across refits until the engines or the plan change.
      TRANSFERRING   `pack(manifest, tensors)`: copy one bucket into a free buffer; returns the
                     Payload sent to every engine. Raises if no buffer is free: the runner must
                     `release(payload)` a bucket only after every engine acknowledged it, and
                     only then may its buffer be reused. When an engine did not answer (it may
                     still be reading), the runner calls `abandon(payload)` instead: that buffer
                     is never reused, and a transport that can replaces it so streaming goes on.
      disconnect     `disconnect()`: free everything. Idempotent; safe after a failed run.

    `slots` is how many buckets may be in flight at once (2 = double buffering).
    """

    kind: ClassVar[str] = "transport"
    slots: int = 2

    @abstractmethod
    def connect(self, plan: Sequence[BucketManifest], n_engines: int) -> ConnectInfo: ...

    @abstractmethod
    def pack(self, manifest: BucketManifest, tensors: NamedTensors) -> Payload: ...

    @abstractmethod
    def release(self, payload: Payload) -> None: ...

    @abstractmethod
    def disconnect(self) -> None: ...

    def abandon(self, payload: Payload) -> None:  # noqa: B027 - optional: default keeps the slot busy
        """Never reuse this payload's buffer (an engine may still read it); replace it if possible."""

    @property
    @abstractmethod
    def connected(self) -> bool: ...


class Receiver(ABC):
    """Engine side of a transport, built in the engine's process from a ConnectInfo.

    `read(payload)` returns views of the bucket's tensors that stay valid until the engine
    acknowledges the bucket (returns from its load call); `close()` detaches.
    """

    def __init__(self, info: ConnectInfo) -> None:
        self.info = info

    @abstractmethod
    def read(self, payload: Payload) -> list[tuple[str, torch.Tensor]]: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Detach from the transport's buffers."""


class EngineDriver(ABC):
    """Controls one rollout engine. Trainer side; talks to the engine across its own boundary.

    Lifecycle, per state (every call blocks until done, raises on failure, honours `timeout`):
      OFFLOADING (colocated)   `resume_memory(["weights"])`: give the engine its weight memory
                               back; returns {"weights_intact": bool} (False: contents lost, the
                               engine must not serve again until a refit completes).
      CONNECTING               `attach(info)`: open the transport's buffers once.
      PAUSING                  `pause(mode)`: stop generation (abort / retract / in_place).
      INVALIDATING             `flush()`: drop every KV/prefix cache entry; must succeed before
                               any byte moves. `begin(plan)`: validate the whole plan against the
                               model (names, shapes, dtypes, coverage) and open the update
                               session; nothing is applied yet.
      TRANSFERRING             `load(payload)`: copy one bucket into the model. Returning is the
                               acknowledgement: the engine no longer reads the buffer.
      POST_PROCESSING          `finalize()`: post-load processing, exactly once per session,
                               after the last bucket; closes the session.
      CONTINUING               `publish(version)`, then `continue_generation()`.
      RESTORING (colocated)    `resume_memory(["kv_cache"])`.
      QUARANTINING             `quarantine(reason)`: keep the engine out of service (it holds
                               weights no version names); it is STALE until a refit completes.
                               (Also inside CONTINUING, for engines that failed while others
                               committed.)
      disconnect               `detach()`.

    An engine whose call fails leaves the run; if it failed with an error (not a timeout, not
    death) after it was paused, the runner retries its whole update (`flush`, `begin`, every
    bucket, `finalize`) while attempts and time remain. A driver should raise
    `refit.errors.EngineError` with a kind in `NO_EFFECT_KINDS` when the engine refused a request
    before changing anything: such a refused bucket does not poison the engine.

    Capabilities (class attributes) tell the runner what is safe: `supports_in_place_pause`
    means the engine can make in-place-paused requests KV-safe after an update (otherwise the
    runner refuses `in_place`); `transports` lists the transport kinds the engine can receive.
    """

    supports_in_place_pause: ClassVar[bool] = False
    transports: ClassVar[frozenset[str]] = frozenset()

    name: str

    @property
    def incarnation(self) -> str:
        """Changes when the engine restarts, so the runner reconnects to the new process."""
        return self.name

    @abstractmethod
    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]: ...

    @abstractmethod
    def attach(self, info: ConnectInfo, *, timeout: float) -> None: ...

    @abstractmethod
    def detach(self, *, timeout: float) -> None: ...

    @abstractmethod
    def pause(self, mode: PauseMode, *, timeout: float) -> None: ...

    @abstractmethod
    def flush(self, *, timeout: float) -> None: ...

    @abstractmethod
    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None: ...

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

    # ---- optional hooks -------------------------------------------------------------------------

    def engine_lock(self) -> EngineLock | None:
        """The lock the engines themselves host (e.g. a rollout manager's lock actor), if any.
        When None for every engine, the context uses a process-wide lock per engine set."""
        return None

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        """Make the engine really hang / die / receive corrupted bytes on its next `call` (fault
        injection). Return False when unsupported: the runner then simulates the fault."""
        return False

    def audit(self, *, timeout: float) -> list[dict[str, Any]] | None:
        """What the engine itself did (see refit.invariants.check_engine_audit), or None when the
        engine keeps no such record. The conformance kit checks it against what the driver said."""
        return None

    @property
    def alive(self) -> bool:
        """False once the driver knows its engine is gone (a restart is needed)."""
        return True
