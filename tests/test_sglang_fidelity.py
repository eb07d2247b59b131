"""The emulated SGLang server against SGLang 0.5.23's own HTTP server (its FastAPI app, routes,
request types, validation handler and auth decision, tests/sglang_app.py), request for request:
the same status, the same answer shape, the same texts where a driver reads them, and the same
death where SGLang's scheduler raises. The emulator's stdlib front is what `refit.testing` ships
(no SGLang needed); this is the evidence that it answers as SGLang does."""

from __future__ import annotations

import base64
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from refit.drivers.sglang import update_weights_from_tensor_body
from refit.testing.sglang_server import EmulatedSGLang, EmulatedSGLangEngine

from .conftest import CONFIG
from .sglang_app import SGLangAppServer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pair() -> Iterator[dict[str, EmulatedSGLangEngine]]:
    made = {
        "emulator": EmulatedSGLangEngine.start("emu", config=CONFIG, in_thread=True),
        "sglang": EmulatedSGLangEngine.start("app", config=CONFIG, in_thread=True, server=SGLangAppServer),
    }
    yield made
    for e in made.values():
        e.close()


def _tensor_body(name: str, tensor: torch.Tensor) -> dict[str, Any]:
    return update_weights_from_tensor_body([[(name, tensor)]], weight_version=None)


def _norm() -> torch.Tensor:
    return torch.full((CONFIG.hidden_size,), 0.5)


CORPUS: list[tuple[str, str, Any]] = [
    ("POST", "/pause_generation", None),  # no body: a validation error
    ("POST", "/pause_generation", {"mode": "sideways"}),
    ("POST", "/update_weights_from_tensor", {"serialized_named_tensors": ["not base64!"]}),
    ("POST", "/update_weight_version", {}),
    ("POST", "/end_weight_update", {}),
    ("POST", "/update_weights_from_tensor", "tensor:model.norm.weight"),  # a good payload, no session
    ("POST", "/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]]}),
    ("POST", "/destroy_weights_update_group", {"group_name": "nope"}),
    ("POST", "/begin_weight_update", {}),
    ("POST", "/begin_weight_update", {}),
    ("POST", "/update_weights_from_tensor", "tensor:model.norm.weight"),
    ("POST", "/end_weight_update", {}),
    ("POST", "/flush_cache", None),
    ("POST", "/update_weight_version", {"new_version": "7", "abort_all_requests": False}),
    ("GET", "/model_info", None),
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]}),
    ("POST", "/generate", {"input_ids": [3, 1, 4], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}),
    ("POST", "/weights_checker", {"action": "checksum"}),  # every rank's checksums of the weights
    ("GET", "/weights_checker", None),  # no body: the default request
    ("POST", "/weights_checker", {"action": "checksum", "selector": "draft"}),  # no draft model: no payload
    ("POST", "/weights_checker", {"action": "checksum", "selector": "sideways"}),
    ("POST", "/weights_checker", {"action": "spin"}),
    ("POST", "/weights_checker", {"action": "spin", "selector": "draft"}),  # no draft runner: nothing checks it
    ("POST", "/weights_checker", {"action": 5}),
    ("POST", "/weights_checker", {"skip_tensor_list": "model"}),
    ("POST", "/weights_checker", {"action": "checksum", "skip_tensor_list": ["mlp"]}),
    ("POST", "/no_such_route", {}),
]


def _send(engine: EmulatedSGLangEngine, method: str, route: str, body: Any) -> httpx.Response:
    if isinstance(body, str) and body.startswith("tensor:"):
        body = _tensor_body(body.removeprefix("tensor:"), _norm())
    return (
        httpx.request(method, engine.url + route, json=body, timeout=30)
        if body is not None
        else httpx.request(method, engine.url + route, timeout=30)
    )


def _shape(resp: httpx.Response) -> Any:
    """What must agree: the status, and the answer with SGLang's validation messages (FastAPI's
    wording, with file paths) reduced to their envelope."""
    try:
        data = resp.json()
    except ValueError:
        return resp.status_code, resp.text
    if isinstance(data, dict) and data.get("object") == "error":
        data = {**data, "message": "<validation message>"}
    if isinstance(data, dict) and "meta_info" in data:
        data = {**data, "output_ids": len(data["output_ids"])}
    if isinstance(data, dict) and "model_path" in data:
        data = {k: data[k] for k in ("weight_version", "is_generation")}
    return resp.status_code, data


