"""Stand-in modules for CUDA-only packages that have no build beside the CPU torch (test support).

Some third-party modules the contract and Megatron tests call import a CUDA-only package at the top
(`triton`, `torchvision`, `transformer_engine`, ...) although the part we call never uses it. A
meta-path finder answers those imports, only for packages that are really absent, with an empty
module whose every attribute is a stand-in class (usable as a base class, in `isinstance`, as a
decorator that returns the function unchanged, and falsy). Nothing of ours runs through them.
torch must decide "no triton" before a stand-in for it exists (its inductor caches that answer).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any


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


def install(roots: Sequence[str]) -> list[str]:
    """Stand-ins for those of `roots` (top-level package names) that are absent; returns the names
    newly stood in. Idempotent; later calls add roots to the one finder."""
    finder = next((f for f in sys.meta_path if isinstance(f, _Finder)), None)
    if finder is None:
        import torch._inductor.compile_fx  # noqa: F401 - torch decides "no triton" before a stand-in exists
        import torch.utils._triton as torch_triton

        torch_triton.has_triton()
        finder = _Finder(set())
        sys.meta_path.append(finder)
    missing = [r for r in roots if r not in finder.roots and importlib.util.find_spec(r) is None]
    finder.roots.update(missing)
    return missing
