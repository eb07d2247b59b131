"""LoRA source: a trainer model wrapped by PEFT (or any adapter state dict with its spec), whose
refit moves the adapter only: A and B per targeted projection, named as PEFT saves them
(`get_peft_model_state_dict`). A run over this source is a LoRA refit (`RefitContext.adapter`):
each engine stages the adapter as a new version beside the ones its requests use, and publishing
makes it the one new requests get; nothing pauses.

Lifecycle: as `TorchSource` (`metas()` at run start, `iter_buckets(plan)` in TRANSFERRING; the
adapter's tensors are the trainer's own, handed out as they are). `adapter`: what the engines are
told besides the tensors ({"name", "r", "lora_alpha", "target_modules", "use_rslora", "dtype"}).
FSDP2-sharded adapters: pass a callable returning the full tensors (gathered), as `TorchSource`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from refit.buckets import dtype_name
from refit.drivers.torch_source import TorchSource

if TYPE_CHECKING:
    import torch


class LoraSource(TorchSource):
    kind = "lora"

    def __init__(
        self,
        model: Any,
        *,
        name: str,
        adapter_name: str = "default",
        spec: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        """`model`: a `peft.PeftModel` (its adapter `adapter_name` is sent), or a state dict of
        PEFT-named adapter tensors / a callable returning one, with `spec` (a `LoraSpec`, its dict,
        or a PEFT `LoraConfig`). `name`: the adapter's name on the engines (requests ask for it).
        A spec whose math the engines would not compute as PEFT does (DoRA, LoRA biases, rank or
        alpha patterns, ...) is refused here, by name."""
        from refit.reference.lora import LoraSpec, parse_name

        if not isinstance(name, str) or not name or "@" in name:
            raise ValueError(f"lora source: adapter name {name!r} must be a non-empty string without '@'")
        self._peft = None
        if spec is None:
            configs = getattr(model, "peft_config", None)
            if not isinstance(configs, Mapping) or adapter_name not in configs:
                raise ValueError(
                    f"lora source: {type(model).__name__} has no PEFT adapter {adapter_name!r}; pass a PeftModel or "
                    "a state dict with spec="
                )
            spec = configs[adapter_name]
            self._peft = model
        self.spec = spec if isinstance(spec, LoraSpec) else LoraSpec.from_dict(spec)
        state: Any = model
        if self._peft is not None:
            state = _peft_state(model, adapter_name)
        super().__init__(state, optimizer=optimizer)
        named = self._named()
        for tname, _ in named:
            parse_name(tname)  # a name that is not a LoRA tensor is refused now, naming it
        dtypes = {dtype_name(t.dtype) for _, t in named}
        if len(dtypes) != 1:
            raise ValueError(f"lora source: the adapter's tensors have several dtypes {sorted(dtypes)}")
        self.adapter = {"name": name, **self.spec.to_dict(), "dtype": dtypes.pop()}

    def metas(self) -> list[Any]:
        """As `TorchSource.metas`; the adapter's dtype is read again (the trainer may have cast it)."""
        metas = super().metas()
        dtypes = {m.dtype for m in metas}
        if len(dtypes) != 1:
            raise ValueError(f"lora source: the adapter's tensors have several dtypes {sorted(dtypes)}")
        self.adapter["dtype"] = dtypes.pop()
        return metas

    @property
    def resident(self) -> bool:
        return not any(hasattr(t, "placements") for _, t in self._named())

    def logprobs(self, prompts: Any, top: int) -> list[dict[str, list[Any]]]:
        raise NotImplementedError("verify='probe' of a LoRA refit: use verify='digest'")


def _peft_state(model: Any, adapter_name: str) -> Callable[[], dict[str, torch.Tensor]]:
    """The adapter's tensors under the names PEFT saves them by (its `get_peft_model_state_dict`
    for LoRA: the adapter name dropped from each key), read from the live parameters at each call:
    the parameters themselves, so FSDP2's DTensors stay sharded (the transport gathers them). Not
    PEFT's function itself: from 0.22 it gathers DTensors into full CPU copies on every rank."""
    marks = (f".lora_A.{adapter_name}.", f".lora_B.{adapter_name}.")

    def state() -> dict[str, torch.Tensor]:
        return {
            name.replace(f".{adapter_name}.", "."): p for name, p in model.named_parameters()
            if any(m in name for m in marks)
        }  # fmt: skip

    return state
