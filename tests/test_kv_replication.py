"""Models with fewer KV heads than TP ranks (Qwen2.5-1.5B: 2 KV heads; served at TP 4): SGLang and
vLLM then hold each KV head on TP / KV heads ranks (layers/linear.py `QKVParallelLinear`:
num_kv_head_replicas, and rank r loads KV head r // it). The layout refit verifies against is
checked here against both servers' own loaders (imported without a GPU); the reference engine
holds KV heads the same way; refits into emulated SGLang and vLLM servers of such a model verify,
and a rank whose copy of a KV head differs from its replica's is caught and named."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from refit import protocol
from refit.buckets import heads_by_name
from refit.drivers import sglang_checksums as sc
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.shm import SharedMemoryTransport
from refit.drivers.torch_source import TorchSource
from refit.drivers.vllm_transport import VLLMIPCTransport
from refit.reference.model import ModelConfig
from refit.testing.sglang_server import EmulatedSGLangEngine
from refit.testing.vllm_server import EmulatedVLLMEngine

from .conftest import caught_behind_server, clean_refits_verify
from .conftest import trained_tiny_llama as _trained
from .sglang_support import sglang, validate_body
from .vllm_support import validate_request, vllm

# (attention heads, KV heads, TP, biases): replicated (KV < TP) and split (KV >= TP) cases
GEOMETRIES = [(4, 2, 4, False), (8, 1, 8, True), (12, 2, 4, True), (4, 4, 2, False), (8, 2, 2, True)]
HEAD_DIM, HIDDEN = 8, 16


def _qkv(heads: int, kv: int, bias: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(heads * 100 + kv)
    pre = "model.layers.0.self_attn."
    state = {
        pre + "q_proj.weight": torch.randn(heads * HEAD_DIM, HIDDEN, generator=g),
        pre + "k_proj.weight": torch.randn(kv * HEAD_DIM, HIDDEN, generator=g),
        pre + "v_proj.weight": torch.randn(kv * HEAD_DIM, HIDDEN, generator=g),
    }
    if bias:
        state.update({pre + f"{p}_proj.bias": torch.randn(n * HEAD_DIM, generator=g) for p, n in
                      (("q", heads), ("k", kv), ("v", kv))})  # fmt: skip
    return state


@contextlib.contextmanager
def _patched(module: Any, **values: Any) -> Iterator[None]:
    old = {k: getattr(module, k) for k in values}
    for k, v in values.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


def _server_params(server: str, state: dict[str, torch.Tensor], heads: int, kv: int, tp: int) -> list[dict[str, Any]]:
    """Each TP rank's fused qkv_proj weight (and bias) as the server's own QKVParallelLinear builds
    it and its own weight_loader fills it from the trainer's q, k and v (the rank and size its
    parallel groups would give are patched in: no process group)."""
    import importlib

    (sglang if server == "sglang" else vllm)()  # the CPU import shims
    linear = importlib.import_module(f"{server}.srt.layers.linear" if server == "sglang" else f"{server}.model_executor.layers.linear")  # fmt: skip
    rank = [0]
    if server == "sglang":
        patches = {"get_group_rank_size": lambda group: (rank[0], tp), "_resolve_linear_group": lambda group: None}
        other: Any = linear
    else:  # its parameter classes read the rank too
        patches = {
            "get_tensor_model_parallel_rank": lambda: rank[0],
            "get_tensor_model_parallel_world_size": lambda: tp,
        }
        other = importlib.import_module("vllm.model_executor.parameter")
    bias = any(n.endswith("bias") for n in state)
    out = []
    with _patched(linear, **patches), _patched(other, **{k: v for k, v in patches.items() if hasattr(other, k)}):
        for r in range(tp):
            rank[0] = r
            layer = linear.QKVParallelLinear(HIDDEN, HEAD_DIM, heads, kv, bias=bias, params_dtype=torch.float32)
            for shard in ("q", "k", "v"):
                for what in ("weight", "bias") if bias else ("weight",):
                    param = getattr(layer, what)
                    param.weight_loader(param, state[f"model.layers.0.self_attn.{shard}_proj.{what}"], shard)
            out.append(
                {what: getattr(layer, what).detach().clone() for what in ("weight", "bias") if bias or what == "weight"}
            )
    return out


@pytest.mark.parametrize("server", ["sglang", "vllm"])
@pytest.mark.parametrize(("heads", "kv", "tp", "bias"), GEOMETRIES)
def test_the_qkv_layout_is_the_servers_own_loaders(server: str, heads: int, kv: int, tp: int, bias: bool) -> None:
    """refit's reading of each rank's qkv_proj (the checksums' pieces, and the trainer's
    LayoutDigests fed tensor by tensor) is byte for byte what the server's loader puts there."""
    state = _qkv(heads, kv, bias)
    served = _server_params(server, state, heads, kv, tp)
    names = heads_by_name(state, {"num_attention_heads": heads, "num_key_value_heads": kv})
    pieces = dict(sc.sglang_params(state, tp, "sglang", names))
    if kv < tp:  # the case that needs the head counts: splitting k and v evenly is not the server's layout
        even = dict(sc.sglang_params(state, tp, "sglang"))
        assert not torch.equal(torch.cat(even["model.layers.0.self_attn.qkv_proj.weight@tp1"]), served[1]["weight"])
    digests = sc.LayoutDigests(sc.kind_for(tp), names)
    for name in reversed(list(state)):  # v before k before q: parts wait for the ones they follow
        digests.add(name, state[name])
    sums = digests.results()
    for r, params in enumerate(served):
        for what, tensor in params.items():
            key = f"model.layers.0.self_attn.qkv_proj.{what}@tp{r}"
            assert torch.equal(torch.cat(pieces[key]), tensor), key
            assert sums[key] == sc.checksum(tensor), key


