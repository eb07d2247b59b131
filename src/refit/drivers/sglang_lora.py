"""LoRA refits into an SGLang server: the pure half of `SGLangEngine`'s adapter calls.

SGLang 0.5.23 has no adapter versions and no staged state (docs/lora-servers.md): an adapter is a
name, loaded whole in one request (`/load_lora_adapter_from_tensors`, servable at once to any
request naming it) and unloaded by another (`/unload_lora_adapter`, which unregisters the name at
once and answers only when the requests using it have finished). So each version of a refit's
adapter is its own name (`version_name`: "policy@v7"), and which one is live is refit's to say:
the driver resolves a request for "policy" to the live version's name (`lora_path`).

The driver keeps its account of the versions in an `AdapterMirror` (`refit.drivers.adapter_names`),
so `refit check` follows SGLang's versions too.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refit.drivers.adapter_names import AdapterMirror, parse_version_name, version_name

# sglang/srt/lora/utils.py get_normalized_target_modules: the fused names SGLang's pool keeps
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def normalized_targets(targets: str | Iterable[str] | None) -> set[str]:
    """SGLang's `get_normalized_target_modules`: q/k/v -> qkv_proj, gate/up -> gate_up_proj;
    "all" / "all-linear" -> {"all"}."""
    if targets is None:
        return set()
    if isinstance(targets, str):
        return {"all"} if targets in ("all", "all-linear") else {targets}
    return {_FUSED.get(t.split(".")[-1], t.split(".")[-1]) for t in targets}


def server_lora(info: Mapping[str, Any]) -> dict[str, Any]:
    """What /server_info says of the server's LoRA settings (its resolved server args)."""
    return {
        "enable_lora": bool(info.get("enable_lora")),
        "max_lora_rank": info.get("max_lora_rank"),
        "lora_target_modules": info.get("lora_target_modules"),
        "max_loaded_loras": info.get("max_loaded_loras"),
        "max_loras_per_batch": info.get("max_loras_per_batch"),
    }


def static_problem(adapter: Mapping[str, Any], *, verify: str, max_live: int | None) -> str | None:
    """What an SGLang server can never do for this LoRA refit, whatever its flags (None: nothing)."""
    if verify != "off":
        return (
            f"verify={verify!r}: SGLang reports no checksums of a loaded adapter (its expected_checksums check, "
            "managers/tp_worker.py load_lora_adapter_from_tensors, raises in the scheduler on a mismatch, which "
            "kills the server); use verify='off'"
        )
    if max_live is None or max_live < 2:
        return (
            "a LoRA refit into SGLang needs max_staleness >= 1: SGLang cannot hold new requests naming an "
            "adapter while its live version drains (its unload unregisters the name at once, "
            "managers/tokenizer_control_mixin.py _unload_lora_adapter_locked), so the new version goes live "
            "beside the old one, and refit unloads old ones (a call that waits for their requests) in DRAINING"
        )
    targets = set(adapter.get("target_modules") or ())
    if targets & {"q_proj", "k_proj", "v_proj"} and not {"q_proj", "v_proj"} <= targets:
        return (
            f"target modules {sorted(targets)}: SGLang fuses q/k/v into qkv_proj only from q_proj, and needs v_proj "
            "with it (sglang/srt/lora/lora.py normalize_qkv_proj: q without v fails the load; k or v without q "
            "stays unfused and kills the server at the first batch that uses it); target q_proj and v_proj too"
        )
    if "up_proj" in targets and "gate_proj" not in targets:
        return (
            f"target modules {sorted(targets)}: SGLang fuses gate/up into gate_up_proj only from gate_proj "
            "(lora.py normalize_gate_up_proj: up without gate stays unfused and kills the server at the first batch "
            "that uses it); target gate_proj too"
        )
    if adapter.get("use_rslora"):
        return (
            "use_rslora: SGLang scales every adapter by lora_alpha / r and ignores use_rslora "
            "(sglang/srt/lora/lora.py), so it would serve other outputs than the trainer's"
        )
    return None


