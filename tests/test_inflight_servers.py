"""In-flight refit on the emulated SGLang 0.5.23 and vLLM 0.33 servers (which do what the servers'
source does, docs/engines.md): what they support, pause_mode "retract" with kv="recompute", holds
requests across a refit, none aborted, each token labelled by the server's own version spans; what
they cannot, "in_place" with kv="keep", is refused before any engine is touched, naming the server
version and the function that rules it out (docs/async.md)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from refit import protocol, staleness
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm_transport import VLLMIPCTransport
from refit.errors import ConfigError, EngineError
from refit.reference.model import ModelConfig, TinyLlama
from refit.testing.sglang_server import EmulatedSGLang, EmulatedSGLangEngine
from refit.testing.vllm_server import EmulatedVLLMEngine

from .conftest import perturbed

CFG = ModelConfig(max_seq_len=512)
SERVERS: dict[str, tuple[Any, Any, str]] = {
    "sglang": (lambda: EmulatedSGLangEngine.start("s0", config=CFG, in_thread=True), SGLangTensorTransport,
               r"SGLang 0\.5\.23's Scheduler\.flush_cache"),
    "vllm": (lambda: EmulatedVLLMEngine.start("v0", config=CFG, in_thread=True, backend="ipc"), VLLMIPCTransport,
             r"vLLM 0\.33's Scheduler\.reset_prefix_cache"),
}  # fmt: skip


@pytest.mark.parametrize("server", SERVERS)
def test_requests_in_flight_are_held_through_a_refit_and_labelled_per_token(server: str) -> None:
    start, transport, _ = SERVERS[server]
    engine = start()
    model = TinyLlama(CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(model), transport(), [engine], mode="colocated", pause_mode="retract")
    try:
        futures = [engine.submit([i + 1, 2, 3, 4], 200) for i in range(4)]
        behind = engine.server.engine  # the reference engine behind the emulated server
        while behind.info()["tokens_sampled"] < 40:
            time.sleep(0.005)
        perturbed(model, seed=1)
        result = protocol.run(ctx)
        assert result.ok, result.error
        outs = [f.result(timeout=120) for f in futures]
        assert [o["finish_reason"] for o in outs] == ["length"] * 4  # none aborted
        for o in outs:
            versions = o["weight_versions"]
            assert len(versions) == 200 and versions == sorted(versions) and set(versions) <= {0, 1}
        assert any(set(o["weight_versions"]) == {0, 1} for o in outs)  # the refit landed mid-request
    finally:
        ctx.close()
        engine.close()


@pytest.mark.parametrize("server", SERVERS)
def test_in_place_with_kept_kv_is_refused_naming_the_server(server: str) -> None:
    start, transport, reason = SERVERS[server]
    engine = start()
    try:
        with pytest.raises(ConfigError, match=reason):
            protocol.RefitContext(
                TorchSource(TinyLlama(CFG, seed=0)), transport(), [engine], mode="disaggregated",
                pause_mode="in_place", kv="keep",
            )  # fmt: skip
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("server", "reason"),
    [
        ("sglang", r"SGLang 0\.5\.23 writes every update into the live model \(model_runner_components/weight_updater"),
        ("vllm", r"vLLM 0\.33\.0 writes every update into the live parameters \(distributed/weight_transfer"),
    ],
)
def test_atomic_refits_are_refused_naming_what_the_server_lacks(server: str, reason: str) -> None:
    """Neither server can stage a second copy of the weights to swap in: atomic=True is refused
    when the context is made, naming the version and where it loads into the live weights."""
    start, transport, _ = SERVERS[server]
    engine = start()
    try:
        with pytest.raises(ConfigError, match=reason):
            protocol.RefitContext(TorchSource(TinyLlama(CFG, seed=0)), transport(), [engine], atomic=True)
    finally:
        engine.close()


@pytest.mark.parametrize("server", SERVERS)
def test_a_held_server_keeps_its_requests_until_a_refit_reaches_it(server: str) -> None:
    """max_staleness=0: the server whose flush was refused is held (STALE) by pausing it with its
    requests kept (SGLang: retract; vLLM: keep), not aborted; the next refit brings it back and the
    request it was generating finishes under the new version."""
    _, transport, _ = SERVERS[server]
    if server == "sglang":
        engines: list[Any] = [EmulatedSGLangEngine.start(f"s{i}", config=CFG, in_thread=True) for i in range(2)]
    else:
        engines = [EmulatedVLLMEngine.start(f"v{i}", config=CFG, in_thread=True, backend="ipc") for i in range(2)]
    model = TinyLlama(CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(model), transport(), engines, mode="colocated", retries=0)
    try:
        running = engines[1].submit([5, 6, 7, 8], 400)
        behind = engines[1].server.engine
        while behind.info()["tokens_sampled"] < 20:
            time.sleep(0.002)
        perturbed(model, seed=1)
        # (before begin: a vLLM begin that may have run moves its weights away, which only a quarantine answers)
        ctx.faults = protocol.FaultPlan().fail_at("invalidating", engine=1, call="flush", kind="raise")
        first = protocol.run(ctx)
        assert first.engines[engines[1].name].status == "stale", first.engines
        time.sleep(0.2)
        assert not running.done() and behind.info()["waiting"] + behind.info()["running"] == 1
        with pytest.raises(EngineError, match="stale: it holds version 0"):  # the driver refuses new ones
            engines[1].generate([1, 2, 3], 2, timeout=5)
        ctx.faults = None
        perturbed(model, seed=2)
        second = protocol.run(ctx)
        assert second.ok and second.engines[engines[1].name].status == "updated", second.error
        out = running.result(timeout=120)
        assert out["finish_reason"] == "length" and len(out["weight_versions"]) == 400
        assert set(out["weight_versions"]) == {0, 2} and out["weight_versions"] == sorted(out["weight_versions"])
    finally:
        ctx.close()
        for e in engines:
            e.close()


class _NoSpans(EmulatedSGLang):
    """A server that labels only the request (no per-token spans, which 0.5.23's
    utils/weight_versions.py add_weight_versions_to_meta_info adds): meta_info carries the
    request's weight_version alone. It reports 0.5.22, a version refit does not trust to give
    spans whenever a request straddled an update."""

    def op_generate(self, obj: Any, *args: Any) -> dict[str, Any]:
        out = super().op_generate(obj, *args)
        out["meta_info"].pop("weight_versions", None)
        return out


def test_without_spans_tokens_are_versioned_only_where_no_commit_point_fell_inside_the_request() -> None:
    """A server that labels only the request: a request no refit touched gets its label on every
    token; one a refit landed in gets None per token (which weights sampled each is unknown, so
    `refit.staleness` refuses it) instead of the last version on all of them."""
    engine = EmulatedSGLangEngine.start("s0", config=CFG, in_thread=True, server=_NoSpans, version="0.5.22")
    model = TinyLlama(CFG, seed=0)
    ctx = protocol.RefitContext(TorchSource(model), SGLangTensorTransport(), [engine], mode="colocated", verify="off")
    try:
        before = engine.generate([1, 2, 3], 8)
        assert before["weight_versions"] == [0] * 8
        straddling = engine.submit([5, 6, 7], 300)
        behind = engine.server.engine
        while behind.info()["tokens_sampled"] < 8 + 40:
            time.sleep(0.005)
        perturbed(model, seed=1)
        assert protocol.run(ctx).ok
        out = straddling.result(timeout=120)
        assert out["finish_reason"] == "length" and out["weight_versions"] == [None] * 300
        with pytest.raises(ValueError, match="a weight version is a non-negative int, got None"):
            staleness.lag(out["weight_versions"], current=1)
        assert engine.generate([1, 2, 3], 4)["weight_versions"] == [1] * 4
    finally:
        ctx.close()
        engine.close()
