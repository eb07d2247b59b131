"""SGLang's own code, imported without a GPU, for contract tests.

`.ci/run` installs sglang 0.5.23 with `--no-deps` plus the small pure-Python packages its
serializer, bucket and request modules import (see .ci/run). Two of its imports are CUDA-only
packages with no build that works beside the CPU torch: `triton` (imported at the top of
sglang/srt/utils/common.py) and `torchvision` (pulled into io_struct through a multimodal config).
The shim below makes `import triton` / `import torchvision` return empty stand-in modules, and only
when the real package is absent. Nothing of ours runs through them; they only let SGLang's module
graph load so its serializer, FlattenedTensorBucket, request types and group helper can be called.
torch must see "no triton" before the stand-in exists (its inductor caches that answer).
"""

from __future__ import annotations

import types
import warnings
from typing import Any

from .standins import install

CUDA_ONLY = ("triton", "torchvision")


def install_shim() -> list[str]:
    """Stand-ins for SGLang's CUDA-only imports that are absent; returns their names. Idempotent."""
    return install(CUDA_ONLY)


def sglang() -> types.SimpleNamespace:
    """SGLang's modules the contract tests call (imports take a few seconds the first time)."""
    install_shim()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import sglang as sg
        from sglang.srt.managers import io_struct
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.common import init_custom_process_group
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket
    return types.SimpleNamespace(
        version=sg.__version__,
        io_struct=io_struct,
        MultiprocessingSerializer=MultiprocessingSerializer,
        FlattenedTensorBucket=FlattenedTensorBucket,
        init_custom_process_group=init_custom_process_group,
    )


ROUTE_TYPES = {
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/generate": "GenerateReqInput",
    "/weights_checker": "CheckWeightsReqInput",
}


def request_type(route: str) -> Any:
    return getattr(sglang().io_struct, ROUTE_TYPES[route])


def fields_of(cls: Any) -> set[str]:
    import dataclasses

    import msgspec

    if isinstance(cls, type) and issubclass(cls, msgspec.Struct):
        return {f.name for f in msgspec.structs.fields(cls)}
    return {f.name for f in dataclasses.fields(cls)}


def validate_body(route: str, body: dict[str, Any], query: dict[str, list[str]] | None = None) -> Any:
    """Validate a JSON body as SGLang 0.5.23's HTTP server does (pydantic over its request type),
    and also refuse keys the type does not have: SGLang would silently ignore a misspelt field."""
    from pydantic import TypeAdapter

    cls = request_type(route)
    unknown = set(body) - fields_of(cls)
    if unknown:
        raise ValueError(f"{route}: {sorted(unknown)} are not fields of SGLang's {cls.__name__} (ignored by SGLang)")
    return TypeAdapter(cls).validate_python(body)
