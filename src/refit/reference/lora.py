"""LoRA adapters in the reference engine: several versions of an adapter live at once, applied
unmerged, chosen per request; a new version loads beside the ones requests still use.

What a LoRA refit moves is an adapter: for each targeted linear layer of the model, `A` [r, in]
and `B` [out, r], named as PEFT saves them (`get_peft_model_state_dict`, `adapter_model.safetensors`):
  base_model.model.model.layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight
  base_model.model.model.layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight
and a spec (`LoraSpec`: rank, alpha, target modules). A targeted layer computes
`base(x) + (B @ (A @ x)) * scale`, `scale = alpha / r` (`alpha / sqrt(r)` with rsLoRA), x cast to
the adapter's dtype for the product and the sum cast back to the layer's, as PEFT's
`peft.tuners.lora.layer.Linear.forward` does. The engine fuses q/k/v and gate/up: each slice of
the fused output gets its own projection's update.

Each version moves through the adapter table (`refit.states`, "adapter"): STAGING (its tensors
land in memory nothing serves), STAGED (checked whole), LIVE (new requests naming the adapter get
it), RETIRED (a newer one is live: only requests pinned to it use it), UNLOADED (freed once no
request is pinned to it), or DISCARDED (never served). `AdapterTable` keeps the versions, their
machines, who is pinned to which, and the per-version prefix caches (KV computed under one
adapter is never read under another). It records each move as an engine audit record
(op "adapter"), with the engine's token counter, for `refit.invariants.adapters`.
"""

from __future__ import annotations

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from refit.errors import EngineError
from refit.reference.model import ModelConfig
from refit.states import SERVABLE_ADAPTER, Adapter, AdapterEvent, FactMachine

# the projections an adapter may target, and where each lives in a decoder layer
LORA_TARGETS: dict[str, str] = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
ROW_PARALLEL = frozenset({"o_proj", "down_proj"})  # sharded by input columns on TP ranks: A's columns split
PEFT_PREFIX = "base_model.model."  # what PEFT's saved state dict puts before the model's own names
MOVES_KEPT = 4096  # adapter moves kept for `AdapterTable.report` until the caller acknowledges them
# the first version of a spec with a bound (`max_live`) also reserves the memory of min(max_live, this)
# more versions: the versions that come while the bound's live ones serve stage into it, not into fresh
# allocations on the serving thread (a steady stream of refits under max_live needs max_live + 1 slabs)
SLABS_RESERVED = 2
# freed versions' memory kept per (spec, dtype) for the versions to come to stage into: as many as a
# steady stream under a reserved bound cycles through (two versions may be freed between two stages and
# none before the next: a pool that dropped the second would allocate on the serving thread then)
SLABS_KEPT = SLABS_RESERVED + 1
PLANS_KEPT = 64  # per slab: the checked copies kept for receivers' stable bucket views
# PEFT LoraConfig fields whose non-default values change the math this engine computes: refused by name
_REFUSED: dict[str, Any] = {
    "use_dora": False,
    "bias": "none",
    "fan_in_fan_out": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layer_replication": None,
    "lora_bias": False,
    "trainable_token_indices": None,
    "target_parameters": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
    "use_bdlora": False,
    "exclude_modules": None,
}


