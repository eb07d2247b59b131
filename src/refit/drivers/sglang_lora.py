"""LoRA refits into an SGLang server: the pure half of `SGLangEngine`'s adapter calls.

SGLang 0.5.23 has no adapter versions and no staged state (docs/lora-servers.md): an adapter is a
name, loaded whole in one request (`/load_lora_adapter_from_tensors`, servable at once to any
request naming it) and unloaded by another (`/unload_lora_adapter`, which unregisters the name at
once and answers only when the requests using it have finished). So each version of a refit's
adapter is its own name (`version_name`: "policy@v7"), and which one is live is refit's to say:
the driver resolves a request for "policy" to the live version's name (`lora_path`).

`AdapterMirror` is the driver's account of the versions it loaded, published, unloaded or
discarded, kept on the adapter fact table (`refit.states`: STAGING, STAGED, LIVE, RETIRED,
UNLOADED, DISCARDED) and reported as the same self-contained move records the reference engine
gives (`refit.invariants.adapters`), so `refit check` follows SGLang's versions too. What SGLang
itself lists (`/v1/models`) is folded in at each probe (`sync`): a version the server lost is
unloaded, one found that the mirror never saw is adopted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from refit.states import SERVABLE_ADAPTER, Adapter, AdapterEvent, FactMachine

_NAME = re.compile(r"^(?P<adapter>.+)@v(?P<version>\d+)$")
# sglang/srt/lora/utils.py get_normalized_target_modules: the fused names SGLang's pool keeps
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj"}  # fmt: skip


def version_name(adapter: str, version: int) -> str:
    """The SGLang adapter name of `version` of `adapter` ("policy@v7")."""
    return f"{adapter}@v{int(version)}"


def parse_version_name(name: str) -> tuple[str, int] | None:
    """("policy", 7) from "policy@v7"; None for a name refit did not make."""
    m = _NAME.match(name)
    return (m["adapter"], int(m["version"])) if m else None


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
    if plan_buckets != 1:
        return (
            f"SGLang loads an adapter in one request (/load_lora_adapter_from_tensors) and this plan has "
            f"{plan_buckets} buckets: use bucket_bytes >= the adapter's bytes"
        )
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


class AdapterMirror:
    """The driver's account of its adapters' versions on one server (see the module docstring)."""

    def __init__(self) -> None:
        self.versions: dict[str, dict[int, FactMachine]] = {}
        self.max_live: dict[str, int | None] = {}
        self.moves: list[dict[str, Any]] = []
        self.seq = 0

    def state(self, adapter: str, version: int) -> Adapter | None:
        m = self.versions.get(adapter, {}).get(version)
        return None if m is None else Adapter(m.state)

    def live(self, adapter: str) -> int | None:
        return next((v for v, m in self.versions.get(adapter, {}).items() if m.state == Adapter.LIVE), None)

    def servable(self, adapter: str) -> list[int]:
        return sorted(v for v, m in self.versions.get(adapter, {}).items() if m.state in SERVABLE_ADAPTER)

    def loaded(self, adapter: str) -> list[int]:
        """Versions on the server: staged (loaded, not published) or servable."""
        keep = (Adapter.STAGED, *SERVABLE_ADAPTER)
        return sorted(v for v, m in self.versions.get(adapter, {}).items() if m.state in keep)

    def staged(self, adapter: str) -> int | None:
        pending = (Adapter.STAGING, Adapter.STAGED)
        return next((v for v, m in self.versions.get(adapter, {}).items() if m.state in pending), None)

    def going(self, adapter: str) -> list[int]:
        """The servable versions a publish of the staged one would push past `max_live` (oldest first)."""
        bound, servable = self.max_live.get(adapter), self.servable(adapter)
        return [] if bound is None else servable[: max(0, len(servable) + 1 - bound)]

    def _log(self, adapter: str, version: int, event: str, src: str | None, **fields: Any) -> None:
        self.seq += 1
        m = self.versions[adapter][version]
        self.moves.append({
            "adapter": adapter, "adapter_version": version, "event": event, "src": src, "state": str(m.state),
            "servable": len(self.servable(adapter)), "max_live": self.max_live.get(adapter), "seq": self.seq,
            **fields,
        })  # fmt: skip

    def _move(self, adapter: str, version: int, event: AdapterEvent, **fields: Any) -> None:
        m = self.versions[adapter][version]
        src = str(m.state)
        m.fire(event)
        self._log(adapter, version, str(event), src, **fields)

    def stage(self, adapter: str, version: int, max_live: int | None) -> None:
        self.max_live[adapter] = max_live
        self.versions.setdefault(adapter, {})[version] = FactMachine("adapter")
        self._log(adapter, version, "stage", None)

    def complete(self, adapter: str, version: int) -> None:
        self._move(adapter, version, AdapterEvent.COMPLETE)

    def publish(self, adapter: str, version: int) -> None:
        before = self.live(adapter)
        if before is not None:
            self._move(adapter, before, AdapterEvent.SUPERSEDE)
        self._move(adapter, version, AdapterEvent.PUBLISH)

    def unload(self, adapter: str, version: int, **fields: Any) -> None:
        if self.state(adapter, version) == Adapter.LIVE:
            self._move(adapter, version, AdapterEvent.SUPERSEDE, **fields)
        self._move(adapter, version, AdapterEvent.UNLOAD, **fields)
        del self.versions[adapter][version]

    def discard(self, adapter: str, version: int, *, reason: str) -> None:
        self._move(adapter, version, AdapterEvent.DISCARD, reason=reason)
        del self.versions[adapter][version]

    def sync(self, adapter: str, on_server: Iterable[int]) -> None:
        """Fold in the versions the server lists: one it lost is unloaded (a restart, another
        client's unload), one never seen here is adopted (a new driver over a running server: the
        newest is taken as live, the others as retired). Adoption makes no move record (nothing
        moved: the first record of an adopted version starts where it was found)."""
        found = set(on_server)
        mine = self.versions.setdefault(adapter, {})
        for v in [v for v, m in mine.items() if v not in found and m.state != Adapter.STAGING]:
            if mine[v].state == Adapter.STAGED:
                self.discard(adapter, v, reason="gone from the server")
            else:
                self.unload(adapter, v, reason="gone from the server")
        new = sorted(found - set(mine))
        if not new:
            return
        live = self.live(adapter)
        newest = max(new) if live is None else max(live, *new)
        for v in new:
            m = mine[v] = FactMachine("adapter")
            m.fire(AdapterEvent.COMPLETE)
            m.fire(AdapterEvent.PUBLISH)
            if v != newest:
                m.fire(AdapterEvent.SUPERSEDE)
        if live is not None and live != newest:  # a newer one someone else loaded: that one is taken as live
            self._move(adapter, live, AdapterEvent.SUPERSEDE, reason=f"v{newest} found on the server")

    def report(self) -> list[dict[str, Any]]:
        out, self.moves = self.moves, []
        return out

    def describe(self) -> dict[str, dict[int, dict[str, str]]]:
        return {a: {v: {"state": str(m.state)} for v, m in vs.items()} for a, vs in self.versions.items() if vs}


__all__ = [
    "AdapterMirror", "config_dict", "load_body", "normalized_targets", "parse_version_name", "server_lora",
    "server_problem", "static_problem", "version_name",
]  # fmt: skip
