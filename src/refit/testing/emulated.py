"""What the emulated engine servers share (`refit.testing.sglang_server`, `refit.testing.vllm_server`).

An emulated server is a loopback HTTP server (one thread per connection) in front of a reference
engine (`refit.reference`): the subclass maps one engine API's routes, bodies, status codes and
answers onto the engine's calls; this base owns the engine, the server, the per-route fault
arming (a hang or a kill really happens in the server), the labels, and the emulator's own routes
under `/_refit/` (weights read back, fresh logits, the engine's audit), which the conformance kit
reads through `EmulatorClient`. Every JSON body received is kept in `received` and may be checked
by `validate(route, body)` (tests pass the engine project's own request types there).

A dead engine takes the server down: the request in flight loses its connection (no answer) and
later ones are refused, as when an engine server's scheduler dies.
"""

from __future__ import annotations

import base64
import contextlib
import contextvars
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

from refit.drivers.base import Payload
from refit.drivers.http import label_version
from refit.drivers.reference import ReferenceEngine
from refit.errors import EngineDied, EngineError

CALL_TIMEOUT = 120.0
# The refit call (and bucket) a request serves, as the driver's x-refit-* headers name them: faults
# are armed by call. A context variable, so it follows a request into threads and asyncio tasks.
REQUEST: contextvars.ContextVar[tuple[str | None, int | None]] = contextvars.ContextVar(
    "refit_emulated_request", default=(None, None)
)


class _Reply(Exception):
    """An HTTP answer other than 200 (raised inside a handler)."""

    def __init__(self, status: int, body: Any) -> None:
        self.status, self.body = status, body
        super().__init__(f"HTTP {status}")


class _Drop(Exception):
    """The server died: close the connection without an answer."""


