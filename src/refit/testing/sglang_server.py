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
types there). Routes under `/_refit/` are the emulator's own (weights read back, fresh logits, the
engine's audit, fault arming), used by the conformance kit through `EmulatedSGLangEngine`.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from refit.drivers.base import ConnectInfo, Payload
from refit.drivers.buckets import BucketManifest, TensorEntry, TensorMeta, itemsize
from refit.drivers.flattened import FLATTENED_BUCKET, manifest_from_metadata, peek_metadata
from refit.drivers.reference import ReferenceEngine
from refit.drivers.sglang import Capabilities, SGLangEngine, _as_version, _version_tuple
from refit.errors import EngineDied, EngineError

CALL_TIMEOUT = 120.0
GROUP_TIMEOUT_S = 60.0
MEMORY_TAGS = ("kv_cache", "weights")  # what the reference engine keeps; cuda_graph is accepted and ignored
ADMIN_FREE = frozenset({"/generate", "/model_info", "/get_model_info", "/server_info", "/get_server_info", "/health"})


class _Reply(Exception):
    """An HTTP answer other than 200 (raised inside a handler)."""

    def __init__(self, status: int, body: Any) -> None:
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class _Drop(Exception):
    """The server died: close the connection without an answer."""


class EmulatedSGLang:
    """A loopback HTTP server emulating SGLang `version` in front of `engine` (a reference engine
    driver; the emulator owns it from here on). `url` once started."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        version: str = "0.5.23",
        api_key: str | None = None,
        decoder: str = "refit",
        validate: Callable[[str, dict[str, Any]], None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.engine = engine
        self.version = version
        self.v = _version_tuple(version) or (0, 5, 23)
        self.api_key = api_key
        self.validate = validate
        self.label = "default"
        self.startup_time = time.time()
        self.session_open = False
        self.groups: dict[str, dict[str, Any]] = {}
        self.bucket_count = 0  # buckets of the open session (the index a fault is armed at)
        self._request_local = threading.local()  # per request thread: the driver's bucket index, if named
        self.armed: dict[tuple[str, int | None], tuple[str, float]] = {}
        self.received: list[tuple[str, dict[str, Any]]] = []  # every JSON body, in arrival order
        self.dead = False
        self._hanging = 0  # requests stalled by an armed hang right now
        self._hangs = threading.Condition()
        self._lock = threading.RLock()  # weight routes run one at a time, as SGLang's writer lock does
        self.engine.client.call(
            "attach",
            ConnectInfo(
                "sglang_tensor",
                "refit.drivers.flattened:FlattenedTensorReceiver",
                fields={"decoder": decoder},
                parts=({},) * engine.tp_size,
            ),
            timeout=CALL_TIMEOUT,
        )
        self._server = _Server((host, port), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="emulated-sglang", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def tp(self) -> int:
        return self.engine.tp_size

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(Exception):
            self._server.shutdown()
            self._server.server_close()
        with contextlib.suppress(Exception):
            self.engine.close()

    def die(self) -> None:
        """The server goes down (its scheduler died): connections are refused from now on."""
        self.dead = True
        threading.Thread(target=self.close, daemon=True).start()

    def restart(self) -> None:
        raise NotImplementedError  # a restarted SGLang server is a new EmulatedSGLang

    # ---- engine calls --------------------------------------------------------------------------

    def _engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.engine.client.call(method, *args, timeout=CALL_TIMEOUT, **kwargs)
        except EngineDied:
            self.die()
            raise _Drop() from None

    def _fault(self, call: str | None, bucket: int | None = None) -> None:
        if call is None or not self.armed:
            return
        fault = self.armed.pop((call, bucket), None) or self.armed.pop((call, None), None)
        if fault is None:
            return
        kind, seconds = fault
        if kind == "hang":
            with self._hangs:
                self._hanging += 1
            try:
                time.sleep(seconds)
            finally:
                with self._hangs:
                    self._hanging -= 1
                    self._hangs.notify_all()
        elif kind == "kill":
            with contextlib.suppress(Exception):
                self.engine.client.call("arm_fault", "kill", "ping", None, 0.0, timeout=5.0)
                self.engine.client.call("ping", timeout=5.0)
            self.die()
            raise _Drop()

    # ---- routes --------------------------------------------------------------------------------

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        if self.dead:
            raise _Drop()
        route = getattr(self, "r_" + path.strip("/").replace("/", "__"), None)
        if route is None:
            raise _Reply(404, {"detail": "Not Found"})
        return route(method, query, body, call)

    def _obj(self, body: Any, route: str, required: Sequence[str] = ()) -> dict[str, Any]:
        if not isinstance(body, dict):
            raise _Reply(422, {"detail": [{"type": "missing", "loc": ["body"], "msg": "Field required"}]})
        missing = [k for k in required if k not in body]
        if missing:
            raise _Reply(
                422, {"detail": [{"type": "missing", "loc": ["body", k], "msg": "Field required"} for k in missing]}
            )
        if self.validate is not None:
            try:
                self.validate(route, body)
            except Exception as exc:
                raise _Reply(422, {"detail": f"{type(exc).__name__}: {exc}"}) from None
        self.received.append((route, body))
        return body

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

    def _label(self, label: str) -> None:
        """SGLang labels whatever the engine holds; the reference core keeps its own account."""
        self.label = label
        try:
            version = int(label)
        except ValueError:
            return
        info = self._engine("info")
        try:
            if version > info["version"]:
                self._engine("publish", version)
                return
        except EngineError:
            pass  # not a complete update as the core sees it: the label is set anyway (SGLang checks nothing)
        self._engine("label_version", version)

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
        if not isinstance(ids, list) or not ids:
            raise _Reply(400, {"error": {"message": "this emulator takes input_ids only"}})
        try:
            out = self._engine("generate", ids, int(params.get("max_new_tokens", 16)))
        except EngineError as exc:
            raise _Reply(400, {"error": {"message": exc.message}}) from None
        tokens, versions = out.get("output") or [], out.get("weight_versions") or []
        meta: dict[str, Any] = {
            "finish_reason": {"type": out.get("finish_reason")},
            "prompt_tokens": len(ids),
            "completion_tokens": len(tokens),
            "num_retractions": int(out.get("num_retractions") or 0),
            "weight_version": str(versions[-1]) if versions else self.label,
        }
        if len(set(versions)) > 1:
            spans, start = [], 0
            for i in range(1, len(versions) + 1):
                if i == len(versions) or versions[i] != versions[start]:
                    spans.append({"version": str(versions[start]), "start": start, "end": i})
                    start = i
            meta["weight_versions"] = spans
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    # ---- the emulator's own routes (inspection and faults; not SGLang) --------------------------

    def r__refit__state_dict(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        import torch

        buf = io.BytesIO()
        torch.save(self._engine("state_dict"), buf)
        return {"torch_save_b64": base64.b64encode(buf.getvalue()).decode()}

    def r__refit__score(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {"logits": self._engine("score", list(body["tokens"])).tolist()}

    def r__refit__audit(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        return {"audit": self._engine("audit")}

    def r__refit__info(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        """The engine's own account, once no request is stalled by an armed hang (the kit waits
        for a hung engine to come back before it checks what it serves)."""
        with self._hangs:
            self._hangs.wait_for(lambda: self._hanging == 0, timeout=float((body or {}).get("wait_s", 30.0)))
        with self._lock:
            info = self._engine("info")
        return {**info, "label": self.label, "session_open": self.session_open, "groups": list(self.groups)}

    def r__refit__arm_fault(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self.armed[(body["call"], body.get("bucket"))] = (body["kind"], float(body.get("seconds", 0.0)))
        return {"armed": True}


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Logged, never printed: a client that hung up (a driver past its timeout) or a server torn
        down under a request is the emulator's business, not the test output's."""
        logging.getLogger(__name__).debug("emulated SGLang: request from %s failed", client_address, exc_info=True)


