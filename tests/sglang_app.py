"""SGLang 0.5.23's own HTTP server in front of the emulated scheduler (test support).

`SGLangAppServer` is an `EmulatedSGLang` whose HTTP front is SGLang's: the FastAPI `app` of
`sglang.srt.entrypoints.http_server`, with its routes, request types, pydantic validation, its
validation handler (400, not FastAPI's 422), its response shapes and status codes, served by
uvicorn. Only SGLang's tokenizer manager is replaced: `TokenizerShim` has the methods SGLang's
routes call, each running the emulator's `op_*` method of the same name (the scheduler over a
reference engine). API keys are decided by SGLang's own `decide_request_auth`. The emulator's
`/_refit/` inspection routes (not SGLang's API) are answered beside it.

A crash in the emulated scheduler (`_Drop`) kills this server as SGLang's SIGQUIT handler kills
its process tree: listening sockets closed, every open connection aborted, no answer sent.

One FastAPI `app` exists per process (a module global, as in SGLang); several servers share it,
each request finding its own server through a context variable set by the ASGI wrapper.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import hashlib
import json
import socket
import threading
import time
import types
from typing import Any

from refit.testing.emulated import REQUEST, _Drop, _Reply
from refit.testing.sglang_server import EmulatedSGLang

from .sglang_support import install_shim

_CURRENT: contextvars.ContextVar[TokenizerShim] = contextvars.ContextVar("sglang_app_server")
_LOADED: dict[str, types.SimpleNamespace] = {}


def sglang_http() -> types.SimpleNamespace:
    """SGLang's http_server module and the pieces the wrapper uses (imported once, ~10 s)."""
    if not _LOADED:
        install_shim()
        import importlib

        class _NoDriver:  # CPU: no triton driver (fla/utils.py asks at import)
            def get_current_target(self) -> Any:
                raise RuntimeError("no GPU driver (stand-in)")

        runtime = importlib.import_module("triton.runtime")
        if not hasattr(runtime.driver, "active") or isinstance(runtime.driver, type):
            runtime.driver = types.SimpleNamespace(active=_NoDriver())
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.entrypoints import http_server
            from sglang.srt.lora.lora_config import LoRAConfig
            from sglang.srt.lora.lora_registry import LoRARegistry
            from sglang.srt.managers import io_struct
            from sglang.srt.managers.io_struct import FlushCacheReqOutput
            from sglang.srt.managers.tokenizer_control_mixin import TokenizerControlMixin
            from sglang.srt.managers.tokenizer_manager import TokenizerManager
            from sglang.srt.utils import auth
            from sglang.srt.utils.common import normalize_serialized_named_tensor_payloads

        class _State:
            @property
            def tokenizer_manager(self) -> TokenizerShim:
                return _CURRENT.get()

            @property
            def scheduler_info(self) -> dict[str, Any]:
                return {}

            template_manager = None

        http_server.set_global_state(_State())  # type: ignore[arg-type]
        _LOADED["sglang"] = types.SimpleNamespace(
            module=http_server, app=http_server.app, auth=auth, FlushCacheReqOutput=FlushCacheReqOutput,
            normalize=normalize_serialized_named_tensor_payloads, server_args=_publish_server_args(),
            LoRARegistry=LoRARegistry, LoRAConfig=LoRAConfig, io=io_struct, TCM=TokenizerControlMixin,
            TM=TokenizerManager,
        )  # fmt: skip
    return _LOADED["sglang"]


def _publish_server_args() -> Any:
    """SGLang's own ServerArgs for a model directory holding only the reference model's HF config,
    published as SGLang's tokenizer process publishes it (its routes read the config bags)."""
    import tempfile

    from sglang.srt import runtime_context
    from sglang.srt.server_args import ServerArgs
    from transformers import LlamaConfig

    from refit.reference.model import ModelConfig

    c = ModelConfig()
    path = tempfile.mkdtemp(prefix="refit-sglang-model-")
    LlamaConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads, vocab_size=c.vocab_size,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)  # fmt: skip
    # LoRA on (the config bag is one per process: a server whose emulator has no LoRA answers as
    # SGLang without --enable-lora from the shim, `TokenizerShim._lora_off`)
    args = ServerArgs(
        model_path=path, device="cpu", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=64,
        lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )  # fmt: skip
    runtime_context.publish(args, role="tokenizer")
    return args


