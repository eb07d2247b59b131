"""Shared fixtures: a tiny trainer model, reference engines on threads (fast) or processes (real)."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

# One intra-op thread for torch here and in every process a test starts (trainer ranks, servers;
# engine processes take theirs from `spawn(threads=)`): the models are tiny, and on a 2-core
# machine running 3 test workers, extra OpenMP threads only spin waiting for each other.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# CPU engine processes forked from one that imported the server already (refit.reference.forkserver):
# the same server code, without each of the suite's hundreds of engines importing torch again.
os.environ.setdefault("REFIT_FORKSERVER", "1")

import pytest
import torch
from hypothesis import settings

from refit import protocol
from refit.drivers.reference import ReferenceEngine
from refit.drivers.shm import SharedMemoryTransport, leaked_segments
from refit.drivers.torch_source import TorchSource
from refit.reference.model import ModelConfig, TinyLlama

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

settings.register_profile("refit", derandomize=True, deadline=None, max_examples=40, print_blob=True)
settings.register_profile("long", deadline=None, max_examples=500)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "refit"))

CONFIG = ModelConfig()
SMALL_BUCKET = 64 << 10  # 8 buckets for the default model


@pytest.fixture
def config() -> ModelConfig:
    return CONFIG


def perturbed(model: TinyLlama, seed: int, scale: float = 0.05) -> TinyLlama:
    """Take a 'training step': change every weight, deterministically."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))
    return model


@pytest.fixture
def trainer() -> TinyLlama:
    """Starts from the same checkpoint (seed 0) as the engines, then takes one 'step'."""
    return perturbed(TinyLlama(CONFIG, seed=0), seed=100)


@pytest.fixture
def thread_engines() -> Iterator[Callable[[int], list[ReferenceEngine]]]:
    made: list[ReferenceEngine] = []

    def make(n: int = 2) -> list[ReferenceEngine]:
        engines = [ReferenceEngine.in_thread(f"t{len(made) + i}", CONFIG, seed=0) for i in range(n)]
        made.extend(engines)
        return engines

    yield make
    for e in made:
        e.close()


@pytest.fixture
def make_ctx() -> Iterator[Callable[..., protocol.RefitContext]]:
    made: list[protocol.RefitContext] = []

    def make(model: TinyLlama, engines: list[ReferenceEngine], **kw: object) -> protocol.RefitContext:
        kw.setdefault("bucket_bytes", SMALL_BUCKET)
        kw.setdefault("deadline_s", 30.0)
        if "version" not in kw:
            kw["version"] = max(e.info()["version"] for e in engines)
        ctx = protocol.RefitContext(
            source=TorchSource(model),
            transport=SharedMemoryTransport(),
            engines=engines,
            **kw,  # type: ignore[arg-type]
        )
        made.append(ctx)
        return ctx

    yield make
    for ctx in made:
        ctx.close()
    assert leaked_segments(pid=os.getpid()) == []


def matches(engine: ReferenceEngine, model: TinyLlama) -> bool:
    """The engine's weights, read back and unfused, equal the model's bit for bit."""
    state = engine.state_dict()
    return all(torch.equal(state[k], v) for k, v in model.state_dict().items())


SUMMARY: list[str] = []  # lines tests want printed at the end of the run (matrix sizes, counts)
_REPORTED: list[str] = []  # the same lines as the process that prints them got them (xdist: from workers)


@pytest.fixture(autouse=True)
def _summary_lines(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test's SUMMARY lines travel in its report, so they reach the terminal under xdist too."""
    yield
    while SUMMARY:
        request.node.user_properties.append(("refit-summary", SUMMARY.pop(0)))


# The longest files first (measured on a 2-core box): README's command spreads whole files over
# workers (`--dist loadfile`, with `--no-loadscope-reorder` in pyproject's addopts so this order
# stands), and a long file started last keeps one worker busy after the others have finished.
LONGEST_FIRST = (
    "test_sglang_driver.py", "test_ray.py", "test_fault_matrix_broadcast.py", "test_conformance_kit_broadcast.py",
    "test_conformance_kit.py", "test_vllm.py", "test_sglang_kit.py", "test_fault_matrix.py", "test_vllm_kit.py",
    "test_docs.py", "test_spmd.py", "test_e2e.py", "test_broadcast_ops.py", "test_model_families.py",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "teardown":
        _REPORTED.extend(str(v) for k, v in report.user_properties if k == "refit-summary")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for line in _REPORTED:
        terminalreporter.write_line(line)


class Forward:
    """A TCP forwarder in front of a server (a proxy or load balancer): `down()` drops its open
    connections and refuses new ones, `up()` listens again on the same port."""

    def __init__(self, target: tuple[str, int], port: int = 0) -> None:
        self.target, self.port = target, port
        self.open: list[socket.socket] = []
        self.up()

    def up(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", self.port))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, args=(self.listener,), daemon=True).start()

    def down(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept: a closed fd alone keeps listening
        self.listener.close()
        for c in self.open:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)

    def _accept(self, listener: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while True:
                c, _ = listener.accept()
                u = socket.create_connection(self.target)
                self.open += [c, u]
                for a, b in ((c, u), (u, c)):
                    threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(65536):
                b.sendall(data)
        for x in (a, b):
            with contextlib.suppress(OSError):
                x.shutdown(socket.SHUT_RDWR)


def restart_before(engine: Any, call: str) -> None:
    """The emulated server behind `engine` restarts (a new process at its URL) just before the
    driver's next `call`; `del engine.<call>` undoes it."""
    original = getattr(engine, call)

    def restart_first(*a: Any, **kw: Any) -> Any:
        engine.server.restart()
        return original(*a, **kw)

    setattr(engine, call, restart_first)


def trained_tiny_llama(config: Any) -> TinyLlama:
    """A TinyLlama of `config` whose weights moved off their seed (a trainer after some steps)."""
    model = TinyLlama(config, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return model


def caught_behind_server(engines: list[Any], transport: Any, model: TinyLlama, kind: str, bucket: int | None) -> Any:
    """Arm a silent fault in the reference engine behind the first emulated server (its driver has
    no `arm_fault`), refit both engines colocated with no retry, and check that the other engine
    published and that the trace holds; returns the faulted engine's outcome (closes everything)."""
    from refit import invariants

    call = "finalize" if kind == "stale_head" else "load"
    engines[0].server.engine.client.call("arm_fault", kind, call, bucket, 0.0, timeout=5)
    ctx = protocol.RefitContext(
        TorchSource(model), transport, engines, mode="colocated", retries=0, bucket_bytes=64 << 10
    )
    try:
        result = protocol.run(ctx)
        bad, good = (result.engines[e.name] for e in engines)
        assert good.status == "updated" and good.verify["ok"]
        assert bad.status == "quarantined" and "unverified" in (bad.error or "")
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
        return bad
    finally:
        ctx.close()
        for e in engines:
            e.close()


def clean_refits_verify(ctx: protocol.RefitContext, model: TinyLlama, kind: str, engines: list[Any]) -> None:
    """Two refits of `model` (moved between them), each engine's verdict passing with something
    compared; the run's start records `kind`; the trace holds. Closes the context and engines."""
    from refit import invariants

    try:
        assert ctx.digest_kind == kind
        for _ in range(2):
            result = protocol.run(ctx)
            assert result.ok, result.error
            for outcome in result.engines.values():
                assert outcome.verify["ok"] and outcome.verify["compared"] > 0
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(1.01)
        start = next(e for e in ctx.recorder.events if e.get("event") == "start")
        assert start["digest"] == kind
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()