def _handler_for(emu: EmulatedSGLang) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms Nagle stalls

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def _serve(self, method: str) -> None:
            parsed = urlparse(self.path)
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                admin = parsed.path not in ADMIN_FREE and not parsed.path.startswith("/_refit/")
                if emu.api_key and admin and self.headers.get("Authorization") != f"Bearer {emu.api_key}":
                    raise _Reply(401, {"error": {"message": "Unauthorized: admin API key required"}})
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    raise _Reply(422, {"detail": "body is not JSON"}) from None
                bucket = self.headers.get("x-refit-bucket")
                emu._request_local.bucket = int(bucket) if bucket is not None else None
                result = emu.handle(method, parsed.path, parse_qs(parsed.query), body, self.headers.get("x-refit-call"))
                self._send(200, result)
            except _Reply as reply:
                self._send(reply.status, reply.body)
            except _Drop:
                self.close_connection = True
                with contextlib.suppress(OSError):
                    self.connection.shutdown(2)
            except Exception as exc:  # an emulator bug: a 500 naming it
                self._send(500, {"error": {"message": f"{type(exc).__name__}: {exc}"}})

        def _send(self, status: int, body: Any) -> None:
            if isinstance(body, str):
                data, ctype = body.encode(), "text/plain; charset=utf-8"
            else:
                data, ctype = json.dumps(body).encode(), "application/json"
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

    return Handler


