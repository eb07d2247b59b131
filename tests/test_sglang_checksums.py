"""Verification of SGLang engines by SGLang's own checksums (`/weights_checker`, action "checksum"):
the hash and the vocabulary split are checked against SGLang 0.5.23's own code (imported without a
GPU, tests/sglang_support.py), the emulator's answer against SGLang's wire types, and refits into
emulated SGLang servers are verified with it: clean ones pass, silent faults injected in the engine
behind the emulator are caught and named at SGLang's parameter and TP rank."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch

from refit import invariants, protocol
from refit.drivers import sglang_checksums as sc
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.errors import ConfigError
from refit.reference.model import ModelConfig, TinyLlama
from refit.testing.sglang_server import EmulatedSGLangEngine

from .conftest import caught_behind_server, clean_refits_verify
from .conftest import trained_tiny_llama as _trained
from .sglang_support import sglang, validate_body


def _sglang_module(name: str) -> Any:
    import importlib

    sglang()  # the shim for SGLang's CUDA-only imports
    return importlib.import_module(name)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_the_checksum_is_sglangs_own_on_the_host(dtype: torch.dtype) -> None:
    checker = _sglang_module("sglang.srt.utils.weight_checker")
    g = torch.Generator().manual_seed(0)
    for shape in [(7,), (33, 17), (0,)]:
        t = (torch.randn(shape, generator=g) * 50).to(dtype)
        assert sc.checksum(t) == checker._hash_tensor(t)
        pieces = [t[: len(t) // 2], t[len(t) // 2 :]] if t.dim() else [t]
        assert sc.pieces_checksum(pieces) == checker._hash_tensor(t)


@pytest.mark.parametrize(("vocab", "tp"), [(250, 1), (250, 2), (256, 4), (151936, 8), (32001, 3), (100, 7)])
def test_the_vocabulary_split_is_sglangs(vocab: int, tp: int) -> None:
    """Each rank's rows and padding, against VocabParallelEmbedding._get_indices (the padded sizes
    as its constructor computes them: padding 64, times TP when that does not divide)."""
    vpe = _sglang_module("sglang.srt.layers.vocab_parallel_embedding")
    pad = 64 * (tp if vpe.pad_vocab_size(vocab, 64) % tp else 1)
    padded = vpe.pad_vocab_size(vocab, pad)
    for rank in range(tp):
        idx = vpe.VocabParallelEmbedding._get_indices(padded, padded, vocab, vocab, rank, tp)
        start, taken, per_rank = sc.vocab_rows(vocab, tp, rank)
        assert (start, start + taken) == (idx.org_vocab_start_index, idx.org_vocab_end_index)
        assert per_rank == padded // tp


def _engines(
    n: int, *, tp: int, tied: bool = False, prefix: str = "s", device: str = "cpu"
) -> tuple[list[EmulatedSGLangEngine], ModelConfig]:
    config = ModelConfig(tie_word_embeddings=tied, vocab_size=250)
    engines = [
        EmulatedSGLangEngine.start(f"{prefix}{i}", config=config, tp=tp, validate=validate_body, device=device)
        for i in range(n)
    ]
    return engines, config


def test_the_emulators_answer_is_sglangs_wire_shape_and_the_trainers_expectation() -> None:
    io_struct = sglang().io_struct
    checker = _sglang_module("sglang.srt.utils.weight_checker")
    (engine,), _ = _engines(1, tp=2)
    try:
        headers = {"Authorization": f"Bearer {engine.server.admin_api_key}"} if engine.server.admin_api_key else {}
        body = httpx.post(f"{engine.url}/weights_checker", json={"action": "checksum"}, headers=headers).json()
        assert body["success"] is True and len(body["ranks"]) == 2
        for rank, info in enumerate(body["ranks"]):
            wire = __import__("msgspec").convert(info, io_struct.ChecksumInfo)
            assert wire.parallelism_info[0].tp_rank == rank and wire.parallelism_info[0].role == "target"
            assert info["per_gpu_checksum"] == checker.overall_checksum(info["checksums"])
        state = engine.server.engine.client.call("served_state_dict", timeout=30)
        assert sc.reported(body) == sc.expected(state, 2)  # the engine's own weights, as SGLang lays them out
        assert sc.reported(httpx.get(f"{engine.url}/weights_checker", headers=headers).json()) == sc.reported(body)
        bad = httpx.post(f"{engine.url}/weights_checker", json={"action": "snapshot"}, headers=headers)
        assert bad.status_code == 400 and bad.json()["success"] is False and "snapshot" in bad.json()["message"]
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("tp", "tied", "device"), [(1, False, "cpu"), (2, False, "cpu"), (2, True, "cpu"), (2, False, "cuda")]
)
def test_refits_into_sglang_verify_by_its_checksums(tp: int, tied: bool, device: str) -> None:
    """On "cuda" the server hashes as SGLang does there (gpu_tensor_hash, tests/test_sglang_tile_hash.py)
    and the trainer computes the same: the kind says which."""
    engines, config = _engines(2, tp=tp, tied=tied, device=device)
    model = _trained(config)
    ctx = protocol.RefitContext(TorchSource(model), SGLangTensorTransport(), engines, mode="colocated")
    clean_refits_verify(ctx, model, sc.kind_for(tp, device), engines)
    assert sc.kind_for(tp, device) == ("sglang" if device == "cpu" else "sglang-cuda") + f"/tp{tp}"


@pytest.mark.parametrize(
    ("kind", "tp", "bucket", "named"),
    [
        ("swap_qk", 1, 1, ["model.layers.0.self_attn.qkv_proj.weight@tp0"]),
        ("flip", 1, 2, ["model.layers.0.mlp.gate_up_proj.weight@tp0"]),
        (
            "swap_tp",
            2,
            1,
            ["model.layers.0.self_attn.o_proj.weight@tp0", "model.layers.0.self_attn.qkv_proj.weight@tp0"],
        ),
        ("stale_head", 1, None, ["lm_head.weight@tp0"]),
    ],
)
def test_a_silent_fault_behind_sglang_is_caught_and_named(
    kind: str, tp: int, bucket: int | None, named: list[str]
) -> None:
    """The fault is armed in the reference engine behind the emulator (the SGLang driver has no
    `arm_fault`): it acks and would serve wrong weights; SGLang's checksums name the parameter."""
    for device in ("cpu", "cuda"):
        engines, config = _engines(2, tp=tp, device=device)
        bad = caught_behind_server(engines, SGLangTensorTransport(), _trained(config), kind, bucket)
        assert bad.verify["mismatched"] == named, device


