"""Ray hosting (extra `[ray]`): reference engines and trainer ranks as Ray actors, an owner-token
lock in a Ray actor, and engine or rank death seen through Ray. Nothing in the core knows it is on
Ray: `RayEngine` is the reference engine's driver over an actor, `RayRanks` a `Ranks` hosting,
`RayLock` an `EngineLock`.

  engine actor  a synchronous, single-threaded Ray actor (Ray runs one submitter's calls to it in
                submission order, the per-engine order the protocol needs) hosting one reference
                engine: TP=1 in the actor's process (`HostedEngine`: each call runs on the actor's
                own thread under the engine's lock; generation steps on a thread between calls),
                TP>1 as the actor's child processes (an inference server's workers). Each call
                returns as soon as the engine answered; generation is submitted and
                polled, never awaited inside the actor. An engine killed by an armed fault takes
                its actor with it, as a crashed engine process would. A restarted actor (Ray's
                `max_restarts`) starts out of service: it holds the checkpoint, not the weights
                its version names, until a refit completes.
  RayEngine     `ReferenceEngine` over `RayClient`: each wave's steps for the engine are one actor
                call whose ObjectRef's own future the runner waits on (no thread per pending call).
                Refit errors come back from the actor as data (kind, message) and are rebuilt, so
                they keep their kind; an actor that died (ActorDiedError, its node lost) is
                `EngineDied` (`ActorUnavailableError`, transient by Ray's account, is a timeout:
                state unknown). The incarnation is the actor's current process, asked at each run
                start (bounded): a restart, seen by a failed call or not, is a new incarnation, so
                the runner reconnects it and refits it fully.
  RayLock       an `EngineLock` hosted by a named Ray actor in a fixed namespace (shared by every
                process of the cluster that names it), every call bounded, with an optional lease
                for a holder that died holding it.

  RankHost      a trainer rank's side of `RayRanks`, kept by the user's trainer actor (one per
                rank, over that rank's own Source and Transport): the actor exposes one method
                that hands each step to it (`await host.step(...)` in an async actor). Steps are
                numbered by the leader and start in that order whatever order Ray delivers them
                in (Ray orders calls only for synchronous single-threaded actors, which would
                also serialize the send lane behind packing); each runs on the participant's
                ordered lanes (pack of bucket k+1 while bucket k is sent). Errors come back as
                data; every answer carries whether this rank's transport is connected.
  RayRanks      the leader (the driver process, which holds no source): each step is one actor
                call per rank, awaited through the ObjectRef's own future; a rank actor that died
                (ActorDiedError, node loss) is a `RankError` naming the rank.

Lifecycle per state: the reference engine's (refit.drivers.reference) and the participant's
(refit.protocol.ranks), unchanged.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import signal
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from refit.drivers.base import Source, Transport
from refit.drivers.reference import ReferenceEngine
from refit.errors import EngineDied, EngineError, RankError
from refit.protocol.lock import EngineLock
from refit.protocol.ranks import Lanes, Participant, Ranks, RankStep, combine

ACTOR_CALL_TIMEOUT_S = 3600.0  # inside the actor; the caller's own deadline bounds every call
POLL_S = 0.005  # how often a pending generation is polled


class EngineActor:
    """The engine actor's class (`ray.remote` is applied when an engine starts, so `import refit`
    never imports Ray)."""

    def __init__(self, name: str, config: dict[str, Any], seed: int, version: int, serving: bool, tp: int = 1) -> None:
        import ray

        from refit.reference.client import await_ready, launch_process
        from refit.reference.engine import EngineCore
        from refit.reference.model import ModelConfig
        from refit.reference.server import HostedEngine

        with warnings.catch_warnings():  # Ray marks the property deprecated and has no replacement for it
            warnings.simplefilter("ignore")
            restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        model = ModelConfig(**config)
        serving = serving and not restarted
        self.client: Any
        if tp == 1:  # calls run on the actor's thread, under the engine's lock (no hop to another thread)
            self.client = HostedEngine(EngineCore(model, seed, version=version, serving=serving), name)
        else:  # TP ranks are the actor's child processes (as an inference server's workers are)
            model.check_tp(tp)
            self.client = await_ready(launch_process(name, model, seed, version=version, serving=serving, tp=tp))
        self.identity = {"pid": os.getpid(), "restarted": restarted, "tp": tp}
        self.tickets: dict[int, Future[Any]] = {}
        self.ids = itertools.count()

    def ident(self) -> dict[str, Any]:
        return self.identity

    def call(self, request: bytes) -> bytes:
        """One request, pickled by the caller: `(method, args, kwargs)`; the reply, pickled. (Ray
        moves one bytes object faster than it serializes a tuple of arguments and a tuple back:
        about 2 ms per wave to 8 actors on a 2-core host.)"""
        method, args, kwargs = pickle.loads(request)
        return pickle.dumps(self._call(method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)

    def _call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        try:
            return ("ok", self.client.call(method, *args, timeout=ACTOR_CALL_TIMEOUT_S, **kwargs))
        except EngineDied:  # the engine is gone (an armed kill, a crash): so is its actor
            os.kill(os.getpid(), signal.SIGKILL)
            raise
        except EngineError as exc:
            return ("err", exc.kind, exc.message, exc.data)
        except TimeoutError as exc:
            return ("timeout", str(exc))
        except Exception as exc:
            return ("err", "internal", f"{type(exc).__name__}: {exc}", None)

    def submit(self, prompt: list[int], max_new_tokens: int) -> int:
        ticket = next(self.ids)
        self.tickets[ticket] = self.client.call_async("generate", prompt, max_new_tokens)
        return ticket

    def poll(self, tickets: list[int]) -> dict[int, tuple[Any, ...]]:
        done = {}
        for t in tickets:
            fut = self.tickets.get(t)
            if fut is None:
                done[t] = ("err", "bad_request", f"no generation {t}", None)
            elif fut.done():
                del self.tickets[t]
                exc = fut.exception()
                if exc is None:
                    done[t] = ("ok", fut.result())
                elif isinstance(exc, EngineError):
                    done[t] = ("err", exc.kind, exc.message, exc.data)
                else:
                    done[t] = ("err", "internal", f"{type(exc).__name__}: {exc}", None)
        return done

    def shutdown(self) -> None:
        self.client.close()


def _why(exc: BaseException, limit: int = 400) -> str:
    """What a Ray error says went wrong: the remote exception's own text (a RayTaskError's text
    starts with the remote traceback), else the end of the error's text."""
    cause = getattr(exc, "cause", None)
    text = f"{type(cause).__name__}: {cause}" if isinstance(cause, BaseException) else str(exc)
    text = " ".join(text.split())
    return text if len(text) <= limit else "..." + text[-limit:]


