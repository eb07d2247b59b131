"""Thin adapters that put the reference engine core behind a message channel.

`serve(channel, server)` is the engine's main loop, the same whether the channel is a socket to a
spawned process or an in-memory queue to a thread: it answers one request at a time, in arrival
order, and steps in-flight generations whenever no request is waiting. `generate` replies late,
when its request finishes, so control calls (pause, flush, load...) keep flowing meanwhile.

Wire format. A request is ``(call_id, method, body)`` where `body` is the pickled ``(args,
kwargs)``; the engine decodes it with an allowlisting unpickler (builtins and refit's manifest /
payload types only), so a payload naming any other class is refused before anything runs. A reply
is ``(call_id, ok, value)``; a failed call's value is ``(kind, message)``.

Manifests once per connection (`refit.reference.memo`): a client sends a bucket manifest whole
the first time and by key once the engine answered that request (`encode_defining`,
`safe_decode(body, manifests)`); a steady refit sends, per bucket, an index.

Batches. `steps(list of (call, args))` runs consecutive protocol calls in one request, stopping at
the first that fails, and answers with one (ok, value-or-error, seconds) per step run: a refit's
control calls take one round trip per wave instead of one per call.

A drain that waits. A `steps` request whose `drain` is not ready (requests still on the versions
its publish would push out) is parked, not answered: the engine goes on stepping generations and
looks again whenever a request finishes, then runs the drain again (and any steps after it) and
answers, or answers not ready a little before the call's budget is spent (`_park_margin`), or
when another call that changes the engine arrives. The engine's turns are the two looks and the
answer; the wait between them is generation's.

Hosted in the caller's threads. `HostedEngine` runs a TP=1 engine without a channel, for a host
that has threads of its own (a Ray actor): a call runs on the calling thread under the engine's
lock, generation steps on a thread of its own between calls (one lock hand-off per call, instead
of two thread hops and a reply thread).

Tensor parallelism. An engine with TP=t is t processes: the head (TP rank 0) talks to the driver
and forwards every request that touches the model to its followers over their own sockets before
running it itself; every rank runs it on its own core (sharded weights, replicated scheduler), and
they meet in gloo collectives (forward all-reduces, a bucket's accept-or-refuse vote, readback).
Followers die with their head.

Fault arming (tests, `refit demo --fail-at`): `arm_fault(kind, call, bucket, seconds)` makes the
engine misbehave on its next matching request: ``hang`` (stall `seconds`, then carry on late),
``kill`` (the process dies with SIGKILL; a thread engine's loop ends and its channel closes),
``corrupt`` (a bucket's bytes are damaged in transit, caught by its checksum; any other request's
body arrives truncated and cannot be decoded).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import io
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from refit.drivers.base import ConnectInfo, Payload, Receiver
from refit.errors import EngineDied, EngineError
from refit.reference.engine import SILENT_FAULTS, EngineCore
from refit.reference.memo import ManifestDef, ManifestMemo, ManifestRef, Manifests, swap

SHUTDOWN = "__shutdown__"
RECEIVER_PREFIX = "refit."  # receivers are imported by path; only refit's own may be named
ALLOWED_CLASSES = frozenset(
    {
        ("refit.buckets", "BucketManifest"),
        ("refit.buckets", "TensorEntry"),
        ("refit.buckets", "TensorMeta"),
        ("refit.drivers.base", "ConnectInfo"),
        ("refit.drivers.base", "Payload"),
        ("refit.reference.memo", "ManifestDef"),
        ("refit.reference.memo", "ManifestRef"),
    }
)
FAULT_KINDS = ("hang", "kill", "corrupt", *SILENT_FAULTS)
AUDITED = frozenset(
    {
        "probe", "pause", "flush", "begin", "load", "finalize", "publish", "label_version", "continue_generation",
        "quarantine", "resume_memory", "release_memory", "abort_requests", "verify", "stage", "swap", "discard",
        "drain",
    }
)  # fmt: skip
HEAD_ONLY = frozenset({"info", "audit", "ping", "arm_fault", "result"})  # no model state: not forwarded
PROTOCOL_CALLS = frozenset(
    {
        "probe", "resume_memory", "release_memory", "attach", "detach", "pause", "flush", "begin", "load",
        "finalize", "publish", "continue_generation", "quarantine", "verify", "stage", "swap", "discard", "drain",
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
    """A request body, manifests whole (an engine's client uses `encode_defining`)."""
    return pickle.dumps((args, kwargs), protocol=5)


def encode_defining(args: tuple[Any, ...], kwargs: dict[str, Any], memo: ManifestMemo) -> tuple[bytes, list[int]]:
    """`encode` with a memo, and the keys this body defines (confirm them once it is answered)."""
    from refit.buckets import BucketManifest

    defined: list[int] = []
    args = swap(args, lambda m: memo.out(m, defined), (BucketManifest,))
    return pickle.dumps((args, kwargs), protocol=5), defined


def safe_decode(body: bytes, manifests: Manifests | None = None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Decode a request body, refusing any class outside ALLOWED_CLASSES; manifests sent by key
    resolved from `manifests` (a key it lacks: `unknown_manifest`; none given: refused)."""
    try:
        args, kwargs = _SafeUnpickler(io.BytesIO(body)).load()
    except Exception as exc:
        raise EngineError("bad_payload", f"request body could not be decoded: {exc}") from None
    if isinstance(args, tuple) and manifests is not None:
        args = swap(args, manifests.into, (ManifestDef, ManifestRef))
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


_WIRE_ATOMS = frozenset({str, int, float, bool, bytes, type(None)})  # cross as they are (no walk)


def _to_wire(obj: Any) -> Any:
    """Tensors cross the socket as (dtype, shape, raw bytes), pickled by value: no shared fds to
    leak, and any dtype (bfloat16 has no numpy form). Atoms are passed over, not walked (a
    verify's hundreds of digests cost no call each)."""
    import torch

    kind = type(obj)
    if kind in _WIRE_ATOMS:
        return obj
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ("__tensor__", str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)
    if isinstance(obj, dict):
        return {k: v if type(v) in _WIRE_ATOMS else _to_wire(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(v if type(v) in _WIRE_ATOMS else _to_wire(v) for v in obj)
    return obj


def _from_wire(obj: Any) -> Any:
    import torch

    kind = type(obj)
    if kind in _WIRE_ATOMS:
        return obj
    if kind is tuple and len(obj) == 4 and obj[0] == "__tensor__":
        _, dtype, shape, raw = obj
        flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        return flat.view(getattr(torch, dtype)).reshape(shape)
    if isinstance(obj, dict):
        return {k: v if type(v) in _WIRE_ATOMS else _from_wire(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(v if type(v) in _WIRE_ATOMS else _from_wire(v) for v in obj)
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


def load_receiver(info: ConnectInfo, tp_rank: int = 0) -> Receiver:
    module_name, _, cls_name = info.receiver.partition(":")
    if not module_name.startswith(RECEIVER_PREFIX):
        raise EngineError("bad_request", f"receiver {info.receiver!r} is not a refit receiver")
    if tp_rank >= len(info.parts):
        raise EngineError("bad_request", f"connect info has {len(info.parts)} parts, TP rank {tp_rank} has none")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(info, tp_rank)


class _Killed(Exception):
    """An armed kill fired in an engine running on a thread: its loop ends as if the process died."""


PARK_MIN_S = 0.005  # a drain parks only when it could wait at least this long


def _park_margin(budget: float, step_s: float) -> float:
    """How long before the call's budget (counted from when the engine took it up: up to a decode
    step after the caller started its own clock) a parked drain answers, so the answer reaches the
    caller in time: a tenth of a second and a twentieth of the budget (at most 2 s), and two steps
    (`step_s`, the engine's averaged one: the one it may have been in when the request came, and
    one more of slack; the serve loop answers before a step that would end past `until`)."""
    return min(0.1 + 0.05 * budget, 2.0) + 2 * step_s


def _hold_left(args: Any, waited: float) -> Any:
    """A drain's args (hold_s, ...) with `waited` seconds taken off its hold (never below 0)."""
    if isinstance(args, list | tuple) and args and type(args[0]) in (int, float):
        return (max(0.0, float(args[0]) - waited), *args[1:])
    return args


def _ready(value: Any) -> bool:
    return not isinstance(value, dict) or value.get("ready") is not False


class Parked:
    """A `steps` request held at a drain that was not ready: the steps, where it stopped, the
    answers so far, the call's end (engine clock) and budget, when it answers at the latest
    (`until`), and when the drain first ran."""

    def __init__(
        self, steps: list[tuple[str, tuple[Any, ...]]], index: int, out: list[tuple[bool, Any, float]],
        end: float | None, budget: float | None,
    ) -> None:  # fmt: skip
        self.steps, self.index, self.out, self.end, self.budget = steps, index, out, end, budget
        self.until = self.first = 0.0
        self.resumed = False


class EngineServer:
    """Maps request names onto the core; owns the engine side of the transport and armed faults."""

    METHODS = frozenset(
        {
            "info", "submit", "result", "score", "state_dict", "digests", "pause", "continue_generation", "flush",
            "begin", "load", "finalize", "publish", "label_version", "quarantine", "release_memory",
            "resume_memory", "attach", "detach", "ping", "audit", "arm_fault", "probe", "steps", "abort_requests",
            "verify", "served_state_dict", "rank_shards", "stage", "swap", "discard", "drain",
            "unload_adapter", "load_adapter_dir",  # an adapter server's own loads and unloads (emulated SGLang, vLLM)
        }
    )  # fmt: skip

    def __init__(
        self, core: EngineCore, name: str, *, in_process: bool, followers: list[Channel] | None = None
    ) -> None:
        self.core = core
        self.name = name
        self.profiles = _CallProfiles(os.environ.get("REFIT_PROFILE_CALLS"), name)  # off unless asked
        self.in_process = in_process  # False: this is the engine's own process
        self.followers = followers or []  # TP ranks 1.. (this is the head)
        self.receivers: dict[str, Receiver] = {}  # transport kind -> this rank's receiver
        self.manifests = Manifests()  # what its client sent once (`ManifestMemo`)
        self.armed: dict[tuple[str, int | None], tuple[str, float]] = {}
        self._corrupt_next_load = False
        # the engine thread's whole turn at a call (`serve`): when it read the request, and the
        # audit record to stamp with when its answer left (decode and answer are the thread's time too)
        self.received_at: float | None = None
        self._last_record: dict[str, Any] | None = None
        self.parks = False  # whether a drain not ready may be parked (`serve` parks; a hosted engine does not)

    def handle(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in self.METHODS:
            raise EngineError("bad_request", f"unknown method {method!r}")
        fn: Callable[..., Any] = getattr(self, f"_{method}", None) or getattr(self.core, method)
        try:
            return self._handle(method, fn, args, kwargs)
        finally:
            self.core.mangle = None

    def _handle(self, method: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if method not in AUDITED:
            return fn(*args, **kwargs)
        bucket = args[0].manifest.index if method == "load" and args and isinstance(args[0], Payload) else None
        received, self.received_at = self.received_at, None
        before = {
            "dirty_before": self.core.dirty,
            "ready_before": self.core.ready_to_publish,
            "session_open_before": self.core.session is not None,
            "start": time.monotonic(),
            **({} if received is None else {"received": received}),
        }
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            self.core.record(method, False, bucket=bucket, error=getattr(exc, "kind", type(exc).__name__), **before)
            raise
        self.core.record(method, True, bucket=bucket, **before)
        self._last_record = self.core.audit[-1]
        return result

    def answered(self, at: float) -> None:
        """The answer to the call just handled left at `at` (its audit record's "answered")."""
        rec, self._last_record = self._last_record, None
        if rec is not None:
            rec["answered"] = at

    def dispatch(self, method: str, body: bytes) -> Any:
        """Decode, apply any armed fault, forward to the TP followers, handle."""
        self._last_record = None  # (`answered` stamps only a record of this request)
        fault = self._armed_for(method, body)
        if fault is not None and self._fire(fault, method) == "corrupt" and method != "load":
            body = body[: len(body) // 2]  # the request arrives truncated
        with self.profiles.call("decode." + method):
            args, kwargs = safe_decode(body, self.manifests)
        if method == "steps":
            return self._steps(*args)
        self.forward(method, encode(args, kwargs) if self.followers else body)  # followers keep no memo
        with self.profiles.call(method):
            return self.handle(method, args, kwargs)

    def forward(self, method: str, body: bytes) -> None:
        """Send a request to every TP follower first. A follower that is gone (its socket reads
        end-of-file: followers never write after start-up) breaks the engine: the head exits, so
        the driver sees the engine die rather than a stream of errors from a half engine."""
        if self.followers and method not in HEAD_ONLY:
            for rank, ch in enumerate(self.followers, start=1):
                try:
                    if ch.poll(0):
                        raise EOFError(f"TP rank {rank} closed its channel")
                    ch.send((method, body))
                except (EOFError, OSError) as exc:
                    raise _Killed(f"TP rank {rank} is gone: {exc}") from exc

    def _fire(self, fault: tuple[str, float], method: str) -> str:
        kind, seconds = fault
        if kind == "kill":
            if self.in_process:
                raise _Killed(method)
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "hang":
            time.sleep(seconds)
        elif kind in SILENT_FAULTS:
            self.core.mangle = kind  # for this call only (`handle` clears it)
        elif method == "load":
            self._corrupt_next_load = True
        return kind

    def _steps(
        self, steps: list[tuple[str, tuple[Any, ...]]], budget: float | None = None, moves_ack: Any = None
    ) -> list[tuple[bool, Any, float]] | Parked:
        """Run consecutive protocol calls, stopping at the first that fails. `budget`: seconds the
        caller gave the whole call, from when the engine takes it up; a step that would start after
        it is not run (an earlier one overran: the caller has given up on the call). `moves_ack`:
        (epoch, n), the last adapter move the caller recorded (`EngineCore.ack_moves`). A drain
        not ready, where this server parks (`parks`), returns `Parked` (see the module doc)."""
        self.core.ack_moves(moves_ack)
        end = None if budget is None else time.monotonic() + budget
        return self._run_steps(Parked(steps, 0, [], end, budget))

    def resume(self, parked: Parked) -> list[tuple[bool, Any, float]]:
        """A parked drain's second look (ready, or its time is up, or another call came), then the
        steps after it: the answer to its request."""
        parked.resumed = True
        out = self._run_steps(parked)
        assert not isinstance(out, Parked)
        return out

    def _run_steps(self, p: Parked) -> list[tuple[bool, Any, float]] | Parked:
        out, end, budget = p.out, p.end, p.budget
        for i in range(p.index, len(p.steps)):
            call, args = p.steps[i]
            again = p.resumed and i == p.index  # the parked drain's second look
            t0 = time.monotonic()
            if again:  # its hold counts from the first look: what is left of it, not a fresh one
                args = _hold_left(args, t0 - p.first)
            if i > 0 and not again and end is not None and t0 >= end:
                out.append((False, ("deadline", f"{call} not started: the call's {budget:.3g}s budget was spent"), 0.0))
                break
            try:
                if call not in PROTOCOL_CALLS:
                    raise EngineError("bad_request", f"{call!r} is not a protocol step")
                bucket = args[0].manifest.index if call == "load" and args and isinstance(args[0], Payload) else None
                fault = self.armed.pop((call, bucket), None) or self.armed.pop((call, None), None)
                if fault is not None and self._fire(fault, call) == "corrupt" and call != "load":
                    raise EngineError("bad_payload", f"{call}: request arrived damaged and could not be decoded")
                if self.followers:
                    self.forward("steps", encode(([(call, args)],), {}))
                with self.profiles.call(call):
                    value = self.handle(call, tuple(args), {})
            except _Killed:
                raise
            except Exception as exc:
                out.append((False, _error_value(exc), time.monotonic() - (p.first if again else t0)))
                break
            if call == "drain" and not again and self.parks and end is not None and not _ready(value):
                until = end - _park_margin(budget or 0.0, self.core.step_s)
                if until > time.monotonic() + PARK_MIN_S:
                    p.index, p.until, p.first = i, until, t0
                    self.core.lora.unsent(value.get("adapter_moves") or [])  # this answer is not sent
                    self.received_at = self._last_record = None  # (the answer has not left: nothing to stamp)
                    return p
            out.append((True, value, time.monotonic() - (p.first if again else t0)))  # a drain's: its wait too
            self.received_at = time.monotonic()  # the next step's turn starts where this one's ended
        self.received_at = None
        return out

    def _armed_for(self, method: str, body: bytes) -> tuple[str, float] | None:
        if not self.armed:
            return None
        bucket = None
        if method == "load":
            try:
                payload = safe_decode(body, self.manifests)[0][0]
                bucket = payload.manifest.index
            except Exception:  # undecodable: handle() reports it
                return None
        return self.armed.pop((method, bucket), None) or self.armed.pop((method, None), None)

    def _arm_fault(self, kind: str, call: str, bucket: int | None = None, seconds: float = 0.0) -> None:
        if kind not in FAULT_KINDS:
            raise EngineError("bad_request", f"fault kind {kind!r}; known {FAULT_KINDS}")
        if (why := self.core.cannot_fault(kind)) is not None:  # it would change nothing: refused, not "injected"
            raise EngineError("bad_request", f"fault kind {kind!r} cannot act on this engine: {why}")
        self.armed[(call, bucket)] = (kind, float(seconds))

    def _probe(self, target_version: int, adapter: str | None = None, moves_ack: Any = None) -> dict[str, Any]:
        return {**self.core.probe(target_version, adapter, moves_ack), "pid": os.getpid()}

    def _ping(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "name": self.name}

    def _state_dict(self) -> dict[str, Any]:
        """The weights it serves (a staged copy is not served until its swap)."""
        with self.core.serving_view():
            return self.core.hf_state_dict()

    def _digests(self) -> dict[str, int]:
        with self.core.serving_view():
            return self.core.digests()

    def _audit(self) -> list[dict[str, Any]]:
        return list(self.core.audit)

    def _attach(self, info: ConnectInfo) -> None:
        """Open a transport's engine side. One receiver per transport kind: an engine behind an API
        that takes several (SGLang: tensors by reference, and a broadcast group) keeps each open."""
        self._detach(info.kind)
        self.receivers[info.kind] = load_receiver(info, self.core.comm.rank)

    def _detach(self, kind: str | None = None) -> None:
        for k in [kind] if kind is not None else list(self.receivers):
            receiver = self.receivers.pop(k, None)
            if receiver is not None:
                self.core.forget_kept()  # the kept copies read the receiver's views
                receiver.close()

    def _load(self, payload: Payload) -> None:
        """Every TP rank reads its own part and checks it; they vote; all apply or none does. A
        single-rank engine whose receiver writes straight into the weights (`direct_targets`,
        `Receiver.read_into`) has applied part of a bucket before any check: a failure then is
        `partial_load`, never one of no effect."""
        receiver = self.receivers.get(payload.kind)
        if receiver is None:
            raise EngineError("not_attached", f"no {payload.kind!r} transport attached; attach before load")
        index = payload.manifest.index
        manifest, skipped = payload.manifest, frozenset[str]()
        cast = payload.fields.get("dtype") == "cast"  # a loader that casts (SGLang's `param.data.copy_`)
        try:
            if payload.fields.get("unknown") == "skip":  # a loader that drops names the model lacks (SGLang's)
                manifest, dropped = self.core.known_only(manifest, drop_tied=payload.fields.get("tied_head") == "skip")
                skipped = frozenset(dropped)
            self.core.check_load(manifest, cast=cast)  # the manifest first: a truncated bucket is named as such
        except EngineError:
            if payload.fields.get("receive_first"):  # a server that receives what the request names, then loads
                with contextlib.suppress(ValueError, KeyError, OSError, IndexError, RuntimeError):
                    receiver.read(payload)  # (SGLang's distributed update): the sender's broadcast completes
            raise
        problem = None
        tensors: list[tuple[str, Any]] = []
        comm = self.core.comm
        clock = self.core.load_host_s
        t0 = time.perf_counter()
        fused = comm.size == 1  # one rank: verify while copying (TP ranks vote first, then apply)
        into: dict[str, Any] = {}  # tensors the receiver writes straight into the weights
        try:
            if (
                fused
                and receiver.expected(payload) is None
                and not self._corrupt_next_load
                and self.core.mangle is None
            ):
                into = self.core.direct_targets(manifest, receiver.writes_into(payload))
            tensors = receiver.read_into(payload, into) if into else receiver.read(payload)
            if skipped:  # read whole (as SGLang decodes the whole bucket), loaded without them
                tensors = [(n, t) for n, t in tensors if n not in skipped]
            if self._corrupt_next_load:
                self._corrupt_next_load = False
                tensors = _damaged(tensors)
            if not fused:
                receiver.verify(payload, tensors)
        except (ValueError, KeyError, OSError, IndexError, RuntimeError) as exc:
            problem = f"{type(exc).__name__}: {exc}"
        t1 = time.perf_counter()
        clock["read"] += t1 - t0
        votes = comm.gather_objects(problem)
        bad = [(rank, p) for rank, p in enumerate(votes) if p is not None]
        if bad:
            self.core.break_session(f"bucket {index} could not be read on TP rank {bad[0][0]}")
            rank, text = bad[0]
            if into:  # not "no effect": some of it may already be in the weights
                raise EngineError("partial_load", f"bucket {index}: {text} (it was read straight into the weights)")
            raise EngineError("bad_payload", f"bucket {index} (TP rank {rank}): {text}")
        stream = receiver.copy_stream
        t1 = time.perf_counter()
        failed: EngineError | None = None
        try:
            with torch_stream(stream):
                self.core.load(
                    manifest, tensors, expected=receiver.expected(payload) if fused else None,
                    tied_head=payload.fields.get("tied_head", "check"), keep=receiver.stable_views, cast=cast,
                )  # fmt: skip
        except EngineError as exc:
            failed = exc
            if into and exc.no_effect:  # refused after the receiver already wrote part of it into the weights
                failed = EngineError(
                    "partial_load", f"{exc.message} (bucket {index} was read straight into the weights)"
                )
                failed.__cause__ = exc
        except Exception as exc:  # a copy that raised part way: what landed is unknown
            self.core.break_session(f"bucket {index} failed while it was copied")
            failed = EngineError("internal", f"{type(exc).__name__}: {exc}")
            failed.__cause__ = exc
        finally:
            receiver.consumed(payload)  # the copies from its buffer are queued: the transport's side may order on them
            t2 = time.perf_counter()
            clock["load"] += t2 - t1
            tensors = into = None  # type: ignore[assignment]  # the views go now: a receiver's deleter may sync here
            clock["drop"] += time.perf_counter() - t2
        # the ack leaves only once every rank has copied its shard; every rank gets here, failed or
        # not, so a rank's failure is every rank's (their collectives stay paired)
        outcomes = comm.gather_objects(None if failed is None else (failed.kind, failed.message))
        if failed is not None:
            raise failed
        bad = [(rank, o) for rank, o in enumerate(outcomes) if o is not None]
        if bad:
            rank, (kind, message) = bad[0]
            self.core.break_session(f"bucket {index} failed on TP rank {rank}")
            raise EngineError(kind, f"TP rank {rank}: {message}")


def torch_stream(stream: Any) -> Any:
    """`torch.cuda.stream(stream)`, or nothing to enter for None (CPU receivers)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


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


def _error_value(exc: BaseException) -> tuple[Any, ...]:
    if isinstance(exc, EngineError):
        return (exc.kind, exc.message, exc.data) if exc.data else (exc.kind, exc.message)
    return "internal", f"{type(exc).__name__}: {exc}"


class _CallProfiles:
    """`REFIT_PROFILE_CALLS=DIR` (a measurement aid, off by default): each engine call's handling
    under cProfile, by call name (`decode.<method>` and `send.<method>`: the request's decoding and
    the answer's send); written at exit to DIR/<engine>-<pid>-calls.txt, per call the 25 costliest
    functions by own time."""

    def __init__(self, where: str | None, name: str) -> None:
        self.where, self.name = where, name
        self.by_call: dict[str, Any] = {}

    @contextlib.contextmanager
    def call(self, method: str) -> Any:
        if not self.where:
            yield
            return
        import cProfile

        prof = self.by_call.setdefault(method, cProfile.Profile())
        prof.enable()
        try:
            yield
        finally:
            prof.disable()

    def write(self) -> None:
        if not self.by_call:
            return
        import pstats

        out = io.StringIO()
        for method, prof in sorted(self.by_call.items()):
            out.write(f"==== {method}\n")
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(25)
        path = os.path.join(str(self.where), f"{self.name}-{os.getpid()}-calls.txt")
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(out.getvalue())


def serve(channel: Channel, server: EngineServer) -> None:
    """Run the engine until SHUTDOWN or until the other side goes away."""
    core = server.core
    server.parks = True
    waiters: dict[int, list[int]] = {}
    parked: tuple[int, str, Parked] | None = None  # a drain waiting for its requests: (call id, method, state)

    def answer(call_id: int, method: str, value: Any) -> None:
        with server.profiles.call("send." + method):
            channel.send((call_id, True, value))
        server.answered(time.monotonic())

    def unpark() -> None:  # the parked drain looks again and its request is answered
        nonlocal parked
        assert parked is not None
        (call_id, method, p), parked = parked, None
        server.received_at = time.monotonic()  # the engine's turn starts now (the wait was generation's)
        answer(call_id, method, server.resume(p))

    try:
        while True:
            if parked is not None and time.monotonic() + core.step_s >= parked[2].until:
                unpark()  # a step now would end past `until`: it answers first
            wait = 0.0 if core.has_work() else core.wake_in()
            if parked is not None:  # (it answers at `until` at the latest)
                left = max(0.0, parked[2].until - core.step_s - time.monotonic())
                wait = left if wait is None else min(wait, left)
            if channel.poll(wait):
                received = time.monotonic()
                msg = channel.recv()
                if msg == SHUTDOWN:
                    break
                call_id, method, body = msg
                if parked is not None and method not in HEAD_ONLY and method != "generate":
                    unpark()  # a call that may change the engine: the parked drain answers first
                try:
                    if method == "generate":
                        args, kwargs = safe_decode(body)
                        server.forward("submit", body)
                        rid = core.submit(*args, **kwargs)
                        waiters.setdefault(rid, []).append(call_id)
                    else:
                        server.received_at = received
                        value = server.dispatch(method, body)
                        if isinstance(value, Parked):
                            parked = (call_id, method, value)
                        else:
                            answer(call_id, method, value)
                except _Killed:
                    raise
                except Exception as exc:  # the engine survives a bad request and says why
                    channel.send((call_id, False, _error_value(exc)))
            elif server.followers:  # TP: the followers step on the head's answer, not on their own clocks
                go = core.has_work()
                server.forward("__step__", b"1" if go else b"")
                core.step(go)
            else:
                core.step()
            finished = core.pop_finished()
            for rid in finished:
                for call_id in waiters.pop(rid, []):
                    channel.send((call_id, True, core.result(rid)))
            if parked is not None and (finished or not core.has_work()) and core.drained():
                unpark()
    except (EOFError, BrokenPipeError, ConnectionResetError, _Killed):
        pass
    finally:
        server.profiles.write()
        server._detach()
        channel.close()


class HostedEngine:
    """A TP=1 engine run by its host's threads (see the module doc), with `EngineClient`'s call
    interface: `call` runs one request on the calling thread under the engine's lock (its timeout
    is the host's to enforce: the call is not handed to anyone); `call_async("generate", ...)`
    submits a generation whose future the step thread settles when it finishes. The step thread
    advances generations whenever no call waits for the engine. An armed kill ends the engine and
    raises `EngineDied` (the host decides how to die)."""

    def __init__(self, core: EngineCore, name: str) -> None:
        self.name = name
        self.tp = 1
        self.pid = os.getpid()
        self.server = EngineServer(core, name, in_process=True)
        self.core = core
        self._cond = threading.Condition(threading.Lock())
        self._count = threading.Lock()
        self._callers = 0  # calls waiting for the engine: the step thread lets them go first
        self._waiters: dict[int, Any] = {}  # request id -> its Future
        self._dead: EngineDied | None = None
        self._stepper = threading.Thread(target=self._steps, name=f"refit-engine-{name}", daemon=True)
        self._stepper.start()

    @property
    def alive(self) -> bool:
        return self._dead is None

    @contextlib.contextmanager
    def _locked(self) -> Any:
        with self._count:
            self._callers += 1
        done: list[tuple[Any, Any]] = []
        try:
            with self._cond:  # held by the step thread for at most one decode step
                if self._dead is not None:
                    raise self._dead
                yield
                done = self._finished()
        finally:
            with self._count:
                self._callers -= 1
            with self._cond:
                self._cond.notify_all()  # the step thread: the call is done (and may have made work)
            _settle(done)  # outside the lock: a callback may call the engine again

    def _finished(self) -> list[tuple[Any, Any]]:
        """Under the lock: (future, result) of every generation that finished."""
        out = []
        for rid in self.core.pop_finished():
            fut = self._waiters.pop(rid, None)
            if fut is not None:
                out.append((fut, self.core.result(rid)))
        return out

    def _steps(self) -> None:
        while True:
            with self._cond:
                while self._dead is None and (self._callers or not self.core.has_work()):
                    self._cond.wait(None if self._callers else self.core.wake_in())  # a hold lapsing wakes it
                if self._dead is not None:
                    return
                self.core.step()
                done = self._finished()
            _settle(done)  # outside the lock: a callback may submit the next prompt

    def call(self, method: str, *args: Any, timeout: float | None = None, **kwargs: Any) -> Any:
        with self._locked():
            try:
                return self.server.dispatch(method, encode(args, kwargs))
            except _Killed as exc:
                self._end(EngineDied(f"engine {self.name}: killed by an armed fault at {exc}"))
                raise self._dead from None  # type: ignore[misc]

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Any:
        fut: Future[Any] = Future()
        try:
            if method != "generate":
                fut.set_result(self.call(method, *args, **kwargs))
                return fut
            with self._locked():
                self._waiters[self.core.submit(*args, **kwargs)] = fut
        except Exception as exc:
            fut.set_exception(exc)
        return fut

    def _end(self, why: EngineDied) -> None:
        """Under the lock: the engine is gone; pending generations fail with it (settled on a
        thread of their own: a callback may call the engine, which must not wait for this lock)."""
        self._dead = why
        waiters, self._waiters = self._waiters, {}
        self._cond.notify_all()
        if waiters:
            threading.Thread(target=lambda: [f.set_exception(why) for f in waiters.values()], daemon=True).start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop now: generations still running fail (they are not run to the end)."""
        with self._count:
            self._callers += 1  # the step thread lets go of the engine after its current step
        try:
            with self._cond:
                if self._dead is None:
                    self._end(EngineDied(f"engine {self.name} was shut down"))
        finally:
            with self._count:
                self._callers -= 1
        self._stepper.join(timeout)
        self.server._detach()


def _settle(done: list[tuple[Any, Any]]) -> None:
    for fut, result in done:
        fut.set_result(result)


def follow(channel: Channel, server: EngineServer) -> None:
    """A TP follower's loop: run what the head forwards, until the head goes away."""
    core = server.core
    try:
        while True:
            method, body = channel.recv()
            if method == "__step__":
                core.step(body == b"1")
                continue
            try:
                args, kwargs = safe_decode(body)
                if method == "steps":
                    for call, call_args in args[0]:
                        server.handle(call, tuple(call_args), {})
                elif method == "submit":
                    core.submit(*args, **kwargs)
                else:
                    server.handle(method, args, kwargs)
            except Exception:
                pass  # group shows up again at the next collective, and the head's exit ends this loop
    except (EOFError, OSError, BrokenPipeError, ConnectionResetError):
        pass
    finally:
        server._detach()


def _die_with_parent() -> None:
    """A follower is killed when its head dies (Linux), so no TP rank outlives its engine."""
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


TP_STORE_TIMEOUT = datetime.timedelta(seconds=120)
TP_GROUP_TIMEOUT = datetime.timedelta(seconds=600)  # a TP collective waits for a rank this long


def _tp_group(store: Any, rank: int, size: int) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, size, TP_GROUP_TIMEOUT)


def process_main(fd: int, spec: dict[str, Any]) -> None:
    """Entry point of an engine process: `python -m refit.reference.server FD JSON`. The head
    (TP rank 0) starts its followers with the same command and `"tp_rank"` set."""
    from multiprocessing.connection import Connection

    import torch

    from refit.reference.engine import Comm
    from refit.reference.model import ModelConfig

    torch.set_num_threads(spec["threads"])
    device = torch.device(spec.get("device", "cpu"))
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # receivers and collectives use the engine's own GPU
    conn = Connection(fd)
    tp, rank = int(spec.get("tp", 1)), int(spec.get("tp_rank", 0))
    comm, store, followers, procs = None, None, [], []
    if tp > 1:
        import torch.distributed as dist

        if rank > 0:
            _die_with_parent()
        port = int(spec.get("tp_port", 0))
        store = dist.TCPStore(
            "127.0.0.1", port, tp, is_master=rank == 0, wait_for_workers=False, timeout=TP_STORE_TIMEOUT
        )
    if tp > 1 and rank == 0:
        for r in range(1, tp):
            ours, theirs = socket.socketpair()
            child = {**spec, "tp_rank": r, "tp_port": store.port}
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "refit.reference.server", str(theirs.fileno()), json.dumps(child)],
                pass_fds=(theirs.fileno(),),
            ))  # fmt: skip
            theirs.close()
            followers.append(PipeChannel(Connection(ours.detach())))
    if tp > 1:
        comm = Comm(_tp_group(store, rank, tp), rank, tp)
    core = EngineCore(
        ModelConfig(**spec["config"]), spec["seed"], version=spec["version"], serving=spec["serving"], comm=comm,
        device=spec.get("device", "cpu"), max_running=int(spec.get("max_running", 8)),
        memory_limit=spec.get("memory_limit"), batch_decode=bool(spec.get("batch_decode", False)),
    )  # fmt: skip
    channel = PipeChannel(conn)
    if rank > 0:
        channel.send(("ready", os.getpid()))
        follow(channel, EngineServer(core, spec["name"], in_process=False))
        return
    for f in followers:  # every follower built its core: the engine is ready
        f.recv()
    conn.send(("ready", os.getpid()))
    try:
        serve(channel, EngineServer(core, spec["name"], in_process=False, followers=followers))
    finally:
        for f in followers:
            f.close()
        for p in procs:
            with contextlib.suppress(Exception):
                p.wait(5)
        del store


if __name__ == "__main__":
    process_main(int(sys.argv[1]), json.loads(sys.argv[2]))