class EmulatedServer:
    """A loopback HTTP server in front of `engine` (a reference engine driver; the server owns it
    from here on). Subclasses add routes as methods `r_<path with / as __>` taking (method, query,
    body, call) and returning the JSON answer (or raising `_Reply` for another status)."""

    def __init__(
        self,
        engine: ReferenceEngine,
        *,
        version: str,
        api_key: str | None = None,
        validate: Callable[..., None] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        new_engine: Callable[[], ReferenceEngine] | None = None,
    ) -> None:
        self.engine = engine
        self.new_engine = new_engine
        self.version = version
        self.api_key = api_key
        self.validate = validate
        self.label = "default"
        self.crashed: str | None = None  # why the server died, when it crashed
        self.armed: dict[tuple[str, int | None], tuple[str, float]] = {}
        self.received: list[tuple[str, Any]] = []  # every JSON body, in arrival order
        self.requests: list[tuple[str, str]] = []  # every request's method and path (the API's, not /_refit/)
        self.dead = False
        self._hanging = 0  # requests stalled by an armed hang right now
        self._hangs = threading.Condition()
        self._lock = threading.RLock()  # weight routes run one at a time (the engines' writer locks)
        self.setup_engine()
        self._listen(host, port)

    def _listen(self, host: str, port: int) -> None:
        self._server = _Server((host, port), _handler_for(self))
        self._thread = threading.Thread(target=self._server.serve_forever, name=type(self).__name__, daemon=True)
        self._thread.start()

    def reset_state(self) -> None:
        """What a fresh server process holds (subclasses add their API's state)."""
        self.label = "default"

    def restart(self) -> None:
        """The server process dies and a new one starts at the same address (what an orchestrator
        does): a fresh engine from `new_engine`, and the state of a fresh process."""
        if self.new_engine is None:
            raise RuntimeError("this emulated server was started without new_engine: it cannot restart")
        host, port = self.address
        self.die(wait=True)
        self.reset_state()
        self.engine, self.dead, self.crashed, self.armed = self.new_engine(), False, None, {}
        self.setup_engine()
        self._listen(host, port)

    def setup_engine(self) -> None:
        """Open what the API needs on the engine before the server takes requests."""

    def requires_key(self, path: str) -> bool:
        """Whether `path` needs the API key (when the server has one)."""
        return not path.startswith("/_refit/")

    def authorize(self, method: str, path: str, header: str | None) -> _Reply | None:
        """The refusal of a request its key does not unlock, else None."""
        if self.api_key and self.requires_key(path) and header != f"Bearer {self.api_key}":
            return _Reply(401, {"error": {"message": "Unauthorized: API key required"}})
        return None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._server.server_address[:2]
        return str(host), int(port)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{host}:{port}"

    @property
    def tp(self) -> int:
        return self.engine.tp_size

    def heads(self, names: Iterable[str]) -> dict[str, int]:
        """Name -> heads of each q/k/v projection among `names`, from the served model's config
        (a server knows it: SGLang's and vLLM's QKVParallelLinear are built from it)."""
        from refit.buckets import heads_by_name

        counts = self.engine.client.call("info", timeout=30.0)["heads"]
        return heads_by_name(names, {"num_attention_heads": counts[0], "num_key_value_heads": counts[1]})

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(Exception):
            self._server.shutdown()
            self._server.server_close()
        with contextlib.suppress(Exception):
            self.engine.close()

    def die(self, *, wait: bool = False) -> None:
        """The server goes down (its scheduler died): connections are refused from now on.
        `wait`: return once the engine is gone too (else it is closed on a thread)."""
        self.dead = True
        with contextlib.suppress(OSError):  # stop listening now, before any request in flight is dropped
            self._server.socket.shutdown(socket.SHUT_RDWR)  # (a close alone waits for the accept loop's poll)
        with contextlib.suppress(OSError):
            self._server.socket.close()
        if wait:
            self.close()
        else:
            threading.Thread(target=self.close, daemon=True).start()

    def bucket_hint(self) -> int | None:
        """The bucket index the driver named for this request (SGLang's and vLLM's bodies carry none)."""
        return REQUEST.get()[1]

    def invalid(self, detail: Any) -> _Reply:
        """The answer to a request its schema refuses (FastAPI's default: 422; servers override)."""
        return _Reply(422, {"detail": detail})

    # ---- engine calls --------------------------------------------------------------------------

    def _engine(self, method: str, *args: Any, **kwargs: Any) -> Any:
        try:
            return self.engine.client.call(method, *args, timeout=CALL_TIMEOUT, **kwargs)
        except EngineDied:
            self.die()
            raise _Drop() from None

    def _fault(self, call: str | None = None, bucket: int | None = None) -> None:
        """Run the fault armed for this refit call (default: the request's), if any."""
        call = REQUEST.get()[0] if call is None else call
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

    def handle(self, method: str, path: str, query: dict[str, list[str]], body: Any, call: str | None) -> Any:
        if self.dead:
            raise _Drop()
        if not path.startswith("/_refit/"):
            self.requests.append((method, path))
        if path == "/openapi.json":  # FastAPI serves its route list there (SGLang's and vLLM's apps both)
            return self.openapi()
        route = getattr(self, "r_" + path.strip("/").replace("/", "__"), None)
        if route is None:
            raise _Reply(404, {"detail": "Not Found"})
        return route(method, query, body, call)

    def openapi(self) -> dict[str, Any]:
        """The routes this server answers, in the shape of FastAPI's /openapi.json "paths"."""
        paths = {
            "/" + name.removeprefix("r_").replace("__", "/"): {}
            for name in dir(self)
            if name.startswith("r_") and not name.startswith("r__refit") and callable(getattr(self, name))
        }
        return {"openapi": "3.1.0", "paths": dict(sorted(paths.items()))}

    def _obj(self, body: Any, route: str, required: Sequence[str] = ()) -> dict[str, Any]:
        """A JSON object body (a missing one is refused, as FastAPI refuses it: `invalid`), checked
        by `validate`."""
        if not isinstance(body, dict):
            raise self.invalid([{"type": "missing", "loc": ["body"], "msg": "Field required"}])
        missing = [k for k in required if k not in body]
        if missing:
            raise self.invalid([{"type": "missing", "loc": ["body", k], "msg": "Field required"} for k in missing])
        self._check(route, body)
        return body

    def _check(self, route: str, body: Any, query: dict[str, list[str]] | None = None) -> None:
        """Hand the request to `validate(route, body, query)` (`invalid` if it refuses), and keep it."""
        if self.validate is not None:
            try:
                self.validate(route, body, query)
            except Exception as exc:
                raise self.invalid(f"{type(exc).__name__}: {exc}") from None
        self.received.append((route, body if query is None else {"query": query}))

    def _generate(self, ids: Any, max_tokens: int, adapter: str | None = None) -> dict[str, Any]:
        """Run a request on the engine (waits while it is paused); `adapter`: a loaded adapter's name."""
        if not isinstance(ids, list) or not ids:
            raise _Reply(400, {"error": {"message": "this emulator takes token ids only"}})
        try:
            if adapter is not None:
                return self._engine("generate", ids, int(max_tokens), adapter)
            return self._engine("generate", ids, int(max_tokens))
        except EngineError as exc:
            raise _Reply(400, {"error": {"message": exc.message}}) from None

    @staticmethod
    def spans(versions: Sequence[Any]) -> list[dict[str, Any]]:
        """Per-token versions as [{"version", "start", "end"}] runs (the engines' weight_versions)."""
        out, start = [], 0
        for i in range(1, len(versions) + 1):
            if i == len(versions) or versions[i] != versions[start]:
                out.append({"version": label_of(versions[start]), "start": start, "end": i})
                start = i
        return out

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

    # ---- the emulator's own routes (inspection and faults; not the engine API) ------------------

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
        return {**info, "label": self.label}

    def r__refit__arm_fault(self, method: str, query: Any, body: Any, call: str | None) -> Any:
        self.armed[(body["call"], body.get("bucket"))] = (body["kind"], float(body.get("seconds", 0.0)))
        return {"armed": True}