@functools.cache
def _engine_actor_class() -> Any:
    import ray

    # synchronous and single-threaded: Ray runs one submitter's calls in submission order
    return ray.remote(num_cpus=0, max_concurrency=1)(EngineActor)


def _settle(reply: tuple[Any, ...], out: Future[Any]) -> None:
    tag, *rest = reply
    if tag == "ok":
        out.set_result(rest[0])
    elif tag == "timeout":
        out.set_exception(TimeoutError(rest[0]))
    else:
        kind, message, data = rest
        out.set_exception(EngineError(kind, message, data) if data else EngineError(kind, message))


class RayClient:
    """The `EngineClient` interface over an engine actor (what `ReferenceEngine` drives)."""

    def __init__(self, actor: Any, name: str, *, timeout: float = 120.0) -> None:
        import ray

        self.actor = actor
        self.name = name
        self._closed = False
        self._dead: EngineDied | None = None
        ident = ray.get(actor.ident.remote(), timeout=timeout)
        self.pid: int | None = int(ident["pid"])
        self.tp = int(ident.get("tp", 1))
        self._generations: dict[int, Future[Any]] = {}
        self._poller: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self._dead is None

    def _died(self, exc: BaseException) -> EngineDied:
        self._dead = EngineDied(f"engine {self.name}: its Ray actor died ({type(exc).__name__}: {_why(exc)})")
        return self._dead

    def _translate(self, exc: BaseException) -> BaseException:
        import ray

        unavailable = getattr(ray.exceptions, "ActorUnavailableError", ())
        if unavailable and isinstance(exc, unavailable):  # transient (Ray says so): state unknown, not dead
            return TimeoutError(f"engine {self.name}: its Ray actor is unavailable ({_why(exc)})")
        if isinstance(exc, ray.exceptions.RayActorError):  # ActorDiedError, node loss
            return self._died(exc)
        if isinstance(exc, ray.exceptions.GetTimeoutError):
            return TimeoutError(f"engine {self.name}: {exc}")
        return exc

    def refresh(self, timeout: float = 2.0) -> None:
        """Ask the actor which process serves it now (bounded): Ray may have restarted it since the
        last call, with or without any call seeing the death; a new process is a new incarnation."""
        if self._closed:
            return
        import ray

        try:
            ident = ray.get(self.actor.ident.remote(), timeout=timeout)
        except Exception as exc:
            if self._dead is None and isinstance(exc, ray.exceptions.ActorDiedError):
                self._died(exc)
            return  # dead, or not back yet: the incarnation stays the last one seen
        self.pid, self._dead = int(ident["pid"]), None

    def _remote(self, submit: Callable[[], Any], settle: Callable[[Any, Future[Any]], None]) -> Future[Any]:
        """One actor call: `submit()` makes it; its ObjectRef's own future hands the answer to
        `settle(answer, out)`; Ray's errors (at submission or on the reply) are translated."""
        out: Future[Any] = Future()
        try:
            ref = submit()
        except Exception as exc:
            out.set_exception(self._translate(exc))
            return out

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                out.set_exception(self._translate(exc))
            else:
                settle(f.result(), out)

        ref.future().add_done_callback(done)
        return out

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        if self._dead is not None:
            out: Future[Any] = Future()
            out.set_exception(self._dead)
            return out
        if method == "generate":
            return self._generate(*args)
        request = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        return self._remote(
            lambda: self.actor.call.remote(request), lambda reply, out: _settle(pickle.loads(reply), out)
        )

    def call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        fut = self.call_async(method, *args, **kwargs)
        try:
            return fut.result(timeout=max(timeout, 0.0))
        except TimeoutError:
            if fut.done():  # the call's own outcome (an unavailable actor), not our wait
                raise
            raise TimeoutError(f"engine {self.name}: {method} did not answer within {timeout:.3g}s") from None

    # ---- generation: submitted, then polled (the actor never blocks on it) ----------------------

    def _generate(self, prompt: Sequence[int], max_new_tokens: int) -> Future[Any]:
        """Submitted without waiting (the caller's own timeout bounds the wait for the result)."""

        def submitted(ticket: Any, out: Future[Any]) -> None:  # settled later, by the poller
            with self._lock:
                self._generations[int(ticket)] = out
                if self._poller is None:
                    self._poller = threading.Thread(target=self._poll, name=f"refit-ray-{self.name}", daemon=True)
                    self._poller.start()

        return self._remote(lambda: self.actor.submit.remote(list(prompt), max_new_tokens), submitted)

    def _poll(self) -> None:
        import ray

        while True:
            with self._lock:
                tickets = list(self._generations)
                if not tickets:
                    self._poller = None
                    return
            try:  # no limit of its own: each caller's timeout bounds its wait; a dead actor ends it
                done = ray.get(self.actor.poll.remote(tickets))
            except Exception as exc:
                err = self._translate(exc)
                with self._lock:
                    pending, self._generations = self._generations, {}
                    self._poller = None
                for fut in pending.values():
                    fut.set_exception(err)
                return
            for ticket, reply in done.items():
                with self._lock:
                    fut = self._generations.pop(int(ticket), None)
                if fut is not None:
                    _settle(reply, fut)
            time.sleep(POLL_S)

    def close(self, timeout: float = 10.0) -> None:
        import ray

        if self._dead is None:
            with contextlib.suppress(Exception):
                ray.get(self.actor.shutdown.remote(), timeout=timeout)
        self._closed = True
        with contextlib.suppress(Exception):
            ray.kill(self.actor, no_restart=True)
        self._dead = self._dead or EngineDied(f"engine {self.name} was closed")


