"""Engine driver for the reference engine (`refit.reference`), in processes or on a thread.

The engine runs a wave's consecutive steps in one request (`run_steps_async`): a refit's control
calls take two round trips. Replies are matched by id on the client's reader thread, so a pending
call holds no thread here (`run_steps_async` hands back that future). An engine with `tp > 1` is
one head process plus TP followers; every TP rank receives full tensors from its own part of the
transport and keeps its shard.

Lifecycle, per state (each is one step, answered when done):
  first engine call       probe(target_version) -> {"version", "serving", "closed_session", "pid"}
  OFFLOADING (colocated)  resume_memory(["weights"]) -> {"weights_intact": bool}
  CONNECTING              attach(info): the engine maps the shared-memory buffers once
  PAUSING                 pause(mode): abort | retract | in_place
  INVALIDATING            flush(), then begin(plan): the whole plan is validated against the
                          model before any byte is applied
  TRANSFERRING            load(payload): the engine copies the bucket into its fused weights;
                          the reply is the acknowledgement
  POST_PROCESSING         finalize(): completeness check + post-load processing, closes session
  CONTINUING              publish(version), continue_generation()
  LoRA refits             as atomic runs: stage(plan, digest, adapter) opens a new version of the
                          adapter (`EngineCore.begin(adapter=...)`), loads fill it, finalize checks
                          it whole, verify hashes it, publish makes it live; never paused
  RESTORING (colocated)   resume_memory(["kv_cache"])
  QUARANTINING            quarantine(reason): aborts queued work, refuses to serve until a
                          complete refit publishes a new version
  abort before pausing    release_memory(["weights"]) (colocated)

Held in place (pause_mode "in_place", the run's kv="keep"), each request keeps its own KV, computed
with the old weights (off-policy, counted per request as `stale_kv_tokens`), while the flush clears
the prefix cache, so a request started after the update never reuses an old entry:
`supports_in_place_pause` is True.
Besides the protocol calls, the driver exposes what tests and the demo use to check a refit:
`generate`, `submit`/`wait`, `score`, `state_dict`, `info`, `release_memory`.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import itertools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Executor, Future
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest
from refit.drivers.base import ConnectInfo, EngineDriver, PauseMode, Payload, Step, StepResult, outcome_of
from refit.errors import EngineError

if TYPE_CHECKING:
    import torch

    from refit.reference.client import EngineClient
    from refit.reference.model import ModelConfig

DEFAULT_TIMEOUT = 60.0


class ReferenceEngine(EngineDriver):
    supports_in_place_pause = True
    pause_modes = frozenset({"abort", "retract", "in_place"})
    transports = frozenset({"shm", "broadcast", "ipc", "sglang_tensor"})
    holds_requests = True  # a hold keeps its requests waiting (quarantine(reason, keep_requests=True))
    stages = True  # atomic runs: a second copy written while generating (`EngineCore.begin(staged=True)`)
    serves_adapters = True  # LoRA refits: adapter versions side by side (`refit.reference.lora`)
    digest_kinds = frozenset({"xxh3", "wsum"})
    probes = True

    def __init__(self, client: EngineClient) -> None:
        self.client = client
        self.name = client.name
        # the last adapter move an answer handed to the run (epoch, n): sent with each call, so the
        # engine reports again what an answer that came too late (or never) carried ("": none yet)
        self._moves_ack: tuple[str, int] = ("", 0)

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
        tp: int = 1,
        device: str = "cpu",
        max_running: int = 8,
        memory_limit: int | None = None,
        batch_decode: bool = False,
    ) -> ReferenceEngine:
        """A reference engine in its own process(es).

        config: the model it serves (default `ModelConfig()`, the reference TinyLlama); for a
            trainer's HF model, `ModelConfig.from_hf(model.config)`: a refit from a model of
            another shape is refused before any byte, naming both.
        seed: its initial weights (`TinyLlama(config, seed)`'s), served as `version` until a refit.
        version: the weight version it starts at (a context over it starts there too:
            `RefitContext(version=...)`).
        threads: torch threads per process.
        serving: False for a recovered engine: it refuses requests until a refit completes
            (miles#1724: replacements served before getting weights).
        tp: TP ranks (processes), each holding a shard.
        device: "cpu", or a CUDA device (one TP rank) for weights, KV and forward.
        max_running: requests decoded at once (the rest wait).
        memory_limit: bytes its weights may take, staged copies included (None: no limit).
        batch_decode: one forward per step for every running request (`EngineCore`)."""
        return cls.spawn_many(
            [name],
            config,
            seed,
            version=version,
            threads=threads,
            serving=serving,
            tp=tp,
            device=device,
            max_running=max_running,
            memory_limit=memory_limit,
            batch_decode=batch_decode,
        )[0]

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
        tp: int = 1,
        device: str = "cpu",
        max_running: int = 8,
        memory_limit: int | None = None,
        batch_decode: bool = False,
    ) -> list[ReferenceEngine]:
        """Several engines (each `tp` processes), started in parallel (the arguments: `spawn`)."""
        from refit.reference.client import await_ready, launch_process
        from refit.reference.model import ModelConfig

        (config or ModelConfig()).check_tp(tp)  # refused here, not as a crash inside the new process
        if device != "cpu" and tp > 1:
            raise ValueError(f"device {device!r} with tp={tp}: a reference engine on a GPU has one TP rank")
        launches = [
            launch_process(
                n, config or ModelConfig(), seed, version=version, threads=threads, serving=serving, tp=tp,
                device=device, max_running=max_running, memory_limit=memory_limit, batch_decode=batch_decode,
            )
            for n in names
        ]  # fmt: skip
        return [cls(await_ready(launch)) for launch in launches]

    @classmethod
    def in_thread(
        cls,
        name: str,
        config: ModelConfig | None = None,
        seed: int = 0,
        *,
        version: int = 0,
        serving: bool = True,
        max_running: int = 8,
        memory_limit: int | None = None,
        batch_decode: bool = False,
    ) -> ReferenceEngine:
        """A reference engine on a thread of this process (fast; for unit tests). `max_running`:
        requests it decodes at once (the rest wait); `memory_limit`: bytes its weights may take,
        staged copies included; `batch_decode`: one forward per step for every running request
        (`EngineCore`)."""
        from refit.reference.client import start_thread
        from refit.reference.model import ModelConfig

        config = config or ModelConfig()
        return cls(
            start_thread(
                name,
                config,
                seed,
                version=version,
                serving=serving,
                max_running=max_running,
                memory_limit=memory_limit,
                batch_decode=batch_decode,
            )
        )

    @property
    def incarnation(self) -> str:
        return f"{self.name}@{self.client.pid or id(self.client)}"

    @property
    def tp_size(self) -> int:
        return self.client.tp

    @property
    def written_digests(self) -> frozenset[str]:  # type: ignore[override]
        """wsum on one TP rank: it fuses the digest into its copies (TP ranks read back)."""
        return frozenset({"wsum"}) if self.tp_size == 1 else frozenset()

    @property
    def alive(self) -> bool:
        return self.client.alive

    def close(self) -> None:
        self.client.close()

    # ---- protocol calls ---------------------------------------------------------------------

    def run_steps_async(self, steps: Sequence[Step], *, timeout: float, executor: Executor) -> Future[list[StepResult]]:
        """One request for the whole list; the engine stops at the first step that fails. A subclass
        that overrides a step's method gets one call per step, so its override is what runs."""
        if any(getattr(type(self), s.call) is not getattr(ReferenceEngine, s.call) for s in steps):
            return super().run_steps_async(steps, timeout=timeout, executor=executor)
        out: Future[list[StepResult]] = Future()
        end = time.monotonic() + timeout
        reply = self.client.call_async("steps", [(s.call, tuple(s.args)) for s in steps], timeout, self._moves_ack)
        calls = [s.call for s in steps]

        def expire() -> None:  # its budget is spent: the call returns now, whatever the engine does later
            now = round(time.monotonic(), 6)
            err = TimeoutError(f"engine {self.name} did not answer {calls} within its {timeout:.3g}s")
            _settle(out, [StepResult("timeout", error=err, seconds=timeout, done_at=now)])

        def done(f: Future[Any]) -> None:
            now = round(time.monotonic(), 6)
            exc = f.exception()
            if exc is not None:
                _settle(out, exc)
                return
            if now > end:  # answered past its budget: the runner cannot know what it did in time
                late = TimeoutError(f"engine {self.name} answered {calls} after its {timeout:.3g}s")
                _settle(out, [StepResult("timeout", error=late, seconds=now - end + timeout, done_at=now)])
                return
            results = []
            for ok, value, seconds in f.result():
                if ok:
                    results.append(StepResult("ok", value, seconds=seconds, done_at=now))
                else:
                    err = EngineError(*value)
                    results.append(StepResult(outcome_of(err), error=err, seconds=seconds, done_at=now))
            _settle(out, results)

        reply.add_done_callback(done)
        _WATCHDOG.at(end, expire)
        return out

    def probe(self, target_version: int, adapter: str | None = None, *, timeout: float) -> dict[str, Any]:
        return self.client.call("probe", target_version, adapter, self._moves_ack, timeout=timeout)

    def recorded_moves(self, moves: Sequence[Mapping[str, Any]]) -> None:
        """The run recorded these moves in its trace: the last one is acknowledged with the next
        call (`EngineCore.ack_moves`); what an answer the run did not record carried comes again."""
        last = moves[-1] if moves else None
        if isinstance(last, Mapping) and isinstance(last.get("n"), int):
            self._moves_ack = (str(last.get("epoch")), int(last["n"]))

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

    def begin(self, plan: Sequence[BucketManifest], digest: str | None = None, *, timeout: float) -> None:
        self.client.call("begin", list(plan), digest, timeout=timeout)

    def stage(
        self,
        plan: Sequence[BucketManifest],
        digest: str | None = None,
        adapter: dict[str, Any] | None = None,
        *,
        timeout: float,
    ) -> None:
        self.client.call("stage", list(plan), digest, adapter, timeout=timeout)

    def swap(self, *, timeout: float) -> None:
        self.client.call("swap", timeout=timeout)

    def drain(self, hold_s: float, *, timeout: float) -> dict[str, Any]:
        return self.client.call("drain", hold_s, timeout=timeout)

    def discard(self, *, timeout: float) -> None:
        self.client.call("discard", timeout=timeout)

    def load(self, payload: Payload, *, timeout: float) -> None:
        self.client.call("load", payload, timeout=timeout)

    def finalize(self, *, timeout: float) -> None:
        self.client.call("finalize", timeout=timeout)

    def publish(self, version: int, *, timeout: float) -> None:
        self.client.call("publish", version, timeout=timeout)

    def continue_generation(self, *, timeout: float) -> None:
        self.client.call("continue_generation", timeout=timeout)

    def quarantine(
        self, reason: str, keep_requests: bool = False, adapter: str | None = None, *, timeout: float
    ) -> None:
        """Out of service until a refit completes; `adapter` (a LoRA refit's hold): that adapter only."""
        if adapter is None:
            self.client.call("quarantine", reason, keep_requests, timeout=timeout)
        else:
            self.client.call("quarantine", reason, keep_requests, adapter, timeout=timeout)

    def verify(self, kind: str | None, probe: Sequence[Any] | None = None, *, timeout: float) -> dict[str, Any]:
        return self.client.call("verify", kind, probe, timeout=timeout)

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
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        *,
        adapter: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
    ) -> dict[str, Any]:
        """Greedy-decode `max_new_tokens` after `prompt` (token ids) and wait for the finished
        request. Returns {"output": token ids, "finish_reason": "length" | "abort" | ...,
        "weight_versions": the weight version each token was sampled under, "logprobs", and
        "adapter", "adapter_version" (None without one), with the cache's and the engine's own
        accounts ("cached_tokens", "num_retractions", "stale_kv_tokens", "token_seqs", ...)}.
        `adapter`: a loaded LoRA adapter's name: the request is pinned to its live version to its
        last token. `timeout`: seconds to wait for the answer (TimeoutError past it)."""
        if adapter is None:
            return self.client.call("generate", list(prompt), max_new_tokens, timeout=timeout)
        return self.client.call("generate", list(prompt), max_new_tokens, adapter, timeout=timeout)

    def submit(self, prompt: Sequence[int], max_new_tokens: int, *, adapter: str | None = None) -> Any:
        """Start a request and return a Future of its result, without waiting."""
        if adapter is None:
            return self.client.call_async("generate", list(prompt), max_new_tokens)
        return self.client.call_async("generate", list(prompt), max_new_tokens, adapter)

    def score(
        self, tokens: Sequence[int], *, adapter: str | None = None, timeout: float = DEFAULT_TIMEOUT
    ) -> torch.Tensor:
        if adapter is None:
            return self.client.call("score", list(tokens), timeout=timeout)
        return self.client.call("score", list(tokens), adapter, timeout=timeout)

    def state_dict(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, torch.Tensor]:
        return self.client.call("state_dict", timeout=timeout)

    def digests(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, int]:
        """Each HF tensor's xxHash3 digest as the engine holds it (`refit.buckets.tensor_digest`)."""
        return self.client.call("digests", timeout=timeout)

    def info(self, *, timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
        return self.client.call("info", timeout=timeout)

    def release_memory(
        self, tags: Sequence[str], *, timeout: float = DEFAULT_TIMEOUT, cpu_backup: bool = False
    ) -> None:
        self.client.call("release_memory", list(tags), cpu_backup=cpu_backup, timeout=timeout)


def _settle(out: Future[Any], value: Any) -> None:
    """Complete `out` once (a call's answer and its budget's expiry race; the first wins)."""
    with contextlib.suppress(concurrent.futures.InvalidStateError):
        if isinstance(value, BaseException):
            out.set_exception(value)
        else:
            out.set_result(value)


class _Watchdog:
    """One thread that runs each callback at its time (monotonic): a call's budget expiring costs
    a heap push, not a thread per call."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cond = threading.Condition()
        self._count = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, when: float, fn: Callable[[], None]) -> None:
        with self._cond:
            entry = (when, next(self._count), fn)
            heapq.heappush(self._heap, entry)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="refit-call-budgets", daemon=True)
                self._thread.start()
            if self._heap[0] is entry:  # it waits for the earliest only: wake it when that changed
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else max(self._heap[0][0] - time.monotonic(), 0.0))
                _, _, fn = heapq.heappop(self._heap)
            with contextlib.suppress(Exception):
                fn()


_WATCHDOG = _Watchdog()
