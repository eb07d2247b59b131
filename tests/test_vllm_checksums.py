"""Verification of vLLM engines by vLLM's own checksums (`POST /weight_checker`, action
"checksum", vLLM 0.33.0): the hash and the worker's key prefix are vLLM's own code run here
(`compute_tensor_digests`, `Worker._weight_checksum_prefix`, imported without a GPU), the
emulator's answers are held against vLLM's own router, and refits into emulated vLLM servers are
verified with it: clean ones pass, silent faults injected in the engine behind the emulator are
caught and named at vLLM's parameter and TP rank."""

from __future__ import annotations

import types
from typing import Any

import httpx
import pytest
import torch

from refit import invariants, protocol
from refit.drivers import sglang_checksums as sc
from refit.drivers import vllm_checksums as vc
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm_transport import VLLMBroadcastTransport, VLLMIPCTransport
from refit.errors import ConfigError
from refit.reference.model import ModelConfig
from refit.testing.vllm_server import EmulatedVLLMEngine

from .conftest import caught_behind_server, clean_refits_verify
from .conftest import trained_tiny_llama as _trained
from .vllm_support import validate_request, vllm

pytestmark = pytest.mark.e2e


def _engines(
    n: int, *, tp: int, tied: bool = False, backend: str = "ipc", validate: Any = validate_request
) -> tuple[list[EmulatedVLLMEngine], Any]:
    config = ModelConfig(tie_word_embeddings=tied, vocab_size=250)
    engines = [
        EmulatedVLLMEngine.start(f"v{i}", config=config, tp=tp, backend=backend, validate=validate) for i in range(n)
    ]
    return engines, config


def _vllm_worker_digests(state: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, str]:
    """What vLLM's own worker code reports for rank `rank` of a model holding these parameters:
    `Worker.compute_weight_checksums` (its prefix from `_weight_checksum_prefix`, with the
    parallel groups' ranks it reads) over `compute_tensor_digests` of a module whose parameters
    are refit's reading of vLLM's layout."""
    vllm()  # the CPU import shim's environment
    import vllm.v1.worker.gpu_worker as gw

    module = torch.nn.Module()
    for key, pieces in sc.sglang_params(state, tp, "vllm"):
        name, _, r = key.rpartition("@tp")
        if int(r) == rank:
            parent = module
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, torch.nn.Module())
                parent = getattr(parent, part)
            parent.register_parameter(leaf, torch.nn.Parameter(torch.cat(pieces), requires_grad=False))
    worker = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0),
        model_runner=types.SimpleNamespace(get_model=lambda: module),
    )
    worker._weight_checksum_prefix = lambda: gw.Worker._weight_checksum_prefix(worker)
    group = types.SimpleNamespace(rank_in_group=0)
    saved = (gw.get_pp_group, gw.get_pcp_group, gw.get_tp_group)
    gw.get_pp_group = gw.get_pcp_group = lambda: group  # type: ignore[assignment]
    gw.get_tp_group = lambda: types.SimpleNamespace(rank_in_group=rank)  # type: ignore[assignment]
    try:
        return gw.Worker.compute_weight_checksums(worker)  # type: ignore[arg-type]
    finally:
        gw.get_pp_group, gw.get_pcp_group, gw.get_tp_group = saved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_checksum_is_vllms_own(dtype: torch.dtype) -> None:
    vllm()
    from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

    t = (torch.randn(5, 7) * 50).to(dtype)
    module = torch.nn.Module()
    module.register_parameter("w", torch.nn.Parameter(t, requires_grad=False))
    assert compute_tensor_digests(module) == {"w": sc.checksum(t, "vllm")}
    assert sc.checksum(t, "vllm") != sc.checksum(t)  # SGLang keeps 8 bytes of it: another kind


@pytest.mark.parametrize(("tp", "tied"), [(1, False), (2, False), (2, True)])
def test_the_emulators_answer_is_vllms_workers_and_router(tp: int, tied: bool) -> None:
    """Per worker, vLLM's own code over refit's reading of its layout gives the emulator's keys and
    digests; vLLM's own router, handed those per-worker dicts, answers what the emulator answers
    (checksum and compare), and refuses what the emulator refuses."""
    (engine,), _ = _engines(1, tp=tp, tied=tied)
    try:
        body = httpx.post(f"{engine.url}/weight_checker", json={"action": "checksum"}, timeout=60).json()
        state = engine.server.engine.client.call("served_state_dict", timeout=30)
        workers = [_vllm_worker_digests(state, tp, r) for r in range(tp)]
        assert body == {"checksums": {k: v for w in workers for k, v in w.items()}}
        assert ("dp0:pp0:pcp0:tp0:lm_head.weight" in body["checksums"]) is not tied  # a tied head: the embedding
        assert vc.reported(body) == sc.expected(state, tp, "vllm")  # what the trainer computes from the same state
        client = _router_with(workers)
        baseline = dict(body["checksums"])
        baseline[next(iter(baseline))] = "0" * 64
        for request in ({"action": "checksum"}, {"action": "compare", "baseline": baseline},
                        {"action": "compare"}, {"action": "bogus"}, {"action": "compare", "baseline": {"a": 1}},
                        {}, [1, 2]):  # fmt: skip
            ours = httpx.post(f"{engine.url}/weight_checker", json=request, timeout=60)
            theirs = client.post("/weight_checker", json=request)
            assert ours.status_code == theirs.status_code, (request, ours.text, theirs.text)
            if theirs.status_code == 200:
                assert ours.json() == theirs.json()
        assert httpx.get(f"{engine.url}/weight_checker", timeout=60).status_code == 405
    finally:
        engine.close()