class RayEngine(ReferenceEngine):
    """A reference engine hosted by a Ray actor (see the module docstring)."""

    def __init__(self, client: RayClient, lock: EngineLock | None = None) -> None:
        super().__init__(client)  # type: ignore[arg-type]
        self._lock = lock

    @classmethod
    def start(
        cls,
        name: str,
        config: Any = None,
        seed: int = 0,
        *,
        version: int = 0,
        serving: bool = True,
        tp: int = 1,
        max_restarts: int = 0,
        lock: EngineLock | None = None,
        timeout: float = 120.0,
        options: dict[str, Any] | None = None,
    ) -> RayEngine:
        """An engine actor on the connected Ray cluster (`ray.init()` first). `tp`: TP ranks (more
        than one: the actor's child processes, each holding a shard). `max_restarts`: Ray
        restarts a dead actor this many times (each restart is a new incarnation, out of service
        until refit). `lock`: the engine set's shared lock (e.g. a `RayLock`). `options`: more
        `.options(...)` for the actor, e.g. a `scheduling_strategy` that keeps it on the trainer's
        node (transports that share memory need the same host)."""
        from refit.reference.model import ModelConfig

        (config or ModelConfig()).check_tp(tp)  # refused here, not as an actor that fails to start
        actor_cls = _engine_actor_class()
        actor = actor_cls.options(max_restarts=max_restarts, max_task_retries=0, **(options or {})).remote(
            name, (config or ModelConfig()).to_dict(), seed, version, serving, tp
        )
        return cls(RayClient(actor, name, timeout=timeout), lock)

    @property
    def incarnation(self) -> str:
        self.client.refresh()  # type: ignore[attr-defined]
        return super().incarnation

    def engine_lock(self) -> EngineLock | None:
        return self._lock


