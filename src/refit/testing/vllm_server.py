"""An emulated vLLM server: vLLM 0.33's weight-transfer HTTP API in front of a reference engine.

Not vLLM. It serves the reference engine (`refit.reference`) behind the routes vLLM registers with
VLLM_SERVER_DEV_MODE=1 (`vllm/entrypoints/rl/online/api_router.py`, the dev sleep and cache
routers, `/version`, `/v1/models`, `/v1/completions`), with their bodies, status codes, answers and
error envelopes, so the vLLM driver runs unchanged in CI where no vLLM GPU server can:

  * every worker-side failure is HTTP 500 {"error": {"message": "Call to collective_rpc method
    failed: <why>", ...}}, whatever the cause: update without start, start twice ("already active"),
    finish without start, unknown init/update keys ("Invalid init_info/update_info ..."), a packed
    tensor at an offset its dtype cannot view; a failed update clears the session; request
    validation errors are HTTP 400;
  * `/pause?mode=abort` rejects new requests with 503 until `/resume`; `keep` freezes them (with
    `clear_cache=true` their KV is dropped and recomputed after the resume; without, it is kept);
    `wait` is not emulated;
  * `/update_weight_version` and `finish_weight_update(weight_version)` label whatever the engine
    holds; the label starts at "default";
  * the weight routes are not guarded by the API key (only /v1 routes are), as in vLLM.

`backend`: what the server was started with (`--weight-transfer-config '{"backend": ...}'`):
``nccl`` (the group is formed over gloo here: vLLM's own receiver is NCCL-only) or ``ipc`` (packed;
CPU buffers travel by shared-memory name, which vLLM itself cannot open). The server machinery,
fault arming and `/_refit/` routes are `refit.testing.emulated`'s.
"""

from __future__ import annotations

import base64
import contextlib
import pickle
import threading
from collections.abc import Callable
from typing import Any

from refit.buckets import ITEMSIZE, BucketManifest, TensorEntry, TensorMeta
from refit.drivers.base import ConnectInfo, Payload
from refit.drivers.flattened import FLATTENED_BUCKET
from refit.drivers.reference import ReferenceEngine
from refit.drivers.vllm import VLLMEngine
from refit.errors import EngineError
from refit.testing.emulated import EmulatedServer, EmulatorClient, _Reply

GROUP_TIMEOUT_S = 60.0
NCCL_INIT_KEYS = frozenset(
    {"master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed",
     "packed_buffer_size_bytes", "packed_num_buffers"}
)  # fmt: skip
UPDATE_KEYS = {
    "nccl": frozenset({"names", "dtype_names", "shapes"}),
    "ipc": frozenset({"names", "dtype_names", "shapes", "ipc_handles", "ipc_handles_pickled", "tensor_sizes"}),
}
MODEL_ID = "refit-reference"
BOOL_ENVS = frozenset({"VLLM_SERVER_DEV_MODE", "VLLM_ALLOW_INSECURE_SERIALIZATION"})  # parsed as bool(int(...))
PUBLIC_ROUTES = frozenset({"/version", "/v1/models", "/v1/completions", "/health"})
# vllm/entrypoints/serve/lora/api_router.py attach_router: attached only when vllm/envs.py's
# VLLM_ALLOW_RUNTIME_LORA_UPDATING is "1" or "true" (case-insensitive); not a dev route
LORA_ROUTES = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
# A head tied to the embedding, inside a weight-update session (vLLM 0.33): start_weight_update
# (distributed/weight_transfer/nccl_engine.py, ipc_engine.py) calls `initialize_layerwise_reload`
# (model_executor/model_loader/reload/layerwise.py), which puts a meta Parameter of its own on each
# layer (recorded per module at model build, reload/meta.py): the head and the embedding are two
# Parameters while the session lasts, so `AutoWeightsLoader` finds no alias (`_get_tied_embedding_
# params` matches by identity) and loads both names. Each layer, once loaded, is copied into the
# tensor they share (`_copy_and_restore_kernel_tensors`): the later of the two in stream order is
# served under both names; one never sent leaves the other's. (Outside a session, at startup, the
# loader skips the head instead.)
TIED_HEAD = {"tied_head": "write"}


def _rpc_error(message: str, tp: int = 1) -> _Reply:
    """How vLLM answers a worker-side failure: HTTP 500, whatever the worker raised; with several
    workers their executor wraps the message (v1/executor/multiproc_executor.py)."""
    if tp > 1:
        message = f"Worker failed with error '{message}', please check the stack trace above for the root cause"
    return _Reply(
        500,
        {"error": {"message": f"Call to collective_rpc method failed: {message}", "type": "InternalServerError",
                   "param": None, "code": 500}},
    )  # fmt: skip


