"""LoRA refits into a vLLM server: the pure half of `VLLMEngine`'s adapter calls.

vLLM 0.33.0 loads an adapter only from a directory (`POST /v1/load_lora_adapter {lora_name,
lora_path}`, routes attached only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), selects it per request
by `model`, and unloads by name (`POST /v1/unload_lora_adapter`: it removes the name from the API
server only; requests already running keep it, and the engine drops its weights when its own LRU
evicts them). Its `load_inplace` keeps the prefix cache keyed by (name, path), so refit never uses
it: each version is its own name ("policy@v7", `refit.drivers.adapter_names`) in its own directory,
written by the driver (`write_adapter`: adapter_config.json and adapter_model.safetensors, as
`PEFTHelper.from_local_dir` and `LoRAModel.from_local_checkpoint` read them). docs/lora-servers.md
has the file and function of each fact.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ALLOWED_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py: --max-lora-rank's choices


def server_lora(info: Mapping[str, Any]) -> dict[str, Any]:
    """What /server_info?config_format=json says of LoRA: its lora_config (None: --enable-lora
    off) and whether the runtime routes are attached (VLLM_ALLOW_RUNTIME_LORA_UPDATING)."""
    config = info.get("vllm_config") if isinstance(info.get("vllm_config"), dict) else {}
    lora = config.get("lora_config") if isinstance(config, dict) else None
    env = info.get("vllm_env") if isinstance(info.get("vllm_env"), dict) else {}
    flag = env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") if isinstance(env, dict) else None
    return {
        "enable_lora": isinstance(lora, dict),
        "max_lora_rank": lora.get("max_lora_rank") if isinstance(lora, dict) else None,
        "runtime_updating": flag in (True, 1, "1", "true", "True"),
    }


def static_problem(adapter: Mapping[str, Any], *, verify: str, max_live: int | None) -> str | None:
    """What no vLLM server can do for this LoRA refit (None: nothing)."""
    if verify != "off":
        return (
            f"verify={verify!r}: vLLM reports no checksums of a loaded adapter (its /weight_checker hashes the "
            "model's parameters); use verify='off'"
        )
    if max_live is None or max_live < 2:
        return (
            "a LoRA refit into vLLM needs max_staleness >= 1: vLLM cannot hold new requests naming an adapter "
            "while its live version drains (its unload removes the name at once: "
            "vllm/entrypoints/openai/models/serving.py unload_lora_adapter), so the new version goes live beside "
            "the old one, and refit unloads old names in DRAINING"
        )
    return None


def server_problem(adapter: Mapping[str, Any], lora: Mapping[str, Any]) -> str | None:
    """What this server (its /server_info) cannot load (None: nothing)."""
    if not lora.get("enable_lora"):
        return "LoRA is not enabled on the server: launch it with --enable-lora --max-lora-rank R"
    if not lora.get("runtime_updating"):
        return (
            "the server loads no adapters at runtime: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (without it "
            "/v1/load_lora_adapter is not attached)"
        )
    rank = lora.get("max_lora_rank")
    if isinstance(rank, int) and int(adapter["r"]) > rank:
        return f"the adapter's rank {adapter['r']} is above the server's --max-lora-rank {rank}"
    return None


def config_dict(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """adapter_config.json as PEFTHelper reads it (r, lora_alpha, target_modules; use_rslora honoured)."""
    return {
        "peft_type": "LORA", "r": int(adapter["r"]), "lora_alpha": float(adapter["lora_alpha"]),
        "target_modules": list(adapter["target_modules"]), "use_rslora": bool(adapter.get("use_rslora", False)),
        "use_dora": False, "bias": "none",
    }  # fmt: skip


def write_adapter(directory: Path, adapter: Mapping[str, Any], tensors: Mapping[str, Any]) -> Path:
    """One version's directory: adapter_config.json and adapter_model.safetensors (written under a
    temporary name, then renamed: the server never reads half a file)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config_dict(adapter)))
    part = directory / "adapter_model.safetensors.part"
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(part))
    part.rename(directory / "adapter_model.safetensors")
    return directory


def prune(root: Path, adapter: str, keep: Sequence[str]) -> list[str]:
    """Remove the version directories of `adapter` under `root` whose names are not in `keep` (the
    server may reload an evicted adapter from its path while a request still uses it: keep those)."""
    from refit.drivers.adapter_names import parse_version_name

    gone = []
    if root.is_dir():
        for d in root.iterdir():
            parsed = parse_version_name(d.name)
            if d.is_dir() and parsed is not None and parsed[0] == adapter and d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)
                gone.append(d.name)
    return gone


__all__ = ["config_dict", "prune", "server_lora", "server_problem", "static_problem", "write_adapter"]
