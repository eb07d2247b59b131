"""Thin adapters that put the reference engine core behind a message channel.

`serve(channel, server)` is the engine's main loop, the same whether the channel is a socket to a
spawned process or an in-memory queue to a thread: it answers one request at a time, in arrival
order, and steps in-flight generations whenever no request is waiting. `generate` replies late,
when its request finishes, so control calls (pause, flush, load...) keep flowing meanwhile.

Wire format. A request is ``(call_id, method, body)`` where `body` is the pickled ``(args,
kwargs)``; the engine decodes it with an allowlisting unpickler (builtins and refit's manifest /
payload types only), so a payload naming any other class is refused before anything runs. A reply
is ``(call_id, ok, value)``; a failed call's value is ``(kind, message)``.

Fault arming (tests, `refit demo --fail-at`): `arm_fault(kind, call, bucket, seconds)` makes the
engine misbehave on its next matching request: ``hang`` (stall `seconds`, then carry on late),
``kill`` (the process dies with SIGKILL; a thread engine's loop ends and its channel closes),
``corrupt`` (a bucket's bytes are damaged in transit, caught by its checksum; any other request's
body arrives truncated and cannot be decoded).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from refit.drivers.base import ConnectInfo, Payload, Receiver
from refit.drivers.buckets import crc32
from refit.errors import EngineError
from refit.reference.engine import EngineCore

SHUTDOWN = "__shutdown__"
RECEIVER_PREFIX = "refit."  # receivers are imported by path; only refit's own may be named
ALLOWED_CLASSES = frozenset(
    {
        ("refit.drivers.buckets", "BucketManifest"),
        ("refit.drivers.buckets", "TensorEntry"),
        ("refit.drivers.buckets", "TensorMeta"),
        ("refit.drivers.base", "ConnectInfo"),
        ("refit.drivers.base", "Payload"),
    }
)
FAULT_KINDS = ("hang", "kill", "corrupt")
AUDITED = frozenset(
    {
        "pause", "flush", "begin", "load", "finalize", "publish", "label_version", "continue_generation",
        "quarantine", "resume_memory", "release_memory",
    }
)  # fmt: skip


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float | None) -> bool: ...
    def close(self) -> None: ...


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_CLASSES:
            raise pickle.UnpicklingError(f"blocked class {module}.{name}")
        return super().find_class(module, name)


def encode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    return pickle.dumps((args, kwargs), protocol=5)


def safe_decode(body: bytes) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Decode a request body, refusing any class outside ALLOWED_CLASSES."""
    try:
        args, kwargs = _SafeUnpickler(io.BytesIO(body)).load()
    except Exception as exc:
        raise EngineError("bad_payload", f"request body could not be decoded: {exc}") from None
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise EngineError("bad_payload", "request body is not (args, kwargs)")
    return args, kwargs


class _Mailbox:
    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._cv = threading.Condition()
        self.closed = False

    def put(self, obj: Any) -> None:
        with self._cv:
            self._items.append(obj)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self.closed = True
            self._cv.notify_all()

    def poll(self, timeout: float | None) -> bool:
        with self._cv:
            return self._cv.wait_for(lambda: self._items or self.closed, timeout)

    def get(self) -> Any:
        with self._cv:
            self._cv.wait_for(lambda: self._items or self.closed)
            if self._items:
                return self._items.popleft()
            raise EOFError("channel closed")


class LocalChannel:
    """One end of an in-memory channel pair (objects are passed by reference)."""

    def __init__(self, inbox: _Mailbox, outbox: _Mailbox) -> None:
        self._inbox, self._outbox = inbox, outbox

    @staticmethod
    def pair() -> tuple[LocalChannel, LocalChannel]:
        a, b = _Mailbox(), _Mailbox()
        return LocalChannel(a, b), LocalChannel(b, a)

    def send(self, obj: Any) -> None:
        if self._outbox.closed:
            raise BrokenPipeError("channel closed")
        self._outbox.put(obj)

    def recv(self) -> Any:
        return self._inbox.get()

    def poll(self, timeout: float | None) -> bool:
        return self._inbox.poll(timeout)

    def close(self) -> None:
        self._outbox.close()
        self._inbox.close()


