"""Verification before publish: digests of the weights, and the pure comparison of what the
trainer sent with what an engine reports it will serve.

A digest names one tensor's bytes, per HF tensor name. The trainer's digests are taken while its
ranks pack (`refit.protocol.ranks.Participant`), of the tensors it sent; each engine computes its
own from its stored layout (fused, sharded, a serving copy of the head: whatever it will serve),
unfused back into HF names. The runner compares them in VERIFYING (`compare`, no I/O); an engine
whose report differs is not published.

Kinds (`DIGEST_KINDS`):
  xxh3   xxHash3-64 over the tensor's raw bytes in 1 MiB pieces, the pieces' digests hashed
         again (`refit.buckets.tensor_digest`): the checksum the CPU transports already use.
         A tensor on a GPU is read to the host first.

Modes (`VERIFY_MODES`, `RefitContext(verify=...)`):
  digest  every finalized engine reports its digests; an engine publishes only when each tensor
          the trainer sent, and the head it serves, matches bit for bit.
  off     the engine's word is trusted (finalize answered): nothing is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DIGEST_KINDS = ("xxh3",)
VERIFY_MODES = ("digest", "off")
SERVED_HEAD = "lm_head.weight"  # what an engine serves as its output head, reported under this name


def digest(tensor: torch.Tensor, kind: str = "xxh3") -> str:
    """One tensor's digest as 16 hex digits."""
    if kind != "xxh3":
        raise ValueError(f"digest kind {kind!r}; known {DIGEST_KINDS}")
    from refit.buckets import tensor_digest

    return f"{tensor_digest(tensor):016x}"


@dataclass
class Verdict:
    """One engine's verification: `ok` when every compared tensor matched. `mismatched`: names whose
    bytes differ; `missing`: names the trainer sent that the engine did not report; `unexpected`:
    names the engine reported that the trainer never sent (and that no sent tensor stands for)."""

    ok: bool
    compared: int
    mismatched: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    def describe(self, limit: int = 5) -> str:
        if self.ok:
            return f"{self.compared} tensors match"
        parts = []
        for what, names in (("differ", self.mismatched), ("not reported", self.missing),
                            ("reported but never sent", self.unexpected)):  # fmt: skip
            if names:
                more = f" and {len(names) - limit} more" if len(names) > limit else ""
                parts.append(f"{len(names)} {what}: {', '.join(names[:limit])}{more}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok, "compared": self.compared, "mismatched": self.mismatched, "missing": self.missing,
            "unexpected": self.unexpected,
        }  # fmt: skip


def compare(expected: Mapping[str, str], reported: Mapping[str, str], tied: Mapping[str, str] | None = None) -> Verdict:
    """What an engine reported (`reported`: name -> digest) against what the trainer sent
    (`expected`). `tied` (alias -> tensor): names the engine may report that stand for another sent
    tensor (a head tied to the embedding, served from its own copy): compared with that tensor
    when the trainer did not send the alias itself."""
    tied = dict(tied or {})
    tied.setdefault(SERVED_HEAD, "model.embed_tokens.weight")
    mismatched, unexpected = [], []
    compared = 0
    for name, got in reported.items():
        want = expected.get(name)
        if want is None and name in tied:
            want = expected.get(tied[name])
        if want is None:
            unexpected.append(name)
            continue
        compared += 1
        if str(got).lower() != str(want).lower():
            mismatched.append(name)
    missing = [n for n in expected if n not in reported]
    return Verdict(not (mismatched or missing or unexpected), compared, sorted(mismatched), sorted(missing),
                   sorted(unexpected))  # fmt: skip


def merge(per_rank: list[Any]) -> tuple[str | None, dict[str, str]]:
    """The trainer's digests from every rank's report ({"kind", "digests"} or None): ranks that
    packed the same tensor report the same digest; a rank that disagrees wins nothing (the name is
    marked conflicting, so no engine can match it)."""
    kind: str | None = None
    out: dict[str, str] = {}
    for report in per_rank:
        if not isinstance(report, dict):
            continue
        kind = kind or report.get("kind")
        for name, d in (report.get("digests") or {}).items():
            if out.setdefault(name, d) != d:
                out[name] = "conflict"
    return kind, out
