"""Verification before publish: digests of the weights, and the pure comparison of what the
trainer sent with what an engine reports it will serve.

A digest names one tensor's bytes, per HF tensor name. The trainer's digests are taken while its
ranks pack (`refit.protocol.ranks.Participant`), of the tensors it sent; each engine computes its
own from its stored layout (fused, sharded, a serving copy of the head: whatever it will serve),
unfused back into HF names. The runner compares them in VERIFYING (`compare`, no I/O); an engine
whose report differs is not published.

Kinds (`DIGEST_KINDS`; the transport names the one its runs use, `Transport.digest_kind`):
  xxh3   xxHash3-64 over the tensor's raw bytes in 1 MiB pieces, the pieces' digests hashed
         again (`refit.buckets.tensor_digest`): the checksum the CPU transports already use.
         A tensor on a GPU is read to the host first.
  wsum   `refit.wsum`: a GPU reads each byte once (a Triton kernel; the result stays on the
         device until a batch is read back with one sync); the host computes the same value.
         The GPU transports' kind (CUDA IPC, NCCL broadcast).
  sglang/tp<N>  an engine's kind, not a transport's: SGLang's own checksums (its /weights_checker)
         of each parameter of its fused, TP-sharded layout on N ranks, keyed "<param>@tp<rank>"
         (`refit.drivers.sglang_checksums`); the trainer computes the same from what it packs.
         A run uses it when every engine reports it and none reports the transport's kind.
  vllm/tp<N>  the same layout with vLLM's own checksums (its /weight_checker: sha256 hex per
         parameter, `refit.drivers.vllm_checksums`).

Modes (`VERIFY_MODES`, `RefitContext(verify=...)`):
  digest  every finalized engine reports its digests; an engine publishes only when each tensor
          the trainer sent, and the head it serves, matches bit for bit.
  probe   a few fixed prompts: the engine's next-token log-probabilities at the trainer's top
          tokens, against the trainer's model (computed before the run offloads it), within a
          tolerance set by the weights' dtype. Catches what digests cannot: an engine that
          holds the right bytes and computes with them wrongly (a wrong config).
  both    digest and probe.
  off     the engine's word is trusted (finalize answered): nothing is compared.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DIGEST_KINDS = ("xxh3", "wsum")
VERIFY_MODES = ("digest", "probe", "both", "off")
DIGEST_POINTS = ("auto", "written", "served")  # where an engine takes its digest (RefitContext.digest_point)
PROBE_TOP = 8  # tokens per prompt compared: the trainer's most likely next tokens
# the largest |logprob difference| a probe allows, by the weights' dtype: two implementations of the
# same forward differ by rounding (float32: ~1e-6 in this repo's reference engine vs torch; bf16
# matmuls in another order: a few hundredths)
PROBE_TOLERANCE = {"float64": 1e-6, "float32": 1e-3, "float16": 0.05, "bfloat16": 0.15}
SERVED_HEAD = "lm_head.weight"  # what an engine serves as its output head, reported under this name
CONFLICT = "conflict"  # the trainer's ranks disagree on a tensor's digest: no report can match it
LISTED = 50  # names a verdict lists per kind of problem (the count is always whole)


def is_kind(kind: Any) -> bool:
    """A digest kind: one of `DIGEST_KINDS`, or an engine layout's ("sglang/tp<N>", "vllm/tp<N>")."""
    from refit.drivers.sglang_checksums import tp_of

    return isinstance(kind, str) and (kind in DIGEST_KINDS or (tp_of(kind) or 0) >= 1)


def uncovered(kind: str, sums: Mapping[str, str], planned: list[str]) -> list[str]:
    """The planned tensors the trainer's digests do not cover (per tensor, or per the layout's
    parameters on every rank)."""
    from refit.drivers.sglang_checksums import tp_of
    from refit.drivers.sglang_checksums import uncovered as layout_uncovered

    tp = tp_of(kind)
    if tp is not None:
        return layout_uncovered(sums, planned, tp)
    return [n for n in planned if sums.get(n) is None]


def unmappable(kind: str, shapes: Mapping[str, tuple[int, ...]], heads: Mapping[str, int] | None = None) -> list[str]:
    """What of a plan (HF name -> shape; `heads`: name -> the attention heads its rows hold) digests
    of `kind` cannot cover (an engine layout's kind maps whole server parameters; per-tensor kinds
    cover anything): empty when all of it."""
    from refit.drivers.sglang_checksums import flavour_of, tp_of
    from refit.drivers.sglang_checksums import unmappable as layout_unmappable

    tp = tp_of(kind)
    return [] if tp is None else layout_unmappable(shapes, tp, flavour_of(kind), heads)