def test_the_plan_check_asks_for_the_kv_head_count_and_refuses_what_no_server_serves() -> None:
    shapes = {n: tuple(t.shape) for n, t in _qkv(4, 2, True).items()}
    gap = sc.unmappable(shapes, 4)
    assert len(gap) == 1 and "k_proj.weight and 3 more: the model's KV head count is not known" in gap[0]
    assert "TorchSource(..., config=hf_config)" in gap[0]
    assert sc.unmappable(shapes, 1) == []  # one rank: nothing to split
    heads = heads_by_name(shapes, {"num_attention_heads": 4, "num_key_value_heads": 2})
    for flavour in ("sglang-cuda", "vllm"):
        assert sc.unmappable(shapes, 4, flavour, heads) == []
        assert sc.unmappable(shapes, 2, flavour, heads) == []
        odd = sc.unmappable(shapes, 3, flavour, heads)  # 2 KV heads over 3 ranks; 4 heads too
        assert any("4 heads do not split over TP 3" in p for p in odd)
        assert any("2 KV heads of 16 rows cannot be replicated over TP 3" in p for p in odd)
    # SGLang on the host pads heads that do not divide by TP (adjust_config_with_unaligned_cpu_tp)
    host = sc.unmappable(shapes, 4, "sglang", heads)
    assert len(host) == 4 and all("2 heads do not divide by TP 4, and SGLang on the host pads them" in p for p in host)
    assert sc.unmappable(shapes, 2, "sglang", heads) == []
    mlp = {"model.layers.0.mlp.gate_proj.weight": (96, 16), "model.layers.0.mlp.up_proj.weight": (96, 16)}
    assert sc.unmappable(mlp, 1, "sglang-cuda") == [] and sc.unmappable(mlp, 2, "vllm") == []
    padded = sc.unmappable(mlp, 2, "sglang")  # 96 is not a multiple of 32 x 2: the host pads it to 128
    assert len(padded) == 2 and "intermediate size 96 is not a multiple of 32 x TP 2" in padded[0]


def test_the_emulator_refuses_a_host_model_sglang_would_pad_and_attention_dp_has_no_checksums() -> None:
    """The emulator does not pad as SGLang on the host does: it refuses such a model. A server
    running attention data-parallel splits the vocabulary over its attention-TP group: its driver
    reports no digests and says why; `refit doctor`'s diagnosis says the same."""
    from refit.doctor import Answer
    from refit.drivers.sglang import diagnose

    with pytest.raises(ValueError, match="SGLang on the host pads these"):
        EmulatedSGLangEngine.start("h0", config=_config(kv_heads=1), tp=2)
    for args in ({"attn_dp_size": 2}, {"enable_dp_lm_head": True}):
        engine = EmulatedSGLangEngine.start("d0", config=_config(), tp=1, in_thread=True, server_args=args)
        try:
            assert engine.digest_kinds == frozenset()
            assert "attention data-parallel" in str(engine.no_digests)
            assert next(iter(args)) in str(engine.no_digests)
        finally:
            engine.close()
    info = {"version": "0.5.23", "tp_size": 2, "dp_size": 1, "attn_dp_size": 2, "enable_memory_saver": True}
    answers = {"/server_info": Answer(200, info), "/model_info": Answer(200, {"weight_version": "7"}),
               "/openapi.json": Answer(404, {})}  # fmt: skip
    _, findings, _ = diagnose(answers, admin_key=False)
    found = [f for f in findings if f.check == "data parallel"]
    assert [f.status for f in found] == ["warn"] and "attn_dp_size 2" in found[0].detail