def _router_with(workers: list[dict[str, str]]) -> Any:
    """vLLM's own RL router on an app whose engine client answers `compute_weight_checksums` with
    these per-worker dicts (vLLM's validation handler is not mounted: FastAPI's 422 is compared as
    vLLM's 400)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from fastapi.testclient import TestClient

    app = FastAPI()
    app.include_router(vllm().routers[0])

    async def as_vllm(request: Any, exc: Exception) -> JSONResponse:  # handlers/validation.py: 400
        return JSONResponse(status_code=400, content={"error": {"message": str(exc), "code": 400}})

    app.add_exception_handler(RequestValidationError, as_vllm)

    class Client:
        async def compute_weight_checksums(self) -> list[dict[str, str]]:
            return [dict(w) for w in workers]

    app.state.engine_client = Client()
    return TestClient(app, raise_server_exceptions=False)


@pytest.mark.parametrize(("tp", "tied", "backend"), [(1, False, "ipc"), (2, False, "nccl"), (2, True, "ipc")])
def test_refits_into_vllm_verify_by_its_checksums(tp: int, tied: bool, backend: str) -> None:
    engines, config = _engines(2, tp=tp, tied=tied, backend=backend)
    model = _trained(config)
    transport = VLLMIPCTransport() if backend == "ipc" else VLLMBroadcastTransport()
    mode = "colocated" if backend == "ipc" else "disaggregated"
    ctx = protocol.RefitContext(TorchSource(model), transport, engines, mode=mode, bucket_bytes=64 << 10)
    clean_refits_verify(ctx, model, f"vllm/tp{tp}", engines)


@pytest.mark.parametrize(
    ("kind", "tp", "bucket", "named"),
    [
        ("swap_qk", 1, 1, ["model.layers.0.self_attn.qkv_proj.weight@tp0"]),
        ("flip", 1, 2, ["model.layers.0.mlp.gate_up_proj.weight@tp0"]),
        ("stale_head", 1, None, ["lm_head.weight@tp0"]),
    ],
)
def test_a_silent_fault_behind_vllm_is_caught_and_named(
    kind: str, tp: int, bucket: int | None, named: list[str]
) -> None:
    """The fault is armed in the reference engine behind the emulator (the vLLM driver has no
    `arm_fault`): it acks and would serve wrong weights; vLLM's checksums name the parameter."""
    engines, config = _engines(2, tp=tp)
    bad = caught_behind_server(engines, VLLMIPCTransport(), _trained(config), kind, bucket)
    assert bad.verify["mismatched"] == named


@pytest.mark.parametrize("tp", [1, 2])
def test_a_stale_head_behind_a_tied_vllm_server_is_caught(tp: int) -> None:
    """The engine behind the emulator serves its output head from a copy; with a tied head a
    stale copy is a head that is not the embedding, which vLLM would list as a parameter of its
    own: the checksums must cover what it serves, or the engine publishes wrong logits."""
    engines, config = _engines(2, tp=tp, tied=True)
    bad = caught_behind_server(engines, VLLMIPCTransport(), _trained(config), "stale_head", None)
    assert bad.verify["mismatched"] == ["lm_head.weight@tp0"]  # the fault is armed on the engine's rank 0


