"""Torch source: any `nn.Module` or state dict, named as the engine names it, bucketed by bytes.

Lifecycle:
  OFFLOADING (colocated)  `offload()`: drop gradients (set to None); move optimizer state to CPU
                          when it lives on an accelerator. On a CPU-only trainer the optimizer
                          part has nothing to move.
  CONNECTING              `metas()`: one TensorMeta per state-dict entry (DTensor: global shape).
  TRANSFERRING            `iter_buckets(plan)`: materializes one bucket at a time: a DTensor is
                          gathered with `full_tensor()`, a dtype cast applied if asked; tensors
                          are passed as they are otherwise (the transport copies them, so
                          non-contiguous tensors are fine and nothing is cloned here).
  RESTORING / abort       `restore()`: optimizer state back to where it was.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from refit.drivers.base import NamedTensors, Source
from refit.drivers.buckets import BucketManifest, TensorMeta, dtype_name

if TYPE_CHECKING:
    import torch


class TorchSource(Source):
    kind = "torch"

    def __init__(
        self,
        model: Any,
        *,
        rename: Callable[[str], str | None] | None = None,
        dtype: torch.dtype | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """`model`: an nn.Module, a state dict, or a callable returning one (called per refit).
        `rename`: trainer name -> engine name, or None to skip a tensor. `dtype`: cast floating
        tensors to this dtype on the way out."""
        self._model = model
        self._rename = rename
        self._dtype = dtype
        self._optimizer = optimizer
        self._moved: list[tuple[dict[str, Any], str, Any]] = []  # (state, key, original device)

    def _state_dict(self) -> Mapping[str, torch.Tensor]:
        from torch import nn

        if isinstance(self._model, nn.Module):
            return self._model.state_dict(keep_vars=False)
        if callable(self._model):
            return self._model()
        return self._model

    def _named(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, tensor in self._state_dict().items():
            engine_name = self._rename(name) if self._rename else name
            if engine_name is not None:
                out.append((engine_name, tensor))
        return out

    def _out_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self._dtype if self._dtype is not None and tensor.is_floating_point() else tensor.dtype

    def metas(self) -> list[TensorMeta]:
        return [
            TensorMeta(name, dtype_name(self._out_dtype(t)), tuple(int(d) for d in t.shape))
            for name, t in self._named()
        ]

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[NamedTensors]:
        named = dict(self._named())
        for manifest in plan:
            bucket = []
            for name in manifest.names:
                if name not in named:
                    raise KeyError(f"torch source: planned tensor {name!r} is no longer in the state dict")
                bucket.append((name, self._materialize(named[name])))
            yield bucket  # no grad-mode context is held across this yield: the trainer's thread is untouched

    def _materialize(self, tensor: torch.Tensor) -> torch.Tensor:
        import torch

        with torch.no_grad():
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # DTensor / FSDP2
            full = full.detach()
            target = self._out_dtype(full)
            return full if full.dtype == target else full.to(target)

    def offload(self) -> None:
        from torch import nn

        if isinstance(self._model, nn.Module):
            self._model.zero_grad(set_to_none=True)
        if self._optimizer is None:
            return
        for state in self._optimizer.state.values():
            for key, value in list(state.items()):
                if hasattr(value, "device") and value.device.type != "cpu":
                    self._moved.append((state, key, value.device))
                    state[key] = value.to("cpu")

    def restore(self) -> None:
        for state, key, device in self._moved:
            state[key] = state[key].to(device)
        self._moved.clear()