def _config(kv_heads: int = 2) -> ModelConfig:
    return ModelConfig(num_kv_heads=kv_heads)  # 4 heads; 2 KV heads over 4 ranks, or 1 over 2: each on 2 ranks


@pytest.mark.e2e
@pytest.mark.parametrize("server", ["sglang", "vllm"])
def test_refits_of_a_model_with_fewer_kv_heads_than_ranks_verify_by_the_servers_checksums(server: str) -> None:
    config = _config(kv_heads=1)
    assert config.kv_replicas(2) == 2
    if server == "sglang":
        engines: list[Any] = [  # on the host SGLang pads such heads: a CUDA server replicates them
            EmulatedSGLangEngine.start("s0", config=config, tp=2, validate=validate_body, device="cuda")
        ]
        transport: Any = SGLangTensorTransport()
    else:
        engines = [EmulatedVLLMEngine.start("v0", config=config, tp=2, backend="ipc", validate=validate_request)]
        transport = VLLMIPCTransport()
    model = _trained(config)
    ctx = protocol.RefitContext(TorchSource(model), transport, engines, mode="colocated")  # heads: model.config
    clean_refits_verify(ctx, model, f"{'sglang-cuda' if server == 'sglang' else server}/tp2", engines)


def _kv_names(config: ModelConfig, layers: range) -> list[str]:
    return [f"model.layers.{i}.self_attn.{p}_proj.weight" for i in layers for p in ("k", "v")]


@pytest.mark.e2e
def test_a_rank_whose_kv_copy_differs_from_its_replica_is_caught_behind_sglang() -> None:
    """kv_replica: TP rank 0 keeps the other KV head's k and v rows while rank 1, which shares its
    head, keeps the right ones. SGLang hashes every rank's own qkv_proj, and so does the emulator
    (`rank_shards`), so rank 0's is named: a reading of one replica per head would have passed."""
    config = _config()
    engines = [
        EmulatedSGLangEngine.start(f"s{i}", config=config, tp=4, validate=validate_body, device="cuda")
        for i in range(2)
    ]
    bad = caught_behind_server(engines, SGLangTensorTransport(), _trained(config), "kv_replica", 1)  # layer 0's
    assert bad.verify["mismatched"] == ["model.layers.0.self_attn.qkv_proj.weight@tp0"]


@pytest.mark.e2e
def test_the_reference_engine_names_kv_heads_whose_replicas_disagree() -> None:
    """The reference engine's own digests (HF names) read one rank per KV head (the last of its
    replicas); rank 0's k and v differ from its replica's, so no one tensor is served and they
    are named, though the ranks read hold the right rows."""
    from refit.drivers.reference import ReferenceEngine

    config = _config()
    engines = ReferenceEngine.spawn_many(["r0", "r1"], config, seed=0, tp=4)
    engines[0].arm_fault("kv_replica", "load", bucket=None, seconds=0.0, timeout=5)
    model = _trained(config)
    ctx = protocol.RefitContext(TorchSource(model), SharedMemoryTransport(), engines, retries=0, bucket_bytes=1 << 30)
    try:
        result = protocol.run(ctx)
        bad, good = result.engines["r0"], result.engines["r1"]
        assert good.status == "updated" and good.verify["ok"]
        assert bad.status == "quarantined"
        assert sorted(bad.verify["mismatched"]) == sorted(_kv_names(config, range(config.num_layers)))
    finally:
        ctx.close()
        for e in engines:
            e.close()


