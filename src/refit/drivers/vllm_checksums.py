"""vLLM's own weight checksums (`POST /weight_checker {"action": "checksum"}`), mapped onto refit's
verification: what vLLM 0.33.0 answers, read in its source.

  * entrypoints/rl/online/api_router.py `weight_checker` (registered only with
    VLLM_SERVER_DEV_MODE=1): merges one dict per worker from `EngineClient.
    compute_weight_checksums` into {"checksums": {key: digest}} (a key two workers both report
    is an HTTP 500); "compare" with a `baseline` answers {"match", "mismatches"}; "reset" zeroes
    the weights (refit never sends it).
  * v1/worker/gpu_worker.py `Worker.compute_weight_checksums`: each key is the worker's ranks,
    "dp<d>:pp<p>:pcp<c>:tp<t>:", then the parameter's name; model_loader/weight_checksum.py
    hashes every parameter (`named_parameters()`: no buffers; a tied head is the embedding, listed
    once) as the sha256 hex digest of its bytes read to the host. Nothing in that chain looks at
    the pause: it answers while generation is paused.
  * The parameters are laid out as SGLang's are (`refit.drivers.sglang_checksums`, flavour
    "vllm"): q/k/v fused per rank, gate/up fused, o/down split by columns, the embedding and an
    untied head split by vocabulary rows padded to a multiple of 64 (zeros), norms whole.

The digest kind is "vllm/tp<N>"; `reported` turns an answer into {"<param>@tp<rank>": digest},
the keys `sglang_checksums.expected(state, tp, "vllm")` and the trainer's `LayoutDigests` give.
Mapped: one data-parallel rank, one pipeline stage, no context parallelism. On vLLM's CPU
backend linear weights are repacked after loading and their parameters left empty, so every one
hashes as the empty string: `reported` refuses such an answer, naming why.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

KIND_PREFIX = "vllm/tp"
EMPTY = hashlib.sha256(b"").hexdigest()  # what an emptied (repacked) parameter hashes to
_KEY = re.compile(r"^dp(\d+):pp(\d+):pcp(\d+):tp(\d+):(.+)$")


def kind_for(tp: int) -> str:
    return f"{KIND_PREFIX}{tp}"


def key(name: str, tp_rank: int) -> str:
    """vLLM's key for a parameter of one TP rank (data-parallel rank 0, one stage)."""
    return f"dp0:pp0:pcp0:tp{tp_rank}:{name}"


def reported(body: Any) -> dict[str, str]:
    """vLLM's /weight_checker checksum answer as {"<parameter>@tp<rank>": digest}, with each rank's
    head (`sglang_checksums.with_head`); raises ValueError naming what is malformed or unmapped."""
    from refit.drivers.sglang_checksums import with_head

    sums = body.get("checksums") if isinstance(body, dict) else None
    if not isinstance(sums, dict) or not sums:
        raise ValueError(f"the answer has no checksums: {str(body)[:200]}")
    out: dict[str, str] = {}
    emptied = []
    for k, value in sums.items():
        m = _KEY.match(k) if isinstance(k, str) else None
        if m is None or not isinstance(value, str):
            raise ValueError(f"a checksum entry is not vLLM's ('dp<d>:pp<p>:pcp<c>:tp<t>:<name>': hex): {k!r}")
        dp, pp, pcp, tp, name = m.groups()
        if (dp, pp, pcp) != ("0", "0", "0"):
            raise ValueError(
                f"{k!r}: a data-parallel, pipeline or context-parallel rank other than 0 is not mapped (one "
                "engine per data-parallel rank, one stage)"
            )
        if value == EMPTY and name.endswith(".weight"):
            emptied.append(name)
        out[f"{name}@tp{tp}"] = value
    if emptied:
        raise ValueError(
            f"{len(emptied)} parameters hash as empty (first {emptied[0]!r}): vLLM's CPU backend repacks linear "
            "weights after loading and empties their parameters, so its checksums cannot verify them"
        )
    return with_head(out)


def answer(
    state: dict[str, Any], tp: int, heads: dict[str, int] | None = None, shards: list[dict[str, Any]] | None = None
) -> dict[str, str]:
    """The checksums a vLLM server of `tp` workers holding `state` (HF names, as served; `heads`:
    name -> the heads a q/k/v projection holds; `shards`: each worker's own rows and columns,
    `sglang_checksums.sglang_params`) reports: the body's "checksums", worker by worker in rank
    order (what the emulator answers)."""
    from refit.drivers.sglang_checksums import pieces_checksum, sglang_params

    per_rank: list[dict[str, str]] = [{} for _ in range(tp)]
    for k, pieces in sglang_params(state, tp, "vllm", heads, shards):
        name, _, rank = k.rpartition("@tp")
        per_rank[int(rank)][key(name, int(rank))] = pieces_checksum(pieces, "vllm")
    return {k: v for sums in per_rank for k, v in sums.items()}
