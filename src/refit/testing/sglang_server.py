"""An emulated SGLang server: SGLang 0.5.23's weight-update HTTP API in front of a reference engine.

Not SGLang. Every behaviour here is SGLang's, read in its source (docs/engines.md has the table with
the file and function of each); where SGLang crashes, holds a lock or skips a sync, this does too:

  * the whole server dies (the request in flight loses its connection, later ones are refused)
    wherever SGLang's scheduler raises, since `run_scheduler_process` answers any exception with
    SIGQUIT to the server, which kills its process tree: a tensor update whose payload cannot be
    decoded or whose load raises (a wrong shape; a name the model lacks is skipped and the rest
    loaded, as SGLang's loader does: `SGLANG_LOADER`), `release_memory_occupation` of a busy
    engine (an assert), `resume_memory_occupation` of a tag that was never released (a KeyError),
    and, up to 0.5.21, an update asked to flush while requests hold KV (an assert);
  * request validation errors are HTTP 400 with SGLang's `ErrorResponse` body (its handler
    replaces FastAPI's 422); a POST with no body is one of them;
  * update, begin and end answer `{"success", "message"}`, HTTP 400 when not successful, with
    SGLang's texts (the no-session text, "already open", "Weights were updated, but the cache was
    not flushed ...", "Failed to update parameter online ... partially updated");
  * outside a pause, begin/end and every update wait for the model's writer lock: for every request
    in flight to finish, new ones waiting behind it (SGLang's writer-preferring RWLock);
    `/pause_generation` and `/continue_generation` always answer 200;
  * `/update_weight_version` aborts every request in flight unless `abort_all_requests` is false;
    any update or label sets the label, whatever weights the engine holds;
  * `/server_info` has no identity: its `startup_time` is a dict of startup durations;
  * `restart()` is a restart: a fresh engine behind the same URL, label "default", no session, no
    group, nothing released.

`version` picks the behaviours of older releases the driver still meets (before 0.5.21 no
begin/end session and a flush refused while retracted requests wait; up to 0.5.21 the flush assert;
before 0.5.12 `/get_weight_version`). `validate(route, body)` is called on every JSON body received
(tests pass SGLang's own request types). The stdlib HTTP front below maps routes onto the `op_*`
methods, named after the SGLang tokenizer-manager methods they stand for; tests mount SGLang's own
FastAPI app over the same methods (tests/sglang_app.py). The server machinery, fault arming and the
emulator's own `/_refit/` routes are `refit.testing.emulated`'s.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

from refit.buckets import BucketManifest, TensorEntry, TensorMeta, itemsize
from refit.drivers.base import ConnectInfo, Payload
from refit.drivers.flattened import FLATTENED_BUCKET, manifest_from_metadata, peek_metadata
from refit.drivers.http import version_tuple
from refit.drivers.reference import ReferenceEngine
from refit.drivers.sglang import SGLangEngine
from refit.errors import EngineError
from refit.testing.emulated import EmulatedServer, EmulatorClient, _Drop, _Reply, label_of

GROUP_TIMEOUT_S = 60.0
MEMORY_TAGS = ("kv_cache", "weights")  # what the reference engine keeps; cuda_graph is accepted and ignored
ALL_TAGS = ("weights", "kv_cache", "cuda_graph")  # sglang/srt/constants.py GPU_MEMORY_ALL_TYPES

# SGLang 0.5.23's texts, verbatim (managers/scheduler_components/weight_updater.py, entrypoints/http_server.py)
NO_SESSION = "{op} must run between begin_weight_update() and end_weight_update()"
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"
NOT_FLUSHED = (
    "Weights were updated, but the cache was not flushed because requests are still running or queued. "
    "Retract or finish them, then call /flush_cache."
)
PARTIAL = (
    "Failed to update parameter online: {e}. The full weights of the ModelRunner are partially updated. "
    "Please discard the whole weights."
)
FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)
# A head tied to the embedding is dropped unread by SGLang's loaders: models/llama.py
# `LlamaForCausalLM.load_weights` skips "lm_head.weight" when tie_word_embeddings; models/qwen2.py
# `Qwen2ForCausalLM.load_weights` finds no such parameter (its lm_head is the embedding module) and
# skips it with a warning. So a trainer whose head differs from its embedding is not refused: the
# server serves its embedding as the head (verification by its checksums names lm_head.weight).
TIED_HEAD_DROPPED = {"tied_head": "skip"}
# What SGLang 0.5.23's loaders do with the rest of a bucket, once decoded (models/qwen2.py and
# llama.py `_legacy_load_weights`, the default loader; both `update_weights_from_tensor` and
# `update_weights_from_distributed` end in `model.load_weights`): a name the model lacks is skipped
# (a warning, "Parameter ... not found in params_dict", or silently for a layer out of range), the
# rest loaded; a tied head is dropped unread; a tensor sent in another dtype is cast as
# `weight_loader` copies it (`param.data.copy_`). A flattened bucket's metadata is read as
# `FlattenedTensorBucket.reconstruct_tensors` reads it (`numel` there, its value unused; no tensors:
# nothing loaded, success). Where this is still stricter than SGLang (a wrong shape always kills the
# server here; SGLang's parallel-linear loaders truncate or zero-pad some): docs/engines.md.
SGLANG_LOADER = {**TIED_HEAD_DROPPED, "unknown": "skip", "dtype": "cast", "metadata": "sglang"}

# Request fields and defaults of SGLang 0.5.23's io_struct types (managers/io_struct.py) that the
# emulator reads; a body's other keys are ignored, as SGLang ignores them.
DEFAULTS: dict[str, dict[str, Any]] = {
    "/pause_generation": {"mode": "abort"},
    "/continue_generation": {"torch_empty_cache": True},
    "/begin_weight_update": {"selector": "all"},
    "/end_weight_update": {},
    "/update_weights_from_tensor": {"load_format": None, "flush_cache": True, "abort_all_requests": False,
                                    "weight_version": None, "selector": "all", "torch_empty_cache": False},
    "/update_weights_from_distributed": {"load_format": None, "group_name": "weight_update_group", "flush_cache": True,
                                         "abort_all_requests": False, "weight_version": None, "selector": "all",
                                         "torch_empty_cache": False},
    "/init_weights_update_group": {"group_name": "weight_update_group", "backend": "nccl"},
    "/destroy_weights_update_group": {"group_name": "weight_update_group"},
    "/update_weight_version": {"abort_all_requests": True},
    "/release_memory_occupation": {"tags": None},
    "/resume_memory_occupation": {"tags": None},
    "/generate": {"input_ids": None, "sampling_params": None, "lora_path": None},
    "/weights_checker": {"action": "checksum", "allow_quant_error": False, "skip_tensor_list": None, "selector": "all"},
    "/load_lora_adapter_from_tensors": {"pinned": False, "added_tokens_config": None, "load_format": None,
                                        "expected_checksums": None},
    "/load_lora_adapter": {"pinned": False},
    "/unload_lora_adapter": {},
}  # fmt: skip
REQUIRED = {
    "/update_weights_from_tensor": ("serialized_named_tensors",),
    "/update_weights_from_distributed": ("names", "dtypes", "shapes"),
    "/init_weights_update_group": ("master_address", "master_port", "rank_offset", "world_size"),
    "/update_weight_version": ("new_version",),
    "/load_lora_adapter_from_tensors": ("lora_name", "config_dict", "serialized_named_tensors"),
    "/load_lora_adapter": ("lora_name", "lora_path"),
    "/unload_lora_adapter": ("lora_name",),
}
LORA_ROUTES = ("/load_lora_adapter", "/load_lora_adapter_from_tensors", "/unload_lora_adapter")
PAUSE_MODES = ("abort", "retract", "in_place")
# entrypoints/http_server.py routes under @auth_level(AuthLevel.ADMIN_OPTIONAL) that the emulator serves
ADMIN_ROUTES = frozenset({
    "/pause_generation", "/continue_generation", "/flush_cache", "/begin_weight_update", "/end_weight_update",
    "/update_weights_from_tensor", "/update_weights_from_distributed", "/init_weights_update_group",
    "/destroy_weights_update_group", "/update_weight_version", "/release_memory_occupation",
    "/resume_memory_occupation", "/weights_checker", *LORA_ROUTES,
})  # fmt: skip
ABORT_POLL_S = 1.0  # TokenizerManager.pause_generation(abort): re-aborts every second until the model lock is free

# LoRA (managers/tokenizer_control_mixin.py, lora/lora_registry.py, lora/lora_manager.py), verbatim
LORA_NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
LORA_INCOMPLETE_UNLOAD = "LoRA adapter '{name}' has an incomplete unload. Retry the unload before loading it again."
LORA_ALREADY = "Failed to load LoRA adapter {name} because it is already loaded"
LORA_DORA = "Failed to load {name} because LoRA serving currently doesn't support DoRA adapters"
LORA_INCOMPATIBLE = (
    "LoRA adapter {name} with rank {r} is incompatible with the current LoRA memory pool configuration. Please ensure "
    "that the LoRA adapter's rank is within the configured `--max-lora-rank` and that the target modules are included "
    "in `--lora-target-modules`."
)
LORA_MISSING = "LoRA with name {name} does not exist. Loaded LoRAs: odict_keys({names!r})"
LORA_NEVER = "Got LoRA adapter that has never been loaded: {name}\nAll loaded adapters: dict_keys({names!r})."
LORA_RELOAD = "Failed to implicitly load LoRA adapter {name}: {why}"
LORA_TENSOR_PATH = "__tensor__"  # the path a tensor-loaded adapter is registered under


class Crash(Exception):
    """SGLang's scheduler raised: the server dies (the emulator's `crash`)."""


class _RWLock:
    """sglang/srt/utils/aio_rwlock.py `RWLock`, on threads: readers share it, a writer waits for
    every reader to leave, and a waiting writer keeps new readers out."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.readers = 0
        self._writer = False
        self._waiting_writers = 0

    @contextlib.contextmanager
    def reader(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._writer and not self._waiting_writers)
            self.readers += 1
        try:
            yield
        finally:
            with self._cond:
                self.readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def writer(self) -> Iterator[None]:
        with self._cond:
            self._waiting_writers += 1
            try:
                self._cond.wait_for(lambda: not self._writer and not self.readers)
                self._writer = True
            finally:
                self._waiting_writers -= 1
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    def locked(self) -> bool:
        with self._cond:
            return self._writer or self.readers > 0