@dataclass(frozen=True)
class LoraSpec:
    """What an adapter is, beside its tensors: rank, alpha, the projections it targets, rsLoRA."""

    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.r, int) or isinstance(self.r, bool) or self.r < 1:
            raise ValueError(f"LoRA rank r={self.r!r}: a positive integer")
        if not isinstance(self.alpha, int | float) or isinstance(self.alpha, bool) or not math.isfinite(self.alpha):
            raise ValueError(f"lora_alpha={self.alpha!r}: a finite number")
        unknown = sorted(set(self.targets) - set(LORA_TARGETS))
        if unknown or not self.targets:
            raise ValueError(
                f"target modules {unknown or '(none)'}: the reference engine applies LoRA to {sorted(LORA_TARGETS)}"
            )
        object.__setattr__(self, "targets", tuple(t for t in LORA_TARGETS if t in self.targets))  # canonical order

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.rslora else self.alpha / self.r

    def to_dict(self) -> dict[str, Any]:
        return {"r": self.r, "lora_alpha": self.alpha, "target_modules": list(self.targets), "use_rslora": self.rslora}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LoraSpec:
        """From `to_dict`'s form or a PEFT `LoraConfig` (its object or its `adapter_config.json`
        dict). Fields whose non-default values change the math (DoRA, LoRA biases, rank or alpha
        patterns, fan_in_fan_out, modules_to_save, ...) are refused by name, never ignored."""
        d = _as_dict(d)
        for key, default in _REFUSED.items():
            value = d.get(key, default)
            if value not in (default, None) and value != default and not (value == [] and default is None):
                raise ValueError(f"{key}={value!r}: the reference engine serves plain LoRA (default {default!r})")
        targets = d.get("target_modules")
        if isinstance(targets, str):  # PEFT allows a regex; only explicit lists are served
            raise ValueError(f"target_modules={targets!r}: name the projections as a list")
        if d.get("peft_type") not in (None, "LORA"):
            raise ValueError(f"peft_type={d.get('peft_type')!r}: only LORA adapters are served")
        return cls(int(d["r"]), float(d["lora_alpha"]), tuple(targets or ()), bool(d.get("use_rslora", False)))

    def shapes(self, config: ModelConfig) -> dict[str, tuple[int, ...]]:
        """Every tensor of an adapter with this spec on `config`'s model, PEFT-named, in order."""
        assert config.head_dim is not None
        h, q, kv, inter = (
            config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim,
            config.intermediate_size,
        )  # fmt: skip
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip
        out: dict[str, tuple[int, ...]] = {}
        for i in range(config.num_layers):
            for proj in self.targets:
                n_in, n_out = dims[proj]
                stem = f"{PEFT_PREFIX}model.layers.{i}.{LORA_TARGETS[proj]}.{proj}"
                out[f"{stem}.lora_A.weight"] = (self.r, n_in)
                out[f"{stem}.lora_B.weight"] = (n_out, self.r)
        return out


def _as_dict(d: Any) -> dict[str, Any]:
    if isinstance(d, Mapping):
        return dict(d)
    if hasattr(d, "to_dict"):
        return dict(d.to_dict())
    raise ValueError(f"a LoRA spec is a mapping or a PEFT LoraConfig, not {type(d).__name__}")


def parse_name(name: str) -> tuple[int, str, str]:
    """(layer, projection, "A" or "B") of a PEFT-named adapter tensor; ValueError otherwise."""
    parts = name.removeprefix(PEFT_PREFIX).split(".")
    # model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight
    ok = (
        name.startswith(PEFT_PREFIX) and len(parts) == 7 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
        and parts[4] in LORA_TARGETS and LORA_TARGETS[parts[4]] == parts[3] and parts[5] in ("lora_A", "lora_B")
        and parts[6] == "weight"
    )  # fmt: skip
    if not ok:
        raise ValueError(
            f"{name!r} is not a LoRA tensor name ({PEFT_PREFIX}model.layers.N.<module>.<proj>.lora_A.weight)"
        )
    return int(parts[2]), parts[4], parts[5][-1]