def label_of(version: Any) -> str:
    """The label an engine server reports for refit's integer version (0: "default", the label
    SGLang and vLLM start with)."""
    return "default" if version == 0 else str(version)


class _Server(ThreadingHTTPServer):
    """One thread per connection (a request that waits, like /generate while paused, blocks nobody)."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Logged, never printed: a client that hung up (a driver past its timeout) or a server torn
        down under a request is the emulator's business, not the test output's."""
        log = logging.getLogger(__name__)
        log.debug("emulated server: request from %s failed", client_address, exc_info=True)


def _handler_for(emu: EmulatedServer) -> type[BaseHTTPRequestHandler]:
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
                refused = emu.authorize(method, parsed.path, self.headers.get("Authorization"))
                if refused is not None:
                    raise refused
                try:
                    body = json.loads(raw) if raw else None
                except ValueError:
                    raise emu.invalid([{"type": "json_invalid", "loc": ["body"], "msg": "JSON decode error"}]) from None
                bucket = self.headers.get("x-refit-bucket")
                call = self.headers.get("x-refit-call")
                REQUEST.set((call, int(bucket) if bucket is not None else None))
                result = emu.handle(method, parsed.path, parse_qs(parsed.query), body, call)
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


class EmulatorClient:
    """Mixed into a production driver pointed at an emulated server: what the conformance kit reads
    from the engine behind it (weights read back, fresh logits, its audit), and real faults (the
    server hangs or dies on the call it is armed for). The protocol calls stay the driver's."""

    server: EmulatedServer
    name: str

    def _headers(self, call: str) -> dict[str, str]:
        # which refit call (and bucket) a route serves: the emulator arms faults by call, and its
        # engine records buckets under the driver's index (SGLang's body carries none)
        headers = {"x-refit-call": call}
        bucket = getattr(getattr(self, "_bucket", None), "index", None)
        if call == "load" and bucket is not None:
            headers["x-refit-bucket"] = str(bucket)
        return headers

    def load(self, payload: Payload, *, timeout: float) -> None:
        self._bucket.index = payload.manifest.index
        try:
            super().load(payload, timeout=timeout)  # type: ignore[misc]
        finally:
            self._bucket.index = None

    @property
    def alive(self) -> bool:
        return not self.server.dead

    def close(self) -> None:
        super().close()  # type: ignore[misc]
        self.server.close()

    def arm_fault(self, kind: str, call: str, *, bucket: int | None, seconds: float, timeout: float) -> bool:
        if kind not in ("hang", "kill"):
            return False  # the engine APIs' updates carry no checksum: corruption is simulated at the boundary
        self._emu("/_refit/arm_fault", {"kind": kind, "call": call, "bucket": bucket, "seconds": seconds}, timeout)
        return True

    def _emu(self, route: str, body: dict[str, Any] | None, timeout: float) -> Any:
        status, data = self._request("POST", route, "inspect", timeout=timeout, body=body or {})  # type: ignore[attr-defined]
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
        """The label the server reports, read once no request is stalled by a hang."""
        data = self._emu("/_refit/info", {"wait_s": max(timeout - 1.0, 0.0)}, timeout)
        return {"version": label_version(data["label"]), "engine": data}

    def audit(self, *, timeout: float = CALL_TIMEOUT) -> list[dict[str, Any]] | None:
        return self._emu("/_refit/audit", None, timeout)["audit"]