def digest(tensor: torch.Tensor, kind: str = "xxh3") -> str:
    """One tensor's digest as 16 hex digits (for many tensors on a GPU, `Digests` syncs once)."""
    if kind == "wsum":
        batch = Digests(kind)
        batch.add("t", tensor)
        return batch.results()["t"]
    if kind != "xxh3":
        raise ValueError(f"digest kind {kind!r}; known {DIGEST_KINDS}")
    from refit.buckets import tensor_digest

    return f"{tensor_digest(tensor):016x}"


class Digests:
    """Digests of many tensors by name: `add` as they come, `results` once (a GPU's are queued and
    read back together, with one host sync)."""

    def __init__(self, kind: str, heads: Mapping[str, int] | None = None) -> None:
        """`heads`: name -> the attention heads its rows hold (an engine layout's kind needs the
        KV heads' to map k and v over TP ranks: `refit.buckets.attention_heads`)."""
        if not is_kind(kind):
            raise ValueError(
                f"digest kind {kind!r}; known {DIGEST_KINDS} and the server layouts 'sglang/tp<N>', "
                "'sglang-cuda/tp<N>', 'vllm/tp<N>'"
            )
        self.kind = kind
        self._done: dict[str, str] = {}
        self._batch: Any = None  # wsum's `Batch`, or an engine layout's `LayoutDigests` (whole parameters)
        self._heads = heads

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self.kind == "xxh3":
            self._done[name] = digest(tensor, "xxh3")
            return
        if self._batch is None:
            if self.kind == "wsum":
                from refit.wsum import Batch

                self._batch = Batch()
            else:
                from refit.drivers.sglang_checksums import LayoutDigests

                self._batch = LayoutDigests(self.kind, self._heads)
        self._batch.add(name, tensor)

    def flush(self) -> None:
        """Hash what is queued now (a GPU's: one launch); the caller may then drop the tensors."""
        if self._batch is not None:
            self._batch.flush()

    def put(self, name: str, value: str) -> None:
        """A digest already known (a transport hashed the bytes while packing)."""
        self._done[name] = value

    def results(self) -> dict[str, str]:
        if self._batch is not None:
            self._done.update(self._batch.results())
            self._batch = None
        return dict(self._done)


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
        """As data; each list of names cut to LISTED (with `<kind>_count` the whole count)."""
        out: dict[str, Any] = {"ok": self.ok, "compared": self.compared}
        for key in ("mismatched", "missing", "unexpected"):
            names = getattr(self, key)
            out[key] = names[:LISTED]
            if len(names) > LISTED:
                out[f"{key}_count"] = len(names)
        return out


def compare(expected: Mapping[str, str], reported: Mapping[str, str], tied: Mapping[str, str] | None = None) -> Verdict:
    """What an engine reported (`reported`: name -> digest) against what the trainer sent
    (`expected`). `tied` (alias -> tensor): names the engine may report that stand for another sent
    tensor (a head tied to the embedding, served from its own copy): compared with that tensor
    when the trainer did not send the alias itself."""
    values = expected.values()
    if reported == expected and CONFLICT not in values and None not in values:  # the clean case, at C speed
        return Verdict(True, len(expected))
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
        if want == CONFLICT or (got != want and str(got).lower() != str(want).lower()):
            mismatched.append(name)
    missing = [n for n in expected if n not in reported]
    return Verdict(not (mismatched or missing or unexpected), compared, sorted(mismatched), sorted(missing),
                   sorted(unexpected))  # fmt: skip


def digests_of(mode: str) -> bool:
    return mode in ("digest", "both")


def probes_of(mode: str) -> bool:
    return mode in ("probe", "both")


def default_prompts(vocab: int, n: int = 4, length: int = 12) -> list[list[int]]:
    """Fixed prompts of token ids below `vocab` (the same for every run of the same model)."""
    return [[(7919 * (i + 1) + 104729 * j) % max(vocab, 1) for j in range(length)] for i in range(n)]