@dataclass
class Slab:
    """One adapter version's memory: a flat buffer holding every tensor of the spec in PEFT's
    order (`views`, by name; `pairs`, (layer, proj) -> [A, B], what `delta` reads). A version
    unloaded or discarded gives its slab back to the table, and the next version of that spec
    stages into it: the views, the regions a hashing copy credits (`regions`) and the checked
    copies of stable bucket views (`plans`) are built once, not per refit."""

    flat: torch.Tensor
    views: dict[str, torch.Tensor]
    pairs: dict[tuple[int, str], list[torch.Tensor | None]]
    regions: Any = None  # `refit.wsum.Regions` of `views`, made on first use
    plans: dict[int, tuple[Any, ...]] = field(default_factory=dict)  # id(bucket views) -> kept checks

    @classmethod
    def allocate(
        cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device, *, touch: bool = False
    ) -> Slab:
        """`shapes`: each tensor's shape as this rank keeps it (its shard on a TP rank). `touch`:
        written once now (zeros), so the first copies into it do not pay for its first use."""
        total = sum(math.prod(shape) for shape in shapes.values())
        flat = (
            torch.zeros(total, dtype=dtype, device=device) if touch else torch.empty(total, dtype=dtype, device=device)
        )
        views: dict[str, torch.Tensor] = {}
        pairs: dict[tuple[int, str], list[torch.Tensor | None]] = {}
        at = 0
        for name, shape in shapes.items():
            n = math.prod(shape)
            views[name] = flat[at : at + n].view(shape)
            at += n
            layer, proj, which = parse_name(name)
            pairs.setdefault((layer, proj), [None, None])[0 if which == "A" else 1] = views[name]
        return cls(flat, views, pairs)

    def written_regions(self) -> Any:
        if self.regions is None:
            from refit.wsum import Regions

            self.regions = Regions(self.views)
        return self.regions


@dataclass
class AdapterVersion:
    """One version of an adapter: its spec, its tensors ((layer, proj) -> [A, B]), its position."""

    name: str
    version: int
    spec: LoraSpec
    shapes: dict[str, tuple[int, ...]]
    dtype: torch.dtype
    machine: FactMachine = field(default_factory=lambda: FactMachine("adapter"))
    weights: dict[tuple[int, str], list[torch.Tensor | None]] = field(default_factory=dict)
    landed: set[str] = field(default_factory=set)
    pinned: int = 0  # requests admitted with this version that have not finished
    cache: Any = None  # its prefix cache (the engine's PrefixCache), made on first use
    slab: Slab | None = None  # its memory (`weights` are views of it), from staging until it is freed

    @property
    def state(self) -> Adapter:
        return self.machine.state

    @property
    def nbytes(self) -> int:
        if self.slab is None:
            return 0
        return self.slab.flat.numel() * self.slab.flat.element_size()

    def delta(
        self, layer: int, proj: str, x: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    ) -> torch.Tensor | None:
        """`(B @ (A @ x)) * scale` for projection `proj` of `layer`, in the adapter's dtype (None
        where the adapter does not target it). On TP ranks a row-parallel projection's `x` and A
        are this rank's columns: `reduce` (the ranks' all-reduce) sums `A @ x` over them, in
        float32 and rounded once (as `_row_parallel` does the base product), before B; a
        column-parallel one's B is this rank's rows, so the update is its slice of the output."""
        pair = self.weights.get((layer, proj))
        if pair is None:
            return None
        a, b = pair
        assert a is not None and b is not None
        if reduce is not None and proj in ROW_PARALLEL:
            u = reduce(F.linear(x.float(), a.float())).to(a.dtype)
        else:
            u = F.linear(x.to(a.dtype), a)
        return F.linear(u, b) * self.spec.scale