class EmulatedSGLangEngine(SGLangEngine):
    """The SGLang driver pointed at an `EmulatedSGLang`, plus what the conformance kit reads from the
    engine behind it (weights read back, fresh logits, its audit) and real faults (the emulator
    hangs or dies on the call it is armed for). The protocol calls are the production driver's."""

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
        validate: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> EmulatedSGLangEngine:
        """A fresh reference engine (own processes, or a thread) behind a new emulated server."""
        if in_thread:
            engine = ReferenceEngine.in_thread(name, config, seed)
        else:
            engine = ReferenceEngine.spawn(name, config, seed, tp=tp)
        server = EmulatedSGLang(engine, version=version, api_key=api_key, decoder=decoder, validate=validate)
        return cls(name, server)

    def _headers(self, call: str) -> dict[str, str]:
        # which refit call (and bucket) a route serves: the emulator arms faults by call, and its
        # engine records buckets under the driver's index (SGLang's body carries none)
        headers = {"x-refit-call": call}
        bucket = getattr(self._bucket, "index", None)
        if call == "load" and bucket is not None:
            headers["x-refit-bucket"] = str(bucket)
        return headers

    def load(self, payload: Payload, *, timeout: float) -> None:
        self._bucket.index = payload.manifest.index
        try:
            super().load(payload, timeout=timeout)
        finally:
            self._bucket.index = None

    @property
    def alive(self) -> bool:
        return not self.server.dead

    def close(self) -> None:
        super().close()
        self.server.close()

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        if kind not in ("hang", "kill"):
            return False  # SGLang's update carries no checksum: corruption is simulated at the boundary
        self._emu("/_refit/arm_fault", {"kind": kind, "call": call, "bucket": bucket, "seconds": seconds}, timeout)
        return True

    def _emu(self, route: str, body: dict[str, Any] | None, timeout: float) -> Any:
        status, data = super()._request("POST", route, "inspect", timeout=timeout, body=body or {})
        if status != 200:
            raise EngineError("server_error", f"engine {self.name}: {route} -> HTTP {status}: {data}")
        return data

    def state_dict(self, *, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        import torch

        data = self._emu("/_refit/state_dict", None, timeout)
        return torch.load(io.BytesIO(base64.b64decode(data["torch_save_b64"])), weights_only=True)

    def score(self, tokens: Sequence[int], *, timeout: float = CALL_TIMEOUT) -> Any:
        import torch

        return torch.tensor(self._emu("/_refit/score", {"tokens": list(tokens)}, timeout)["logits"])

    def info(self, *, timeout: float = CALL_TIMEOUT) -> dict[str, Any]:
        """The label SGLang reports (its /model_info), read once no request is stalled by a hang."""
        data = self._emu("/_refit/info", {"wait_s": max(timeout - 1.0, 0.0)}, timeout)
        caps = self.capabilities or Capabilities.of(None)
        return {"version": _as_version(data["label"]), "engine": data, "capabilities": caps.as_dict()}

    def audit(self, *, timeout: float = CALL_TIMEOUT) -> list[dict[str, Any]] | None:
        return self._emu("/_refit/audit", None, timeout)["audit"]