def probe_tolerance(dtypes: list[str]) -> float:
    """The probe's tolerance for weights of these dtypes (the loosest wins; unknown: bf16's)."""
    floats = [d for d in dtypes if d.startswith(("float", "bfloat"))]
    return max(
        (PROBE_TOLERANCE.get(d, PROBE_TOLERANCE["bfloat16"]) for d in floats), default=PROBE_TOLERANCE["float32"]
    )


def compare_probe(expected: list[dict[str, Any]], got: Any, tolerance: float) -> tuple[bool, float | None, str]:
    """The engine's log-probabilities (`got`: one list per prompt, at the trainer's `ids`) against
    the trainer's; (ok, largest difference, what was wrong)."""
    if not isinstance(got, list) or len(got) != len(expected):
        return False, None, f"the probe answered {type(got).__name__} for {len(expected)} prompts"
    worst, where = 0.0, -1
    for i, (want, have) in enumerate(zip(expected, got, strict=True)):
        values = want["logprobs"]
        if not isinstance(have, list) or len(have) != len(values):
            return False, None, f"prompt {i}: {len(values)} log-probabilities expected"
        try:
            diff = max((abs(float(a) - float(b)) for a, b in zip(values, have, strict=True)), default=0.0)
        except (TypeError, ValueError):
            return False, None, f"prompt {i}: log-probabilities that are not numbers"
        if not diff <= worst:  # NaN counts as the worst
            worst, where = diff, i
    ok = worst <= tolerance
    return (
        ok,
        worst,
        "" if ok else f"prompt {where}: next-token log-probability off by {worst:.3g} (tolerance {tolerance:g})",
    )


def merge(per_rank: list[Any]) -> tuple[str | None, dict[str, str]]:
    """The trainer's digests from every rank's report ({"kind", "digests"} or None): ranks that
    packed the same tensor report the same digest; a rank that disagrees wins nothing (the name is
    marked conflicting, so no engine can match it)."""
    reports = [r for r in per_rank if isinstance(r, dict)]
    if len(reports) == 1:  # one rank reports (the usual case): nothing to reconcile
        return reports[0].get("kind"), dict(reports[0].get("digests") or {})
    kind: str | None = None
    out: dict[str, str] = {}
    for report in per_rank:
        if not isinstance(report, dict):
            continue
        kind = kind or report.get("kind")
        for name, d in (report.get("digests") or {}).items():
            if out.setdefault(name, d) != d:
                out[name] = CONFLICT
    return kind, out


def judge(
    answer: Any,
    kind: str | None,
    expected: Mapping[str, str],
    reference: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One engine's verify answer against what the trainer sent: its digests of kind `kind` (None:
    not asked) against `expected`, and its probe answers against `reference` ({"expected": the
    trainer's logprobs, "tolerance"}; None: not asked). The verdict: `ok`; when digests were asked,
    `compared` and the `mismatched` / `missing` / `unexpected` names; when the probe was, `probe`
    ({"ok", "max_diff", "tolerance"}); and `problems` (what was wrong, in words). Pure: the ledger
    and `refit check` both call it."""
    verdict: dict[str, Any] = {"ok": False}
    if kind is not None:
        verdict.update(compared=0, mismatched=[], missing=[], unexpected=[])
    problems: list[str] = []
    if not isinstance(answer, dict):
        problems.append(f"verify answered {type(answer).__name__}, not a report")
        answer = {}
    if kind is not None:
        digests = answer.get("digests")
        if not isinstance(digests, dict) or answer.get("kind") != kind:
            problems.append(f"verify({kind!r}) answered without {kind} digests (got {answer.get('kind')!r})")
        else:
            found = compare(expected, digests)
            verdict.update({k: v for k, v in found.to_dict().items() if k != "ok"})
            if not found.ok:
                text = f"what it will serve is not what the trainer sent: {found.describe()}"
                if found.compared > 1 and len(found.mismatched) == found.compared:
                    text += (
                        " (every tensor differs: does the engine keep the weights in another dtype than the "
                        "trainer sends, or a layout this digest kind does not map?)"
                    )
                problems.append(text)
    if reference is not None:
        ok, diff, why = compare_probe(
            list(reference["expected"]), answer.get("logprobs"), float(reference["tolerance"])
        )
        verdict["probe"] = {"ok": ok, "max_diff": diff, "tolerance": reference["tolerance"]}
        if not ok:
            problems.append(f"its forward does not match the trainer's model: {why}")
    verdict["ok"] = not problems
    verdict["problems"] = problems
    return verdict
