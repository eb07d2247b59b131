"""Thin adapters that put the reference engine core behind a message channel.

`serve(channel, server)` is the engine's main loop, the same whether the channel is a pipe to a
spawned process or an in-memory queue to a thread: it answers one request at a time, in arrival
order, and steps in-flight generations whenever no request is waiting. `generate` replies late,
when its request finishes, so control calls (pause, flush, load...) keep flowing meanwhile.

A request is ``(call_id, method, args, kwargs)``; a reply ``(call_id, ok, value)`` where a failed
call's value is ``(kind, message)``. Only the methods in `EngineServer.METHODS` can be called.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from refit.drivers.base import ConnectInfo, Payload, Receiver
from refit.errors import EngineError
from refit.reference.engine import EngineCore

SHUTDOWN = "__shutdown__"
RECEIVER_PREFIX = "refit."  # receivers are imported by path; only refit's own may be named


class Channel(Protocol):
    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float | None) -> bool: ...
    def close(self) -> None: ...


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
    """Tensors cross the pipe as numpy arrays (pickled by value: no shared fds to leak)."""
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
    """A multiprocessing Connection, with tensors converted for the trip."""

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


class EngineServer:
    """Maps request names onto the core; owns the engine side of the transport."""

    METHODS = frozenset(
        {
            "info", "submit", "result", "score", "state_dict", "pause", "continue_generation", "flush",
            "begin", "load", "finalize", "publish", "quarantine", "release_memory", "resume_memory",
            "attach", "detach", "ping",
        }
    )  # fmt: skip

    def __init__(self, core: EngineCore, name: str) -> None:
        self.core = core
        self.name = name
        self.receiver: Receiver | None = None
        self.transport_kind: str | None = None

    def handle(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in self.METHODS:
            raise EngineError("bad_request", f"unknown method {method!r}")
        fn: Callable[..., Any] = getattr(self, f"_{method}", None) or getattr(self.core, method)
        return fn(*args, **kwargs)

    def _ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "name": self.name}

    def _state_dict(self) -> dict[str, Any]:
        return self.core.hf_state_dict()

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
        try:
            tensors = self.receiver.read(payload)
        except (ValueError, KeyError, OSError) as exc:
            raise EngineError("bad_payload", f"bucket {payload.manifest.index}: {exc}") from exc
        self.core.load(payload.manifest, tensors)


def _error_value(exc: BaseException) -> tuple[str, str]:
    if isinstance(exc, EngineError):
        return exc.kind, str(exc).split(": ", 1)[-1]
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
                call_id, method, args, kwargs = msg
                try:
                    if method == "generate":
                        rid = core.submit(*args, **kwargs)
                        waiters.setdefault(rid, []).append(call_id)
                    else:
                        channel.send((call_id, True, server.handle(method, args, kwargs)))
                except Exception as exc:  # the engine survives a bad request and says why
                    channel.send((call_id, False, _error_value(exc)))
            else:
                core.step()
            for rid in core.pop_finished():
                for call_id in waiters.pop(rid, []):
                    channel.send((call_id, True, core.result(rid)))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        server._detach()
        channel.close()


def process_main(fd: int, config: dict[str, Any], seed: int, name: str, version: int, threads: int) -> None:
    """Entry point of an engine process: `python -m refit.reference.server FD JSON`."""
    from multiprocessing.connection import Connection

    import torch

    from refit.reference.model import ModelConfig

    torch.set_num_threads(threads)
    conn = Connection(fd)
    core = EngineCore(ModelConfig(**config), seed, version=version)
    conn.send(("ready", os.getpid()))
    serve(PipeChannel(conn), EngineServer(core, name))


if __name__ == "__main__":
    import json
    import sys

    spec = json.loads(sys.argv[2])
    process_main(int(sys.argv[1]), spec["config"], spec["seed"], spec["name"], spec["version"], spec["threads"])
