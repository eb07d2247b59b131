"""Engine driver for the reference engine (`refit.reference`), in a process or on a thread.

Lifecycle, per state (each is one request to the engine, answered when done):
  OFFLOADING (colocated)  resume_memory(["weights"]) -> {"weights_intact": bool}
  CONNECTING              attach(info): the engine maps the shared-memory buffers once
  PAUSING                 pause(mode): abort | retract | in_place
  INVALIDATING            flush(), then begin(plan): the whole plan is validated against the
                          model before any byte is applied
  TRANSFERRING            load(payload): the engine copies the bucket into its fused weights;
                          the reply is the acknowledgement
  POST_PROCESSING         finalize(): completeness check + post-load processing, closes session
  CONTINUING              publish(version), continue_generation()
  RESTORING (colocated)   resume_memory(["kv_cache"])
  QUARANTINING            quarantine(reason): aborts queued work, refuses to serve until a
                          complete refit publishes a new version

The reference engine cannot make in-place-paused requests KV-safe (their KV predates the new
weights), so `supports_in_place_pause` is False and the runner refuses that mode for it.
Besides the protocol calls, the driver exposes what tests and the demo use to check a refit:
`generate`, `submit`/`wait`, `score`, `state_dict`, `info`, `release_memory`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from refit.drivers.base import ConnectInfo, EngineDriver, PauseMode, Payload
from refit.drivers.buckets import BucketManifest

if TYPE_CHECKING:
    import torch

    from refit.reference.client import EngineClient
    from refit.reference.model import ModelConfig

DEFAULT_TIMEOUT = 60.0


class ReferenceEngine(EngineDriver):
    supports_in_place_pause = False
    transports = frozenset({"shm"})

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.name = client.name

    @classmethod
    def spawn(
        cls,
        name: str,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        version: int = 0,
        threads: int = 1,
        serving: bool = True,
    ) -> ReferenceEngine:
        """A reference engine in its own process. `serving=False` for a recovered engine: it refuses
        requests until a refit completes (miles#1724: replacements served before getting weights)."""
        return cls.spawn_many([name], config, seed, version=version, threads=threads, serving=serving)[0]

    @classmethod
    def spawn_many(
        cls,
        names: Sequence[str],
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        version: int = 0,
        threads: int = 1,
        serving: bool = True,
    ) -> list[ReferenceEngine]:
        """Several engine processes, started in parallel."""
        from refit.reference.client import await_ready, launch_process
        from refit.reference.model import ModelConfig

        launches = [
            launch_process(n, config or ModelConfig(), seed, version=version, threads=threads, serving=serving)
            for n in names
        ]
        return [cls(await_ready(launch)) for launch in launches]

    @classmethod
    def in_thread(
        cls, name: str, config: ModelConfig | None = None, seed: int = 0, *, version: int = 0, serving: bool = True
    ) -> ReferenceEngine:
        """A reference engine on a thread of this process (fast; for unit tests)."""
        from refit.reference.client import start_thread
        from refit.reference.model import ModelConfig

        return cls(start_thread(name, config or ModelConfig(), seed, version=version, serving=serving))

    @property
    def incarnation(self) -> str:
        return f"{self.name}@{self.client.pid or id(self.client)}"

    @property
    def alive(self) -> bool:
        return self.client.alive

    def close(self) -> None:
        self.client.close()

    # ---- protocol calls ---------------------------------------------------------------------

    def resume_memory(self, tags: Sequence[str], *, timeout: float) -> dict[str, Any]:
        return self.client.call("resume_memory", list(tags), timeout=timeout)

    def attach(self, info: ConnectInfo, *, timeout: float) -> None:
        self.client.call("attach", info, timeout=timeout)

    def detach(self, *, timeout: float) -> None:
        self.client.call("detach", timeout=timeout)

    def pause(self, mode: PauseMode, *, timeout: float) -> None:
        self.client.call("pause", mode, timeout=timeout)

    def flush(self, *, timeout: float) -> None:
        self.client.call("flush", timeout=timeout)

    def begin(self, plan: Sequence[BucketManifest], *, timeout: float) -> None:
        self.client.call("begin", list(plan), timeout=timeout)

    def load(self, payload: Payload, *, timeout: float) -> None:
        self.client.call("load", payload, timeout=timeout)

    def finalize(self, *, timeout: float) -> None:
        self.client.call("finalize", timeout=timeout)

    def publish(self, version: int, *, timeout: float) -> None:
        self.client.call("publish", version, timeout=timeout)

    def continue_generation(self, *, timeout: float) -> None:
        self.client.call("continue_generation", timeout=timeout)

    def quarantine(self, reason: str, *, timeout: float) -> None:
        self.client.call("quarantine", reason, timeout=timeout)

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        """Make the engine itself hang, die or receive corrupted bytes on its next `call` (see
        refit.reference.server); the runner arms it just before that call."""
        self.client.call("arm_fault", kind, call, bucket, seconds, timeout=timeout)
        return True

    def audit(self, *, timeout: float = DEFAULT_TIMEOUT) -> list[dict[str, Any]] | None:
        """What the engine itself did (engine-side record for refit.invariants.check_engine_audit)."""
        return self.client.call("audit", timeout=timeout)

    # ---- serving and inspection -------------------------------------------------------------

    def generate(
        self, prompt: Sequence[int], max_new_tokens: int, *, timeout: float = DEFAULT_TIMEOUT
    ) -> dict[str, Any]:
        """Submit and wait for the finished request (output tokens, versions, cache stats)."""
        return self.client.call("generate", list(prompt), max_new_tokens, timeout=timeout)

    def submit(self, prompt: Sequence[int], max_new_tokens: int) -> Any:
        """Start a request and return a Future of its result, without waiting."""
        return self.client.call_async("generate", list(prompt), max_new_tokens)

    def score(self, tokens: Sequence[int], *, timeout: float = DEFAULT_TIMEOUT) -> torch.Tensor:
        return self.client.call("score", list(tokens), timeout=timeout)

    def state_dict(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, torch.Tensor]:
        return self.client.call("state_dict", timeout=timeout)

    def info(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        return self.client.call("info", timeout=timeout)

    def release_memory(
        self, tags: Sequence[str], *, cpu_backup: bool = False, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.client.call("release_memory", list(tags), cpu_backup=cpu_backup, timeout=timeout)