def test_a_stale_head_behind_a_tied_sglang_server_is_caught() -> None:
    """A tied server whose engine serves a stale copy of the head (not its embedding): the
    checksums cover what it serves, so it is not published."""
    engines, config = _engines(2, tp=1, tied=True)
    bad = caught_behind_server(engines, SGLangTensorTransport(), _trained(config), "stale_head", None)
    assert bad.verify["mismatched"] == ["lm_head.weight@tp0"]


def test_a_malformed_answer_or_an_unmapped_device_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="not computed"):
        sc.reported({"success": False, "message": "boom"})
    with pytest.raises(ValueError, match="no per-rank checksums"):
        sc.reported({"success": True, "message": "Success."})
    with pytest.raises(ValueError, match="not a ChecksumInfo"):
        sc.reported({"success": True, "ranks": [{"checksums": {}}]})
    draft = {"success": True, "ranks": [{"checksums": {"a": "01", "draft.a": "02"}, "per_gpu_checksum": "x",
             "parallelism_info": [{"role": "target", "tp_rank": 0}, {"role": "draft", "tp_rank": 0}]}]}  # fmt: skip
    assert sc.reported(draft) == {"a@tp0": "01"}  # a draft model's weights are not the trainer's
    (engine,), config = _engines(1, tp=1)
    try:
        engine._server_device = "npu"  # SGLang on another device: its layouts there are not mapped
        with pytest.raises(ConfigError, match=r"cannot report digests .*runs on 'npu': refit maps .*\['cpu', 'cuda'\]"):
            protocol.RefitContext(TorchSource(_trained(config)), SGLangTensorTransport(), [engine], mode="colocated")
        engine._server_device, engine._server_offloads = "cuda", True  # some weights hashed on the host
        with pytest.raises(ConfigError, match=r"offloads weights to the host \(--cpu-offload-gb"):
            protocol.RefitContext(TorchSource(_trained(config)), SGLangTensorTransport(), [engine], mode="colocated")
        engine._server_offloads = False
        engine._server_device, engine.checksums = "cpu", False  # a real server's driver: only when asked
        with pytest.raises(ConfigError, match=r"SGLangEngine\(\.\.\., checksums=True\)"):
            protocol.RefitContext(TorchSource(_trained(config)), SGLangTensorTransport(), [engine], mode="colocated")
    finally:
        engine.close()


def test_rotary_buffers_a_trainer_sends_are_not_sglang_parameters() -> None:
    state = dict(TinyLlama(ModelConfig(), seed=0).state_dict())
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.arange(4.0)
    sums = sc.expected(state, 2)
    assert not any("rotary" in k for k in sums) and sc.uncovered(sums, list(state), 2) == []


@pytest.mark.parametrize("tp", [1, 2])
def test_checksums_taken_as_tensors_are_packed_equal_the_whole_states_in_any_order(tp: int) -> None:
    import random

    state = dict(_trained(ModelConfig(vocab_size=250)).state_dict())
    want = sc.expected(state, tp)
    for seed in range(4):
        items = list(state.items())
        random.Random(seed).shuffle(items)  # a fused part may come before the parts it follows
        digests = sc.LayoutDigests(sc.kind_for(tp))
        for name, tensor in items:
            digests.add(name, tensor)
        assert digests.results() == want
    partial = sc.LayoutDigests(sc.kind_for(tp))
    for name, tensor in state.items():
        if not name.endswith("layers.0.self_attn.v_proj.weight"):
            partial.add(name, tensor)
    assert sc.uncovered(partial.results(), list(state), tp) == [
        n
        for n in state
        if n.startswith("model.layers.0.self_attn.") and n.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))
    ]