def test_every_request_is_answered_as_sglangs_own_server_answers_it(pair) -> None:
    for method, route, body in CORPUS:
        got = {name: _shape(_send(e, method, route, body)) for name, e in pair.items()}
        assert got["emulator"] == got["sglang"], (method, route, body, got)
    # the texts the driver reads, verbatim
    for e in pair.values():
        assert e.server.label == "7" and not e.server.session_open


def test_server_info_has_sglangs_fields_and_no_identity(pair) -> None:
    for e in pair.values():
        info = httpx.get(e.url + "/server_info", timeout=30).json()
        assert info["version"] == "0.5.23"
        assert isinstance(info["startup_time"], dict) and "load_weight" in info["startup_time"]  # durations


@pytest.mark.parametrize("front", [EmulatedSGLang, SGLangAppServer], ids=["emulator", "sglang"])
@pytest.mark.parametrize(
    ("case", "route"),
    [
        ("wrong shape in a session", "/update_weights_from_tensor"),
        ("undecodable payload in a session", "/update_weights_from_tensor"),
        ("release while a request runs", "/release_memory_occupation"),
        ("resume of a tag never released", "/resume_memory_occupation"),
    ],
)
def test_where_sglangs_scheduler_raises_the_server_dies(front, case, route) -> None:
    """The request loses its connection, then nothing listens: SGLang's scheduler SIGQUITs the
    server on any exception it raises. Both fronts die the same way."""
    engine = EmulatedSGLangEngine.start("crash", config=CONFIG, in_thread=True, server=front)
    try:
        url = engine.url
        running = None
        if "session" in case:
            assert httpx.post(url + "/begin_weight_update", json={}).status_code == 200
        if case == "wrong shape in a session":
            body: Any = _tensor_body("model.norm.weight", torch.ones(CONFIG.hidden_size + 1))
        elif case == "undecodable payload in a session":
            body = {"serialized_named_tensors": [base64.b64encode(b"not a pickle").decode()],
                    "load_format": "flattened_bucket"}  # fmt: skip
        elif case == "release while a request runs":  # paused in place: the request keeps its KV
            running = engine.submit([3, 1, 4, 1, 5], CONFIG.max_seq_len - 5)
            while not engine.server._engine("info")["running"]:
                assert not running.done(), running.result()
                time.sleep(0.001)
            assert httpx.post(url + "/pause_generation", json={"mode": "in_place"}).status_code == 200
            body = {"tags": ["kv_cache"]}
        else:
            body = {"tags": ["weights"]}
        with pytest.raises(httpx.RemoteProtocolError):
            httpx.post(url + route, json=body, timeout=30)
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/model_info", timeout=5)
        assert engine.server.crashed
        if running is not None:
            with pytest.raises(Exception):  # noqa: B017 - its server is gone
                running.result(timeout=30)
    finally:
        engine.close()


def test_auth_is_decided_as_sglang_decides_it() -> None:
    """--api-key guards every route; --admin-api-key only the weight and control routes."""
    for keys in ({"api_key": "k"}, {"admin_api_key": "a"}, {"api_key": "k", "admin_api_key": "a"}):
        got = {}
        for name, front in (("emulator", EmulatedSGLang), ("sglang", SGLangAppServer)):
            engine = EmulatedSGLangEngine.start("auth", config=CONFIG, in_thread=True, server=front, **keys)
            url = engine.url
            try:
                got[name] = [
                    (r.status_code, r.json() if r.status_code == 401 else None)
                    for r in (
                        httpx.get(url + "/model_info"),
                        httpx.get(url + "/model_info", headers={"Authorization": "Bearer k"}),
                        httpx.post(url + "/continue_generation", json={}),
                        httpx.post(url + "/continue_generation", json={}, headers={"Authorization": "Bearer k"}),
                        httpx.post(url + "/continue_generation", json={}, headers={"Authorization": "Bearer a"}),
                    )
                ]
            finally:
                engine.close()
        assert got["emulator"] == got["sglang"], (keys, got)