LORA_TCM = ("load_lora_adapter", "load_lora_adapter_from_tensors", "unload_lora_adapter", "_unload_lora_adapter_locked")
LORA_TM = ("_validate_and_resolve_lora", "_resolve_lora_path")


class TokenizerShim:
    """The TokenizerManager methods and attributes SGLang's weight-update, control, info and
    generate routes use, each onto the emulator's op of the same name (run on a thread, so the
    event loop keeps serving, as SGLang's awaits its scheduler). LoRA runs SGLang's own tokenizer
    side: `TokenizerControlMixin`'s load, load-from-tensors and unload (its lock, pending unloads,
    LRU eviction), `TokenizerManager`'s per-request resolution and its `LoRARegistry` (counters:
    an unload waits for the requests using the adapter), over the emulated scheduler's ops."""

    def __init__(self, emu: SGLangAppServer) -> None:
        self.emu = emu
        self.model_path = "refit-reference (emulated SGLang)"
        self.served_model_name = "refit-reference"
        self.is_generation = True
        self.model_config = types.SimpleNamespace(
            is_image_understandable_model=False, is_audio_understandable_model=False,
            hf_config=types.SimpleNamespace(model_type="llama", architectures=["LlamaForCausalLM"]),
        )  # fmt: skip
        # SGLang's /server_info reads the tokenizer manager's ServerArgs: this server's tp_size, as it was launched
        self.server_args = copy.copy(sglang_http().server_args)
        self.server_args.tp_size = emu.tp
        lora = emu.lora or {}
        self.enable_lora = emu.lora is not None
        self.server_args.enable_lora = True if emu.lora is not None else None
        for key in ("max_lora_rank", "lora_target_modules", "max_loaded_loras"):
            setattr(self.server_args, key, lora.get(key))
        self.model_config.context_len = 4096
        h = sglang_http()
        for owner, names in ((h.TCM, LORA_TCM), (h.TM, LORA_TM)):  # SGLang's own methods, on this shim
            for name in names:
                setattr(self, name, types.MethodType(getattr(owner, name), self))
        unload = self.unload_lora_adapter

        async def unload_unless_off(obj: Any, request: Any = None) -> Any:  # (its first check, per server)
            return self._lora_off(obj) or await unload(obj, request)

        self.unload_lora_adapter = unload_unless_off
        # TokenizerManager.__init__'s LoRA state
        self.lora_registry = sglang_http().LoRARegistry(None)
        self.lora_update_lock = asyncio.Lock()
        self.pending_lora_unloads: dict[str, str] = {}
        self.lora_ref_cache: dict[str, Any] = {}

    @property
    def startup_time(self) -> dict[str, Any]:
        return self.emu.startup_durations

    def is_ready(self) -> bool:
        return not self.emu.is_pause

    def config_value(self, name: str) -> Any:
        return {"weight_version": self.emu.label, "load_format": "auto"}.get(name)

    async def _op(self, name: str, *args: Any) -> Any:
        return await asyncio.to_thread(getattr(self.emu, name), *args)

    async def get_internal_state(self) -> list[dict[str, Any]]:
        return [{}]

    async def pause_generation(self, obj: Any) -> None:
        await self._op("op_pause_generation", obj)

    async def continue_generation(self, obj: Any) -> None:
        await self._op("op_continue_generation", obj)

    async def flush_cache(self, timeout_s: float | None = None) -> Any:
        success, message = await self._op("op_flush_cache", timeout_s)
        return sglang_http().FlushCacheReqOutput(success=success, message=message)

    async def begin_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._op("op_begin_weight_update", obj)

    async def end_weight_update(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._op("op_end_weight_update", obj)

    async def update_weights_from_tensor(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        obj.serialized_named_tensors = sglang_http().normalize(obj.serialized_named_tensors)  # SGLang's own step
        return await self._op("op_update_weights_from_tensor", obj)

    async def check_weights(self, obj: Any, request: Any = None) -> tuple[bool, str, Any, Any]:
        """tokenizer_control_mixin.py `check_weights`: the scheduler's per-rank payload, and the
        engine checksum SGLang's tokenizer manager makes of it (sha256 over each rank's)."""
        success, message, ranks = await self._op("op_check_weights", obj)
        if not ranks:
            return success, message, None, None
        overall = hashlib.sha256()
        for info in ranks:
            overall.update(info["per_gpu_checksum"].encode())
        return success, message, ranks, overall.hexdigest()

    async def update_weights_from_distributed(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._op("op_update_weights_from_distributed", obj)

    async def init_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._op("op_init_weights_update_group", obj)

    async def destroy_weights_update_group(self, obj: Any, request: Any = None) -> tuple[bool, str]:
        return await self._op("op_destroy_weights_update_group", obj)

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        if abort_all:
            self.emu.op_abort_all()

    async def update_weight_version(self, obj: Any) -> None:
        await self._op("op_update_weight_version", obj)

    async def release_memory_occupation(self, obj: Any, request: Any = None) -> None:
        await self._op("op_release_memory_occupation", obj)

    async def resume_memory_occupation(self, obj: Any, request: Any = None) -> None:
        await self._op("op_resume_memory_occupation", obj)

    async def generate_request(self, obj: Any, request: Any = None) -> Any:
        """SGLang's LoRA resolution (a ValueError: the route's 400), the emulated scheduler's
        generation, then the registry's release (`_release_lora_once`, at the request's end)."""
        loop = asyncio.get_running_loop()

        def resolve(o: Any) -> Any:  # inside the pause wait and the reader lock, as SGLang's order is
            asyncio.run_coroutine_threadsafe(self._validate_and_resolve_lora(o), loop).result()
            return getattr(o, "lora_id", None)

        def release(lora_id: Any) -> None:
            asyncio.run_coroutine_threadsafe(self.lora_registry.release(lora_id), loop).result()

        yield await asyncio.to_thread(self.emu.op_generate, obj, resolve, release)

    def auto_create_handle_loop(self) -> None:
        return None

    def _lora_off(self, obj: Any) -> Any:
        """The answer of SGLang without --enable-lora, for a server whose emulator has LoRA off
        (the process-wide config bag has it on: one per process)."""
        if self.emu.lora is None:
            return sglang_http().io.LoRAUpdateOutput(
                success=False, error_message="LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
            )
        return None

    async def update_lora_adapter_communicator(self, obj: Any) -> list[Any]:
        """The fan-out to the scheduler ranks (one here): the emulated scheduler's op for the
        request type; a load from a path runs SGLang's own `LoRAConfig` first (a path that is no
        directory goes to the Hugging Face Hub, unreachable here: its error is the answer)."""
        io = sglang_http().io
        off = self._lora_off(obj)
        if off is not None:
            return [off]
        if isinstance(obj, io.LoadLoRAAdapterFromTensorsReqInput):
            result = await self._op("op_lora_load_tensors", obj)
        elif isinstance(obj, io.UnloadLoRAAdapterReqInput):
            result = await self._op("op_lora_unload", obj)
        else:
            try:
                await asyncio.to_thread(sglang_http().LoRAConfig, obj.lora_path)
            except Exception as exc:  # LoRAManager.load_lora_adapter answers it
                result = self.emu._lora_result(False, str(exc))
            else:
                result = await self._op("op_lora_load_path", obj)
        fields = {k: result[k] for k in ("success", "error_message", "loaded_adapters")}
        return [io.LoRAUpdateOutput(**fields)]

    def create_abort_task(self, obj: Any) -> None:
        return None


class SGLangAppServer(EmulatedSGLang):
    """An `EmulatedSGLang` served by SGLang's own FastAPI app (see the module docstring)."""

    def _listen(self, host: str, port: int) -> None:
        import uvicorn

        loaded = sglang_http()
        self._shim = TokenizerShim(self)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        self._address = sock.getsockname()[:2]
        config = uvicorn.Config(self._asgi(loaded), lifespan="off", log_level="critical", loop="asyncio", http="h11")
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [sock]}, name="sglang-app", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("SGLang's app did not start under uvicorn")
            time.sleep(0.01)

    @property
    def address(self) -> tuple[str, int]:
        return self._address

    def _asgi(self, loaded: types.SimpleNamespace) -> Any:
        app, auth = loaded.app, loaded.auth

        async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http":
                return
            self._loop = asyncio.get_running_loop()
            if self.dead:
                self._drop_all()
                return
            _CURRENT.set(self._shim)
            headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
            bucket = headers.get("x-refit-bucket")
            REQUEST.set((headers.get("x-refit-call"), int(bucket) if bucket is not None else None))
            path = scope["path"]
            body = b""
            more = True
            while more:  # read the body once, to record it; SGLang's app reads it from the replay below
                message = await receive()
                body += message.get("body", b"")
                more = message.get("more_body", False)
            with contextlib.suppress(ValueError):
                if body:
                    self.received.append((path, json.loads(body)))
            if not path.startswith("/_refit/"):
                self.requests.append((scope["method"], path))
            if path.startswith("/_refit/"):
                await self._inspect(scope, path, body, send)
                return
            if path in ("/server_info", "/get_server_info", "/model_info", "/v1/models"):
                try:  # the probe's reads: SGLang's routes answer them without the scheduler, so a fault
                    await asyncio.to_thread(self._fault)  # armed for the probe is run here
                except _Drop:
                    self._drop_all()
                    return
            decision = auth.decide_request_auth(
                method=scope["method"], path=path, authorization_header=headers.get("authorization"),
                api_key=self.api_key, admin_api_key=self.admin_api_key,
                auth_level=auth._get_auth_level_from_app_and_scope(app, scope),
            )  # fmt: skip
            if not decision.allowed:  # the body SGLang's _ApiKeyASGIMiddleware sends
                text = "Unauthorized" if decision.error_status_code == 401 else "Forbidden"
                await _send_json(send, decision.error_status_code, {"error": text})
                return
            sent = False

            async def replay() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            try:
                await app(scope, replay, send)
            except _Drop:
                self._drop_all()

        return asgi

    async def _inspect(self, scope: dict[str, Any], path: str, body: bytes, send: Any) -> None:
        handler = getattr(self, "r_" + path.strip("/").replace("/", "__"), None)
        if handler is None:
            await _send_json(send, 404, {"detail": "Not Found"})
            return
        try:
            data = await asyncio.to_thread(handler, scope["method"], {}, json.loads(body) if body else None, None)
        except _Reply as reply:
            await _send_json(send, reply.status, reply.body)
            return
        await _send_json(send, 200, data)

    def _drop_all(self) -> None:
        """SIGQUIT: no more listening, every connection aborted, nothing answered."""
        server = self._uvicorn
        for s in getattr(server, "servers", []):
            s.close()
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        server.should_exit = True

    def die(self, *, wait: bool = False) -> None:
        self.dead = True
        loop = getattr(self, "_loop", None)
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._drop_all)
        else:
            self._uvicorn.should_exit = True
        if wait:
            self.close()
        else:
            threading.Thread(target=self.close, daemon=True).start()

    def close(self) -> None:
        self.dead = True
        self._uvicorn.should_exit = True
        self._thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.engine.close()


async def _send_json(send: Any, status: int, data: Any) -> None:
    raw = json.dumps(data).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": raw})