def test_engines_of_different_kinds_are_refused_naming_the_kinds() -> None:
    one, config = _engines(1, tp=1)
    two, _ = _engines(1, tp=2, prefix="t")
    try:
        with pytest.raises(ConfigError, match=r"different kinds.*'sglang/tp1'.*'sglang/tp2'"):
            protocol.RefitContext(
                TorchSource(_trained(config)), SGLangTensorTransport(), [*one, *two], mode="colocated"
            )
    finally:
        for e in [*one, *two]:
            e.close()
    with pytest.raises(ValueError, match="names no role"):
        sc.reported({"success": True, "ranks": [{"checksums": {}, "parallelism_info": [{"tp_rank": 0}]}]})


def test_a_verify_that_hangs_in_sglang_is_dropped_inside_its_budget() -> None:
    """A hang armed for the verify call really holds /weights_checker (the emulator runs the armed
    fault there too): that engine fails on its own call's budget, the other publishes."""
    sglang()  # SGLang's request types, imported once (seconds) before any budgeted call validates with them
    engines, config = _engines(2, tp=1)
    plan = protocol.FaultPlan().fail_at("verifying", engine=0, call="verify", kind="hang")
    ctx = protocol.RefitContext(
        TorchSource(_trained(config)), SGLangTensorTransport(), engines, mode="colocated", pause_mode="abort",
        retries=0, faults=plan, call_timeout_s=5.0, deadline_s=60.0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        hung, good = result.engines["s0"], result.engines["s1"]
        assert good.status == "updated" and good.verify["ok"]
        assert hung.status != "updated" and "/weights_checker" in (hung.error or "")
        assert invariants.check_trace(ctx.recorder.events, open_ok=True) == []
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_tied_server_drops_an_untied_head_as_sglang_does_and_the_checksums_name_it() -> None:
    """SGLang's Llama and Qwen2 loaders skip a checkpoint's lm_head.weight when the model ties it
    to the embedding, so a trainer whose head is its own is not refused: the server answers
    success and serves the embedding as its head. Unverified, that refit publishes; verified by
    SGLang's checksums, the engine is rejected naming the head."""
    engines, config = _engines(1, tp=1, tied=True)
    untied = ModelConfig(tie_word_embeddings=False, vocab_size=config.vocab_size)
    model = _trained(untied)
    assert not torch.equal(model.state_dict()["lm_head.weight"], model.state_dict()["model.embed_tokens.weight"])
    ctx = protocol.RefitContext(TorchSource(model), SGLangTensorTransport(), engines, mode="colocated", retries=0)
    try:
        ctx.verify = "off"
        assert protocol.run(ctx).ok  # SGLang took it: its loader never read the head
        served = engines[0].server.engine.client.call("served_state_dict", timeout=30)
        assert torch.equal(served["model.embed_tokens.weight"], model.state_dict()["model.embed_tokens.weight"])
        ctx.verify = "digest"
        result = protocol.run(ctx)
        outcome = result.engines["s0"]
        assert outcome.status == "quarantined" and outcome.verify["mismatched"] == ["lm_head.weight@tp0"]
    finally:
        ctx.close()
        for e in engines:
            e.close()


def test_a_plan_the_checksums_cannot_cover_is_refused_before_any_engine_is_touched() -> None:
    """SGLang checksums whole fused parameters: a trainer that sends layer 0's q and k but not its
    v (a partial refit) could only fail verification after every engine took the bytes. It is
    refused in IDLE, naming the parameter; no engine is paused. The pure check also names rows that
    do not split over TP."""
    engines, config = _engines(1, tp=1)
    state = {k: v for k, v in _trained(config).state_dict().items() if k != "model.layers.0.self_attn.v_proj.weight"}
    ctx = protocol.RefitContext(TorchSource(state), SGLangTensorTransport(), engines, mode="colocated")
    try:
        result = protocol.run(ctx)
        assert not result.ok and result.state == "FAILED"
        assert (
            "model.layers.0.self_attn.qkv_proj.weight: q_proj and k_proj sent without v_proj (its checksum covers all 3)"
            in str(result.error)
        )
        assert [r for r, _ in engines[0].server.received if r == "/pause_generation"] == []
    finally:
        ctx.close()
        for e in engines:
            e.close()
    shapes = {"model.layers.0.mlp.down_proj.weight": (8, 10), "model.embed_tokens.weight": (255, 8)}
    assert sc.unmappable(shapes, 4) == ["model.layers.0.mlp.down_proj.weight: 10 columns do not split over TP 4"]
    assert sc.unmappable(shapes, 3, "vllm")[-1].startswith("model.embed_tokens.weight: vocabulary 255 padded")