@pytest.mark.e2e
def test_a_source_without_the_models_config_is_refused_at_idle_and_config_fixes_it() -> None:
    config = _config(kv_heads=1)
    engines = [EmulatedSGLangEngine.start("s0", config=config, tp=2, validate=validate_body, device="cuda")]
    model = _trained(config)
    state = dict(model.state_dict())
    ctx = protocol.RefitContext(TorchSource(state), SGLangTensorTransport(), engines, mode="colocated")
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.state == "FAILED"
        assert "KV head count is not known" in str(result.error) and "config=" in str(result.error)
        assert [r for r, _ in engines[0].server.received if r == "/pause_generation"] == []
    finally:
        ctx.close()
    ctx = protocol.RefitContext(TorchSource(state, config=config), SGLangTensorTransport(), engines, mode="colocated")
    clean_refits_verify(ctx, model, "sglang-cuda/tp2", engines)
    with pytest.raises(ValueError, match="names no positive integer head counts"):
        TorchSource(state, config={"hidden_size": 64})


def test_head_counts_that_are_not_the_models_are_refused_naming_them() -> None:
    """A config that is not this model's would split k and v wrongly: every rank's checksum would
    fail (or a wrongly split server's would pass). Refused in IDLE instead, saying why."""
    import numpy as np

    shapes = {n: tuple(t.shape) for n, t in _qkv(4, 2, False).items()}  # head size 8: q 32 rows, k/v 16
    for counts, said in [
        ({"num_attention_heads": 4, "num_key_value_heads": 4}, "heads of different sizes (k_proj 16 rows / 4 heads"),
        ({"num_attention_heads": 4, "num_key_value_heads": 3}, "16 rows do not divide into 3 heads"),
        ({"num_attention_heads": 4}, "heads of different sizes"),  # KV heads default to the heads
    ]:
        problems = sc.unmappable(shapes, 2, "sglang-cuda", heads_by_name(shapes, counts))
        assert problems and said in problems[0], (counts, problems)
    for bad in (0, -1, "2", True, 2.0):
        kv = {n: bad for n in shapes if "k_proj" in n or "v_proj" in n}
        assert any("is not a positive integer" in p for p in sc.unmappable(shapes, 2, "sglang-cuda", kv)), bad
    from refit.buckets import head_counts

    assert head_counts({"num_attention_heads": np.int64(4), "num_key_value_heads": np.int64(2)}) == (4, 2)
    assert head_counts({"num_attention_heads": 4.0, "num_key_value_heads": 2.0}) == (4, 2)
    assert head_counts({"num_attention_heads": True}) is None


def test_a_silent_fault_that_cannot_act_on_an_engine_is_refused_when_armed() -> None:
    from refit.drivers.reference import ReferenceEngine
    from refit.errors import EngineError

    engine = ReferenceEngine.in_thread("one", _config(), seed=0)
    try:
        for kind, why in (("kv_replica", "KV heads replicated over TP ranks"), ("swap_tp", "needs TP ranks")):
            with pytest.raises(EngineError, match=why):
                engine.arm_fault(kind, "load", bucket=None, seconds=0.0, timeout=5)
    finally:
        engine.close()


@pytest.mark.e2e
def test_a_trace_recorded_before_runs_knew_head_counts_still_replays(tmp_path: Any) -> None:
    """Such a trace verified a TP layout by splitting k and v evenly (right when there are as many KV
    heads as ranks). Its start has no `layout_heads` and its plan no head counts: replay gives the
    even split it was verified with instead of refusing the unknown head counts."""
    import json

    from refit.replay import replay

    config = ModelConfig(num_kv_heads=2)
    engines = [EmulatedSGLangEngine.start("s0", config=config, tp=2, validate=validate_body, in_thread=False)]
    model = _trained(config)
    path = tmp_path / "new.jsonl"
    ctx = protocol.RefitContext(TorchSource(model), SGLangTensorTransport(), engines, mode="colocated", trace=path)
    try:
        assert protocol.run(ctx).ok
    finally:
        ctx.close()
        engines[0].close()
    assert replay(path).same
    old = tmp_path / "old.jsonl"
    lines = []
    for line in path.read_text().splitlines():
        event = json.loads(line)
        event.pop("layout_heads", None)
        for m in event.get("manifests") or []:
            m.pop("heads", None)
        lines.append(json.dumps(event))
    old.write_text("\n".join(lines) + "\n")
    report = replay(old)
    assert report.divergence is None and report.same, str(report.divergence)
