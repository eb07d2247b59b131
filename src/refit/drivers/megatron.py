"""Megatron source (extra `[megatron]`): a Megatron-Core model's weights under their Hugging Face
names, produced by megatron-bridge's `AutoBridge.export_hf_weights`, which gathers the TP/PP/EP
shards and converts (fuses, splits, renames) each tensor. One per trainer rank; every rank of the
model's parallel groups takes part, because the export's gathers are collectives.

Lifecycle:
  run start               `metas()`: HF names, dtypes and shapes after conversion, in export
                          order. Learnt once by draining the export on every rank (collective: the
                          runner asks every rank in step), then kept: a model's names and shapes do
                          not change between steps (`forget_metas()` after a change that does).
  OFFLOADING (colocated)  `offload()`: the `offload` hook given, if any (a Megatron trainer frees
                          its optimizer state and gradient buffers its own way).
  TRANSFERRING            `iter_buckets(plan)`: one pass of the export, drained in step on every
                          rank; per bucket, the planned tensors in plan order, each checked against
                          its meta (name, shape, dtype: a mismatch names the tensor). A tensor the
                          export yields before its bucket is held until then (a wire format may
                          order a bucket's tensors differently; it is copied, since a bridge
                          may reuse its buffers); nothing is gathered twice. What the export
                          yields after the plan is a tensor twice or unplanned: an error.
                          A retry starts a fresh export on every rank.
  RESTORING / abort       `restore()`: the `restore` hook given, if any; idempotent by contract.

Not resident: every tensor is made anew by the conversion, so a transport never shares its storage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest, TensorMeta, attention_heads, head_counts
from refit.drivers.base import LazyTensors, Source

if TYPE_CHECKING:
    import torch


class MegatronSource(Source):
    kind = "megatron"

    def __init__(
        self,
        bridge: Any,
        model: Any,
        *,
        cpu: bool = False,
        rename: Callable[[str], str | None] | None = None,
        offload: Callable[[], None] | None = None,
        restore: Callable[[], None] | None = None,
    ) -> None:
        """`bridge`: a megatron-bridge `AutoBridge` (anything with `export_hf_weights(model, cpu=,
        show_progress=, conversion_tasks=)` and `get_conversion_tasks(model)`). `model`: the
        Megatron model chunks (a list, as the bridge takes them; one module is wrapped). `cpu`:
        export on the CPU (host transports) instead of the model's device. `rename`: HF name ->
        engine name, or None to skip a tensor. `offload`/`restore`: colocated hooks."""
        self._bridge = bridge
        self._model = list(model) if isinstance(model, list | tuple) else [model]
        self._cpu = cpu
        self._rename = rename
        self._offload = offload
        self._restore = restore
        self._tasks: Any = None
        self._metas: list[TensorMeta] | None = None

    def _export(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One pass of the bridge's export, renamed (every rank must drain it in step)."""
        if self._tasks is None:  # built once: the model's structure does not change between refits
            self._tasks = self._bridge.get_conversion_tasks(self._model)
        exported: Iterable[Any] = self._bridge.export_hf_weights(
            self._model, cpu=self._cpu, show_progress=False, conversion_tasks=self._tasks
        )
        for name, tensor in exported:
            engine_name = self._rename(name) if self._rename else name
            if engine_name is not None:
                yield engine_name, tensor

    def metas(self) -> list[TensorMeta]:
        if self._metas is None:
            metas: list[TensorMeta] = []
            seen: set[str] = set()
            for name, tensor in self._export():
                if name in seen:
                    raise ValueError(f"megatron source: the export yields {name!r} twice (check `rename`)")
                seen.add(name)
                metas.append(TensorMeta.of(name, tensor))
            if not metas:
                raise ValueError("megatron source: the bridge exported no tensors")
            self._metas = attention_heads(metas, self._head_config())
        return list(self._metas)

    def _head_config(self) -> Any:
        """The config naming the model's head counts: the first chunk's TransformerConfig
        (num_attention_heads, num_query_groups), else the bridge's HF config."""
        hf = getattr(self._bridge, "hf_pretrained", None)
        for config in (getattr(self._model[0], "config", None), getattr(hf, "config", hf)):
            if config is not None and head_counts(config) is not None:
                return config
        return None

    def forget_metas(self) -> None:
        """The model's exported names or shapes changed: the next run learns them again."""
        self._metas = None
        self._tasks = None

    def offload(self) -> None:
        if self._offload is not None:
            self._offload()

    def restore(self) -> None:
        if self._restore is not None:
            self._restore()

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[LazyTensors]:
        stream = self._export()
        held: dict[str, torch.Tensor] = {}
        seen: set[str] = set()
        planned = {e.meta.name for m in plan for e in m.entries}

        def take(meta: TensorMeta) -> torch.Tensor:
            while meta.name not in held:
                try:
                    name, tensor = next(stream)
                except StopIteration:
                    raise ValueError(
                        f"megatron source: the export ended without {meta.name!r} (planned in this refit)"
                    ) from None
                if name not in planned:
                    raise ValueError(f"megatron source: the export yields {name!r}, which this refit did not plan")
                if name in seen:
                    raise ValueError(f"megatron source: the export yields {name!r} twice")
                seen.add(name)
                held[name] = tensor if name == meta.name else tensor.clone()  # the bridge may reuse its buffer
            tensor = held.pop(meta.name)
            got = TensorMeta.of(meta.name, tensor)
            if got != meta:
                raise ValueError(
                    f"megatron source: {meta.name} exported as {got.dtype}{list(got.shape)}, "
                    f"planned as {meta.dtype}{list(meta.shape)}"
                )
            return tensor

        def bucket(manifest: BucketManifest, last: bool) -> Iterator[tuple[str, torch.Tensor]]:
            for entry in manifest.entries:
                yield entry.meta.name, take(entry.meta)
            if last:  # the export runs to its end on every rank (its last collectives), inside the last pack
                for name, _ in stream:
                    what = "twice" if name in seen else "after the planned tensors, unplanned"
                    raise ValueError(f"megatron source: the export yields {name!r} {what}")

        try:
            for i, manifest in enumerate(plan):
                yield bucket(manifest, i == len(plan) - 1)
        finally:
            held.clear()
