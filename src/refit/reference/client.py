"""Trainer-side handle on a reference engine running in a spawned process or a thread.

Calls are matched to replies by id on a reader thread, so many threads may call at once; every
call waits at most `timeout` seconds. If the engine dies, every pending and later call raises
`EngineDied` at once instead of hanging.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from refit.errors import EngineDied, EngineError
from refit.reference import forkserver
from refit.reference.engine import EngineCore
from refit.reference.model import ModelConfig
from refit.reference.server import (
    SHUTDOWN,
    Channel,
    EngineServer,
    LocalChannel,
    ManifestMemo,
    PipeChannel,
    encode_defining,
    serve,
)


class EngineClient:
    def __init__(
        self,
        channel: Channel,
        name: str,
        *,
        pid: int | None = None,
        process: Any = None,
        thread: threading.Thread | None = None,
        tp: int = 1,
    ) -> None:
        self.name = name
        self.tp = tp
        self.pid = pid
        self.process = process
        self._thread = thread
        self._channel = channel
        self._send_lock = threading.Lock()
        self._pending: dict[int, Future[Any]] = {}
        self._memo = ManifestMemo()  # manifests the engine holds travel as keys (server.py)
        self._defines: dict[int, list[int]] = {}  # call id -> the manifest keys its body defined
        self._pending_lock = threading.Lock()
        self._ids = itertools.count()
        self._dead: EngineDied | None = None
        self._close_lock = threading.Lock()  # close runs once: a second os.close could hit a reused fd
        self._closed = False
        self._reader = threading.Thread(target=self._read, name=f"refit-client-{name}", daemon=True)
        self._reader.start()

    # ---- plumbing ---------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            while True:
                call_id, ok, value = self._channel.recv()
                with self._pending_lock:
                    fut = self._pending.pop(call_id, None)
                    defined = self._defines.pop(call_id, None)
                if ok and defined:  # decoded and run: the engine holds what the body defined
                    self._memo.confirm(defined)
                if fut is None:
                    continue  # a reply to a call that already timed out
                if ok:
                    fut.set_result(value)
                else:
                    fut.set_exception(EngineError(*value))
        except (EOFError, OSError, ConnectionResetError):
            pass
        code = self.process.poll() if self.process is not None else None
        self._dead = EngineDied(f"engine {self.name} is gone" + (f" (exit code {code})" if code is not None else ""))
        with self._pending_lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(self._dead)

    @property
    def alive(self) -> bool:
        return self._dead is None

    def call_async(self, method: str, *args: Any, **kwargs: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        if self._dead is not None:
            fut.set_exception(self._dead)
            return fut
        call_id = next(self._ids)
        body, defined = encode_defining(args, kwargs, self._memo)
        with self._pending_lock:
            self._pending[call_id] = fut
            if defined:
                self._defines[call_id] = defined
        try:
            with self._send_lock:
                self._channel.send((call_id, method, body))
        except (OSError, BrokenPipeError) as exc:
            with self._pending_lock:
                self._pending.pop(call_id, None)
                self._defines.pop(call_id, None)
            fut.set_exception(EngineDied(f"engine {self.name}: cannot send {method}: {exc}"))
        return fut

    def call(self, method: str, *args: Any, timeout: float, **kwargs: Any) -> Any:
        fut = self.call_async(method, *args, **kwargs)
        try:
            return fut.result(timeout=max(timeout, 0.0))
        except FutureTimeout:
            raise TimeoutError(f"engine {self.name}: {method} did not answer within {timeout:.3g}s") from None

    def close(self, timeout: float = 10.0) -> None:
        """Stop the engine (politely, then by force) and wait for it. Safe from several threads at
        once (an emulated server's death closes it on a thread while its restart closes it too):
        the first call closes, the others wait for it."""
        with self._close_lock:
            if self._closed:
                return
            self._close(timeout)
            self._closed = True

    def _close(self, timeout: float) -> None:
        if self._dead is None:
            try:
                with self._send_lock:
                    self._channel.send(SHUTDOWN)
            except (OSError, BrokenPipeError):
                pass
        if self.process is not None:
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
        self._reader.join(timeout)
        self._channel.close()


@dataclass
class _Launch:
    name: str
    proc: Any  # a subprocess.Popen, or a forkserver.ForkedProcess
    conn: Connection
    tp: int = 1


def launch_process(
    name: str,
    config: ModelConfig,
    seed: int,
    *,
    version: int = 0,
    threads: int = 1,
    serving: bool = True,
    tp: int = 1,
    device: str = "cpu",
    max_running: int = 8,
    memory_limit: int | None = None,
    batch_decode: bool = False,
) -> _Launch:
    """Start an engine process without waiting for it (see `await_ready`).

    The engine runs `python -m refit.reference.server` over one end of a socket pair, so starting
    it never re-imports the caller's main module (as multiprocessing's spawn would).
    """
    ours, theirs = socket.socketpair()
    spec = {
        "config": config.to_dict(), "seed": seed, "name": name, "version": version, "threads": threads,
        "serving": serving, "tp": tp, "device": device, "max_running": max_running, "memory_limit": memory_limit,
        "batch_decode": batch_decode,
    }  # fmt: skip
    proc: Any
    if forkserver.enabled(device):  # a fork of a process that imported the server already
        try:
            proc = forkserver.launch(theirs.fileno(), spec)
        except BaseException:
            ours.close()
            theirs.close()
            raise
    else:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "refit.reference.server", str(theirs.fileno()), json.dumps(spec)],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
    theirs.close()
    _CHILDREN.add(proc)
    return _Launch(name, proc, Connection(ours.detach()), tp)


def await_ready(launch: _Launch, start_timeout: float = 120.0) -> EngineClient:
    name, proc, conn = launch.name, launch.proc, launch.conn
    if not conn.poll(start_timeout):
        proc.kill()
        raise TimeoutError(f"engine {name} did not start within {start_timeout}s")
    try:
        tag, pid = conn.recv()
    except EOFError:
        code = proc.wait(5)
        raise EngineDied(f"engine {name} exited during start-up (exit code {code})") from None
    if tag != "ready":
        proc.kill()
        raise EngineDied(f"engine {name} sent {tag!r} instead of ready")
    return EngineClient(PipeChannel(conn), name, pid=pid, process=proc, tp=launch.tp)


_CHILDREN: weakref.WeakSet[Any] = weakref.WeakSet()  # Popen or ForkedProcess


@atexit.register
def _reap_children() -> None:
    for proc in list(_CHILDREN):
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


def start_thread(
    name: str,
    config: ModelConfig,
    seed: int,
    *,
    version: int = 0,
    serving: bool = True,
    core: type[EngineCore] = EngineCore,
    max_running: int = 8,
    memory_limit: int | None = None,
    batch_decode: bool = False,
) -> EngineClient:
    """Run an engine on a thread of this process (same loop as the process version). `core`: an
    EngineCore subclass (tests use one to host an engine-side bug behind a correct driver);
    `max_running`: requests decoded at once (the rest wait); `memory_limit`, `batch_decode`: see
    EngineCore."""
    ours, theirs = LocalChannel.pair()
    engine = core(
        config, seed, version=version, serving=serving, max_running=max_running, memory_limit=memory_limit,
        batch_decode=batch_decode,
    )  # fmt: skip
    server = EngineServer(engine, name, in_process=True)
    thread = threading.Thread(target=serve, args=(theirs, server), name=f"refit-engine-{name}", daemon=True)
    thread.start()
    return EngineClient(ours, name, thread=thread)
