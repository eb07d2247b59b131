"""An emulated SGLang server: SGLang's weight-update HTTP API in front of a reference engine.

Not SGLang. It serves the reference engine (`refit.reference`) behind SGLang 0.5.x's route names,
request bodies, status codes and answers, including the version traps the SGLang driver must
handle (anchor-engine-apis.md, section 1), so the driver runs unchanged in CI where no SGLang GPU
server can:

  * `version`: the server version it reports (`/server_info`) and behaves as: before 0.5.21 no
    begin/end session (each update applies and post-processes alone), a flush refused while a
    paused engine still has retracted requests waiting, and a refused flush inside an update
    kills the scheduler; 0.5.22+ answers that flush with HTTP 400 "Weights were updated, but the
    cache was not flushed" (the weights did change); 0.5.21+ refuses tensor/distributed updates
    outside a session; `/get_weight_version` answers 404 from 0.5.12 (read `/model_info`).
  * `/update_weight_version` aborts every request in flight unless `abort_all_requests` is false
    (its default is true), and labels whatever weights the engine holds.
  * control routes take a JSON object (a POST with no body is HTTP 422); unknown fields are
    ignored, as SGLang's schema does.
  * `api_key`: the admin API key every weight route then requires (401 otherwise).
  * `/generate` with `input_ids` answers `output_ids` and `meta_info.weight_version` (plus
    `weight_versions` spans when a request straddled an update); it waits while paused.
  * a dead engine takes the server down: the request in flight loses its connection and later
    ones are refused.

`validate(route, body)` is called on every JSON body received (tests pass SGLang's own request
types there). The server machinery, fault arming and the emulator's own `/_refit/` routes are
`refit.testing.emulated`'s; the conformance kit reads them through `EmulatedSGLangEngine`.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from collections.abc import Callable
from typing import Any

from refit.drivers.base import ConnectInfo, Payload
from refit.drivers.buckets import BucketManifest, TensorEntry, TensorMeta, itemsize
from refit.drivers.flattened import FLATTENED_BUCKET, manifest_from_metadata, peek_metadata
from refit.drivers.http import version_tuple
from refit.drivers.reference import ReferenceEngine
from refit.drivers.sglang import SGLangEngine
from refit.errors import EngineError
from refit.testing.emulated import EmulatedServer, EmulatorClient, _Drop, _Reply

GROUP_TIMEOUT_S = 60.0
MEMORY_TAGS = ("kv_cache", "weights")  # what the reference engine keeps; cuda_graph is accepted and ignored
ADMIN_FREE = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/health"})


class EmulatedSGLang(EmulatedServer):
    """A loopback HTTP server emulating SGLang `version` in front of `engine` (a reference engine
    driver; the emulator owns it from here on). `url` once started. `decoder`: how the engine reads
    tensor payloads (``refit``, or ``sglang``: SGLang's own code, which must be importable)."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        version: str = "0.5.23",
        api_key: str | None = None,
        decoder: str = "refit",
        validate: Callable[..., None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.v = version_tuple(version) or (0, 5, 23)
        self.decoder = decoder
        self.session_open = False
        self.groups: dict[str, dict[str, Any]] = {}
        self.bucket_count = 0  # buckets of the open session (the index a fault is armed at)
        super().__init__(engine, version=version, api_key=api_key, validate=validate, host=host, port=port)

    def setup_engine(self) -> None:
        """Tensor payloads carry their own handles: the engine's receiver for them is always open."""
        self._engine(
            "attach",
            ConnectInfo(
                "sglang_tensor",
                "refit.drivers.flattened:FlattenedTensorReceiver",
                fields={"decoder": self.decoder},
                parts=({},) * self.tp,
            ),
        )

    def requires_key(self, path: str) -> bool:
        return path not in ADMIN_FREE and super().requires_key(path)

    def r_server_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._fault(call)
        return {"version": self.version, "startup_time": self.startup_time, "internal_states": [{}], "tp_size": self.tp}

    r_get_server_info = r_server_info

    def r_model_info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {"model_path": "refit-reference (emulated SGLang)", "weight_version": self.label, "is_generation": True}

    r_get_model_info = r_model_info

    def r_get_weight_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v >= (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        if self.v >= (0, 5, 12):
            raise _Reply(404, {"detail": "deprecated, use /model_info"})
        return {"weight_version": self.label}

    def r_health(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return None

    def r_pause_generation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/pause_generation")
        mode = obj.get("mode", "abort")
        if mode not in (("abort", "retract", "in_place") if self.v >= (0, 5, 6) else ("abort",)):
            raise _Reply(422, {"detail": f"mode {mode!r} is not one of abort, retract, in_place"})
        self._fault(call)
        self._engine("pause", mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    def r_continue_generation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._obj(body, "/continue_generation")
        self._fault(call)
        self._engine("continue_generation")
        return {"message": "Generation continued successfully.", "status": "ok"}

    def r_flush_cache(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self._fault(call)
        if not self._flush():
            raise _Reply(400, "Cache not flushed because there are pending requests.")
        return "Cache flushed.\nPlease check backend logs for more details."

    def _flush(self) -> bool:
        info = self._engine("info")
        if self.v < (0, 5, 21) and info["paused"] and info["waiting"]:
            return False  # the waiting queue counts before 0.5.21 (sglang#33783)
        try:
            self._engine("flush")
        except EngineError:
            return False
        return True

    def r_begin_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v < (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        self._obj(body, "/begin_weight_update")
        with self._lock:
            self._fault(call)
            if self.session_open:
                raise _Reply(400, {"success": False, "message": "A weight update session is already open."})
            self._engine("begin", None)
            self.session_open, self.bucket_count = True, 0
        return {"success": True, "message": "Weight update session started."}

    def r_end_weight_update(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        if self.v < (0, 5, 21):
            raise _Reply(404, {"detail": "Not Found"})
        self._obj(body, "/end_weight_update")
        with self._lock:
            self._fault(call)
            if not self.session_open:
                raise _Reply(400, {"success": False, "message": "No active weight update session."})
            self.session_open = False
            try:
                self._engine("finalize")
            except EngineError as exc:
                raise _Reply(400, {"success": False, "message": exc.message}) from None
        return {"success": True, "message": "Weight update session ended."}

    def _update(self, route: str, obj: dict[str, Any], payload_of: Callable[[int], Payload], call: str | None) -> Any:
        """One tensor/distributed update: session rules, the load, the flush inside it, the label."""
        with self._lock:
            implicit = self.v < (0, 5, 21)
            if not implicit and not self.session_open:
                name = route.strip("/")
                raise _Reply(
                    400,
                    {
                        "success": False,
                        "message": f"{name} must run between begin_weight_update() and end_weight_update().",
                    },
                )
            hint = getattr(self._request_local, "bucket", None)
            index = self.bucket_count if hint is None else hint
            try:
                payload = payload_of(index)
            except ValueError as exc:
                raise _Reply(400, {"success": False, "message": str(exc)}) from None
            self._fault(call, index)
            if obj.get("abort_all_requests"):
                self._engine("abort_requests")
            try:
                if implicit:
                    self._engine("begin", None)
                self._engine("load", payload)
                if implicit:
                    self._engine("finalize")
            except EngineError as exc:
                raise _Reply(400, {"success": False, "message": f"{exc.kind}: {exc.message}"}) from None
            self.bucket_count += 1
            if obj.get("flush_cache", True) and not self._flush():
                if self.v <= (0, 5, 21):  # an assert in the scheduler: the server dies
                    self._engine("arm_fault", "kill", "ping", None, 0.0)
                    with contextlib.suppress(_Drop):
                        self._engine("ping")
                    self.die()
                    raise _Drop()
                raise _Reply(
                    400,
                    {
                        "success": False,
                        "message": "Weights were updated, but the cache was not flushed because requests are still "
                        "running or queued. Retry /flush_cache after they finish.",
                    },
                )
            message = "Succeeded to update model weights."
            if obj.get("weight_version") is not None:
                self._label(str(obj["weight_version"]))
                message += f" Weight version updated to {obj['weight_version']}."
        return {"success": True, "message": message}

    def r_update_weights_from_tensor(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/update_weights_from_tensor", ["serialized_named_tensors"])
        entries = obj["serialized_named_tensors"]

        def payload_of(index: int) -> Payload:
            if obj.get("load_format") != FLATTENED_BUCKET:
                raise ValueError(f"load_format {obj.get('load_format')!r}: this emulator serves flattened_bucket only")
            if not isinstance(entries, list) or len(entries) < self.tp:
                raise ValueError(f"serialized_named_tensors has {len(entries)} entries for TP size {self.tp}")
            try:
                raw = [base64.b64decode(e, validate=True) for e in entries[: self.tp]]
            except Exception as exc:
                raise ValueError(f"serialized_named_tensors: not base64 ({exc})") from None
            try:
                manifest = manifest_from_metadata(index, peek_metadata(raw[0]))
            except Exception as exc:
                raise ValueError(f"cannot read the flattened bucket: {type(exc).__name__}: {exc}") from None
            return Payload("sglang_tensor", manifest, {}, tuple({"serialized": r} for r in raw))

        return self._update("/update_weights_from_tensor", obj, payload_of, call)

    def r_init_weights_update_group(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(
            body, "/init_weights_update_group", ["master_address", "master_port", "rank_offset", "world_size"]
        )
        name = obj.get("group_name", "weight_update_group")
        self._fault(call)
        if name in self.groups:
            raise _Reply(
                400,
                {
                    "success": False,
                    "message": f"Failed to initialize custom process group: group {name!r} already exists.",
                },
            )
        info = ConnectInfo(
            "sglang_broadcast",
            "refit.drivers.flattened:SGLangBroadcastReceiver",
            fields={
                "addr": obj["master_address"], "port": int(obj["master_port"]), "world": int(obj["world_size"]),
                "group": name, "backend": obj.get("backend", "nccl"), "timeout_s": GROUP_TIMEOUT_S,
            },
            parts=tuple({"rank": int(obj["rank_offset"]) + j} for j in range(self.tp)),
        )  # fmt: skip
        try:
            self._engine("attach", info)
        except EngineError as exc:
            raise _Reply(
                400, {"success": False, "message": f"Failed to initialize custom process group: {exc.message}"}
            ) from None
        self.groups[name] = obj
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def r_destroy_weights_update_group(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/destroy_weights_update_group")
        name = obj.get("group_name", "weight_update_group")
        self._fault(call)
        if self.groups.pop(name, None) is None:
            raise _Reply(400, {"success": False, "message": f"The group {name!r} does not exist."})
        self._engine("detach", "sglang_broadcast")
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def r_update_weights_from_distributed(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/update_weights_from_distributed", ["names", "dtypes", "shapes"])

        def payload_of(index: int) -> Payload:
            if obj.get("group_name", "weight_update_group") not in self.groups:
                raise ValueError(f"group {obj.get('group_name')!r} is not initialized")
            entries, offset = [], 0
            for name, dtype, shape in zip(obj["names"], obj["dtypes"], obj["shapes"], strict=True):
                meta = TensorMeta(name, dtype, tuple(int(d) for d in shape))
                if obj.get("load_format") == FLATTENED_BUCKET and offset % itemsize(dtype):
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype torch.{dtype}")
                entries.append(TensorEntry(meta, offset))
                offset += meta.nbytes
            manifest = BucketManifest(index, tuple(entries), offset)
            return Payload("sglang_broadcast", manifest, {"load_format": obj.get("load_format")}, ({},) * self.tp)

        return self._update("/update_weights_from_distributed", obj, payload_of, call)

    def r_update_weight_version(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/update_weight_version", ["new_version"])
        self._fault(call)
        if obj.get("abort_all_requests", True):  # SGLang's default: every request in flight is aborted
            self._engine("abort_requests")
        self._label(str(obj["new_version"]))
        return {"success": True, "message": "Weight version updated.", "new_version": self.label}

    def r_release_memory_occupation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/release_memory_occupation")
        self._fault(call)
        try:
            self._engine("release_memory", self._tags(obj))
        except EngineError as exc:
            raise _Reply(400, {"error": {"message": exc.message}}) from None
        return None

    def r_resume_memory_occupation(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/resume_memory_occupation")
        self._fault(call)
        try:
            self._engine("resume_memory", self._tags(obj))
        except EngineError as exc:
            raise _Reply(400, {"error": {"message": exc.message}}) from None
        return None

    @staticmethod
    def _tags(obj: dict[str, Any]) -> list[str]:
        tags = obj.get("tags") or ["kv_cache", "weights", "cuda_graph"]
        return [t for t in tags if t in MEMORY_TAGS]

    def r_generate(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        obj = self._obj(body, "/generate")
        params = obj.get("sampling_params") or {}
        ids = obj.get("input_ids")
        out = self._generate(ids, int(params.get("max_new_tokens", 16)))
        tokens, versions = out.get("output") or [], out.get("weight_versions") or []
        meta: dict[str, Any] = {
            "finish_reason": {"type": out.get("finish_reason")},
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "num_retractions": int(out.get("num_retractions") or 0),
            "weight_version": str(versions[-1]) if versions else self.label,
        }
        if len(set(versions)) > 1:  # SGLang reports spans only for a request that straddled an update
            meta["weight_versions"] = self.spans(versions)
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def r__refit__info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {**super().r__refit__info(method, query, body, call), "session_open": self.session_open,
                "groups": list(self.groups)}  # fmt: skip


class EmulatedSGLangEngine(EmulatorClient, SGLangEngine):
    """The production SGLang driver pointed at an `EmulatedSGLang`, plus what the conformance kit
    reads from the engine behind it (`EmulatorClient`)."""

    def __init__(self, name: str, server: EmulatedSGLang, **kwargs: Any) -> None:
        self.server = server
        self._bucket = threading.local()
        super().__init__(name, server.url, api_key=server.api_key, tp=server.tp, **kwargs)

    @classmethod
    def start(
        cls,
        name: str,
        *,
        version: str = "0.5.23",
        tp: int = 1,
        api_key: str | None = None,
        seed: int = 0,
        config: Any = None,
        in_thread: bool = False,
        decoder: str = "refit",
        validate: Callable[..., None] | None = None,
    ) -> EmulatedSGLangEngine:
        """A fresh reference engine (own processes, or a thread) behind a new emulated server."""
        if in_thread:
            engine = ReferenceEngine.in_thread(name, config, seed)
        else:
            engine = ReferenceEngine.spawn(name, config, seed, tp=tp)
        server = EmulatedSGLang(engine, version=version, api_key=api_key, decoder=decoder, validate=validate)
        return cls(name, server)
