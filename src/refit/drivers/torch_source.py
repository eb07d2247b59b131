"""Torch source: any `nn.Module` or state dict (plain or FSDP2/DTensor), named as the engine
names it. One per trainer rank: under FSDP2 every rank builds one over its own sharded module.

Lifecycle:
  run start               `metas()`: one TensorMeta per state-dict tensor, an alias (a tied head)
                          under its first name only (DTensor: global shape;
                          the dtype after the optional cast; q/k/v projections carry their head
                          counts when the model's config is known).
  OFFLOADING (colocated)  `offload()`: drop gradients (set to None); move optimizer state to CPU
                          when it lives on an accelerator. On a CPU-only trainer the optimizer
                          part has nothing to move.
  TRANSFERRING            `iter_buckets(plan)`: per bucket, the planned tensors one at a time,
                          as they are: a DTensor stays sharded (the transport gathers it straight
                          into its buffer, casting on the way), nothing is cloned or gathered
                          here, so the trainer never holds a whole extra bucket.
  RESTORING / abort       `restore()`: optimizer state back to where it was.
  storages()              a resident source (plain tensors handed out as they are) offers the
                          storages they lie in, for a transport that shares them once (CUDA IPC).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from refit.buckets import BucketManifest, TensorMeta, attention_heads, dtype_name, head_counts
from refit.drivers.base import LazyTensors, Source, Storages

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
        send_aliases: bool = False,
        config: Any = None,
    ) -> None:
        """`model`: an nn.Module, a state dict, or a callable returning one (called per refit).
        `rename`: trainer name -> engine name, or None to skip a tensor. `dtype`: cast floating
        tensors to this dtype on the way out. `send_aliases`: send a tensor the state dict lists
        twice under both names (default: once, under the first name kept). `config`: the model's
        config (transformers', refit's ModelConfig, or a dict with num_attention_heads and
        num_key_value_heads), for a `model` that does not carry it as `.config`: verifying
        against a server that replicates KV heads over its TP ranks needs their count."""
        self._model = model
        self._config = config if config is not None else getattr(model, "config", None)
        if config is not None and head_counts(config) is None:
            raise ValueError(
                f"torch source: config {type(config).__name__} names no positive integer head counts "
                "(num_attention_heads and num_key_value_heads, or num_heads and num_kv_heads)"
            )
        self._send_aliases = send_aliases
        self._rename = rename
        self._dtype = dtype
        self._optimizer = optimizer
        self._moved: list[tuple[dict[str, Any], str, Any]] = []  # (state, key, original device)

    def _state_dict(self, keep_vars: bool = False) -> Mapping[str, torch.Tensor]:
        from torch import nn

        if isinstance(self._model, nn.Module):
            return self._model.state_dict(keep_vars=keep_vars)
        if callable(self._model):
            return self._model()
        return self._model

    def _named(self, keep_vars: bool = False) -> list[tuple[str, torch.Tensor]]:
        """(engine name, tensor) per state-dict entry kept by `rename`, but a tensor listed twice
        (a tied head: `lm_head.weight` is `model.embed_tokens.weight`) only under the first name
        kept, as `named_parameters()` lists it and as vLLM's own trainer-side source sends it: a
        server that ties the same names (its config's tie_word_embeddings) serves it under both.
        `send_aliases=True`: every name (a server whose config does not tie them)."""
        out = []
        seen: set[tuple[Any, ...]] = set()
        for name, tensor in self._state_dict(keep_vars).items():
            engine_name = self._rename(name) if self._rename else name
            if engine_name is None:
                continue
            key = None if self._send_aliases else _alias_key(tensor)
            if key is not None:
                if key in seen:
                    continue
                seen.add(key)
            out.append((engine_name, tensor))
        return out

    def _out_dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self._dtype if self._dtype is not None and tensor.is_floating_point() else tensor.dtype

    @property
    def resident(self) -> bool:
        """Plain tensors of a module or state dict, handed out as they are, are the trainer's own. A
        callable (it may gather, and is called once per refit), a cast or a DTensor is not."""
        from torch import nn

        if self._dtype is not None or (callable(self._model) and not isinstance(self._model, nn.Module)):
            return False
        return not any(hasattr(t, "placements") for _, t in self._named())

    def flatten_into(self, transport: Any, bucket_bytes: int) -> int:
        """Move the trainer's tensors into the layout `transport` plans for `bucket_bytes` (one
        buffer per bucket, each tensor at its planned offset), in place: every tensor object (a
        module's parameters and buffers, a state dict's values) keeps its identity and values, its
        memory becomes a view of its bucket's buffer. A transport that sends a bucket's buffer
        (SGLang's flattened buckets, `SGLangTensorTransport`) then finds each bucket already packed
        and sends a view of the trainer's own memory: no copy per refit. Call it where the model's
        tensors are not being used (before training, or between steps); an optimizer built
        before keeps working (it holds the same tensor objects). Needs tensors handed out as they
        are (`resident`: no cast, no DTensor, not a callable source), each listed once
        (`send_aliases` off). CPU buffers are made in named shared memory. Returns the buffers'
        bytes."""
        import torch

        from refit.drivers.flattened import shared_buffer

        if not self.resident or self._send_aliases:
            raise ValueError(
                "torch source: flatten_into needs the trainer's own tensors as they are (no dtype cast, no DTensor, "
                "not a callable, send_aliases off)"
            )
        named = dict(self._named(keep_vars=True))
        _check_movable(named)
        plan = transport.plan(self.metas(), bucket_bytes)
        total = 0
        with torch.no_grad():
            for manifest in plan:
                tensors = [named[n] for n in manifest.names]
                devices = {t.device for t in tensors}
                if len(devices) != 1:
                    where = sorted(map(str, devices))
                    raise ValueError(f"torch source: bucket {manifest.index}'s tensors lie on {where}")
                buffer = shared_buffer(manifest.nbytes, devices.pop())
                total += int(buffer.numel())
                for entry, tensor in zip(manifest.entries, tensors, strict=True):
                    meta = entry.meta
                    view = buffer[entry.offset : entry.offset + meta.nbytes].view(tensor.dtype).view(tensor.shape)
                    view.copy_(tensor)
                    tensor.data = view
        return total

    def storages(self) -> Storages | None:
        """The trainer's own tensors, when handed out as they are (`resident`); else None."""
        if not self.resident:
            return None
        return Storages(tuple(t.detach() for _, t in self._named()))

    def metas(self) -> list[TensorMeta]:
        metas = [
            TensorMeta(name, dtype_name(self._out_dtype(t)), tuple(int(d) for d in t.shape))
            for name, t in self._named()
        ]
        return attention_heads(metas, self._config)

    def iter_buckets(self, plan: Sequence[BucketManifest]) -> Iterator[LazyTensors]:
        named = dict(self._named())
        for manifest in plan:
            missing = [n for n in manifest.names if n not in named]
            if missing:
                raise KeyError(f"torch source: planned tensors {missing[:3]} are no longer in the state dict")
            yield [(name, named[name].detach()) for name in manifest.names]

    def logprobs(self, prompts: Sequence[Sequence[int]], top: int) -> list[dict[str, list[Any]]]:
        """The module's next-token log-probabilities (its forward returns logits, or an object with
        `.logits`, as transformers' models do), in eval mode, without gradients."""
        import torch
        from torch import nn

        model = self._model
        if not isinstance(model, nn.Module):
            raise NotImplementedError("torch source: only an nn.Module can score prompts (this one is a state dict)")
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        training = model.training
        model.eval()
        out = []
        try:
            with torch.no_grad():
                for prompt in prompts:
                    result = model(torch.tensor([list(prompt)], device=device))
                    logits = getattr(result, "logits", result)
                    row = torch.log_softmax(logits[0, -1].float(), dim=-1)
                    values, ids = row.topk(min(top, row.numel()))
                    out.append({"ids": ids.tolist(), "logprobs": values.tolist()})
        finally:
            model.train(training)
        return out

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


def _check_movable(named: Mapping[str, Any]) -> None:
    """Refuse a layout that would leave some tensor behind: memory that a tensor outside the
    source also uses (a detached copy, such as `state_dict()` hands out, or a view of a bigger
    base: moving ours would leave that one training alone), or that two of ours share with
    overlapping bytes. Tensors that share a storage without overlapping (an earlier layout's
    bucket) may move: nothing else holds it."""
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    by_storage: dict[int, list[tuple[str, Any]]] = {}
    for name, tensor in named.items():
        if tensor.untyped_storage().nbytes():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append((name, tensor))
    for holders in by_storage.values():
        storage = holders[0][1].untyped_storage()
        if use_count is not None and use_count(storage._cdata) > len(holders) + 1:  # (+1: `storage` here)
            names = ", ".join(n for n, _ in holders[:3])
            raise ValueError(
                f"torch source: the memory of {names} is also used by a tensor outside the source (a detached copy, "
                "as state_dict() returns, or a view of a bigger tensor): flatten_into would leave that one behind; "
                "give TorchSource the module itself"
            )
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n) for n, t in holders)
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"torch source: {a} and {b} share memory; flatten_into would separate them")


def _alias_key(tensor: Any) -> tuple[Any, ...] | None:
    """What makes two state-dict entries one tensor: the same storage (by identity, so an empty
    shard of a DTensor counts too), viewed the same way; None for a tensor without a storage
    (sparse)."""
    local = getattr(tensor, "_local_tensor", None)  # a DTensor: its shard on this rank, and how it is sharded
    t = tensor if local is None else local
    try:
        storage = t.untyped_storage()._cdata
    except (NotImplementedError, RuntimeError):
        return None
    where = (storage, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
    return where if local is None else (*where, tuple(tensor.shape), str(tensor.placements))