class LockActor:
    """The lock actor's class: one holder at a time, by owner token; with a lease, a holder that has
    not released after `lease_s` is taken to be gone (its process died holding the lock)."""

    def __init__(self, lease_s: float | None = None) -> None:
        self.holder: str | None = None
        self.lease_s = lease_s
        self.since = 0.0
        self.taken = 0

    def acquire(self, owner: str) -> bool:
        expired = self.lease_s is not None and time.monotonic() - self.since > self.lease_s
        if self.holder is None or self.holder == owner or expired:
            self.holder, self.since = owner, time.monotonic()
            self.taken += 1
            return True
        return False

    def acquisitions(self) -> int:
        return self.taken

    def release(self, owner: str) -> bool:
        if self.holder != owner:
            return False
        self.holder = None
        return True

    def get_holder(self) -> str | None:
        return self.holder


@functools.cache
def _lock_actor_class() -> Any:
    import ray

    return ray.remote(num_cpus=0)(LockActor)


class RayLock:
    """An owner-token lock in a named Ray actor, in Ray namespace `namespace`: every process of the
    cluster that names it shares it (trainers on several nodes, a rollout manager). The actor lives
    as long as the job that made it; `detached=True` keeps it across jobs (kill it when done).
    `lease_s`: a holder that has not released after this long is taken to be gone, so a trainer
    that died holding the lock does not block every later refit; set it above your runs' deadline
    plus cleanup grace (None: no lease). Every call waits at most `timeout` seconds."""

    def __init__(
        self, name: str = "refit-engine-lock", *, namespace: str = "refit", timeout: float = 5.0,
        lease_s: float | None = None, detached: bool = False,
    ) -> None:  # fmt: skip
        self.name = name
        self.timeout = timeout
        opts: dict[str, Any] = {"name": name, "namespace": namespace, "get_if_exists": True}
        if detached:
            opts["lifetime"] = "detached"
        self.actor = _lock_actor_class().options(**opts).remote(lease_s)

    def _get(self, ref: Any, what: str) -> Any:
        import ray

        try:
            return ray.get(ref, timeout=self.timeout)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(f"lock actor {self.name!r}: {what} did not answer within {self.timeout:.3g}s") from None

    def acquire(self, owner: str) -> bool:
        return bool(self._get(self.actor.acquire.remote(owner), "acquire"))

    def release(self, owner: str) -> bool:
        return bool(self._get(self.actor.release.remote(owner), "release"))

    @property
    def holder(self) -> str | None:
        return self._get(self.actor.get_holder.remote(), "holder")

    @property
    def acquisitions(self) -> int:
        """How many times the lock was taken (see `LocalLock.acquisitions`)."""
        return int(self._get(self.actor.acquisitions.remote(), "acquisitions"))


