"""What the emulated SGLang server does with a decoded bucket is what SGLang 0.5.23's loader does
(models/qwen2.py and llama.py `_legacy_load_weights`; weight_sync/tensor_bucket.py
`FlattenedTensorBucket.reconstruct_tensors`), not stricter: a name the model lacks is skipped and
the rest loaded, `numel` is never read, a bucket with no tensors loads nothing and succeeds, a
tensor sent in another dtype is cast as it is copied; a wrong shape still kills the server. The
payloads are built and serialized by SGLang's own `FlattenedTensorBucket` and
`MultiprocessingSerializer`, and decoded by SGLang's code (`decoder="sglang"`) or refit's stand-in.

Refit's side: a trainer whose tensor names SGLang's model lacks (a wrapper's prefix, say) gets a
refit that SGLang answers with success while it loaded nothing under those names; refit's
verification by SGLang's own checksums refuses to publish it, and names what was stale."""

from __future__ import annotations

import base64
import dataclasses
import types
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from refit import protocol
from refit.drivers.sglang_transport import SGLangTensorTransport
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.testing.sglang_server import EmulatedSGLangEngine

from .conftest import CONFIG, SMALL_BUCKET, perturbed
from .sglang_support import sglang

pytestmark = pytest.mark.e2e

NORM = "model.norm.weight"


@pytest.fixture(params=["refit", "sglang"])
def server(request: pytest.FixtureRequest) -> Iterator[EmulatedSGLangEngine]:
    if request.param == "sglang":
        sglang()  # SGLang's modules importable in this process (its CUDA-only imports stood in)
    engine = EmulatedSGLangEngine.start("ld", config=CONFIG, in_thread=True, decoder=request.param)
    assert httpx.post(engine.url + "/begin_weight_update", json={}).status_code == 200
    yield engine
    engine.close()


def _body(named: list[tuple[str, torch.Tensor]], edit: Any = None) -> dict[str, Any]:
    """One `update_weights_from_tensor` body, flattened and serialized by SGLang's own code
    (`edit(metadata)` changes the records before serializing)."""
    sg = sglang()
    if named:
        bucket = sg.FlattenedTensorBucket(named_tensors=named)
        flat, metadata = bucket.get_flattened_tensor().share_memory_(), bucket.get_metadata()
    else:  # what a sender of no tensors would serialize: SGLang's constructor refuses to build one
        flat, metadata = torch.empty(0, dtype=torch.uint8).share_memory_(), []
    if edit is not None:
        metadata = edit(metadata)
    data = sg.MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata})
    return {
        "serialized_named_tensors": [base64.b64encode(data).decode()],
        "load_format": "flattened_bucket",
        "flush_cache": False,
    }