def _to_wire(obj: Any) -> Any:
    """Tensors cross the socket as numpy arrays (pickled by value: no shared fds to leak)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return ("__tensor__", obj.detach().cpu().numpy())
    if isinstance(obj, dict):
        return {k: _to_wire(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_wire(v) for v in obj)
    return obj


def _from_wire(obj: Any) -> Any:
    import torch

    if isinstance(obj, tuple) and len(obj) == 2 and obj[0] == "__tensor__":
        return torch.from_numpy(obj[1])
    if isinstance(obj, dict):
        return {k: _from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_from_wire(v) for v in obj)
    return obj


class PipeChannel:
    """A multiprocessing Connection (over a socket), with tensors converted for the trip."""

    def __init__(self, conn: Any) -> None:
        self._conn = conn

    def send(self, obj: Any) -> None:
        self._conn.send(_to_wire(obj))

    def recv(self) -> Any:
        return _from_wire(self._conn.recv())

    def poll(self, timeout: float | None) -> bool:
        return self._conn.poll(timeout)

    def close(self) -> None:
        self._conn.close()


def load_receiver(info: ConnectInfo) -> Receiver:
    module_name, _, cls_name = info.receiver.partition(":")
    if not module_name.startswith(RECEIVER_PREFIX):
        raise EngineError("bad_request", f"receiver {info.receiver!r} is not a refit receiver")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(info)


class _Killed(Exception):
    """An armed kill fired in an engine running on a thread: its loop ends as if the process died."""


class EngineServer:
    """Maps request names onto the core; owns the engine side of the transport and armed faults."""

    METHODS = frozenset(
        {
            "info", "submit", "result", "score", "state_dict", "pause", "continue_generation", "flush",
            "begin", "load", "finalize", "publish", "label_version", "quarantine", "release_memory",
            "resume_memory", "attach", "detach", "ping", "audit", "arm_fault",
        }
    )  # fmt: skip

    def __init__(self, core: EngineCore, name: str, *, in_process: bool) -> None:
        self.core = core
        self.name = name
        self.in_process = in_process  # False: this is the engine's own process
        self.receiver: Receiver | None = None
        self.transport_kind: str | None = None
        self.armed: dict[tuple[str, int | None], tuple[str, float]] = {}
        self._corrupt_next_load = False

    def handle(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in self.METHODS:
            raise EngineError("bad_request", f"unknown method {method!r}")
        fn: Callable[..., Any] = getattr(self, f"_{method}", None) or getattr(self.core, method)
        if method not in AUDITED:
            return fn(*args, **kwargs)
        bucket = args[0].manifest.index if method == "load" and args and isinstance(args[0], Payload) else None
        before = {
            "dirty_before": self.core.dirty,
            "ready_before": self.core.ready_to_publish,
            "session_open_before": self.core.session is not None,
            "start": time.monotonic(),
        }
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            self.core.record(method, False, bucket=bucket, error=getattr(exc, "kind", type(exc).__name__), **before)
            raise
        self.core.record(method, True, bucket=bucket, **before)
        return result

    def dispatch(self, method: str, body: bytes) -> Any:
        """Decode, apply any armed fault, handle."""
        fault = self._armed_for(method, body)
        if fault is not None:
            kind, seconds = fault
            if kind == "kill":
                if self.in_process:
                    raise _Killed(method)
                os.kill(os.getpid(), signal.SIGKILL)
            elif kind == "hang":
                time.sleep(seconds)
            elif method == "load":
                self._corrupt_next_load = True
            else:
                body = body[: len(body) // 2]  # the request arrives truncated
        args, kwargs = safe_decode(body)
        return self.handle(method, args, kwargs)

    def _armed_for(self, method: str, body: bytes) -> tuple[str, float] | None:
        if not self.armed:
            return None
        bucket = None
        if method == "load":
            try:
                payload = safe_decode(body)[0][0]
                bucket = payload.manifest.index
            except Exception:  # undecodable: handle() reports it
                return None
        return self.armed.pop((method, bucket), None) or self.armed.pop((method, None), None)

    def _arm_fault(self, kind: str, call: str, bucket: int | None = None, seconds: float = 0.0) -> None:
        if kind not in FAULT_KINDS:
            raise EngineError("bad_request", f"fault kind {kind!r}; known {FAULT_KINDS}")
        self.armed[(call, bucket)] = (kind, float(seconds))

    def _ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "name": self.name}

    def _state_dict(self) -> dict[str, Any]:
        return self.core.hf_state_dict()

    def _audit(self) -> list[dict[str, Any]]:
        return list(self.core.audit)

    def _attach(self, info: ConnectInfo) -> None:
        self._detach()
        self.receiver = load_receiver(info)
        self.transport_kind = info.kind

    def _detach(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None
        self.transport_kind = None

    def _load(self, payload: Payload) -> None:
        if self.receiver is None or payload.kind != self.transport_kind:
            raise EngineError("not_attached", f"no {payload.kind!r} transport attached; attach before load")
        index = payload.manifest.index
        self.core.check_load(payload.manifest)  # the manifest first: a truncated bucket is named as such
        try:
            tensors = self.receiver.read(payload)
        except (ValueError, KeyError, OSError) as exc:
            self.core.break_session(f"bucket {index} could not be read")
            raise EngineError("bad_payload", f"bucket {index}: {exc}") from exc
        expected = payload.fields.get("crc32")
        if self._corrupt_next_load:
            self._corrupt_next_load = False
            tensors = _damaged(tensors)
        if expected is not None and crc32(tensors) != expected:
            self.core.break_session(f"bucket {index} failed its checksum")
            raise EngineError("bad_payload", f"bucket {index}: checksum mismatch, the bytes changed in transit")
        self.core.load(payload.manifest, tensors)


def _damaged(tensors: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A private copy of the bucket with one byte flipped (what a corrupted transfer delivers)."""
    import torch

    out = list(tensors)
    for i, (name, tensor) in enumerate(out):
        if tensor.numel():
            copy = tensor.clone()
            raw = copy.reshape(-1).view(torch.uint8)
            raw[0] ^= 0xFF
            out[i] = (name, copy)
            break
    return out