def test_answers_vllm_cannot_verify_are_refused_clearly() -> None:
    with pytest.raises(ValueError, match="no checksums"):
        vc.reported({"checksums": {}})
    with pytest.raises(ValueError, match="not vLLM's"):
        vc.reported({"checksums": {"model.norm.weight": "ab"}})
    with pytest.raises(ValueError, match="pipeline"):
        vc.reported({"checksums": {"dp0:pp1:pcp0:tp0:model.norm.weight": "ab"}})
    empty = {"dp0:pp0:pcp0:tp0:model.layers.0.mlp.down_proj.weight": vc.EMPTY, "dp0:pp0:pcp0:tp0:x.bias": "ab"}
    with pytest.raises(ValueError, match="CPU backend repacks"):
        vc.reported({"checksums": empty})
    (engine,), config = _engines(1, tp=1)
    try:
        engine.checksums = False  # a real server's driver: only when asked
        with pytest.raises(ConfigError, match=r"VLLMEngine\(\.\.\., checksums=True\)"):
            protocol.RefitContext(TorchSource(_trained(config)), VLLMIPCTransport(), [engine], mode="colocated")
        engine.checksums = True
        engine.capabilities = type(engine.capabilities).of("0.28.0")
        with pytest.raises(ConfigError, match="no /weight_checker"):
            protocol.RefitContext(TorchSource(_trained(config)), VLLMIPCTransport(), [engine], mode="colocated")
    finally:
        engine.close()


def test_a_fleet_with_one_engine_not_asked_for_checksums_names_that_engine() -> None:
    """One vLLM engine with checksums, one without: the refusal names the one that reports no
    digests and why (`VLLMEngine(..., checksums=True)`), not a clash of digest kinds."""
    engines, config = _engines(2, tp=1)
    try:
        engines[1].checksums = False
        with pytest.raises(ConfigError, match=r"engine v1 .*cannot report digests.*checksums=True"):
            protocol.RefitContext(TorchSource(_trained(config)), VLLMIPCTransport(), engines, mode="colocated")
    finally:
        for e in engines:
            e.close()


@pytest.mark.parametrize("backend", ["ipc", "nccl"])
def test_a_tied_server_serves_an_untied_head_under_both_names_and_the_checksums_name_it(backend: str) -> None:
    """A trainer with a head of its own into a vLLM whose model ties it: inside the update session
    vLLM loads both names (`initialize_layerwise_reload` unties them until the session ends), and
    the tensor they share holds the head, sent after the embedding (tests/test_vllm_tied.py holds
    this against vLLM's own session code). The update succeeds; verified by vLLM's checksums, the
    engine is rejected naming the embedding, which no longer holds what the trainer sent as one."""
    (engine,), config = _engines(1, tp=1, tied=True, backend=backend)
    model = _trained(ModelConfig(tie_word_embeddings=False, vocab_size=config.vocab_size))
    transport = VLLMIPCTransport() if backend == "ipc" else VLLMBroadcastTransport()
    mode = "colocated" if backend == "ipc" else "disaggregated"
    ctx = protocol.RefitContext(TorchSource(model), transport, [engine], mode=mode, retries=0)
    try:
        ctx.verify = "off"
        assert protocol.run(ctx).ok  # vLLM took it
        ctx.verify = "digest"
        outcome = protocol.run(ctx).engines["v0"]
        assert outcome.status == "quarantined" and outcome.verify["mismatched"] == ["model.embed_tokens.weight@tp0"]
    finally:
        ctx.close()
        engine.close()


def test_after_a_server_restart_the_next_refit_still_verifies_by_vllms_checksums() -> None:
    """A restart found by a probe makes the driver read the server afresh; until it has, the run's
    digest kind must not fall back to the transport's (xxh3), which no vLLM engine reports: that
    quarantined every engine of the next refit, the healthy ones too."""
    engines, config = _engines(2, tp=1)
    model = _trained(config)
    ctx = protocol.RefitContext(TorchSource(model), VLLMIPCTransport(), engines, mode="colocated", retries=0)
    try:
        assert protocol.run(ctx).ok
        engines[0].server.restart()
        restarted = protocol.run(ctx)
        assert restarted.engines["v1"].status == "updated" and "restarted" in (restarted.engines["v0"].error or "")
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        result = protocol.run(ctx)
        assert result.ok, result.error
        start = [e for e in ctx.recorder.events if e.get("event") == "start"][-1]
        assert start["digest"] == "vllm/tp1"
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_verify_that_hangs_past_the_deadline_is_named_as_the_cause() -> None:
    """No per-call timeout: the hung /weight_checker call uses what is left of the run's deadline.
    The run's error is that engine's verify (it was the trainer's buffer release, which found no
    time left), the engine's outcome carries it, and nothing publishes."""
    engines, config = _engines(2, tp=1, validate=None)  # (vLLM's validation imports vLLM: seconds of the deadline)
    engines[0].server.armed[("verify", None)] = ("hang", 30.0)
    ctx = protocol.RefitContext(
        TorchSource(_trained(config)), VLLMIPCTransport(), engines, mode="colocated", retries=0,
        bucket_bytes=64 << 10, deadline_s=4.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.version is None
        assert "verify did not finish inside the deadline: engine v0" in str(result.error)
        assert "verify" in (result.engines["v0"].error or "") and result.engines["v0"].status == "failed"
        assert all(o.status != "updated" for o in result.engines.values())
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()