# ---- trainer ranks as Ray actors ------------------------------------------------------------------


class RankHost:
    """One trainer rank's share of every step, inside that rank's Ray actor (see the module doc).

    In the user's trainer actor (async: any `async def` method makes it one):

        self.refit = RankHost(source, transport, rank, world)        # once, next to the model
        async def refit_step(self, session, seq, step):              # what RayRanks calls
            return await self.refit.step(session, seq, step)
    """

    def __init__(self, source: Source, transport: Transport, rank: int, world: int) -> None:
        self.participant = Participant(source, transport, rank, world)
        self._lanes = Lanes(self.participant)
        self._lock = threading.Lock()
        self._sessions: dict[str, _Session] = {}  # per leader (context): its own numbering

    def submit(self, session: str, seq: int, step: RankStep) -> Future[tuple[Any, ...]]:
        """Queue step `seq` of the leader's `session`: it starts once every earlier step of that
        session has; the future holds the answer (never raises). A number already seen (a
        duplicate delivery) is answered with an error at once. A step that waits on an earlier
        one that does not come within `GAP_S` (Ray delivers a submitter's calls microseconds
        apart) fails, with every later step of that leader: this host lost them (its actor was
        restarted, which gives it a fresh host) and the leader needs a new context."""
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                s = self._sessions[session] = _Session()
                for old in list(self._sessions)[:-MAX_SESSIONS]:  # leaders long gone: drop their waits
                    for fut in self._sessions.pop(old).answers.values():
                        fut.set_result(("err", "superseded: newer refit contexts lead these ranks", self.connected))
            out: Future[tuple[Any, ...]] = Future()
            if s.lost is not None:
                out.set_result(("err", s.lost, self.connected))
                return out
            if seq < s.next or seq in s.arrived:
                out.set_result(("err", f"step {seq} was delivered twice (this rank already has it)", self.connected))
                return out
            answer = s.answers.setdefault(seq, out)
            s.arrived[seq] = step
            while s.next in s.arrived:
                n = s.next
                s.next += 1
                self._lanes.submit(s.arrived.pop(n)).add_done_callback(
                    functools.partial(self._answer, s.answers.pop(n))
                )
            if s.arrived and s.timer is None:  # a gap: give the missing steps GAP_S to arrive
                s.timer = threading.Timer(GAP_S, self._gap, (session, s.next))
                s.timer.daemon = True
                s.timer.start()
        return answer

    def _gap(self, session: str, missing: int) -> None:
        with self._lock:
            s = self._sessions.get(session)
            if s is None:
                return
            s.timer = None
            if s.next > missing:  # it came: look again at what still waits
                if s.arrived:
                    s.timer = threading.Timer(GAP_S, self._gap, (session, s.next))
                    s.timer.daemon = True
                    s.timer.start()
                return
            s.lost = (
                f"this rank never got step {missing} of the leader's refit context (its actor was restarted, "
                "which gives it a fresh RankHost, or a call was lost): start a new context"
            )
            waiting, s.arrived, s.answers = s.answers, {}, {}
        for fut in waiting.values():
            fut.set_result(("err", s.lost, self.connected))

    async def step(self, session: str, seq: int, step: RankStep) -> tuple[Any, ...]:
        """`submit`, awaited without blocking the actor's event loop."""
        import asyncio

        return await asyncio.wrap_future(self.submit(session, seq, step))

    @property
    def connected(self) -> bool:
        return bool(self.participant.transport.connected)

    def _answer(self, out: Future[tuple[Any, ...]], fut: Future[Any]) -> None:
        if fut.cancelled():
            out.set_result(("err", "cancelled: the rank's lanes were shut down", self.connected))
            return
        exc = fut.exception()
        if exc is None:
            out.set_result(("ok", fut.result(), self.connected))
        else:
            text = exc.message if isinstance(exc, RankError) else f"{type(exc).__name__}: {exc}"
            out.set_result(("err", text, self.connected))

    def close(self) -> None:
        self._lanes.shutdown()