def _error_value(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, EngineError):
        return exc.kind, exc.message
    return "internal", f"{type(exc).__name__}: {exc}"


def serve(channel: Channel, server: EngineServer) -> None:
    """Run the engine until SHUTDOWN or until the other side goes away."""
    core = server.core
    waiters: dict[int, list[int]] = {}
    try:
        while True:
            if channel.poll(0 if core.has_work() else None):
                msg = channel.recv()
                if msg == SHUTDOWN:
                    break
                call_id, method, body = msg
                try:
                    if method == "generate":
                        args, kwargs = safe_decode(body)
                        rid = core.submit(*args, **kwargs)
                        waiters.setdefault(rid, []).append(call_id)
                    else:
                        channel.send((call_id, True, server.dispatch(method, body)))
                except _Killed:
                    raise
                except Exception as exc:  # the engine survives a bad request and says why
                    channel.send((call_id, False, _error_value(exc)))
            else:
                core.step()
            for rid in core.pop_finished():
                for call_id in waiters.pop(rid, []):
                    channel.send((call_id, True, core.result(rid)))
    except (EOFError, BrokenPipeError, ConnectionResetError, _Killed):
        pass
    finally:
        server._detach()
        channel.close()


def process_main(
    fd: int, config: dict[str, Any], seed: int, name: str, version: int, threads: int, serving: bool
) -> None:
    """Entry point of an engine process: `python -m refit.reference.server FD JSON`."""
    from multiprocessing.connection import Connection

    import torch

    from refit.reference.model import ModelConfig

    torch.set_num_threads(threads)
    conn = Connection(fd)
    core = EngineCore(ModelConfig(**config), seed, version=version, serving=serving)
    conn.send(("ready", os.getpid()))
    serve(PipeChannel(conn), EngineServer(core, name, in_process=False))


if __name__ == "__main__":
    import json
    import sys

    spec = json.loads(sys.argv[2])
    process_main(
        int(sys.argv[1]), spec["config"], spec["seed"], spec["name"], spec["version"], spec["threads"], spec["serving"]
    )
