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

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
import warnings
from typing import Any

CUDA_ONLY = ("triton", "torchvision")


class _Anything(type):
    """A stand-in class: any attribute is another stand-in; used as a decorator it returns the
    function unchanged (`@triton.jit`)."""

    def __getattr__(cls, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{cls.__name__}.{key}", (), {})

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], _Anything):
            return args[0]
        return _Anything(f"{cls.__name__}()", (), {})

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__

    def __iter__(cls) -> Any:
        return iter(())

    def __bool__(cls) -> bool:
        return False


class _StandIn(types.ModuleType):
    def __getattr__(self, key: str) -> Any:
        if key.startswith("__"):
            raise AttributeError(key)
        return _Anything(f"{self.__name__}.{key}", (), {})


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots: set[str]) -> None:
        self.roots = roots

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".", maxsplit=1)[0] in self.roots:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandIn(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0+stand-in"
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


def install_shim() -> list[str]:
    """Stand-ins for the CUDA-only packages that are absent; returns their names. Idempotent."""
    if any(isinstance(f, _Finder) for f in sys.meta_path):
        return []
    import torch._inductor.compile_fx  # noqa: F401 - torch decides "no triton" before a stand-in exists
    import torch.utils._triton as torch_triton

    torch_triton.has_triton()
    missing = [r for r in CUDA_ONLY if importlib.util.find_spec(r) is None]
    sys.meta_path.append(_Finder(set(missing)))
    return missing


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