def server_problem(adapter: Mapping[str, Any], lora: Mapping[str, Any], plan_buckets: int) -> str | None:
    """What this server (its /server_info LoRA settings) cannot load (None: nothing)."""
    if not lora.get("enable_lora"):
        return "LoRA is not enabled on the server: launch it with --enable-lora --max-lora-rank R --lora-target-modules"
    rank = lora.get("max_lora_rank")
    if isinstance(rank, int) and int(adapter["r"]) > rank:
        return f"the adapter's rank {adapter['r']} is above the server's --max-lora-rank {rank}"
    server = normalized_targets(lora.get("lora_target_modules"))
    want = normalized_targets(list(adapter.get("target_modules") or ()))
    if server and "all" not in server and "all" not in want and not want <= server:
        return (
            f"the adapter targets {sorted(want - server)}, outside the server's --lora-target-modules "
            f"(normalized: {sorted(server)})"
        )
    loaded, live = lora.get("max_loaded_loras"), adapter.get("max_live")
    if isinstance(loaded, int) and isinstance(live, int) and loaded < live + 1:
        return (
            f"the server's --max-loaded-loras {loaded} is below the {live + 1} versions a refit has loaded before its "
            "drain (max_staleness + 2): SGLang would evict a version still serving (its LRU) at the load"
        )
    if plan_buckets != 1:
        return (
            f"SGLang loads an adapter in one request (/load_lora_adapter_from_tensors) and this plan has "
            f"{plan_buckets} buckets: use bucket_bytes >= the adapter's bytes"
        )
    return None


_LORA_NAME = re.compile(r"\.layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\.(?P<proj>\w+)\.lora_(?P<ab>[AB])\.weight$")


def plan_problem(adapter: Mapping[str, Any], plan: Sequence[Any]) -> str | None:
    """The plan against the adapter's spec, as far as a driver can check it without the model
    (SGLang checks shapes only when a batch first uses the adapter, and dies on a wrong one):
    every name a targeted projection's A or B in some layer, each once; every layer with every
    target, A and B; A r rows, B r columns; each projection's shapes the same in every layer."""
    r, targets = int(adapter["r"]), set(adapter.get("target_modules") or ())
    seen: dict[tuple[int, str, str], tuple[int, ...]] = {}
    for manifest in plan:
        for entry in manifest.entries:
            m = _LORA_NAME.search(entry.meta.name)
            if m is None or m["proj"] not in targets:
                return f"{entry.meta.name!r} is not an A or B of a targeted projection ({sorted(targets)})"
            key = (int(m["layer"]), m["proj"], m["ab"])
            if key in seen:
                return f"{entry.meta.name!r} twice"
            shape = tuple(entry.meta.shape)
            if len(shape) != 2 or (m["ab"] == "A" and shape[0] != r) or (m["ab"] == "B" and shape[1] != r):
                return f"{entry.meta.name}: shape {list(shape)} is no rank-{r} lora_{m['ab']}"
            seen[key] = shape
    layers = {k[0] for k in seen}
    for layer in layers:
        for proj in targets:
            for ab in "AB":
                if (layer, proj, ab) not in seen:
                    return f"layer {layer}: {proj}.lora_{ab} missing from the plan"
    for proj in targets:
        for ab in "AB":
            shapes = {seen[(layer, proj, ab)] for layer in layers}
            if len(shapes) > 1:
                return f"{proj}.lora_{ab}: shapes {sorted(shapes)} differ between layers"
    return None


def config_dict(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """The PEFT adapter_config SGLang reads (`LoRAConfig`: r, lora_alpha, target_modules, use_dora)."""
    return {
        "peft_type": "LORA", "r": int(adapter["r"]), "lora_alpha": float(adapter["lora_alpha"]),
        "target_modules": list(adapter["target_modules"]), "use_dora": False, "use_rslora": False, "bias": "none",
    }  # fmt: skip


def load_body(name: str, adapter: Mapping[str, Any], serialized: Sequence[str]) -> dict[str, Any]:
    """`/load_lora_adapter_from_tensors` body: one flattened bucket per TP rank (each rank slices
    its own shard of the full tensors: tp_worker.py)."""
    return {
        "lora_name": name, "config_dict": config_dict(adapter), "serialized_named_tensors": list(serialized),
        "load_format": "flattened_bucket", "pinned": False,
    }  # fmt: skip


__all__ = [
    "AdapterMirror", "config_dict", "load_body", "normalized_targets", "parse_version_name", "server_lora",
    "server_problem", "static_problem", "version_name",
]  # fmt: skip
