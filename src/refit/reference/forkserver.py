"""Reference engine processes forked from one pre-imported process (opt-in: `REFIT_FORKSERVER=1`).

An engine process spends about 1.8 s of CPU importing torch before it serves. With the fork
server, one process (`python -m refit.reference.forkserver FD`) imports `refit.reference.server`
once; each CPU engine is then a fork of it that runs the same `process_main` over its own socket,
as `python -m refit.reference.server` would. The test suite starts hundreds of engines and uses
it (tests/conftest.py); CUDA engines are always started by exec (a CUDA context must not be forked,
and the fork server never makes one), as are TP followers (their head starts them).

Lifecycle: started by the first launch in a process, it ends when that process's end of its
socket closes (the process exited or died; not PDEATHSIG, which would fire when the thread that
started it ends); it reaps the engines it forked and sends back each one's exit code, which
`ForkedProcess` (the `subprocess.Popen` subset the client uses: pid, poll, wait, kill) reports.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import Future
from typing import Any

ENV = "REFIT_FORKSERVER"
START_TIMEOUT_S = 120.0  # the fork server's imports, on a loaded machine


def enabled(device: str) -> bool:
    return os.environ.get(ENV) == "1" and device == "cpu"


class ForkedProcess:
    """An engine forked by the fork server: what `EngineClient` and `launch_process` use of a Popen."""

    def __init__(self, pid: int, server: _Client) -> None:
        self.pid = pid
        self.args = f"forked engine {pid}"
        self.returncode: int | None = None
        self._server = server
        self._exited = threading.Event()

    def _exit(self, code: int) -> None:
        self.returncode = code
        self._exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and self._server.dead and not _exists(self.pid):
            self._exit(-signal.SIGKILL)  # the server that would report its code is gone; so is it
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if end is None else end - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._exited.wait(0.05 if left is None else min(left, 0.05))
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def _exists(pid: int) -> bool:
    """Still running (a zombie, dead but not reaped by whoever adopted it, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


class _Client:
    """This process's end of its fork server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OMP_NUM_THREADS": "1"}  # each engine sets its own from its spec
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "refit.reference.forkserver", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
        )
        theirs.close()
        self.sock = ours
        self.dead = False
        self._ids = itertools.count()
        self._send = threading.Lock()
        self._lock = threading.Lock()
        self._pending: dict[int, Future[ForkedProcess]] = {}
        self._procs: dict[int, ForkedProcess] = {}
        threading.Thread(target=self._read, name="refit-forkserver", daemon=True).start()

    def _read(self) -> None:
        try:
            while msg := self.sock.recv(4096):
                m = json.loads(msg)
                with self._lock:
                    if "pid" in m:
                        proc = self._procs[m["pid"]] = ForkedProcess(m["pid"], self)
                        self._pending.pop(m["id"]).set_result(proc)
                    elif "error" in m:
                        self._pending.pop(m["id"]).set_exception(RuntimeError(m["error"]))
                    elif (proc := self._procs.pop(m["exit"], None)) is not None:
                        proc._exit(m["code"])
        except (OSError, ValueError):
            pass
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)  # reaped, and its exit code known for the errors below
        with self._lock:
            self.dead = True
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RuntimeError(f"the engine fork server is gone (exit code {self.proc.poll()})"))

    def launch(self, fd: int, spec: dict[str, Any]) -> ForkedProcess:
        fut: Future[ForkedProcess] = Future()
        with self._lock:
            if self.dead:
                raise RuntimeError("the engine fork server is gone")
            call_id = next(self._ids)
            self._pending[call_id] = fut
        with self._send:
            socket.send_fds(self.sock, [json.dumps({"id": call_id, "spec": spec}).encode()], [fd])
        return fut.result(timeout=START_TIMEOUT_S)


_clients: dict[int, _Client] = {}  # per process id: a forked caller starts its own
_clients_lock = threading.Lock()


def server_pids() -> list[int]:
    """The process id of this process's fork server, if one runs."""
    client = _clients.get(os.getpid())
    return [] if client is None or client.dead else [client.proc.pid]


def launch(fd: int, spec: dict[str, Any]) -> ForkedProcess:
    """Fork an engine that runs `process_main(fd, spec)` (the fork server starts on first use)."""
    with _clients_lock:
        client = _clients.get(os.getpid())
        if client is None or client.dead:
            client = _clients[os.getpid()] = _Client()
    return client.launch(fd, spec)


# ---- the fork server ------------------------------------------------------------------------


def _child(fd: int, spec: dict[str, Any]) -> None:
    from refit.reference.server import process_main

    code = 0
    try:
        process_main(fd, spec)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve(sock: socket.socket) -> None:
    """Fork an engine per request (its socket's fd rides the request); report each one's exit."""
    import refit.reference.server  # noqa: F401  (the imports every engine would otherwise repeat)

    while True:
        ready, _, _ = select.select([sock], [], [], 0.05)
        if ready:
            try:
                msg, fds, _, _ = socket.recv_fds(sock, 1 << 20, 1)
            except OSError:
                return
            if not msg:
                return  # the client is gone
            req = json.loads(msg)
            try:
                pid = os.fork()
            except OSError as exc:
                sock.send(json.dumps({"id": req["id"], "error": f"fork failed: {exc}"}).encode())
                os.close(fds[0])
                continue
            if pid == 0:
                sock.close()
                _child(fds[0], req["spec"])
            os.close(fds[0])
            sock.send(json.dumps({"id": req["id"], "pid": pid}).encode())
        while True:  # reap: each exit reported once
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            with contextlib.suppress(OSError):
                sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