class EmulatedSGLang(EmulatedServer):
    """A loopback HTTP server emulating SGLang `version` in front of `engine` (a reference engine
    driver; the emulator owns it from here on). `url` once started. `decoder`: how the engine reads
    tensor payloads (``refit``, or ``sglang``: SGLang's own code, which must be importable).
    `new_engine`: makes the engine of a restarted server (default: none, `restart` refused)."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        version: str = "0.5.23",
        api_key: str | None = None,
        admin_api_key: str | None = None,
        decoder: str = "refit",
        validate: Callable[..., None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        new_engine: Callable[[], ReferenceEngine] | None = None,
        memory_saver: bool = True,
        weights_cpu_backup: bool = False,
        device: str = "cpu",
        server_args: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """`api_key` / `admin_api_key`: the server's --api-key / --admin-api-key. `memory_saver`:
        --enable-memory-saver (without it SGLang's release and resume free and restore nothing).
        `weights_cpu_backup`: --enable-weights-cpu-backup (released weights come back intact).
        `device`: the --device it reports ("cpu" or "cuda"); it decides how /weights_checker hashes
        (on "cuda" as SGLang's `gpu_tensor_hash` does, computed here on the host). The weights stay
        where the reference engine holds them. On "cpu" a model SGLang would pad there (heads, KV
        heads or intermediate size not dividing by TP) is refused: the emulator does not pad.
        `server_args`: more resolved server args its /server_info reports (say {"attn_dp_size":
        2}); they change nothing else. `lora`: --enable-lora with its settings ({"max_lora_rank",
        "lora_target_modules", "max_loaded_loras"}; None: LoRA off)."""
        from refit.drivers.sglang_checksums import SGLANG_DEVICES

        if device not in SGLANG_DEVICES:
            raise ValueError(f"device {device!r}: the emulator reports one of {sorted(SGLANG_DEVICES)}")
        info = engine.client.call("info", timeout=30.0)
        (heads, kv_heads), intermediate, tp = info["heads"], info["intermediate_size"], engine.tp_size
        if device == "cpu" and (heads % tp or kv_heads % tp or intermediate % (32 * tp)):
            engine.close()
            raise ValueError(
                f"{heads} heads, {kv_heads} KV heads and intermediate size {intermediate} at TP {tp}: SGLang on the "
                "host pads these (configs/update_config.py adjust_config_with_unaligned_cpu_tp), which the "
                "emulator does not; emulate a CUDA server (device='cuda') or a TP size that divides them"
            )
        self.device = device
        self.server_args = dict(server_args or {})
        self.lora = None if lora is None else {"max_lora_rank": None, "lora_target_modules": None,
                                               "max_loaded_loras": None, **lora}  # fmt: skip
        if self.lora is not None:  # arg_groups/lora_hook.py check_lora_server_args (asserts at launch)
            if not (self.lora["max_lora_rank"] and self.lora["lora_target_modules"]):
                engine.close()
                raise ValueError("SGLang needs --max-lora-rank and --lora-target-modules with --enable-lora and no "
                                 "--lora-paths")  # fmt: skip
            if self.lora["max_loaded_loras"] is not None and self.lora["max_loaded_loras"] < 8:
                engine.close()
                raise ValueError("--max-loaded-loras must be >= --max-loras-per-batch (8)")
        self.memory_saver = memory_saver
        self.weights_cpu_backup = weights_cpu_backup
        self.v = version_tuple(version) or (0, 5, 23)
        self.admin_api_key = admin_api_key
        self.decoder = decoder
        self.reset_state()
        super().__init__(
            engine, version=version, api_key=api_key, validate=validate, host=host, port=port, new_engine=new_engine
        )

    def reset_state(self) -> None:
        """What a fresh SGLang process holds: label "default", no session, group or release."""
        super().reset_state()
        self.session: str | None = None  # SchedulerWeightUpdaterManager._session (its selector)
        self.session_loaded = False
        self.offload_tags: set[str] = set()  # SchedulerWeightUpdaterManager.offload_tags
        self.groups: dict[str, dict[str, Any]] = {}
        self.bucket_count = 0  # buckets of the open session (the index a fault is armed at)
        self.is_pause = False  # TokenizerManager.is_pause, under is_pause_cond
        self.scheduler_paused = False  # Scheduler._engine_paused (retract / in_place; abort leaves it)
        self.pause_cond = threading.Condition(threading.RLock())
        self.model_update_lock = _RWLock()  # TokenizerManager.model_update_lock
        import random

        rnd = random.Random()
        # observability/startup_time.py build_engine_startup_time: durations, no identity
        # LoRA, the tokenizer's side (LoRARegistry, its counters, TokenizerManager's lock and caches)
        self.lora_registry: dict[str, dict[str, Any]] = {}  # name -> {"id", "path", "pinned"}, LRU order
        self.lora_counts: dict[str, int] = {}  # per lora id: requests using it
        self.lora_cond = threading.Condition()
        self.lora_update_lock = threading.Lock()
        self.pending_lora_unloads: dict[str, str] = {}
        self.lora_ref_cache: dict[str, dict[str, Any]] = {}
        # the scheduler's (LoRAManager.lora_refs: id -> {"name", "path"}; the engine holds the tensors)
        self.lora_refs: dict[str, dict[str, Any]] = {}
        self.broken_loras: dict[str, str] = {}  # name -> why its first batch kills the scheduler
        self.startup_durations = {
            "load_weight": round(rnd.uniform(0.5, 3.0), 4), "kv_cache_allocation": round(rnd.uniform(0.1, 1.0), 4),
            "scheduler_e2e": round(rnd.uniform(2.0, 9.0), 4), "cuda_graph": {},
            "tokenizer_e2e": round(rnd.uniform(2.0, 9.0), 4),
        }  # fmt: skip

    @property
    def session_open(self) -> bool:
        return self.session is not None

    def setup_engine(self) -> None:
        """Tensor payloads carry their own handles: the engine's receiver for them is always open."""
        self._engine(
            "attach",
            ConnectInfo(
                "sglang_tensor",
                "refit.drivers.sglang_transport:FlattenedTensorReceiver",
                fields={"decoder": self.decoder},
                parts=({},) * self.tp,
            ),
        )

    def authorize(self, method: str, path: str, header: str | None) -> _Reply | None:
        """utils/auth.py `decide_request_auth`: /health*, /ready*, /metrics* always open; the weight
        and control routes (@auth_level(ADMIN_OPTIONAL)) take the admin key if the server has one,
        else its api_key; every other path (NORMAL, unknown ones and /openapi.json too) takes the
        api_key if it has one, else nothing. "Bearer" in any case. 401 {"error": "Unauthorized"}."""
        if method == "OPTIONS" or path.startswith(("/health", "/ready", "/metrics", "/_refit/")):
            return None
        key = (self.admin_api_key or self.api_key) if path in ADMIN_ROUTES else self.api_key
        if not key:
            return None
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token, key):
            return _Reply(401, {"error": "Unauthorized"})
        return None

    def invalid(self, detail: Any) -> _Reply:
        """SGLang's RequestValidationError handler (entrypoints/http_server.py): 400, ErrorResponse."""
        return _Reply(400, {"object": "error", "message": str(detail), "type": "Bad Request", "param": None,
                            "code": 400})  # fmt: skip

    def _req(self, body: Any, route: str) -> SimpleNamespace:
        """The request object SGLang's schema makes of a JSON body: required fields, defaults."""
        obj = self._obj(body, route, REQUIRED.get(route, ()))
        return SimpleNamespace(**{**DEFAULTS.get(route, {}), **obj})

    def crash(self, why: str) -> _Drop:
        """SGLang's scheduler raised (`run_scheduler_process` sends SIGQUIT; the server's handler
        kills the process tree): the engine and the server go down, the caller's request unanswered."""
        self.crashed = why
        with contextlib.suppress(Exception):
            self.engine.client.call("arm_fault", "kill", "ping", None, 0.0, timeout=5.0)
            self.engine.client.call("ping", timeout=5.0)
        self.die()
        return _Drop()

    # ---- the tokenizer manager's pause and locks (managers/tokenizer_manager.py) ---------------

    def _weights_call(self, fn: Callable[[], Any]) -> Any:
        """`_weight_update_session_call` / `update_weights_from_*`: paused, run at once holding
        is_pause_cond (continue_generation waits); otherwise under the model's writer lock."""
        with self.pause_cond:
            if self.is_pause:
                return fn()
        with self.model_update_lock.writer():
            return fn()

    def _idle(self) -> bool:
        """Scheduler.is_fully_idle(ignore_waiting=paused): nothing running, and nothing waiting
        unless the engine is paused (before 0.5.21 the waiting queue always counts)."""
        info = self._engine("info")
        ignore_waiting = self.scheduler_paused and self.v >= (0, 5, 21)
        return not info["running"] and (ignore_waiting or not info["waiting"])

    def _flush(self) -> bool:
        """Scheduler.flush_cache: refused unless fully idle."""
        if not self._idle():
            return False
        try:
            self._engine("flush", False)  # refused while requests hold KV, held in place or not
        except EngineError:
            return False
        return True

    # ---- operations (one per tokenizer-manager method) ----------------------------------------

    def op_pause_generation(self, obj: Any) -> None:
        """TokenizerManager.pause_generation, holding is_pause_cond throughout: is_pause; then, for
        abort, abort everything and poll every second until no request holds the model lock (the
        scheduler itself is not paused); for retract / in_place, hand the mode to the scheduler."""
        self._fault()
        with self.pause_cond:
            self.is_pause = True
            if obj.mode != "abort":
                self.scheduler_paused = True  # Scheduler._engine_paused
                self._engine("pause", obj.mode)
                return
            self._engine("pause", "abort")  # aborts what runs; the engine holds new requests, as is_pause does
            while self.model_update_lock.locked():
                time.sleep(ABORT_POLL_S)
                self._engine("abort_requests")

    def op_continue_generation(self, obj: Any) -> None:
        self._fault()
        with self.pause_cond:
            self.is_pause = self.scheduler_paused = False
            self._engine("continue_generation")
            self.pause_cond.notify_all()

    def op_flush_cache(self, timeout_s: float | None) -> tuple[bool, str]:
        self._fault()
        with self._lock:
            return self._flush(), ""

    def op_begin_weight_update(self, obj: Any) -> tuple[bool, str]:
        self._fault()

        def run() -> tuple[bool, str]:
            with self._lock:
                if self.session is not None:
                    return False, ALREADY_OPEN
                self._scheduler("begin", None)
                self.session, self.session_loaded, self.bucket_count = obj.selector, False, 0
                return True, "Success"

        return self._weights_call(run)

    def op_end_weight_update(self, obj: Any) -> tuple[bool, str]:
        self._fault()

        def run() -> tuple[bool, str]:
            with self._lock:
                if self.session is None:
                    return False, NOT_OPEN
                self.session = None
                self._scheduler("finalize")
                return True, "Success"

        return self._weights_call(run)

    def _scheduler(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """An engine call in SGLang's scheduler: anything it raises kills the server."""
        try:
            return self._engine(method, *args, **kwargs)
        except EngineError as exc:
            raise self.crash(f"{method}: {exc.kind}: {exc.message}") from None

    def _after_update(self, obj: Any, message: str = "Success") -> tuple[bool, str]:
        """What follows a successful load: the session marks a load, the label, the flush."""
        self.session_loaded = True
        self.bucket_count += 1
        success = True
        if obj.flush_cache and not self._flush():
            if self.v <= (0, 5, 21):  # `assert` in the scheduler (before 0.5.22): the server dies
                raise self.crash("Cache flush failed after updating weights")
            success, message = False, NOT_FLUSHED
        return success, message

    def _label_after(self, obj: Any, success: bool, message: str) -> tuple[bool, str]:
        """The tokenizer manager labels the weights after a successful update carrying a version."""
        if success and obj.weight_version is not None:
            self._label(str(obj.weight_version))
            message += f" Weight version updated to {obj.weight_version}."
        return success, message

    def op_update_weights_from_tensor(self, obj: Any) -> tuple[bool, str]:
        """Session check, then the scheduler decodes its own rank's entry and loads it: a failure
        there raises in the scheduler (SGLang catches none of it) and the server dies."""
        if obj.abort_all_requests:
            self._engine("abort_requests")
        entries = obj.serialized_named_tensors

        def run() -> tuple[bool, str]:
            with self._lock:
                index = self._open_bucket()
                if index is None:
                    return False, NO_SESSION.format(op="update_weights_from_tensor")
                try:
                    payload = self._tensor_payload(entries, obj.load_format, index)
                except Exception as exc:
                    raise self.crash(f"deserialize_own_rank: {type(exc).__name__}: {exc}") from None
                if self.session is None:  # before 0.5.21 each update begins and post-processes alone
                    self._scheduler("begin", None)
                    self._scheduler("load", payload)
                    self._scheduler("finalize")
                else:
                    self._scheduler("load", payload)
                return self._after_update(obj)

        return self._label_after(obj, *self._weights_call(run))

    def _open_bucket(self) -> int | None:
        """The scheduler's session check (0.5.21+; None: refused, no session), then the index of the
        bucket this update is (the driver's, else the count), and its armed fault."""
        if self.session is None and self.v >= (0, 5, 21):
            return None
        hint = self.bucket_hint()
        index = self.bucket_count if hint is None else hint
        self._fault(bucket=index)
        return index

    def _tensor_payload(self, entries: Any, load_format: Any, index: int) -> Payload:
        """Each TP rank's own entry (`deserialize_own_rank` indexes by TP rank)."""
        if load_format != FLATTENED_BUCKET:
            raise NotImplementedError(f"load_format {load_format!r}: this emulator serves flattened_bucket only")
        raw = [e if isinstance(e, bytes) else base64.b64decode(e, validate=True) for e in entries]
        if len(raw) < self.tp:
            raise IndexError("list index out of range")
        manifest = manifest_from_metadata(index, peek_metadata(raw[0]), as_sglang=True)
        return Payload("sglang_tensor", manifest, SGLANG_LOADER, tuple({"serialized": r} for r in raw[: self.tp]))

    def op_update_weights_from_distributed(self, obj: Any) -> tuple[bool, str]:
        """Session check, then receive (a failure is answered: "Failed to receive weights") and load
        (a failure is answered too, the weights partially updated)."""
        if obj.abort_all_requests:
            self._engine("abort_requests")

        def run() -> tuple[bool, str]:
            with self._lock:
                index = self._open_bucket()
                if index is None:
                    return False, NO_SESSION.format(op="update_weights_from_distributed")
                if obj.group_name not in self.groups:  # an assert in receive_weights_from_distributed
                    return False, (
                        f"Failed to receive weights: Group {obj.group_name} not in {list(self.groups)}. "
                        "Please call `init_weights_update_group` first."
                    )
                try:
                    payload = self._distributed_payload(obj, index)
                except ValueError as exc:
                    return False, f"Failed to receive weights: {exc}"
                try:
                    if self.session is None:
                        self._engine("begin", None)
                    self._engine("load", payload)
                    if self.session is None:
                        self._engine("finalize")
                except EngineError as exc:
                    if exc.kind == "bad_payload":
                        return False, f"Failed to receive weights: {exc.message}"
                    return False, PARTIAL.format(e=exc.message)
                return self._after_update(obj, "Succeeded to update parameter online.")

        return self._label_after(obj, *self._weights_call(run))

    def _distributed_payload(self, obj: Any, index: int) -> Payload:
        if obj.load_format == FLATTENED_BUCKET and not obj.names:  # FlattenedTensorBucket.empty
            raise ValueError("Cannot create empty tensor bucket")
        entries, offset = [], 0
        for name, dtype, shape in zip(obj.names, obj.dtypes, obj.shapes, strict=True):
            meta = TensorMeta(name, str(dtype).removeprefix("torch."), tuple(int(d) for d in shape))
            if obj.load_format == FLATTENED_BUCKET and offset % itemsize(meta.dtype):
                raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype torch.{meta.dtype}")
            entries.append(TensorEntry(meta, offset))
            offset += meta.nbytes
        manifest = BucketManifest(index, tuple(entries), offset)
        # SGLang receives every tensor the request names, then loads (weight_updater.py:
        # receive_weights_from_distributed, then load_weights_from_distributed): a refused load
        # has still taken the broadcast
        fields = {"load_format": obj.load_format, "receive_first": True, **SGLANG_LOADER}
        return Payload("sglang_broadcast", manifest, fields, ({},) * self.tp)

    def op_init_weights_update_group(self, obj: Any) -> tuple[bool, str]:
        self._fault()
        with self._lock:
            name = obj.group_name
            if name in self.groups:  # torch refuses a second group of one name
                return False, (
                    "Failed to initialize custom process group: The specified group name has already been created, "
                    "please use a different group name."
                )
            info = ConnectInfo(
                "sglang_broadcast",
                "refit.drivers.sglang_transport:SGLangBroadcastReceiver",
                fields={
                    "addr": obj.master_address, "port": int(obj.master_port), "world": int(obj.world_size),
                    "group": name, "backend": obj.backend, "timeout_s": GROUP_TIMEOUT_S,
                },
                parts=tuple({"rank": int(obj.rank_offset) + j} for j in range(self.tp)),
            )  # fmt: skip
            try:
                self._engine("attach", info)
            except EngineError as exc:
                return False, f"Failed to initialize custom process group: {exc.message}."
            fields = ("master_address", "master_port", "rank_offset", "world_size", "backend")
            self.groups[name] = {k: getattr(obj, k, None) for k in fields}
            return True, "Succeeded to initialize custom process group."

    def op_destroy_weights_update_group(self, obj: Any) -> tuple[bool, str]:
        self._fault()
        with self._lock:
            if self.groups.pop(obj.group_name, None) is None:
                return False, "The group to be destroyed does not exist."
            self._engine("detach", "sglang_broadcast")
            return True, "Succeeded to destroy custom process group."

    def op_abort_all(self) -> None:
        self._engine("abort_requests")

    def op_update_weight_version(self, obj: Any) -> None:
        self._fault()
        self._label(str(obj.new_version))

    def op_release_memory_occupation(self, obj: Any) -> None:
        """SchedulerWeightUpdaterManager.release_memory_occupation: asserts the engine is idle."""
        self._fault()
        with self._lock:
            if not self._idle():
                raise self.crash("AssertionError: release_memory_occupation should be called only when server is idle.")
            tags = list(obj.tags or ALL_TAGS)
            self.offload_tags |= set(tags)
            if self.memory_saver:  # without it SGLang's memory-saver adapter is a no-op
                released = [t for t in tags if t in MEMORY_TAGS]
                self._scheduler("release_memory", released, cpu_backup=self.weights_cpu_backup)

    def op_resume_memory_occupation(self, obj: Any) -> None:
        """`offload_tags.remove(tag)` for each tag: a tag never released raises KeyError."""
        self._fault()
        with self._lock:
            tags = list(obj.tags or ALL_TAGS)
            for tag in tags:
                if tag not in self.offload_tags:
                    raise self.crash(f"KeyError: {tag!r}")
                self.offload_tags.remove(tag)
            if self.memory_saver:
                self._scheduler("resume_memory", [t for t in tags if t in MEMORY_TAGS])

    def op_check_weights(self, obj: Any) -> tuple[bool, str, list[dict[str, Any]]]:
        """scheduler_components/weight_updater.py `check_weights` over utils/weight_checker.py
        `WeightChecker.handle`: "checksum" only (snapshot, reset_tensors and compare are SGLang's
        debugging actions, not emulated: refused as an unsupported action is). Per TP rank, each
        parameter of SGLang's layout (`refit.drivers.sglang_checksums`) built from the engine's
        weights as it serves them, hashed as SGLang hashes on the device it reports (`tensor_hash`:
        sha256 on the host, `gpu_tensor_hash` on CUDA); no draft model. Any error
        is `success: false` with its text, as SGLang's catch-all makes it."""
        from refit.drivers import sglang_checksums as sc

        self._fault()  # a hang or kill armed for the driver's verify call

        try:
            if obj.selector not in ("all", "target", "draft"):
                raise ValueError(f"invalid selector {obj.selector!r}; expected 'target', 'draft', or 'all'")
            if obj.selector == "draft":  # no draft runner: nothing runs the action, no payload
                return True, "Success.", []
            if obj.action in ("snapshot", "reset_tensors", "compare"):  # SGLang's, not emulated
                raise ValueError(f"action={obj.action!r} is not emulated (refit's SGLang emulator computes checksums)")
            if obj.action != "checksum":
                raise ValueError(f"Unsupported action={obj.action!r}")  # WeightChecker.handle's text
            with self._lock:  # SGLang's scheduler runs it between loads, never inside one
                state = self.engine.client.call("served_state_dict", timeout=60.0)  # a tied head: the embedding
                shards = self.engine.client.call("rank_shards", timeout=60.0)  # each rank's own q/k/v, gate/up, o/down
                heads = self.heads(state)
            skip = tuple(obj.skip_tensor_list or ())
            per_rank: list[dict[str, str]] = [{} for _ in range(self.tp)]
            for key, pieces in sc.sglang_params(state, self.tp, heads=heads, shards=shards):
                name, _, rank = key.rpartition("@tp")
                if skip and any(p in name for p in skip):
                    continue
                per_rank[int(rank)][name] = sc.pieces_checksum(pieces, sc.SGLANG_DEVICES[self.device])
        except Exception as exc:  # SGLang answers any error as success: false
            return False, str(exc), []
        ranks = []
        for r, sums in enumerate(per_rank):
            overall = hashlib.sha256()
            for name in sorted(sums):
                overall.update(name.encode())
                overall.update(sums[name].encode())
            par = {"role": "target", "tp_rank": r, "tp_size": self.tp, "dp_rank": 0, "dp_size": 1, "pp_rank": 0,
                   "pp_size": 1, "rank": r, "size": self.tp}  # fmt: skip
            ranks.append({"checksums": sums, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [par]})
        return True, "Success.", ranks

    def op_generate(
        self, obj: Any, resolve: Callable[[Any], Any] | None = None, release: Callable[[Any], None] | None = None
    ) -> dict[str, Any]:
        """A request waits while paused, then holds the model's reader lock for its whole life;
        inside it, its LoRA adapter is resolved and counted (`resolve`: the tokenizer's; TokenizerManager
        generate_request's order), and released when it ends (`release`)."""
        params = obj.sampling_params or {}
        ids = obj.input_ids
        with self.pause_cond:
            self.pause_cond.wait_for(lambda: not self.is_pause)
        with self.model_update_lock.reader():
            held = resolve(obj) if resolve is not None and getattr(obj, "lora_path", None) else None
            try:
                adapter = getattr(obj, "lora_path", None) or None
                if adapter is not None and adapter in self.broken_loras:  # its first batch: uncaught
                    raise self.crash(f"load_lora_weight_to_buffer: {self.broken_loras[adapter]}")
                out = self._generate(ids, int(params.get("max_new_tokens", 128)), adapter)
            finally:
                if release is not None and held is not None:
                    release(held)
        tokens, versions = out.get("output") or [], out.get("weight_versions") or []
        meta: dict[str, Any] = {
            "finish_reason": {"type": out.get("finish_reason")},
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "num_retractions": int(out.get("num_retractions") or 0),
            "weight_version": label_of(versions[-1]) if versions else self.label,
        }
        if len(set(versions)) > 1:  # SGLang reports spans only for a request that straddled an update
            meta["weight_versions"] = self.spans(versions)
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    # ---- LoRA: the scheduler's side (managers/tp_worker.py, lora/lora_manager.py) --------------

    def _lora_result(self, success: bool, error_message: str = "") -> dict[str, Any]:
        """LoRAManager.create_lora_update_result: every adapter this rank holds, either way."""
        return {
            "success": success, "error_message": error_message, "rid": None, "http_worker_ipc": None,
            "loaded_adapters": {ref["name"]: ref["path"] for ref in self.lora_refs.values()},
        }  # fmt: skip

    def op_lora_load_tensors(self, obj: Any) -> dict[str, Any]:
        """TpModelWorker.load_lora_adapter_from_tensors: decode its own rank's entry (a failure
        raises in the scheduler: the server dies), then LoRAManager._load_lora_adapter_from_tensors
        (its failures answered): LoRAConfig (r, lora_alpha, target_modules read; use_rslora,
        rank/alpha patterns ignored: scaling lora_alpha / r), validate_new_adapter (DoRA, a name
        already loaded, the pool's rank and modules), then the weights. Shapes and names are not
        checked at load (SGLang checks them when a batch first uses the adapter, in
        mem_pool.load_lora_weight_to_buffer, uncaught): an adapter the engine refuses is
        registered anyway and kills the server at its first request."""
        self._fault(bucket=self.bucket_hint())
        if obj.expected_checksums is not None:
            raise NotImplementedError("expected_checksums: this emulator does not check adapter checksums")
        try:
            decoded = self._tensor_payload(obj.serialized_named_tensors, obj.load_format, 0)
        except Exception as exc:
            raise self.crash(f"deserialize_own_rank: {type(exc).__name__}: {exc}") from None
        # the adapter's own loader (lora.py `_process_weight`), not the model's: its names are kept
        payload = Payload(decoded.kind, decoded.manifest, {"metadata": "sglang"}, decoded.parts)
        name, config = obj.lora_name, obj.config_dict if isinstance(obj.config_dict, dict) else {}
        names = [e.meta.name for e in payload.manifest.entries]
        try:
            targets, r, alpha = config["target_modules"], config["r"], config["lora_alpha"]
            if isinstance(targets, str) and targets not in ("all", "all-linear"):  # lora/utils.py
                raise ValueError("Only 'all' or 'all-linear' can be used as the string for target module")
            added = {t: i for t, i in (obj.added_tokens_config or {}).items() if i >= self._vocab()}
            if added:  # validate_new_adapter, in its order: added tokens, DoRA, a name loaded, the pool, pins
                raise ValueError(f"Failed to load {name} because LoRA serving currently doesn't support adapters "
                                 "that add tokens to the vocabulary")  # fmt: skip
            if config.get("use_dora", False):
                raise ValueError(LORA_DORA.format(name=name))
            if any(ref["name"] == name for ref in self.lora_refs.values()):
                raise ValueError(LORA_ALREADY.format(name=name))
            if not self._pool_supports(r, targets):
                raise ValueError(LORA_INCOMPATIBLE.format(name=name, r=r))
            if obj.pinned and sum(bool(ref.get("pinned")) for ref in self.lora_refs.values()) >= 8 - 1:
                raise ValueError(f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin "
                                 "all slots in the LoRA memory pool to avoid starvation for unpinned adapters and "
                                 "base models. Please increase your `--max-loras-per-batch` or load it as unpinned "
                                 "LoRA adapters.")  # fmt: skip
            if str(config["peft_type"]).lower() != "lora":  # lora.py LoRAAdapter.__init__: an assert
                raise AssertionError()
            float(alpha) / int(r)  # (scaling: r == 0 raises ZeroDivisionError)
            unfused = self._unfused(names)
        except (KeyError, ValueError, TypeError, AssertionError, ZeroDivisionError) as exc:
            return self._lora_result(False, str(exc))
        spec = {"name": name, "version": 1, "r": r, "lora_alpha": alpha, "target_modules": _targets(targets),
                "dtype": payload.manifest.entries[0].meta.dtype if payload.manifest.entries else None}  # fmt: skip
        try:
            self._engine("stage", [payload.manifest], None, spec)
            self._engine("load", payload)
            self._engine("finalize")
            self._engine("publish", 1)
        except EngineError as exc:
            self.broken_loras[name] = exc.message
        if unfused:  # mem_pool.load_lora_weight_to_buffer -> get_target_module_name raises, uncaught
            self.broken_loras[name] = f"Cannot find target module name for {unfused[0]}"
        self.lora_refs[obj.lora_id] = {"name": name, "path": LORA_TENSOR_PATH, "pinned": bool(obj.pinned)}
        return self._lora_result(True)

    def _vocab(self) -> int:
        return int(self._engine("info").get("vocab_size") or 0)

    def _unfused(self, names: list[str]) -> list[str]:
        """lora.py normalize_qkv_proj / normalize_gate_up_proj per layer: from q (k missing: zeros;
        v missing: KeyError naming it, the load refused), from gate (up missing: zeros); k or v
        without q, or up without gate, stay unfused: names no pool module has (returned)."""
        out = []
        layers: dict[str, set[str]] = {}
        for n in names:
            if ".layers." in n and ".lora_A." in n:
                stem, _, proj = n.split(".lora_A.")[0].rpartition(".")
                layers.setdefault(stem, set()).add(proj)
        for stem, projs in sorted(layers.items()):
            if "q_proj" in projs and "v_proj" not in projs:
                raise KeyError(f"{stem}.v_proj.lora_A.weight")
            out += [f"{stem}.{p}" for p in ("k_proj", "v_proj") if p in projs and "q_proj" not in projs]
            out += [f"{stem}.up_proj" for _ in [0] if "up_proj" in projs and "gate_proj" not in projs]
        return out

    def op_lora_load_path(self, obj: Any) -> dict[str, Any]:
        """LoRAManager.load_lora_adapter from a path: LoRAConfig reads adapter_config.json in the
        directory or, for a path that is none, snapshot_download's from the Hub (no network here:
        its error is answered). This emulator loads no adapter from files."""
        import os

        if not os.path.isdir(str(obj.lora_path)):
            return self._lora_result(False, f"Cannot reach the Hugging Face Hub for {obj.lora_path!r} (offline)")
        raise NotImplementedError("loading an adapter from a directory: this emulator loads adapters from tensors")

    def op_lora_unload(self, obj: Any) -> dict[str, Any]:
        """LoRAManager._unload_lora_adapter: frees its slot and drops it (by id)."""
        self._fault()
        ref = self.lora_refs.pop(obj.lora_id, None)
        if ref is not None:
            self.broken_loras.pop(ref["name"], None)
            with contextlib.suppress(EngineError):
                self._engine("unload_adapter", ref["name"])
        return self._lora_result(True)

    def _pool_supports(self, r: Any, targets: Any) -> bool:
        """LoRAMemoryPool.can_support: the rank within --max-lora-rank, the normalized target
        modules within the server's (or "all")."""
        from refit.drivers.sglang_lora import normalized_targets

        rank = (self.lora or {}).get("max_lora_rank")
        if isinstance(rank, int) and int(r) > rank:
            return False
        want, have = normalized_targets(targets), normalized_targets((self.lora or {}).get("lora_target_modules"))
        return "all" in want or not have or "all" in have or want <= have

    # ---- LoRA: the tokenizer's side, for this module's own HTTP front (tests/sglang_app.py runs
    # SGLang's own TokenizerControlMixin and LoRARegistry over the scheduler ops above) ------------

    def tm_load_lora(self, obj: Any, from_tensors: bool) -> dict[str, Any]:
        """TokenizerControlMixin.load_lora_adapter(_from_tensors): under lora_update_lock, the
        scheduler's load; registered on success, then LRU eviction past --max-loaded-loras."""
        if not self.lora:
            return {**self._lora_result(False, LORA_NOT_ENABLED), "loaded_adapters": None}
        with self.lora_update_lock:
            if obj.lora_name in self.pending_lora_unloads:
                return {**self._lora_result(False, LORA_INCOMPLETE_UNLOAD.format(name=obj.lora_name)),
                        "loaded_adapters": None}  # fmt: skip
            import uuid

            ref = {"id": uuid.uuid4().hex, "path": LORA_TENSOR_PATH if from_tensors else obj.lora_path,
                   "pinned": bool(obj.pinned)}  # fmt: skip
            obj.lora_id, obj.lora_path = ref["id"], ref["path"]
            result = self.op_lora_load_tensors(obj) if from_tensors else self.op_lora_load_path(obj)
            if result["success"]:
                with self.lora_cond:
                    self.lora_registry[obj.lora_name] = ref
                    self.lora_counts[ref["id"]] = 0
                self.lora_ref_cache[obj.lora_name] = ref
            limit = self.lora["max_loaded_loras"]
            while limit is not None and len(self.lora_registry) > limit:
                lru = next((n for n, r in self.lora_registry.items() if not r["pinned"]), None)
                if lru is None:
                    return {**result, "success": False, "error_message": "Didn't find any LoRA adapters when trying "
                            f"to evict LRU LoRA adapter. LoRA registry is: {self.lora_registry}"}  # fmt: skip
                self._unload_locked(lru)
                result["loaded_adapters"].pop(lru, None)
            return result

    def tm_unload_lora(self, name: str) -> dict[str, Any]:
        """TokenizerControlMixin.unload_lora_adapter: under lora_update_lock, `_unload_locked`."""
        if not self.lora:
            return {**self._lora_result(False, LORA_NOT_ENABLED), "loaded_adapters": None}
        with self.lora_update_lock:
            return self._unload_locked(name)

    def _unload_locked(self, name: str) -> dict[str, Any]:
        """_unload_lora_adapter_locked: unregister at once (new requests can no longer get it),
        wait for the requests using it to finish, then the scheduler's unload."""
        lora_id = self.pending_lora_unloads.get(name)
        if lora_id is None:
            with self.lora_cond:
                ref = self.lora_registry.pop(name, None)
                if ref is None:
                    return {**self._lora_result(False, LORA_MISSING.format(name=name, names=list(self.lora_registry))),
                            "loaded_adapters": None}  # fmt: skip
            lora_id = self.pending_lora_unloads[name] = ref["id"]
        with self.lora_cond:
            self.lora_cond.wait_for(lambda: self.lora_counts.get(lora_id, 0) == 0)
            self.lora_counts.pop(lora_id, None)
        result = self.op_lora_unload(SimpleNamespace(lora_name=name, lora_id=lora_id))
        if result["success"]:
            self.pending_lora_unloads.pop(name, None)
        return result

    def tm_acquire_lora(self, name: str | None) -> str | None:
        """TokenizerManager._validate_and_resolve_lora: a name not registered is reloaded from the
        path it was last loaded from (a tensor adapter's, "__tensor__", cannot be), one never
        loaded is refused; then LoRARegistry.acquire counts the request."""
        if not name:  # tokenizer_manager.py _validate_and_resolve_lora: no lora_path, the base model
            return None
        if not self.lora:
            raise _Reply(400, {"error": {"message": (
                f"LoRA adapter '{name}' was requested, but LoRA is not enabled. Please launch the server with "
                "--enable-lora flag and preload adapters using --lora-paths or /load_lora_adapter endpoint."
            )}})  # fmt: skip
        if name not in self.lora_registry:
            if name not in self.lora_ref_cache:
                raise _Reply(400, {"error": {"message": LORA_NEVER.format(name=name, names=list(self.lora_ref_cache))}})
            ref = self.lora_ref_cache[name]
            again = SimpleNamespace(lora_name=name, lora_path=ref["path"], pinned=ref["pinned"])
            result = self.tm_load_lora(again, from_tensors=False)
            if not result["success"] and "already loaded" not in result["error_message"]:
                raise _Reply(400, {"error": {"message": LORA_RELOAD.format(name=name, why=result["error_message"])}})
        with self.lora_cond:
            ref = self.lora_registry.get(name)
            if ref is None:
                raise _Reply(400, {"error": {"message": (
                    f"The following requested LoRA adapters are not loaded: {name}\nLoaded adapters: "
                    f"odict_keys({list(self.lora_registry)!r})."
                )}})  # fmt: skip
            self.lora_registry[name] = self.lora_registry.pop(name)  # most recently used last
            self.lora_counts[ref["id"]] = self.lora_counts.get(ref["id"], 0) + 1
            return ref["id"]

    def tm_release_lora(self, lora_id: str | None) -> None:
        if lora_id is None:
            return
        with self.lora_cond:
            self.lora_counts[lora_id] = self.lora_counts.get(lora_id, 1) - 1
            self.lora_cond.notify_all()

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "refit-reference (emulated SGLang)", "weight_version": self.label, "is_generation": True}

    def server_info(self) -> dict[str, Any]:
        """build_server_info: the resolved server args (these among its ~550 fields), then live state."""
        self._fault()
        return {
            "version": self.version, "startup_time": self.startup_durations, "internal_states": [{}],
            "tp_size": self.tp, "dp_size": 1, "pp_size": 1, "enable_dp_attention": False,
            "enable_memory_saver": self.memory_saver, "enable_weights_cpu_backup": self.weights_cpu_backup,
            "weight_cache_mode": "off", "weight_version": "default", "frontend": "python", "device": self.device,
            "cpu_offload_gb": 0, "offload_group_size": -1, "attn_dp_size": 1, "enable_dp_lm_head": False,
            "enable_lora": True if self.lora else None, "max_loras_per_batch": 8,
            **{k: (self.lora or {}).get(k) for k in ("max_lora_rank", "lora_target_modules", "max_loaded_loras")},
            **self.server_args,
        }  # fmt: skip

    # ---- the HTTP front (entrypoints/http_server.py routes) -----------------------------------

    @staticmethod
    def _answer(result: tuple[bool, str]) -> Any:
        success, message = result
        if not success:
            raise _Reply(400, {"success": False, "message": message})
        return {"success": True, "message": message}

    def r_server_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return self.server_info()

    r_get_server_info = r_server_info

    def r_model_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return self.model_info()

    r_get_model_info = r_model_info

    def r_get_weight_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v >= (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        if self.v >= (0, 5, 12):
            raise _Reply(404, {"detail": "deprecated, use /model_info"})
        return {"weight_version": self.label}

    def r_health(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return None

    def r_ready(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """entrypoints/http_server.py `ready`: 200, or 503 while paused (TokenizerManager.is_ready)."""
        if self.is_pause:
            raise _Reply(503, "")
        return ""

    def r_pause_generation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/pause_generation")
        if obj.mode not in (PAUSE_MODES if self.v >= (0, 5, 6) else ("abort",)):
            raise self.invalid(f"mode: Input should be 'abort', 'retract' or 'in_place' (got {obj.mode!r})")
        self.op_pause_generation(obj)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def r_continue_generation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/continue_generation")
        self.op_continue_generation(obj)
        return {"message": "Generation continued successfully.", "status": "ok"}

    def r_flush_cache(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        success, message = self.op_flush_cache(None)
        if not success:
            raise _Reply(400, message or "Flush cache failed.\n")
        return FLUSHED

    def r_begin_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v < (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        obj = self._req(body, "/begin_weight_update")
        return self._answer(self.op_begin_weight_update(obj))

    def r_end_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v < (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        obj = self._req(body, "/end_weight_update")
        return self._answer(self.op_end_weight_update(obj))

    def r_update_weights_from_tensor(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/update_weights_from_tensor")
        entries = obj.serialized_named_tensors
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            raise self.invalid("serialized_named_tensors: Input should be a valid list of base64 strings")
        try:  # SGLang's Base64Bytes marker decodes them while validating (utils/msgspec_utils.py)
            obj.serialized_named_tensors = [base64.b64decode(e, validate=True) for e in entries]
        except ValueError:
            raise self.invalid("serialized_named_tensors: Value error, Expected base64-encoded bytes") from None
        return self._answer(self.op_update_weights_from_tensor(obj))

    def r_init_weights_update_group(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/init_weights_update_group")
        return self._answer(self.op_init_weights_update_group(obj))

    def r_destroy_weights_update_group(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/destroy_weights_update_group")
        return self._answer(self.op_destroy_weights_update_group(obj))

    def r_update_weights_from_distributed(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/update_weights_from_distributed")
        return self._answer(self.op_update_weights_from_distributed(obj))

    def r_update_weight_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/update_weight_version")
        if obj.abort_all_requests:  # SGLang's default: every request in flight is aborted
            self.op_abort_all()
        self.op_update_weight_version(obj)
        return {"success": True, "message": f"Weight version updated to {obj.new_version}",
                "new_version": obj.new_version}  # fmt: skip

    def r_release_memory_occupation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/release_memory_occupation")
        self.op_release_memory_occupation(obj)

    def r_resume_memory_occupation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/resume_memory_occupation")
        self.op_resume_memory_occupation(obj)

    def r_generate(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/generate")
        return self.op_generate(obj, lambda o: self.tm_acquire_lora(o.lora_path), self.tm_release_lora)

    def _lora_answer(self, result: dict[str, Any]) -> Any:
        """The LoRA routes: 200 on success, else 400, with the LoRAUpdateOutput either way."""
        if not result["success"]:
            raise _Reply(400, result)
        return result

    def r_load_lora_adapter_from_tensors(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._req(body, "/load_lora_adapter_from_tensors")
        for entry in obj.serialized_named_tensors if isinstance(obj.serialized_named_tensors, list) else [None]:
            try:  # msgspec_utils.py Base64Bytes: the request type's own validation (400)
                base64.b64decode(entry, validate=True)
            except (TypeError, ValueError):
                raise self.invalid("serialized_named_tensors: Only base64 data is allowed") from None
        return self._lora_answer(self.tm_load_lora(obj, from_tensors=True))

    def r_load_lora_adapter(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return self._lora_answer(self.tm_load_lora(self._req(body, "/load_lora_adapter"), from_tensors=False))

    def r_unload_lora_adapter(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return self._lora_answer(self.tm_unload_lora(self._req(body, "/unload_lora_adapter").lora_name))

    def r_v1__models(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """entrypoints/http_server.py `available_models`: the base model, then each registered adapter."""
        now = int(time.time())
        cards = [{"id": "refit-reference", "object": "model", "created": now, "owned_by": "sglang",
                  "root": "refit-reference", "parent": None, "max_model_len": 4096}]  # fmt: skip
        if self.lora:
            cards += [{"id": n, "object": "model", "created": now, "owned_by": "sglang", "root": r["path"],
                       "parent": "refit-reference", "max_model_len": None}
                      for n, r in list(self.lora_registry.items())]  # fmt: skip
        return {"object": "list", "data": cards}

    def r_weights_checker(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """entrypoints/http_server.py `check_weights` (GET or POST, the body optional): 200 with
        {"success", "message", "ranks", "per_engine_checksum"}, or 400 {"success": false, "message"}."""
        if method not in ("GET", "POST"):
            raise _Reply(405, {"detail": "Method Not Allowed"})
        obj = self._req({} if body is None else body, "/weights_checker")
        if obj.selector not in ("all", "target", "draft"):  # CheckWeightsReqInput's field types
            raise self.invalid("selector: Input should be 'target', 'draft' or 'all'")
        if not isinstance(obj.action, str):
            raise self.invalid("action: Input should be a valid string")
        if not isinstance(obj.allow_quant_error, bool):
            raise self.invalid("allow_quant_error: Input should be a valid boolean")
        skip = obj.skip_tensor_list
        if skip is not None and not (isinstance(skip, list) and all(isinstance(p, str) for p in skip)):
            raise self.invalid("skip_tensor_list: Input should be a valid list of strings")
        success, message, ranks = self.op_check_weights(obj)
        if not success:
            raise _Reply(400, {"success": False, "message": message})
        if not ranks:  # no runner answered (a draft selector without a draft model): no payload
            return {"success": True, "message": message}
        per_engine = hashlib.sha256()
        for info in ranks:
            per_engine.update(info["per_gpu_checksum"].encode())
        return {"success": True, "message": message, "ranks": ranks, "per_engine_checksum": per_engine.hexdigest()}

    def r__refit__info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {**super().r__refit__info(method, query, body, call), "session_open": self.session_open,
                "groups": list(self.groups), "offload_tags": sorted(self.offload_tags),
                "lora_loaded": sorted(ref["name"] for ref in self.lora_refs.values())}  # fmt: skip


def _targets(targets: Any) -> list[str]:
    """An adapter's target modules as the reference engine takes them ("all": every projection)."""
    from refit.reference.lora import LORA_TARGETS

    return list(LORA_TARGETS) if isinstance(targets, str) else list(targets)


class EmulatedSGLangEngine(EmulatorClient, SGLangEngine):
    """The production SGLang driver pointed at an `EmulatedSGLang`, plus what the conformance kit
    reads from the engine behind it (`EmulatorClient`)."""

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        """A LoRA refit's calls that send no request (stage, finalize, publish, continue; a drain
        with nothing to unload) cannot misbehave in the server: simulated at the boundary."""
        run = self._adapter_run
        quiet = call == "stage" or (run is not None and call in ("finalize", "publish", "continue_generation"))
        if quiet or (run is not None and call == "drain" and not self._lora.going(run["name"])):
            return False
        return super().arm_fault(kind, call, bucket=bucket, seconds=seconds, timeout=timeout)

    def __init__(self, name: str, server: EmulatedSGLang, **kwargs: Any) -> None:
        self.server = server
        self._bucket = threading.local()
        kwargs.setdefault("api_key", server.api_key)
        kwargs.setdefault("admin_api_key", server.admin_api_key)
        kwargs.setdefault("checksums", True)  # the emulator keeps the weights as it loaded them
        super().__init__(name, server.url, tp=server.tp, **kwargs)

    def info(self, *, timeout: float = 60.0) -> dict[str, Any]:
        """The emulator's account (`EmulatorClient.info`), with the versions of each refit adapter
        the server holds ("adapters": {name: {version: {"state"}}}, each loaded one counted as
        servable: SGLang serves any loaded name)."""
        from refit.drivers.sglang_lora import parse_version_name

        out = EmulatorClient.info(self, timeout=timeout)
        adapters: dict[str, dict[int, dict[str, str]]] = {}
        for name in out["engine"].get("lora_loaded", []):
            parsed = parse_version_name(name)
            if parsed is not None:
                adapters.setdefault(parsed[0], {})[parsed[1]] = {"state": "LIVE"}
        return {**out, "adapters": adapters}

    @classmethod
    def start(
        cls,
        name: str,
        *,
        version: str = "0.5.23",
        tp: int = 1,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        seed: int = 0,
        config: Any = None,
        in_thread: bool = False,
        decoder: str = "refit",
        validate: Callable[..., None] | None = None,
        server: Callable[..., EmulatedSGLang] | None = None,
        memory_saver: bool = True,
        weights_cpu_backup: bool = False,
        device: str = "cpu",
        server_args: dict[str, Any] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> EmulatedSGLangEngine:
        """A fresh reference engine (own processes, or a thread) behind a new emulated server.
        `server`: the server class (tests pass one that mounts SGLang's own FastAPI app);
        `memory_saver`, `weights_cpu_backup`: the server's --enable-memory-saver and
        --enable-weights-cpu-backup; `device`: the device it reports; `server_args`: more of its
        resolved args; `lora`: its --enable-lora settings (`EmulatedSGLang`)."""

        def new_engine() -> ReferenceEngine:
            if in_thread:
                return ReferenceEngine.in_thread(name, config, seed)
            return ReferenceEngine.spawn(name, config, seed, tp=tp)

        make = server or EmulatedSGLang
        emu = make(
            new_engine(), version=version, api_key=api_key, admin_api_key=admin_api_key, decoder=decoder,
            validate=validate, new_engine=new_engine, memory_saver=memory_saver, weights_cpu_backup=weights_cpu_backup,
            device=device, server_args=server_args, **({"lora": lora} if lora is not None else {}),
        )  # fmt: skip
        return cls(name, emu)