MAX_SESSIONS = 4  # leaders whose numbering a RankHost keeps (a new context is a new leader)


GAP_S = 2.0  # how long a step waits for an earlier one before the leader's numbering counts as lost


class _Session:
    """One leader's numbering on a RankHost: the next step to start, those that came early."""

    def __init__(self) -> None:
        self.next = 0
        self.arrived: dict[int, RankStep] = {}
        self.answers: dict[int, Future[tuple[Any, ...]]] = {}
        self.timer: threading.Timer | None = None
        self.lost: str | None = None  # why this leader's steps can no longer run here


class RayRanks(Ranks):
    """Trainer ranks hosted by Ray actors (one per rank, in rank order), reached through the actor
    method that hands steps to their `RankHost` (see the module doc)."""

    remote = True

    def __init__(self, actors: Sequence[Any], *, method: str = "refit_step") -> None:
        if not actors:
            raise ValueError("RayRanks needs at least one trainer rank actor")
        self.actors = list(actors)
        self.world = len(self.actors)
        self.method = method
        self._session = f"{os.getpid()}-{id(self):x}-{time.monotonic_ns()}"
        self._seq = itertools.count()
        self._connected = [False] * self.world

    @property
    def connected(self) -> bool:
        return all(self._connected)

    def start(self, step: RankStep, *, timeout: float) -> Future[list[Any]]:
        seq = next(self._seq)
        return combine([self._call(rank, actor, seq, step) for rank, actor in enumerate(self.actors)])

    def _call(self, rank: int, actor: Any, seq: int, step: RankStep) -> Future[Any]:
        import ray

        out: Future[Any] = Future()
        try:
            ref = getattr(actor, self.method).remote(self._session, seq, step)
        except Exception as exc:
            out.set_exception(RankError(rank, f"could not reach its Ray actor: {type(exc).__name__}: {exc}"))
            return out

        def done(f: Future[Any]) -> None:
            exc = f.exception()
            if exc is not None:
                died = isinstance(exc, ray.exceptions.RayActorError)
                self._connected[rank] = False if died else self._connected[rank]
                what = "its Ray actor died" if died else "its Ray actor call failed"
                why = _why(exc)
                if "coroutine" in why:
                    why += (
                        f" (the actor's {self.method} must be `async def` and `await` RankHost.step: a synchronous "
                        "method hands Ray the coroutine instead of the answer)"
                    )
                out.set_exception(RankError(rank, f"{what} ({type(exc).__name__}: {why})"))
                return
            tag, value, connected = f.result()
            self._connected[rank] = bool(connected)
            if tag == "ok":
                out.set_result(value)
            else:
                out.set_exception(RankError(rank, str(value)))

        ref.future().add_done_callback(done)
        return out