def _post(engine: EmulatedSGLangEngine, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(engine.url + "/update_weights_from_tensor", json=body, timeout=30)


def _alive(engine: EmulatedSGLangEngine) -> bool:
    return httpx.get(engine.url + "/model_info", timeout=5).status_code == 200 and not engine.server.crashed


def test_a_name_the_model_lacks_is_skipped_and_the_rest_loaded(server: EmulatedSGLangEngine) -> None:
    norm = torch.full((CONFIG.hidden_size,), 0.25)
    resp = _post(server, _body([("module.model.norm.weight", torch.ones(CONFIG.hidden_size)), (NORM, norm)]))
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert _alive(server)
    assert torch.equal(server.state_dict()[NORM], norm)
    info = server.info()["engine"]
    assert info["skipped_tensors"] == 1 and info["skipped_recent"] == ["module.model.norm.weight"]


def test_numel_is_never_read(server: EmulatedSGLangEngine) -> None:
    norm = torch.full((CONFIG.hidden_size,), 0.75)

    def wrong_numel(metadata: list[Any]) -> list[Any]:
        return [dataclasses.replace(m, numel=m.numel + 12345) for m in metadata]

    resp = _post(server, _body([(NORM, norm)], wrong_numel))
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert torch.equal(server.state_dict()[NORM], norm)


def test_numel_must_be_there(server: EmulatedSGLangEngine) -> None:
    """`_update_weights_from_flattened_bucket` copies each record's `numel` (its value unused): a
    record without one raises in SGLang's scheduler, and the server dies."""

    def no_numel(metadata: list[Any]) -> list[Any]:
        return [types.SimpleNamespace(**{k: v for k, v in vars(m).items() if k != "numel"}) for m in metadata]

    with pytest.raises(httpx.RemoteProtocolError):
        _post(server, _body([(NORM, torch.ones(CONFIG.hidden_size))], no_numel))
    assert server.server.crashed


def test_a_tied_head_is_dropped_unread_whatever_its_shape() -> None:
    """A model whose head is its embedding: SGLang's loaders never look at a sent lm_head.weight
    (Qwen2's finds no such parameter, Llama's skips the name), so a wrong shape does not matter."""
    tied = dataclasses.replace(CONFIG, tie_word_embeddings=True)
    engine = EmulatedSGLangEngine.start("tied", config=tied, in_thread=True)
    try:
        assert httpx.post(engine.url + "/begin_weight_update", json={}).status_code == 200
        norm = torch.full((tied.hidden_size,), 0.5)
        resp = _post(engine, _body([("lm_head.weight", torch.ones(3, 5)), (NORM, norm)]))
        assert resp.status_code == 200 and resp.json()["success"], resp.text
        assert _alive(engine) and torch.equal(engine.state_dict()[NORM], norm)
        assert engine.info()["engine"]["skipped_recent"] == ["lm_head.weight"]
    finally:
        engine.close()


def test_a_bucket_with_no_tensors_loads_nothing_and_succeeds(server: EmulatedSGLangEngine) -> None:
    before = server.state_dict()
    resp = _post(server, _body([]))
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    assert _alive(server)
    after = server.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())


def test_another_dtype_is_cast_as_it_is_copied(server: EmulatedSGLangEngine) -> None:
    sent = torch.linspace(-1, 1, CONFIG.hidden_size, dtype=torch.float64)
    model_dtype = server.state_dict()[NORM].dtype
    assert model_dtype != torch.float64
    resp = _post(server, _body([(NORM, sent)]))
    assert resp.status_code == 200 and resp.json()["success"], resp.text
    got = server.state_dict()[NORM]
    assert got.dtype == model_dtype and torch.equal(got, sent.to(model_dtype))


def test_a_span_its_shape_does_not_fill_still_kills_the_server(server: EmulatedSGLangEngine) -> None:
    def short(metadata: list[Any]) -> list[Any]:  # SGLang's view/reshape of the slice raises
        return [dataclasses.replace(m, end_idx=m.end_idx - 4) for m in metadata]

    with pytest.raises(httpx.RemoteProtocolError):
        _post(server, _body([(NORM, torch.ones(CONFIG.hidden_size))], short))
    assert server.server.crashed


class _Wrapped(torch.nn.Module):
    """A trainer model under a wrapper that prefixes every name ("module."), as DDP does."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner


@pytest.mark.parametrize("verify", ["digest", "off"])
def test_names_sglang_skips_are_caught_by_verification_not_by_its_answer(verify: str) -> None:
    model = perturbed(TinyLlama(CONFIG, seed=0), seed=3)
    engine = EmulatedSGLangEngine.start("skip", config=CONFIG, in_thread=True)
    ctx = protocol.RefitContext(
        TorchSource(_Wrapped(model)), SGLangTensorTransport(), [engine], mode="colocated",
        bucket_bytes=SMALL_BUCKET, deadline_s=60, verify=verify, retries=0,
    )  # fmt: skip
    try:
        result = protocol.run(ctx)
        info = engine.info()["engine"]
        assert info["skipped_tensors"] == len(model.state_dict())  # SGLang answered success to every bucket
        assert _alive(engine)
        if verify == "off":  # nothing refit can see: SGLang said success, the weights are the old ones
            assert result.ok
        else:
            assert not result.ok
            outcome = result.engines["skip"]
            assert outcome.status == "quarantined" and outcome.version is None and not outcome.serving
            assert "not what the trainer sent" in str(result.error)
            assert "module.model.embed_tokens.weight" in str(result.error)  # names what SGLang never loaded
    finally:
        ctx.close()
        engine.close()
