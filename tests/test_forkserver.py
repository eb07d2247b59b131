"""Engine processes forked from a pre-imported process (`REFIT_FORKSERVER=1`, which the suite sets in
conftest.py so its hundreds of engines skip torch's import) and started by exec (the default): the
same server either way, each a process of its own that can be killed, whose death and exit code
the client sees, and that the fork server reaps."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from refit.drivers.reference import ReferenceEngine
from refit.errors import EngineDied
from refit.reference import forkserver


def test_the_suite_forks_its_engines_and_a_forked_engine_dies_and_is_reaped_like_a_child() -> None:
    assert os.environ.get(forkserver.ENV) == "1"
    a, b = ReferenceEngine.spawn_many(["fa", "fb"])
    try:
        assert isinstance(a.client.process, forkserver.ForkedProcess)
        assert a.client.pid == a.client.process.pid != os.getpid()
        assert a.generate([1, 2, 3], 4)["output"] == b.generate([1, 2, 3], 4)["output"]
        os.kill(b.client.pid, signal.SIGKILL)
        assert b.client.process.wait(30) == -signal.SIGKILL  # reaped by the fork server, its code sent back
        with pytest.raises(EngineDied):
            b.generate([1, 2, 3], 1)
        assert a.generate([1, 2, 3], 4)["output"]  # its sibling serves on
    finally:
        a.close()
        b.close()
    assert a.client.process.poll() == 0  # shut down politely, exit code 0


def test_the_fork_server_outlives_the_thread_that_started_it_and_a_failed_launch_leaks_nothing() -> None:
    """Engines spawned from a short-lived thread pool (the first launch of this process may be
    one): the fork server stays (a parent-death signal would fire when that thread ends), later
    launches work, and polite shutdowns report exit code 0. A launch the dead server cannot answer
    fails clearly and leaves no socket behind."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        engines = list(pool.map(ReferenceEngine.spawn, ["t0", "t1"]))
    try:
        assert [p for p in forkserver.server_pids() if not _alive(p)] == []
        engines.append(ReferenceEngine.spawn("t2"))
        assert all(e.generate([1, 2, 3], 2)["finish_reason"] == "length" for e in engines)
    finally:
        for e in engines:
            e.close()
    assert [e.client.process.returncode for e in engines] == [0, 0, 0]
    (server,) = forkserver.server_pids()
    os.kill(server, signal.SIGSTOP)  # it takes no launch; then it dies with the launch pending
    gc.collect()  # what earlier tests in this worker left for the collector closes now, not in the count
    fds = len(os.listdir("/proc/self/fd"))
    killer = threading.Timer(1.0, os.kill, (server, signal.SIGKILL))
    killer.start()
    with pytest.raises(RuntimeError, match="fork server is gone"):
        ReferenceEngine.spawn("never")
    killer.join()
    assert len(os.listdir("/proc/self/fd")) <= fds  # nothing left behind (the dead server's own may go too)
    assert not _alive(server)
    later = ReferenceEngine.spawn("after")  # a new fork server
    try:
        assert later.generate([1, 2, 3], 2)["finish_reason"] == "length"
    finally:
        later.close()


def test_without_the_fork_server_an_engine_is_started_by_exec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(forkserver.ENV)
    engine = ReferenceEngine.spawn("exec")
    try:
        assert isinstance(engine.client.process, subprocess.Popen)
        assert engine.generate([1, 2, 3], 2)["finish_reason"] == "length"
    finally:
        engine.close()


def test_the_fork_server_dies_with_the_process_that_started_it() -> None:
    """A process that launched an engine is killed: its fork server goes too (PDEATHSIG); the
    engine it forked is an orphan like an exec-started one, and dies when its socket closes."""
    code = (
        "import os, sys\n"
        "from refit.drivers.reference import ReferenceEngine\n"
        "from refit.reference import forkserver\n"
        "e = ReferenceEngine.spawn('orphan')\n"
        "print(forkserver._clients[os.getpid()].proc.pid, e.client.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    server, engine = (int(x) for x in proc.stdout.split())
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (_alive(server) or _alive(engine)):
        time.sleep(0.1)
    assert not _alive(server) and not _alive(engine)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie is dead, only not reaped
    except FileNotFoundError:
        return False
