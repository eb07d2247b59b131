"""vLLM's own code, imported without a GPU, for contract tests.

`.ci/run` installs vllm 0.33.0 with `--no-deps` plus the small packages its weight-transfer, RL
router and completion-protocol modules import; they import on the CPU torch as they are (no
stand-ins). What runs here is vLLM's request validation: its FastAPI routers (the RL weight-transfer
router, the dev cache and sleep routers, /version) mounted on a FastAPI app whose engine client
only records what it was asked, and its worker-side info dataclasses (`NCCLWeightTransferInitInfo`,
`NCCLWeightTransferUpdateInfo`, `IPCWeightTransferUpdateInfo`), which parse what the router hands
the workers. What cannot run without a GPU: the workers themselves (CUDA streams, PyNccl, CUDA IPC
rebuilds).
"""

from __future__ import annotations

import functools
import os
import types
import warnings
from typing import Any


@functools.cache
def vllm() -> types.SimpleNamespace:
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles arrive pickled over HTTP
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm as v
        from vllm.distributed.weight_transfer import ipc_engine, nccl_common, nccl_engine
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest
        from vllm.entrypoints.rl.online import api_router as rl_router
        from vllm.entrypoints.serve.dev.cache import api_router as cache_router
        from vllm.entrypoints.serve.dev.sleep import api_router as sleep_router
        from vllm.entrypoints.serve.instrumentator import basic
        from vllm.v1.engine import PauseMode
    return types.SimpleNamespace(
        version=v.__version__,
        NCCLInitInfo=nccl_common.NCCLWeightTransferInitInfo,
        NCCLUpdateInfo=nccl_engine.NCCLWeightTransferUpdateInfo,
        IPCInitInfo=ipc_engine.IPCWeightTransferInitInfo,
        IPCUpdateInfo=ipc_engine.IPCWeightTransferUpdateInfo,
        CompletionRequest=CompletionRequest,
        PauseMode=PauseMode,
        routers=[rl_router.router, cache_router.router, sleep_router.router, basic.router],
    )


class RecordingEngineClient:
    """Stands where vLLM's AsyncLLM would: answers like it and records each call and its arguments."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.vllm_config = types.SimpleNamespace(
            parallel_config=types.SimpleNamespace(world_size=1, world_size_across_dp=1, data_parallel_size=1)
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        async def method(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((name, args, kwargs))
            return {"reset_prefix_cache": True, "wake_up": True, "is_sleeping": False, "get_weight_version": "default",
                    "is_paused": False, "compute_weight_checksums": []}.get(name)  # fmt: skip

        return method


@functools.cache
def _client() -> tuple[Any, RecordingEngineClient]:
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    for router in vllm().routers:
        app.include_router(router)
    recorder = RecordingEngineClient()
    app.state.engine_client = recorder
    return TestClient(app, raise_server_exceptions=False), recorder


GET_ROUTES = frozenset({"/weight_info", "/version", "/get_world_size", "/is_paused", "/is_sleeping"})


def validate_request(route: str, body: Any, query: dict[str, list[str]] | None = None) -> Any:
    """Send the request through vLLM 0.33's own routers (FastAPI validation, the route's handler)
    and refuse anything they answer with an error; then parse what reaches the workers with vLLM's
    own info dataclasses. /v1/completions bodies are validated by vLLM's CompletionRequest."""
    v = vllm()
    if route == "/v1/completions":
        unknown = set(body) - set(v.CompletionRequest.model_fields)
        if unknown:
            raise ValueError(f"/v1/completions: {sorted(unknown)} are not fields of vLLM's CompletionRequest")
        return v.CompletionRequest.model_validate(body)
    client, recorder = _client()
    before = len(recorder.calls)
    method = "GET" if route in GET_ROUTES else "POST"
    response = client.request(method, route, params=query, json=body)
    if response.status_code != 200:
        raise ValueError(f"vLLM's router answered {route} with HTTP {response.status_code}: {response.text[:300]}")
    handed = recorder.calls[before:]
    if route == "/init_weight_transfer_engine":
        init = body["init_info"]
        return (v.IPCInitInfo if set(init) == {"packed"} else v.NCCLInitInfo)(**init)
    if route == "/update_weights":
        info = body["update_info"]
        cls = v.IPCUpdateInfo if "ipc_handles_pickled" in info or "ipc_handles" in info else v.NCCLUpdateInfo
        return cls(**info)
    return handed