class AdapterTable:
    """The adapters an engine holds, per name: at most one STAGING/STAGED version (the refit in
    progress), one LIVE, and RETIRED ones until the requests pinned to them finish. `max_live`
    bounds LIVE + RETIRED per name (`max_staleness + 1`): a staged version is published only once
    the versions it would push past the bound have no request left (`drain`); while the one to go
    is the LIVE one (max_live 1), new requests naming the adapter wait unpinned (`draining`), so it
    drains, and are admitted under the new version once it is published. An adapter the version
    policy holds on this engine (`stale`) admits no new request until a version is published here."""

    def __init__(
        self, config: ModelConfig, device: torch.device, record: Callable[..., None], clock: Callable[[], int],
        shard: Callable[[str], tuple[int, int, int] | None] = lambda name: None,
        agree: Callable[[bool], bool] = lambda held: held,
    ) -> None:  # fmt: skip
        """`shard`: a TP rank's slice of an adapter tensor, by its base weight's HF name: (dim,
        start, length) of the base weight's shard on this rank, or None where it keeps it whole.
        A column-parallel projection's B keeps the rows of its output shard (A whole); a
        row-parallel one's A keeps the columns of its input shard (B whole). `agree`: TP ranks'
        one answer to a time-based question (a draining hold still on), every rank asking it at the
        same point of their replicated scheduling: rank 0's, so their batches stay the same."""
        self.config = config
        self._agree = agree
        self.device = device
        self._shard = shard
        self._record = record
        self._clock = clock  # the engine's tokens sampled so far: when each move happened, in tokens
        self.versions: dict[str, dict[int, AdapterVersion]] = {}
        self.max_live: dict[str, int | None] = {}  # per adapter, as its last stage set it (None: no bound)
        # adapters whose new requests wait unpinned until a publish or a discard (`drain`), and until
        # when at most: a hold its run never follows up (it died, or its cleanup did not come) lapses
        self.draining: dict[str, float] = {}
        self.stale: dict[str, str] = {}  # adapters the version policy holds here until a publish, and why (`hold`)
        self.loads = 0  # adapter versions published so far
        self.unloads = 0
        # moves not yet acknowledged (`report`, `ack`), numbered 1.. ("n") in this table's `epoch`
        self.moves: deque[dict[str, Any]] = deque(maxlen=MOVES_KEPT)
        self.epoch = os.urandom(4).hex()  # a restarted engine's numbering is another one's
        self._numbered = 0
        self._reported = 0  # the last move number an answer carried
        self._free: dict[tuple[LoraSpec, torch.dtype], list[Slab]] = {}  # freed versions' memory (`SLABS_KEPT`)
        self._shapes: dict[LoraSpec, dict[str, tuple[int, ...]]] = {}

    # ---- the versions -------------------------------------------------------------------------

    def _log(self, v: AdapterVersion, event: str, src: str | None, **fields: Any) -> None:
        """One move, as an engine audit record and for `report`: self-contained (where it came
        from, where it went, how many versions of its adapter serve after it, the bound), so a
        window of them can be checked without the history before it."""
        move = {
            "adapter": v.name, "adapter_version": v.version, "event": event, "src": src, "state": str(v.state),
            "servable": len(self.servable(v.name)), "max_live": self.max_live.get(v.name), "seq": self._clock(),
            **fields,
        }  # fmt: skip
        self._numbered += 1
        move["n"], move["epoch"] = self._numbered, self.epoch
        self._record("adapter", True, **move)
        self.moves.append(move)

    def _move(self, v: AdapterVersion, event: AdapterEvent, **fields: Any) -> None:
        src = str(v.state)
        v.machine.fire(event)
        self._log(v, str(event), src, **fields)

    def report(self) -> list[dict[str, Any]]:
        """The moves no answer carried yet (oldest first; at most `MOVES_KEPT`): what the engine's
        answers to probe, drain, publish and discard carry, so the refit trace records every
        version's loads and unloads. They are kept until the caller acknowledges them (`ack`)."""
        out = [m for m in self.moves if m["n"] > self._reported]
        if out:
            self._reported = out[-1]["n"]
        return out

    def unsent(self, moves: list[dict[str, Any]]) -> None:
        """An answer that `report` gave these moves to was never sent (a parked drain's first
        look): the next report carries them again."""
        first = moves[0].get("n") if moves and isinstance(moves[0], dict) else None
        if isinstance(first, int):
            self._reported = max(min(self._reported, first - 1), 0)

    def ack(self, epoch: str | None, n: int) -> None:
        """The caller recorded every move of `epoch` up to number `n` (at most the last one
        reported: it cannot have recorded more): they are dropped. Moves reported after `n` never
        reached it (their answer came after its call gave up, or not at all): the next report
        carries them again. An ack of another epoch (the caller has recorded nothing of this table
        yet, or knew an engine this one replaced) drops nothing and has every kept move reported
        again."""
        n = min(n, self._reported) if epoch == self.epoch else 0
        while self.moves and self.moves[0]["n"] <= n:
            self.moves.popleft()
        self._reported = max(min(self._reported, n), 0)

    def live(self, name: str) -> AdapterVersion | None:
        return next((v for v in self.versions.get(name, {}).values() if v.state == Adapter.LIVE), None)

    def servable(self, name: str) -> list[AdapterVersion]:
        return [v for v in self.versions.get(name, {}).values() if v.state in SERVABLE_ADAPTER]

    def staged(self, name: str) -> AdapterVersion | None:
        return next(
            (v for v in self.versions.get(name, {}).values() if v.state in (Adapter.STAGING, Adapter.STAGED)), None
        )

    def names(self) -> list[str]:
        return sorted(n for n in self.versions if self.live(n) is not None)

    def stage(
        self, name: str, version: int, spec: LoraSpec, dtype: torch.dtype, max_live: int | None = None
    ) -> AdapterVersion:
        """Open STAGING for `name` at `version` (a staged version of `name` not yet published is
        discarded first), bounding `name` to `max_live` servable versions from now on (None: no
        bound; each adapter its own). Refused (EngineError) for a version not newer than the live
        one. Generation goes on: a staged version is not servable (`drain` bounds those at publish)."""
        if not name or not isinstance(name, str):
            raise EngineError("bad_request", f"adapter name {name!r}: a non-empty string")
        self.collect()
        old = self.staged(name)
        if old is not None:
            self.discard(name, reason=f"version {version} staged instead")
        live = self.live(name)
        if live is not None and version <= live.version:
            raise EngineError(
                "bad_request", f"adapter {name!r} version {version}: not newer than the live version {live.version}"
            )
        shapes = self._shapes.get(spec)
        if shapes is None:
            shapes = self._shapes[spec] = spec.shapes(self.config)
        free = self._free.setdefault((spec, dtype), [])
        if free:
            slab = free.pop()
        else:
            local = self._local_shapes(shapes)
            first = not any(v.slab is not None and (v.spec, v.dtype) == (spec, dtype) for v in self._all())
            slab = Slab.allocate(local, dtype, self.device)
            if first and max_live is not None:  # the memory its bound takes, reserved now (`SLABS_RESERVED`)
                free.extend(
                    Slab.allocate(local, dtype, self.device, touch=True) for _ in range(min(max_live, SLABS_RESERVED))
                )
        v = AdapterVersion(name, version, spec, shapes, dtype, weights=slab.pairs, slab=slab)
        self.max_live[name] = max_live
        self.versions.setdefault(name, {})[version] = v
        self._log(v, "stage", None, r=spec.r, targets=list(spec.targets))
        return v

    def load(
        self, name: str, tensors: Sequence[tuple[str, torch.Tensor]], written: Any = None, *, keep: bool = False
    ) -> int:
        """Copy tensors into the staged version of `name`; every name, shape and dtype is checked
        before any is kept (EngineError naming the first wrong one). One batched copy on the
        current stream (no host sync); with `written` (a `refit.wsum.Written` over this version's
        slab), one fused copy-and-hash pass instead. `keep`: the caller hands back this very list
        of views (a receiver's stable views) for the next version staged into this slab, whose
        checks and copy plan are then kept and rerun. Returns the bytes kept."""
        v = self.staged(name)
        if v is None or v.state != Adapter.STAGING:
            raise EngineError("no_session", f"adapter {name!r}: no version is staging")
        slab = v.slab
        assert slab is not None
        index = None if written is None else written.index
        kept = slab.plans.get(id(tensors))
        if kept is not None and kept[0] is tensors and kept[1] is index:
            pairs, plan, n = kept[2], kept[3], kept[4]
        else:
            pairs, n = [], 0
            for tname, t in tensors:
                dst, want = slab.views.get(tname), v.shapes.get(tname)
                if dst is None or want is None:
                    raise EngineError("bad_request", f"adapter {name!r}: {tname!r} is not a tensor of its spec")
                if tuple(t.shape) != want:
                    raise EngineError(
                        "bad_request", f"adapter {name!r}: {tname} has shape {tuple(t.shape)}, expected {want}"
                    )
                if t.dtype != v.dtype:
                    raise EngineError("bad_request", f"adapter {name!r}: {tname} is {t.dtype}, expected {v.dtype}")
                part = self.slice_of(tname) if dst.shape != t.shape else None  # a TP rank: its shard of it
                pairs.append((dst, t if part is None else t.narrow(part[0], part[1], part[2])))
                n += t.numel() * t.element_size()
            plan = None if written is None else written.plan(pairs)
            if keep:
                self._keep(slab, tensors, index, pairs, plan, n)
                # the pooled slabs of this spec get the same checked copies, planned now: the next
                # versions staged into them pay no host work for these views at their first load
                for other in self._free.get((v.spec, v.dtype), ()):
                    if id(tensors) not in other.plans:
                        theirs = [
                            (other.views[tname], src) for (tname, _), (_, src) in zip(tensors, pairs, strict=True)
                        ]
                        regions = None if index is None else other.written_regions()
                        self._keep(
                            other, tensors, regions, theirs, None if regions is None else regions.plan(theirs), n
                        )
        with torch.no_grad():
            if written is not None:
                written.run(plan)
            elif pairs:
                torch._foreach_copy_([d for d, _ in pairs], [t for _, t in pairs])
        v.landed.update(tname for tname, _ in tensors)
        return n

    @staticmethod
    def _keep(slab: Slab, tensors: Any, index: Any, pairs: list[Any], plan: Any, n: int) -> None:
        if len(slab.plans) >= PLANS_KEPT:
            slab.plans.clear()
        slab.plans[id(tensors)] = (tensors, index, pairs, plan, n)

    def complete(self, name: str) -> AdapterVersion:
        """STAGING -> STAGED once every tensor of the spec landed (EngineError naming what is missing)."""
        v = self.staged(name)
        if v is None or v.state != Adapter.STAGING:
            raise EngineError("no_session", f"adapter {name!r}: no version is staging")
        missing = [t for t in v.shapes if t not in v.landed]
        if missing:
            raise EngineError(
                "incomplete",
                f"adapter {name!r} version {v.version}: {len(missing)} tensors never landed ({missing[0]}...)",
            )
        self._move(v, AdapterEvent.COMPLETE, nbytes=v.nbytes)
        return v

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of adapter tensor `name` this rank keeps (None: all of it)."""
        layer, proj, which = parse_name(name)
        part = self._shard(f"model.layers.{layer}.{LORA_TARGETS[proj]}.{proj}.weight")
        if part is None:
            return None
        _dim, start, n = part
        if proj in ROW_PARALLEL:  # the base weight's columns: A's columns (its input); B whole
            return (1, start, n) if which == "A" else None
        return (0, start, n) if which == "B" else None  # the base weight's rows: B's rows (its output)

    def _local_shapes(self, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        out = {}
        for name, shape in shapes.items():
            part = self.slice_of(name)
            local = list(shape)
            if part is not None:
                local[part[0]] = part[2]
            out[name] = tuple(local)
        return out

    def _release(self, v: AdapterVersion) -> None:
        """`v` serves no more: its slab goes back for the next version of its spec to stage into
        (at most `SLABS_KEPT` per spec and dtype; the rest are freed)."""
        slab, v.slab, v.weights = v.slab, None, {}
        free = self._free.setdefault((v.spec, v.dtype), [])
        if slab is not None and len(free) < SLABS_KEPT:
            free.append(slab)

    def _all(self) -> Iterator[AdapterVersion]:
        for versions in self.versions.values():
            yield from versions.values()

    def forget_plans(self) -> None:
        """Drop the kept copy plans of every slab, in use or pooled (they hold a receiver's views)."""
        for versions in self.versions.values():
            for v in versions.values():
                if v.slab is not None:
                    v.slab.plans.clear()
        for free in self._free.values():
            for slab in free:
                slab.plans.clear()

    def pooled_bytes(self) -> int:
        """Bytes held by freed versions' slabs kept for the next to stage into."""
        return sum(s.flat.numel() * s.flat.element_size() for free in self._free.values() for s in free)

    def going(self, name: str) -> list[AdapterVersion]:
        """The servable versions of `name` that publishing its staged one pushes past `max_live`
        (oldest first): each must have no request left before that publish."""
        servable = sorted(self.servable(name), key=lambda v: v.version)
        bound = self.max_live.get(name)
        if bound is None:
            return []
        return servable[: max(0, len(servable) + 1 - bound)]

    def drain(self, name: str, hold_s: float = 60.0) -> dict[str, Any]:
        """Whether the staged version of `name` may be published within its `max_live` now:
        {"ready", "pinned": the requests still on the versions it pushes out}. While the LIVE
        version is among them, new requests naming `name` wait unpinned from now until the publish
        (ready or not: one admitted between this answer and the publish would pin the going
        version), or the discard, or `hold_s` seconds at most (a hold nothing follows up lapses)."""
        v = self.staged(name)
        if v is None or v.state != Adapter.STAGED:
            raise EngineError("not_ready", f"adapter {name!r}: no staged version was completed")
        going = self.going(name)
        pinned = sum(g.pinned for g in going)
        if any(g.state == Adapter.LIVE for g in going):
            self.draining[name] = time.monotonic() + max(0.0, hold_s)
        return {"ready": pinned == 0, "pinned": pinned, "going": [g.version for g in going]}

    def hold(self, name: str, reason: str) -> None:
        """The version policy's hold of `name` on this engine: new requests naming it wait, with no
        lapse, until a version of it is published here (a discard does not lift it)."""
        self.stale[name] = reason

    def admits(self, name: str, *, decide: bool = True) -> bool:
        """Whether a new request naming `name` may be pinned now: not held by the version policy,
        and not draining (or that hold lapsed). `decide`: the admission itself (on TP ranks a
        collective, called by every rank at the same point of their replicated scheduling: rank
        0's clock decides, and a lapsed hold is dropped); without it, this rank's own look, which
        changes nothing and meets no other rank (the head's `has_work`)."""
        if name in self.stale:
            return False
        until = self.draining.get(name)
        if until is None:
            return True
        if not decide:
            return time.monotonic() >= until
        if self._agree(time.monotonic() < until):  # TP ranks: the head's clock decides for all
            return False
        del self.draining[name]
        return True

    def publish(self, name: str) -> AdapterVersion:
        """STAGED -> LIVE; the live one before it is RETIRED, and retired ones with no request left
        are unloaded. Refused (changing nothing) while that would leave more than `max_live`
        servable (`drain` says when it may)."""
        v = self.staged(name)
        if v is None or v.state != Adapter.STAGED:
            raise EngineError("not_ready", f"adapter {name!r}: no staged version was completed")
        busy = [g for g in self.going(name) if g.pinned]
        if busy:
            raise EngineError(
                "busy",
                f"adapter {name!r} version {v.version}: publishing it would leave more than {self.max_live.get(name)} "
                "versions "
                f"live; version {busy[0].version} still has {busy[0].pinned} requests",
            )
        self.draining.pop(name, None)
        self.stale.pop(name, None)
        before = self.live(name)
        if before is not None:
            self._move(before, AdapterEvent.SUPERSEDE)
        self.collect()  # what has no request left goes before the new version serves (never past max_live)
        self._move(v, AdapterEvent.PUBLISH)
        self.loads += 1
        return v

    def discard(self, name: str, *, reason: str) -> bool:
        v = self.staged(name)
        if v is None:
            return False
        if self.device.type == "cuda":  # copies still queued into its slab (a receiver's side stream, a
            torch.cuda.synchronize(self.device)  # failed run's) land before the slab is pooled for the next
        self._release(v)
        self.draining.pop(name, None)
        self._move(v, AdapterEvent.DISCARD, reason=reason)
        del self.versions[name][v.version]
        if not self.versions[name]:
            del self.versions[name]
        return True

    def unload(self, name: str) -> int:
        """Every servable version of `name` stops taking new requests; each is unloaded once no
        request is pinned to it (now, or when its last one finishes). Returns how many were unloaded now."""
        live = self.live(name)
        if live is None and not self.servable(name):
            raise EngineError("bad_request", f"adapter {name!r} is not loaded (loaded: {self.names()})")
        if live is not None:
            self._move(live, AdapterEvent.SUPERSEDE, reason="unload asked")
        before = self.unloads
        self.collect()
        return self.unloads - before

    def collect(self) -> None:
        """Unload every RETIRED version no request is pinned to."""
        for name in list(self.versions):
            for v in list(self.versions[name].values()):
                if v.state == Adapter.RETIRED and v.pinned == 0:
                    self._release(v)
                    v.cache = None
                    self._move(v, AdapterEvent.UNLOAD)
                    self.unloads += 1
                    del self.versions[name][v.version]
            if not self.versions[name]:
                del self.versions[name]

    # ---- requests -----------------------------------------------------------------------------

    def pin(self, name: str) -> AdapterVersion:
        """The LIVE version of `name` for a new request (EngineError if none)."""
        v = self.live(name)
        if v is None:
            raise EngineError("bad_request", f"adapter {name!r} is not loaded (loaded: {self.names()})")
        v.pinned += 1
        return v

    def unpin(self, v: AdapterVersion) -> None:
        v.pinned -= 1
        if v.pinned == 0 and v.state == Adapter.RETIRED:
            self.collect()

    def flush(self) -> int:
        """Clear every version's prefix cache; the tokens dropped."""
        n = 0
        for versions in self.versions.values():
            for v in versions.values():
                if v.cache is not None:
                    n += v.cache.clear()
        return n

    def info(self) -> dict[str, Any]:
        return {
            name: {str(v.version): {"state": str(v.state), "pinned": v.pinned, "bytes": v.nbytes}
                   for v in versions.values()}
            for name, versions in self.versions.items()
        }  # fmt: skip

    def next_lapse(self) -> float | None:
        """Seconds until the earliest draining hold lapses (None: none is held)."""
        now = time.monotonic()
        ends = [u - now for u in self.draining.values()]
        return max(0.0, min(ends)) if ends else None

    def holds(self) -> dict[str, str]:
        """Adapters whose new requests wait, and why."""
        now = time.monotonic()
        out = {n: f"version policy: {r}" for n, r in self.stale.items()}
        out.update({n: "draining for a publish" for n, u in self.draining.items() if u > now and n not in out})
        return out


def apply(
    out: torch.Tensor,
    x: torch.Tensor,
    layer: int,
    projs: Sequence[tuple[str, int]],
    rows: Sequence[AdapterVersion | None],
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`out` (a projection's output [B, T, width]; `projs`: (projection, width) fused side by side
    in that order) plus each row's adapter update on its projection's slice, the sum in the
    adapter's dtype cast back to `out`'s (PEFT's order: base output + update). Rows with no
    adapter (None), and projections an adapter does not target, are left as they are. `reduce`:
    TP ranks' all-reduce, for a row-parallel projection (`AdapterVersion.delta`); every rank
    calls it in the same order (the same rows, the same versions)."""
    if all(v is None for v in rows):
        return out
    result = out
    for v in {id(v): v for v in rows if v is not None}.values():
        idx = [i for i, r in enumerate(rows) if r is v]
        xs = x[idx]
        start = 0
        for proj, width in projs:
            d = v.delta(layer, proj, xs, reduce)
            if d is not None:
                if result is out:
                    result = out.clone()
                base = out[idx, ..., start : start + width]
                result[idx, ..., start : start + width] = (base.to(d.dtype) + d).to(out.dtype)
            start += width
    return result