def _utility_error(method: str, message: str) -> _Reply:
    """An engine-core utility call that raised (v1/engine/core.py `_invoke_utility_method`), answered
    by vLLM's catch-all exception handler: HTTP 500."""
    return _Reply(
        500,
        {"error": {"message": f"Call to {method} method failed: {message}", "type": "InternalServerError",
                   "param": None, "code": 500}},
    )  # fmt: skip


def _bad_request(message: str, param: str | None = None) -> _Reply:
    return _Reply(400, {"error": {"message": message, "type": "Bad Request", "param": param, "code": 400}})


def _flag(query: dict[str, list[str]], key: str, default: bool) -> bool:
    values = query.get(key)
    if not values:
        return default
    value = values[-1].lower()
    if value not in ("true", "false", "1", "0"):
        raise _bad_request(f"{key} must be a boolean", f"query.{key}")
    return value in ("true", "1")


class EmulatedVLLM(EmulatedServer):
    """A loopback HTTP server emulating vLLM `version`'s weight-transfer API in front of `engine`."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        version: str = "0.33.0",
        backend: str = "nccl",
        api_key: str | None = None,
        validate: Callable[..., None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        env: dict[str, str] | None = None,
        sleep_mode: bool = True,
        new_engine: Callable[[], ReferenceEngine] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        """`env`: the server's VLLM_* environment (default: VLLM_SERVER_DEV_MODE=1 only, as vLLM's
        own defaults plus the flag its weight-transfer routes need). `sleep_mode`: started with
        --enable-sleep-mode. `lora`: --enable-lora with its settings ({"max_lora_rank"}; None:
        LoRA off); its runtime routes need VLLM_ALLOW_RUNTIME_LORA_UPDATING in `env` too."""
        self.lora = None if lora is None else {"max_lora_rank": 16, "max_loras": 1, **lora}
        if backend not in ("nccl", "ipc"):
            raise ValueError(f"backend {backend!r}: nccl or ipc")
        self.backend = backend
        self.env = dict(env if env is not None else {"VLLM_SERVER_DEV_MODE": "1"})
        self.sleep_mode = sleep_mode
        self.reset_state()
        super().__init__(
            engine, version=version, api_key=api_key, validate=validate, host=host, port=port, new_engine=new_engine
        )

    def reset_state(self) -> None:
        """A fresh vLLM process: label "default", no transfer engine, no session."""
        super().reset_state()
        self.initialized: dict[str, Any] | None = None  # the init_info the transfer engine was set up with
        self.session_open = False
        self.rejecting = False  # abort/wait pauses reject new requests (503) until /resume
        self.last_update: dict[str, Any] | None = None
        self.bucket_count = 0
        self.asleep: set[str] = set()  # executor memory asleep (sleep, release_kv_cache_memory)
        self.meta = False  # a weight update started and did not finish: no usable weights
        # OpenAIServingModels.lora_requests: the API server's adapters (name -> {"id", "path"})
        self.lora_requests: dict[str, dict[str, Any]] = {}
        self.lora_next_id = 1

    def flag(self, name: str) -> bool:
        """A VLLM_* switch as vllm/envs.py parses it: bool(int(value)), default 0."""
        try:
            return bool(int(self.env.get(name, "0")))
        except ValueError:
            return False

    def authorize(self, method: str, path: str, header: str | None) -> _Reply | None:
        """Only /v1 routes take --api-key; a refusal is 401 {"error": "Unauthorized"}."""
        if self.api_key and self.requires_key(path) and header != f"Bearer {self.api_key}":
            return _Reply(401, {"error": "Unauthorized"})
        return None

    def _rpc(self, message: str) -> _Reply:
        return _rpc_error(message, self.tp)

    def invalid(self, detail: Any) -> _Reply:
        """vLLM's validation handler (entrypoints/serve/exception_handling/handlers/validation.py): 400."""
        return _bad_request(str(detail))

    def requires_key(self, path: str) -> bool:
        return path.startswith("/v1")  # vLLM guards /v1 (and a few other prefixes), not the RL routes

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        """vLLM registers its dev and RL routers only with VLLM_SERVER_DEV_MODE=1
        (vllm/entrypoints/launchers/api_server/routers.py): without it they are 404. Its runtime
        LoRA routes exist only with VLLM_ALLOW_RUNTIME_LORA_UPDATING set."""
        if path in LORA_ROUTES:
            if str(self.env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "")).lower() not in ("1", "true"):
                raise _Reply(404, {"detail": "Not Found"})
            return super().handle(method, path, query, body, call)
        dev = self.flag("VLLM_SERVER_DEV_MODE")
        if not dev and path not in PUBLIC_ROUTES and not path.startswith("/_refit/"):
            raise _Reply(404, {"detail": "Not Found"})
        return super().handle(method, path, query, body, call)

    def r_server_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """vllm/entrypoints/serve/dev/server_info: the config and every VLLM_* variable (no keys)."""
        config = {
            "model_config": {"model": MODEL_ID, "enable_sleep_mode": self.sleep_mode},
            "parallel_config": {"tensor_parallel_size": self.tp, "data_parallel_size": 1},
            "weight_transfer_config": {"backend": self.backend},
            "lora_config": None
            if self.lora is None
            else {
                "max_lora_rank": self.lora["max_lora_rank"],
                "max_loras": self.lora["max_loras"],
                "max_cpu_loras": self.lora.get("max_cpu_loras") or self.lora["max_loras"],
            },
        }
        return {"vllm_config": config if (query or {}).get("config_format") == ["json"] else str(config),
                "vllm_env": {k: self._env_value(k, v) for k, v in self.env.items() if "KEY" not in k},
                "system_env": {}}  # fmt: skip

    # ---- generation control ------------------------------------------------------------------

    def r_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._fault(call)
        return {"version": self.version}

    def _env_value(self, key: str, value: str) -> Any:
        """vllm/envs.py's parsed value: bool(int(...)) switches, the runtime-LoRA one by its text."""
        if key == "VLLM_ALLOW_RUNTIME_LORA_UPDATING":
            return value.lower() in ("1", "true")
        return self.flag(key) if key in BOOL_ENVS else value

    def r_v1__models(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """OpenAIServingModels.show_available_models: the base model, then each adapter (its path
        as root, the base as parent)."""
        cards = [{"id": MODEL_ID, "object": "model", "owned_by": "refit", "root": MODEL_ID, "parent": None}]
        cards += [{"id": n, "object": "model", "owned_by": "vllm", "root": r["path"], "parent": MODEL_ID}
                  for n, r in list(self.lora_requests.items())]  # fmt: skip
        return {"object": "list", "data": cards}

    # ---- runtime LoRA (vllm/entrypoints/openai/models/serving.py, vllm/lora/peft_helper.py) -------

    def r_v1__load_lora_adapter(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """OpenAIServingModels.load_lora_adapter: names checked, then the engine's add_lora (the
        worker reads the directory: PEFTHelper's checks, then the tensors); the name is added only
        once that succeeded. 200 with a text answer."""
        obj = self._obj(body, "/v1/load_lora_adapter", ["lora_name", "lora_path"])
        name, path = obj.get("lora_name") or "", obj.get("lora_path") or ""
        if not name or not path:
            raise _Reply(400, {"error": {"message": "Both 'lora_name' and 'lora_path' must be provided.",
                                         "type": "InvalidUserInput", "param": None, "code": 400}})  # fmt: skip
        if name == MODEL_ID:
            raise _bad_request(f"The lora adapter '{name}' conflicts with a served base model.")
        if name in self.lora_requests:
            if not obj.get("load_inplace"):
                raise _bad_request(
                    f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                    "set 'load_inplace' to True."
                )
            raise NotImplementedError("load_inplace: this emulator does not reload adapters in place")
        self._fault(call)
        import json
        from pathlib import Path

        config_path = Path(path) / "adapter_config.json"
        if not config_path.is_file():  # LoRAAdapterNotFoundError -> 404 (relative paths: the Hub)
            raise _Reply(404, {"error": {"message": f"Loading lora {name} failed: No adapter found for <path>",
                                         "type": "NotFoundError", "param": None, "code": 404}})  # fmt: skip
        try:
            why = self._peft_problem(json.loads(config_path.read_text()))
            if why is None:
                self._engine("load_adapter_dir", name, path)
        except (ValueError, EngineError) as exc:
            why = getattr(exc, "message", str(exc))
        if why is not None:
            raise _utility_error("add_lora", why)
        self.lora_requests[name] = {"id": self.lora_next_id, "path": path}
        self.lora_next_id += 1
        return f"Success: LoRA adapter '{name}' added successfully."

    def _peft_problem(self, config: dict[str, Any]) -> str | None:
        """The worker's checks (lora_model_runner_mixin.py; peft_helper.py PEFTHelper)."""
        if self.lora is None:
            return "LoRA is not enabled. Use --enable-lora to enable LoRA."
        missing = {"r", "lora_alpha", "target_modules"} - set(config)
        if missing:
            return f"Missing required configuration fields: {missing}"
        errors = []
        if config.get("use_dora"):
            errors.append("vLLM does not yet support DoRA.")
        if config.get("bias", "none") != "none":
            errors.append("Adapter bias is not supported.")
        if errors:
            return " ".join(errors)
        if int(config["r"]) > int(self.lora["max_lora_rank"]):
            return f"LoRA rank {config['r']} is greater than max_lora_rank {self.lora['max_lora_rank']}."
        return None

    def r_v1__unload_lora_adapter(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """OpenAIServingModels.unload_lora_adapter: the name goes from the API server; the engine is
        not told (requests running on it go on). The emulator's engine frees the adapter when its
        last request ends (vLLM's evicts it from its LRU caches later)."""
        obj = self._obj(body, "/v1/unload_lora_adapter", ["lora_name"])
        name = obj.get("lora_name") or ""
        if not name:
            raise _Reply(400, {"error": {"message": "'lora_name' needs to be provided to unload a LoRA adapter.",
                                         "type": "InvalidUserInput", "param": None, "code": 400}})  # fmt: skip
        self._fault(call)
        if name not in self.lora_requests:
            raise _Reply(404, {"error": {"message": f"The lora adapter '{name}' cannot be found.",
                                         "type": "NotFoundError", "param": None, "code": 404}})  # fmt: skip
        del self.lora_requests[name]
        with contextlib.suppress(EngineError):
            self._engine("unload_adapter", name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def r_pause(self, method: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        mode = (query.get("mode") or ["abort"])[-1]
        if mode not in ("abort", "wait", "keep"):
            raise _bad_request(f"Input should be 'abort', 'wait' or 'keep' (got {mode!r})", "query.mode")
        clear = _flag(query, "clear_cache", True)
        self._check("/pause", None, query)
        self._fault(call)
        if mode == "wait":
            raise _Reply(501, {"error": {"message": "mode=wait is not emulated", "code": 501}})
        if mode == "abort":
            self._engine("pause", "abort")
            self.rejecting = True
        else:  # keep: frozen; clearing the cache drops their KV (recomputed after the resume)
            self._engine("pause", "retract" if clear else "in_place")
            self.rejecting = False  # v1/engine/core.py pause_generation: keep queues new requests
        if clear:
            self._reset_cache()
        return {"status": "paused"}

    def r_resume(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._check("/resume", body)
        self._fault(call)
        self._engine("continue_generation")
        self.rejecting = False
        return {"status": "resumed"}

    def r_is_paused(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {"is_paused": bool(self._engine("info")["paused"])}

    def _reset_cache(self) -> bool:
        try:
            self._engine("flush", False)  # refused while requests hold KV, held in place or not
        except EngineError:
            return False
        return True

    def r_reset_prefix_cache(self, method: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        running = _flag(query, "reset_running_requests", False)
        _flag(query, "reset_external", False)
        self._check("/reset_prefix_cache", None, query)
        self._fault(call)
        ok = self._reset_cache()
        if not ok and running:  # blocks held by running requests: preempt them (KV dropped), then reset
            self._engine("pause", "retract")
            ok = self._reset_cache()
            if not ok:  # v1/core/sched/scheduler.py reset_prefix_cache raises then
                raise _utility_error(
                    "reset_prefix_cache",
                    "Failed to reset KV cache even when all the running requests are preempted and moved to the "
                    "waiting queue. This is likely due to the presence of running requests waiting for remote KV "
                    "transfer, which is not supported yet.",
                )
        return {"success": ok}

    def r_reset_encoder_cache(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._check("/reset_encoder_cache", body)
        self._fault(call)  # the reference engine has no encoder: nothing to drop
        return None

    def r_get_world_size(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {"world_size": self.tp}

    # ---- memory --------------------------------------------------------------------------------

    def r_sleep(self, method: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        """v1/engine/core.py `sleep`: the scheduler paused in `mode`; level 1 offloads the weights (a
        CPU copy) and discards the KV cache, level 2 discards both; level 0 only pauses."""
        level = int((query.get("level") or ["1"])[-1])
        mode = (query.get("mode") or ["abort"])[-1]
        if level not in (0, 1, 2):
            raise _bad_request("level must be 0, 1 or 2", "query.level")
        self._check("/sleep", None, query)
        self._fault(call)
        self._engine("pause", "abort" if mode == "abort" else "retract")
        if level:
            try:
                self._engine("release_memory", ["kv_cache", "weights"], cpu_backup=level == 1)
            except EngineError as exc:
                raise _utility_error("sleep", exc.message) from None
            self.asleep |= {"weights", "kv_cache"}
        return {"status": "sleeping", "level": level}

    def r_release_kv_cache_memory(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """`release_kv_cache_memory`: only after a completed pause with no request left, and with
        every allocation resident."""
        self._check("/release_kv_cache_memory", body)
        self._fault(call)
        info = self._engine("info")
        if not info["paused"] or info["running"] or info["waiting"]:
            raise _utility_error(
                "release_kv_cache_memory", "release_kv_cache_memory() requires a completed pause first"
            )
        if self.asleep:
            raise _utility_error(
                "release_kv_cache_memory", "release_kv_cache_memory() requires all executor memory to be resident"
            )
        try:
            self._engine("release_memory", ["kv_cache"])
        except EngineError as exc:
            raise _utility_error("release_kv_cache_memory", exc.message) from None
        self.asleep.add("kv_cache")
        return {"status": "kv_cache_released"}

    def r_wake_up(self, method: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        """`wake_up`: what it names comes back ("scheduling" is no allocation); once nothing sleeps,
        the scheduler resumes. Answers "awake" only then (entrypoints/serve/dev/sleep/api_router.py)."""
        tags = query.get("tags") or None
        self._check("/wake_up", None, query)
        self._fault(call)
        memory = [t for t in (tags or ["weights", "kv_cache"]) if t in ("weights", "kv_cache")]
        self._engine("resume_memory", memory)
        self.asleep -= set(memory)
        awake = not self.asleep
        if awake:  # resume_scheduler
            self._engine("continue_generation")
            self.rejecting = False
        return {"status": "awake" if awake else "sleeping", "tags": tags}

    # ---- weight transfer -----------------------------------------------------------------------

    def r_init_weight_transfer_engine(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/init_weight_transfer_engine", ["init_info"])
        init = obj["init_info"]
        if not isinstance(init, dict):
            raise _bad_request("init_info: Input should be a valid dictionary", "body.init_info")
        self._fault(call)
        with self._lock:
            engine = "NCCLWeightTransferEngine" if self.backend == "nccl" else "IPCWeightTransferEngine"
            allowed = NCCL_INIT_KEYS if self.backend == "nccl" else frozenset({"packed"})
            unknown = sorted(set(init) - allowed)
            if unknown:
                raise self._rpc(f"Invalid init_info for {engine}: __init__() got an unexpected keyword argument "
                                 f"{unknown[0]!r}")  # fmt: skip
            if self.initialized is not None:
                self._engine("detach", f"vllm_{self.backend}")
                self.initialized = None
            if self.backend == "ipc":
                if not init.get("packed"):
                    raise self._rpc("unpacked IPC transfers are not emulated (send packed buckets)")
                info = ConnectInfo(
                    "vllm_ipc", "refit.drivers.vllm_transport:VLLMIPCReceiver", {"packed": True}, ({},) * self.tp
                )
            else:
                missing = [k for k in ("rank_offset", "world_size") if k not in init]
                if missing:
                    raise self._rpc(f"Invalid init_info for {engine}: __init__() missing required keyword argument "
                                     f"{missing[0]!r}")  # fmt: skip
                if init.get("master_address") is None or init.get("master_port") is None:
                    raise self._rpc(
                        "NCCLWeightTransferInitInfo: need nccl_unique_id_b64, or both master_address and master_port "
                        f"(got master_address={init.get('master_address')!r}, master_port={init.get('master_port')!r})"
                    )
                info = ConnectInfo(
                    "vllm_nccl",
                    "refit.drivers.sglang_transport:SGLangBroadcastReceiver",
                    {"addr": init["master_address"], "port": int(init["master_port"]), "world": int(init["world_size"]),
                     "group": "vllm_weight_transfer", "backend": "gloo", "timeout_s": GROUP_TIMEOUT_S},
                    tuple({"rank": int(init["rank_offset"]) + j} for j in range(self.tp)),
                )  # fmt: skip
            try:
                self._engine("attach", info)
            except EngineError as exc:
                raise self._rpc(f"weight transfer group did not form: {exc.message}") from None
            self.initialized = dict(init)
            self.last_update = None
        return {"message": "Weight transfer initialized"}

    def r_shutdown_weight_transfer_engine(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._check("/shutdown_weight_transfer_engine", body)
        self._fault(call)
        with self._lock:
            if self.session_open:
                raise self._rpc("Cannot release a trainer connection during a weight update")
            if self.initialized is not None:
                self._engine("detach", f"vllm_{self.backend}")
                self.initialized = None
        return {"message": "Weight transfer shut down"}

    def r_start_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._check("/start_weight_update", body)
        with self._lock:
            self._fault(call)
            if self.session_open:
                raise self._rpc(
                    "start_weight_update called while a weight update is already active. "
                    "Call finish_weight_update first."
                )
            if self._engine("info")["weights_released"]:  # on "meta" since a failed update: start loads anew
                self._engine("resume_memory", ["weights"])
            self._engine("begin", None)
            self.session_open, self.bucket_count = True, 0
            self.meta = True  # initialize_layerwise_reload: every layer's weights on the meta device
        return {"message": "Weight update started"}

    def r_update_weights(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/update_weights", ["update_info"])
        info = obj["update_info"]
        if not isinstance(info, dict):
            raise _bad_request("update_info: Input should be a valid dictionary", "body.update_info")
        with self._lock:
            if not self.session_open:
                raise self._rpc("start_weight_update must be called before update_weights.")
            hint = self.bucket_hint()
            index = self.bucket_count if hint is None else hint
            self._fault(call, index)
            try:
                payload = self._payload(index, info)
                self._engine("load", payload)
            except (ValueError, EngineError) as exc:
                # vLLM clears the session when update_weights raises (v1/worker/gpu_worker.py
                # update_weights), and nothing finalizes the layerwise reload its start began: every
                # layer stays on the meta device (model_loader/reload/layerwise.py): no usable weights
                self.session_open = False
                self._close_engine_session()
                self._engine("release_memory", ["weights"])
                raise self._rpc(str(exc.message if isinstance(exc, EngineError) else exc)) from None
            self.bucket_count += 1
        return {"message": "Weights updated"}

    def _close_engine_session(self) -> None:
        with contextlib.suppress(EngineError):
            self._engine("finalize")

    def _payload(self, index: int, info: dict[str, Any]) -> Payload:
        """The engine-side bucket for one update_info, as vLLM's worker parses it."""
        engine = "NCCLWeightTransferEngine" if self.backend == "nccl" else "IPCWeightTransferEngine"
        unknown = sorted(set(info) - UPDATE_KEYS[self.backend])
        if unknown:
            raise ValueError(
                f"Invalid update_info for {engine}: __init__() got an unexpected keyword argument {unknown[0]!r}"
            )
        if self.initialized is None:
            raise ValueError("NCCL weight transfer not initialized. Call init_transfer_engine() first.")
        pickled = self.backend == "ipc" and info.get("ipc_handles_pickled") is not None
        if pickled and not self.flag("VLLM_ALLOW_INSECURE_SERIALIZATION"):  # IPCWeightTransferUpdateInfo.__post_init__
            raise ValueError(
                "Refusing to deserialize `ipc_handles_pickled` without VLLM_ALLOW_INSECURE_SERIALIZATION=1"
            )
        names, dtypes, shapes = info.get("names", []), info.get("dtype_names", []), info.get("shapes", [])
        if not names and not dtypes and not shapes and self.backend == "nccl":
            if self.last_update is None:
                return Payload("vllm_nccl", BucketManifest(index, (), 0), dict(TIED_HEAD), ({},) * self.tp)
            names, dtypes, shapes = (
                self.last_update["names"],
                self.last_update["dtype_names"],
                self.last_update["shapes"],
            )
        if len(dtypes) != len(names):
            raise ValueError(f"`dtype_names` should be of the same size as `names`: got {len(dtypes)} and {len(names)}")
        if len(shapes) != len(names):
            raise ValueError(f"`shapes` should be of the same size as `names`: got {len(shapes)} and {len(names)}")
        entries, offset = [], 0
        packed = bool(self.initialized.get("packed"))
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if dtype not in ITEMSIZE:
                raise ValueError(f"module 'torch' has no attribute '{dtype}'")
            meta = TensorMeta(str(name), dtype, tuple(int(d) for d in shape))
            if packed and offset % ITEMSIZE[dtype]:
                raise ValueError(
                    f"self.storage_offset() must be divisible by {ITEMSIZE[dtype]} to view Byte as {dtype} "
                    f"(different element sizes), but got {offset}"
                )
            entries.append(TensorEntry(meta, offset))
            offset += meta.nbytes
        manifest = BucketManifest(index, tuple(entries), offset)
        if self.backend == "nccl":
            self.last_update = {"names": names, "dtype_names": dtypes, "shapes": shapes}
            fields = {"load_format": FLATTENED_BUCKET if packed else None, **TIED_HEAD}
            return Payload("vllm_nccl", manifest, fields, ({},) * self.tp)
        if info.get("ipc_handles_pickled") is None:
            raise ValueError("Either `ipc_handles` or `ipc_handles_pickled` must be provided")
        sizes = info.get("tensor_sizes")
        if sizes is None:
            raise ValueError("`tensor_sizes` is required when packed=True")
        if [int(x) for x in sizes] != [e.meta.nbytes for e in entries]:
            raise ValueError(f"tensor_sizes {sizes} do not match names/dtype_names/shapes")
        handles = _SafeHandles.loads(base64.b64decode(info["ipc_handles_pickled"]))
        return Payload("vllm_ipc", manifest, {"handles": handles, **TIED_HEAD}, ({},) * self.tp)

    def r_finish_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._check("/finish_weight_update", body)
        label = (body or {}).get("weight_version") if isinstance(body, dict) else None
        if label is not None and not isinstance(label, str):
            raise _bad_request("weight_version: Input should be a valid string", "body.weight_version")
        with self._lock:
            self._fault(call)
            if not self.session_open:
                raise self._rpc("finish_weight_update called without a matching start_weight_update.")
            try:
                self._engine("finalize")
            except EngineError as exc:
                raise self._rpc(exc.message) from None  # a failed finish leaves the session active
            self.session_open = False
            self.meta = False  # finalize_layerwise_reload: the loaded weights are the model's again
            if label is not None:
                self._label(label)
        return {"message": "Weight update finished"}

    def r_update_weight_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/update_weight_version", ["new_version"])
        self._fault(call)
        self._label(str(obj["new_version"]))
        return {"success": True, "new_version": self.label}

    def r_weight_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._fault(call)
        return {"weight_version": self.label}

    def r_weight_checker(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """entrypoints/rl/online/api_router.py `weight_checker` (POST): "checksum" answers
        {"checksums"} merged over the workers (v1/worker/gpu_worker.py `compute_weight_checksums`:
        "dp0:pp0:pcp0:tp<r>:<param>" -> sha256 hex of each parameter as laid out on worker r,
        `refit.drivers.vllm_checksums.answer`); "compare" with a `baseline` answers {"match",
        "mismatches"} (400 without one); "reset" (vLLM zeroes every parameter) is not emulated: 501.
        Body validation errors are 400 (vLLM's validation handler). Nothing checks the pause: it
        answers while paused."""
        from refit.drivers import vllm_checksums

        if method != "POST":  # only POST is registered; vLLM's HTTPException handler wraps the router's 405
            raise _Reply(405, {"error": {"message": "Method Not Allowed", "type": "Method Not Allowed",
                                         "param": None, "code": 405}})  # fmt: skip
        obj = self._obj(body, "/weight_checker", ["action"])
        action, baseline = obj["action"], obj.get("baseline")
        if action not in ("checksum", "reset", "compare"):
            raise _bad_request("Input should be 'checksum', 'reset' or 'compare'", "body.action")
        if baseline is not None and not (
            isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
        ):
            raise _bad_request("Input should be a valid dictionary of strings", "body.baseline")
        self._fault(call)  # a hang or kill armed for the driver's verify call
        if action == "reset":  # vLLM zeroes every parameter and answers {"status": "reset"}; refit never asks
            raise _Reply(501, {"error": {"message": "action=reset is not emulated", "code": 501}})
        if action == "compare" and baseline is None:
            raise _bad_request("action='compare' requires a 'baseline' object")
        with self._lock:  # between engine steps, never inside a load
            if self.meta:  # start_weight_update moved the layers to the meta device: .cpu() raises
                raise _utility_error("compute_weight_checksums", "Cannot copy out of meta tensor; no data!")
            state = self._engine("served_state_dict")
            shards = self._engine("rank_shards")  # each worker's own q/k/v, gate/up, o/down
        checksums = vllm_checksums.answer(state, self.tp, self.heads(state), shards)
        if action == "checksum":
            return {"checksums": checksums}
        assert baseline is not None
        mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
        return {"match": not mismatches, "mismatches": mismatches}

    # ---- serving -------------------------------------------------------------------------------

    def r_v1__completions(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/v1/completions", ["model", "prompt"])
        if self.meta:  # what vLLM does with layers on the meta device is not determinable from its source
            raise _Reply(500, {"error": {"message": "emulated: the model's layers are on the meta device (a weight "
                                         "update started and did not finish)", "type": "InternalServerError",
                                         "code": 500}})  # fmt: skip
        if self.rejecting:
            raise _Reply(503, {"error": {"message": "Generation is paused. Please retry after it resumes.",
                                         "type": "ServiceUnavailableError", "code": 503}})  # fmt: skip
        model = obj.get("model")
        adapter = model if model in self.lora_requests else None
        if model != MODEL_ID and adapter is None:  # serving.py _check_model
            raise _Reply(404, {"error": {"message": f"The model `{model}` does not exist. Valid aliases: {MODEL_ID}.",
                                         "type": "NotFoundError", "param": "model", "code": 404}})  # fmt: skip
        out = self._generate(obj["prompt"], int(obj.get("max_tokens") or 16), adapter)
        tokens, versions = out.get("output") or [], out.get("weight_versions") or []
        choice: dict[str, Any] = {
            "index": 0, "text": "", "finish_reason": out.get("finish_reason"),
            "token_ids": tokens if obj.get("return_token_ids") else None,
        }  # fmt: skip
        if obj.get("return_weight_versions"):
            choice["weight_versions"] = self.spans(versions)
        return {"id": "cmpl-refit", "object": "text_completion", "model": obj["model"], "choices": [choice]}

    def r__refit__info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {**super().r__refit__info(method, query, body, call), "session_open": self.session_open,
                "initialized": self.initialized is not None, "lora_names": sorted(self.lora_requests)}  # fmt: skip


class _SafeHandles(pickle.Unpickler):
    """The pickled handle dict of a CPU IPC update: a dict of str -> bytes, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"ipc_handles_pickled names {module}.{name}: not a CPU handle dict")

    @classmethod
    def loads(cls, data: bytes) -> dict[str, Any]:
        import io

        obj = cls(io.BytesIO(data)).load()
        if not isinstance(obj, dict):
            raise ValueError("ipc_handles must be a dict of device key -> handle")
        return obj


class EmulatedVLLMEngine(EmulatorClient, VLLMEngine):
    """The production vLLM driver pointed at an `EmulatedVLLM`, plus what the conformance kit reads
    from the engine behind it (`EmulatorClient`)."""

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        """A LoRA refit's calls that send no request (stage, load: the driver reads shared memory
        itself, publish, continue; a drain with nothing to unload) cannot misbehave in the server:
        simulated at the boundary."""
        run = self._adapter_run
        quiet = call == "stage" or (run is not None and call in ("load", "publish", "continue_generation"))
        if quiet or (run is not None and call == "drain" and not self._lora.going(run["name"])):
            return False
        return super().arm_fault(kind, call, bucket=bucket, seconds=seconds, timeout=timeout)

    def info(self, *, timeout: float = 60.0) -> dict[str, Any]:
        """The emulator's account (`EmulatorClient.info`), with the versions of each refit adapter
        the server lists ("adapters": {name: {version: {"state"}}}, each counted as servable)."""
        from refit.drivers.adapter_names import parse_version_name

        out = EmulatorClient.info(self, timeout=timeout)
        adapters: dict[str, dict[int, dict[str, str]]] = {}
        for name in out["engine"].get("lora_names", []):
            parsed = parse_version_name(name)
            if parsed is not None:
                adapters.setdefault(parsed[0], {})[parsed[1]] = {"state": "LIVE"}
        return {**out, "adapters": adapters}

    def __init__(self, name: str, server: EmulatedVLLM, **kwargs: Any) -> None:
        self.server = server
        self._bucket = threading.local()
        kwargs.setdefault("checksums", True)  # the emulator keeps the weights as it loaded them
        super().__init__(name, server.url, api_key=server.api_key, tp=server.tp, **kwargs)

    @classmethod
    def start(
        cls,
        name: str,
        *,
        version: str = "0.33.0",
        backend: str = "nccl",
        tp: int = 1,
        api_key: str | None = None,
        seed: int = 0,
        config: Any = None,
        in_thread: bool = False,
        validate: Callable[..., None] | None = None,
        env: dict[str, str] | None = None,
        lora: dict[str, Any] | None = None,
    ) -> EmulatedVLLMEngine:
        """A fresh reference engine (own processes, or a thread) behind a new emulated server.
        `env`: the server's VLLM_* environment; default: as docs/engines.md launches it
        (VLLM_SERVER_DEV_MODE=1, and VLLM_ALLOW_INSECURE_SERIALIZATION=1 for the IPC backend)."""
        if env is None:
            env = {"VLLM_SERVER_DEV_MODE": "1"}
            if backend == "ipc":
                env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

        def new_engine() -> ReferenceEngine:
            if in_thread:
                return ReferenceEngine.in_thread(name, config, seed)
            return ReferenceEngine.spawn(name, config, seed, tp=tp)

        server = EmulatedVLLM(
            new_engine(), version=version, backend=backend, api_key=api_key, validate=validate, env=env,
            new_engine=new_engine, lora=lora,
        )  # fmt: skip
        return cls(name, server)
