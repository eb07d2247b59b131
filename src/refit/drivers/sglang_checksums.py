"""SGLang's own weight checksums (`/weights_checker`, action "checksum"), mapped onto refit's
verification: what SGLang 0.5.23 hashes, and the same hashes computed from a trainer's HF tensors.

What SGLang computes (read in its source):
  * entrypoints/http_server.py `check_weights` answers {"success", "message", "ranks": [one
    ChecksumInfo per TP rank], "per_engine_checksum"}; managers/scheduler_components/
    weight_updater.py `check_weights` gathers one ChecksumInfo per TP rank over the TP group.
  * utils/weight_checker.py `WeightChecker._compute_checksum`: for every parameter and buffer of
    the model (`named_parameters()` then `named_buffers()`: a tied head is the embedding, listed
    once), except the non-persistent buffers (`_NON_PERSISTENT_BUFFER_PATTERNS`: cos_sin_cache,
    inv_freq, ...), `_hash_tensor`: `mm_utils.tensor_hash` as 16 hex digits. On the host that is
    sha256 of the tensor's raw bytes, its first 8 bytes read big-endian (kind "sglang/tp<N>"); on
    CUDA a Triton hash, `gpu_tensor_hash`, which `refit.drivers.sglang_tile_hash` reproduces (kind
    "sglang-cuda/tp<N>": a server that reports device "cuda").
  * The parameters are SGLang's, per TP rank: q/k/v fused into `qkv_proj` (this rank's q rows,
    then its k rows, then its v rows; QKVParallelLinear), gate/up into `gate_up_proj` (this rank's
    gate rows, then its up rows; MergedColumnParallelLinear), o_proj and down_proj split by
    columns (RowParallelLinear), the embedding and an untied head split by vocabulary rows padded
    to a multiple of 64 (or of 64 x TP when that does not divide; the padding rows zero:
    layers/vocab_parallel_embedding.py `pad_vocab_size`, `_get_indices`, `weight_loader`), norms
    whole on every rank.

`expected(state, tp)` gives the checksums SGLang would report for `state` (HF names, the dtypes
sent), keyed "<SGLang parameter>@tp<rank>", the key `reported(body)` gives SGLang's answer.
Llama-family layouts only (the ones refit's reference engine and emulator serve). On CUDA (and in
vLLM), fewer KV heads than TP ranks are replicated: rank r holds KV head r // (TP / KV heads)
(layers/linear.py `QKVParallelLinear.__init__`: num_kv_head_replicas; `weight_loader`: the KV group's
rank // it), so mapping k_proj and v_proj needs the model's KV head count: `heads` (HF name -> the
attention heads its rows hold, `refit.buckets.attention_heads`). Without it their rows split evenly
over the ranks, right only when there are at least as many KV heads as ranks; a run refuses that
guess at IDLE. On the host SGLang pads such heads instead (`PADS_UNALIGNED`): refused, not mapped.

vLLM 0.33 lays these models out the same way (its QKVParallelLinear, MergedColumnParallelLinear,
RowParallelLinear and VocabParallelEmbedding, the padding rows zero) and hashes each parameter with
the whole sha256 hex digest: kind "vllm/tp<N>" selects that flavour here (`refit.drivers.
vllm_checksums` reads its answer).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

NOT_PARAMETERS = ("rotary_emb.inv_freq", "cos_sin_cache", "cos_cache", "sin_cache", "freqs_cis")
KIND_PREFIX = "sglang/tp"  # the digest kind, with the engine's TP size: "sglang/tp2"
CUDA_KIND_PREFIX = "sglang-cuda/tp"  # the same for a server on CUDA (another hash, the same layout)
# servers whose checksums this layout maps, by kind prefix: SGLang on the host and on CUDA hash
# differently; vLLM 0.33 lays the same models out the same way and hashes differently again
# (`refit.drivers.vllm_checksums`)
FLAVOURS = {KIND_PREFIX: "sglang", CUDA_KIND_PREFIX: "sglang-cuda", "vllm/tp": "vllm"}
# what differs between them, as data: the hash ("sha256/8": sha256's first 8 bytes, big-endian, as
# 16 hex digits; "sha256": the whole hex digest; "tile": gpu_tensor_hash), and whether a vocabulary
# that 64-row padding does not split over TP is padded to 64 x TP instead (else the server cannot
# serve it)
HASH = {"sglang": "sha256/8", "sglang-cuda": "tile", "vllm": "sha256"}
PADS_BY_TP = {"sglang": True, "sglang-cuda": True, "vllm": False}
# SGLang on the host rewrites the model's config before loading (model_executor/model_runner.py, when
# device == "cpu": configs/update_config.py `adjust_config_with_unaligned_cpu_tp`): heads or KV heads
# that do not divide by TP are padded with zero heads (so fewer KV heads than ranks are padded, not
# replicated), and an intermediate size not a multiple of 32 x TP (DEFAULT_MOE_PADDING_SIZE) is padded
# with zero rows. Not mapped: refused by `unmappable`.
PADS_UNALIGNED = {"sglang": True, "sglang-cuda": False, "vllm": False}
INTERMEDIATE_PADDING = 32  # configs/update_config.py DEFAULT_MOE_PADDING_SIZE
# the server's device -> the SGLang flavour its /weights_checker hashes with (mm_utils.tensor_hash:
# `tensor.is_cuda` picks gpu_tensor_hash; ROCm's tensors are "cuda" too). Other devices: not mapped.
SGLANG_DEVICES = {"cpu": "sglang", "cuda": "sglang-cuda"}
VOCAB_PADDING = 64  # layers/vocab_parallel_embedding.py DEFAULT_VOCAB_PADDING_SIZE
FUSED = {  # HF suffix -> (SGLang parameter suffix, position in it)
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
}
# the parts of qkv_proj whose heads SGLang replicates when there are fewer of them than TP ranks
KV_PARTS = frozenset(k for k, (target, position) in FUSED.items() if "qkv" in target and position > 0)
BY_COLUMNS = ("self_attn.o_proj.weight", "mlp.down_proj.weight")
EMBEDDING, HEAD = "model.embed_tokens.weight", "lm_head.weight"
BY_VOCAB = (EMBEDDING, HEAD)


def kind_for(tp: int, device: str = "cpu") -> str:
    """The digest kind of an SGLang server on `device` with `tp` ranks (KeyError: not mapped)."""
    prefix = {flavour: prefix for prefix, flavour in FLAVOURS.items()}[SGLANG_DEVICES[device]]
    return f"{prefix}{tp}"


def _parse(kind: str) -> tuple[str, int] | None:
    for prefix, flavour in FLAVOURS.items():
        if kind.startswith(prefix) and kind[len(prefix) :].isdigit():
            return flavour, int(kind[len(prefix) :])
    return None


def tp_of(kind: str) -> int | None:
    """The TP size a layout kind ("sglang/tpN", "vllm/tpN") names, or None for another kind."""
    parsed = _parse(kind)
    return None if parsed is None else parsed[1]


def flavour_of(kind: str) -> str:
    """Whose checksums a layout kind names: "sglang" or "vllm"."""
    parsed = _parse(kind)
    if parsed is None:
        raise ValueError(f"digest kind {kind!r} is not a server layout's ({', '.join(f'{p}<N>' for p in FLAVOURS)})")
    return parsed[0]


def checksum(tensor: torch.Tensor, flavour: str = "sglang") -> str:
    """SGLang's host checksum of one tensor (mm_utils.tensor_hash, weight_checker._hash_tensor),
    or vLLM's (`flavour="vllm"`)."""
    return pieces_checksum([tensor], flavour)


def vocab_rows(vocab: int, tp: int, rank: int, flavour: str = "sglang") -> tuple[int, int, int]:
    """(first row, rows taken from the tensor, rows on this rank) of a vocabulary-split tensor.
    SGLang pads to a multiple of 64 x TP when one of 64 does not split; vLLM cannot serve that
    (its `divide` asserts) and neither is it mapped here."""
    pad = VOCAB_PADDING
    if -(-vocab // pad) * pad % tp:
        if not PADS_BY_TP[flavour]:
            raise ValueError(f"vocabulary {vocab} padded to a multiple of {pad} does not split over TP {tp}")
        pad *= tp
    per_rank = -(-vocab // pad) * pad // tp
    start = min(rank * per_rank, vocab)
    return start, min(start + per_rank, vocab) - start, per_rank


def _split(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}: {n} rows or columns do not split over TP {tp}")
    return n // tp


def part_rows(rows: int, tp: int, rank: int, what: str, kv_heads: int | None = None) -> tuple[int, int]:
    """(first row, rows) of a q/k/v or gate/up tensor of `rows` rows that TP rank `rank` holds.
    `kv_heads`: a k or v tensor's head count; fewer than `tp` are replicated (each over tp //
    kv_heads ranks; QKVParallelLinear), else (and when None) the rows split evenly."""
    if kv_heads is None or kv_heads >= tp:
        n = _split(rows, tp, what)
        return rank * n, n
    if tp % kv_heads or rows % kv_heads:
        raise ValueError(f"{what}: {kv_heads} KV heads of {rows} rows cannot be replicated over TP {tp}")
    per_head = rows // kv_heads
    return (rank // (tp // kv_heads)) * per_head, per_head


def sglang_params(
    state: Mapping[str, torch.Tensor],
    tp: int,
    flavour: str = "sglang",
    heads: Mapping[str, int] | None = None,
    shards: Sequence[Mapping[str, torch.Tensor]] | None = None,
) -> Iterator[tuple[str, list[torch.Tensor]]]:
    """Each SGLang parameter of every TP rank, as "<name>@tp<rank>" and the pieces whose bytes,
    in order, are its bytes (zeros where SGLang pads the vocabulary). Rotary buffers a trainer may
    send are not SGLang's parameters (its loaders drop them; its checker skips such buffers).
    `heads`: HF name -> the heads its rows hold (k and v: the KV heads, see `part_rows`).
    `shards` (an engine's own, per rank: HF name -> the rows or columns that rank holds): a fused
    part or a column split is read from the rank that holds it, not sliced from `state` (ranks
    sharing a KV head each hash their own copy, as a server does)."""
    import torch

    state = {k: v for k, v in state.items() if not any(p in k for p in NOT_PARAMETERS)}
    fused: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        prefix, _, rest = name.partition("layers.")
        layer, _, suffix = rest.partition(".")
        if prefix and suffix in FUSED:
            target, position = FUSED[suffix]
            fused.setdefault(f"{prefix}layers.{layer}.{target}", {})[position] = tensor
    for name, tensor in state.items():
        prefix, _, rest = name.partition("layers.")
        layer, _, suffix = rest.partition(".")
        if prefix and suffix in FUSED:
            target, position = FUSED[suffix]
            full = f"{prefix}layers.{layer}.{target}"
            parts = fused[full]
            if position != min(parts):
                continue  # the fused parameter is given once, at its first part
            if sorted(parts) != list(range(len(parts))) or len(parts) < (3 if "qkv" in target else 2):
                raise ValueError(f"{full}: the trainer sent only parts {sorted(parts)} of it")
            names = {pos: n for n, (t, pos) in FUSED.items() if t == target}
            kv = {pos: (heads or {}).get(f"{prefix}layers.{layer}.{names[pos]}") for pos in parts}
            for r in range(tp):
                pieces = []
                for pos, p in sorted(parts.items()):
                    part = f"{prefix}layers.{layer}.{names[pos]}"
                    if shards is not None:
                        pieces.append(shards[r][part])
                        continue
                    start, n = part_rows(p.shape[0], tp, r, full, kv[pos] if names[pos] in KV_PARTS else None)
                    pieces.append(p.narrow(0, start, n))
                yield f"{full}@tp{r}", pieces
        elif suffix in BY_COLUMNS:
            for r in range(tp):
                n = _split(tensor.shape[1], tp, name)
                yield (
                    f"{name}@tp{r}",
                    [shards[r][name] if shards is not None else tensor.narrow(1, r * n, n).contiguous()],
                )
        elif name in BY_VOCAB:
            for r in range(tp):
                start, taken, per_rank = vocab_rows(tensor.shape[0], tp, r, flavour)
                pad = torch.zeros((per_rank - taken, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
                yield f"{name}@tp{r}", [tensor.narrow(0, start, taken), pad]
        else:
            for r in range(tp):
                yield f"{name}@tp{r}", [tensor]


def unmappable(
    shapes: Mapping[str, tuple[int, ...]], tp: int, flavour: str = "sglang", heads: Mapping[str, int] | None = None
) -> list[str]:
    """What of a plan (HF name -> shape) this layout cannot map onto the server's parameters, in
    words (empty: all of it maps): a fused parameter sent in part (its checksum covers every part),
    rows or columns that do not split over `tp`, k/v rows whose KV head count is not known (`heads`)
    on more than one rank, or that the server cannot replicate, a vocabulary vLLM cannot split.
    Pure: checked before any engine is touched."""
    problems: list[str] = []
    parts: dict[str, set[int]] = {}
    unknown: list[str] = []
    problems += head_problems(shapes, heads or {})
    if problems:
        return problems
    for name, shape in shapes.items():
        if any(p in name for p in NOT_PARAMETERS):
            continue
        prefix, _, rest = name.partition("layers.")
        layer, _, suffix = rest.partition(".")
        if prefix and suffix in FUSED:
            target, position = FUSED[suffix]
            parts.setdefault(f"{prefix}layers.{layer}.{target}", set()).add(position)
            n = (heads or {}).get(name)
            if suffix in KV_PARTS and tp > 1 and n is None:
                unknown.append(name)
            elif n is not None and n % tp and PADS_UNALIGNED[flavour]:
                problems.append(
                    f"{name}: {n} heads do not divide by TP {tp}, and SGLang on the host pads them with zero heads "
                    "(configs/update_config.py adjust_config_with_unaligned_cpu_tp): not mapped"
                )
                continue
            elif n is not None and n % tp and (suffix not in KV_PARTS or n >= tp):
                problems.append(f"{name}: {n} heads do not split over TP {tp}")
            if (
                target.startswith("mlp.")
                and PADS_UNALIGNED[flavour]
                and shape
                and shape[0] % (INTERMEDIATE_PADDING * tp)
            ):
                problems.append(
                    f"{name}: intermediate size {shape[0]} is not a multiple of {INTERMEDIATE_PADDING} x TP {tp}, and "
                    "SGLang on the host pads it with zero rows (configs/update_config.py "
                    "adjust_config_with_unaligned_cpu_tp): not mapped"
                )
                continue
            try:
                part_rows(shape[0] if shape else 0, tp, 0, name, n if suffix in KV_PARTS else None)
            except ValueError as exc:
                problems.append(str(exc))
        elif suffix in BY_COLUMNS and len(shape) > 1 and shape[1] % tp:
            problems.append(f"{name}: {shape[1]} columns do not split over TP {tp}")
        elif name in BY_VOCAB and shape:
            try:
                vocab_rows(shape[0], tp, 0, flavour)
            except ValueError as exc:
                problems.append(f"{name}: {exc}")
    for target, got in parts.items():
        names = ("q_proj", "k_proj", "v_proj") if "qkv_proj" in target else ("gate_proj", "up_proj")
        if len(got) < len(names):
            sent = " and ".join(names[i] for i in sorted(got))
            lacking = " and ".join(n for i, n in enumerate(names) if i not in got)
            problems.append(f"{target}: {sent} sent without {lacking} (its checksum covers all {len(names)})")
    if unknown:
        problems.append(
            f"{unknown[0]}{f' and {len(unknown) - 1} more' if len(unknown) > 1 else ''}: the model's KV head count "
            f"is not known, and over TP {tp} the server replicates KV heads when there are fewer than ranks, so "
            "their rows cannot be mapped (give the source the model's config: TorchSource(model) for a module with "
            "a `config`, else TorchSource(..., config=hf_config); a Source of your own sets TensorMeta.heads, "
            "refit.buckets.attention_heads)"
        )
    return problems


def head_problems(shapes: Mapping[str, tuple[int, ...]], heads: Mapping[str, int]) -> list[str]:
    """Head counts that cannot be the model's: not a positive integer, not dividing the tensor's
    rows, or giving q and k/v heads of different sizes in one layer (a config that is not this
    model's would split k and v wrongly, and fail every rank's checksum or pass a wrong one)."""
    problems: list[str] = []
    sizes: dict[str, dict[str, int]] = {}  # layer -> {suffix: head size}
    for name, n in heads.items():
        rows = shapes.get(name, ())
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            problems.append(f"{name}: head count {n!r} is not a positive integer")
        elif rows and rows[0] % n:
            problems.append(f"{name}: {rows[0]} rows do not divide into {n} heads (is the config this model's?)")
        elif rows:
            prefix, _, rest = name.partition("layers.")
            layer, _, suffix = rest.partition(".")
            sizes.setdefault(f"{prefix}layers.{layer}", {})[suffix] = rows[0] // n
    for layer, by in sizes.items():
        if len(set(by.values())) > 1:
            said = ", ".join(f"{s.split('.')[1]} {shapes[f'{layer}.{s}'][0]} rows / {heads[f'{layer}.{s}']} heads"
                             for s in sorted(by))  # fmt: skip
            problems.append(f"{layer}: the head counts give heads of different sizes ({said}): not this model's config")
    return problems


def pieces_checksum(pieces: list[torch.Tensor], flavour: str = "sglang") -> str:
    """`checksum` of the tensor whose bytes are these pieces' bytes in order."""
    h = hasher(flavour)
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


class _Sha256:
    """sha256 of tensors' bytes, read on the host (as SGLang's host path and vLLM read them)."""

    def __init__(self, whole: bool) -> None:
        self._h, self._whole = hashlib.sha256(), whole

    def update(self, tensor: torch.Tensor) -> None:
        from refit.buckets import _raw

        t = tensor.detach()
        self._h.update(memoryview(_raw(t.cpu() if t.device.type != "cpu" else t)))

    def hexdigest(self) -> str:
        """vLLM's whole hex digest; SGLang's first 8 bytes, big-endian, as 16 hex digits."""
        h = self._h
        return h.hexdigest() if self._whole else f"{int.from_bytes(h.digest()[:8], 'big'):016x}"


def hasher(flavour: str) -> Any:
    """A fresh hash of `flavour`'s kind: `update(tensor)` with each piece in order, then
    `hexdigest()` (`HASH` says which)."""
    how = HASH[flavour]
    if how == "tile":
        from refit.drivers.sglang_tile_hash import TileHash

        return TileHash()
    return _Sha256(whole=how == "sha256")


def with_head(sums: dict[str, str]) -> dict[str, str]:
    """`sums` with the head each rank serves under "lm_head.weight@tp<rank>": a server that ties
    it to the embedding lists the embedding only, and serves it as the head (SGLang's Llama and
    Qwen2 skip a checkpoint's lm_head.weight when tied), so a trainer whose head differs from its
    embedding is caught there."""
    out = dict(sums)
    for key, value in sums.items():
        name, _, rank = key.rpartition("@tp")
        if name == EMBEDDING and f"{HEAD}@tp{rank}" not in sums:
            out[f"{HEAD}@tp{rank}"] = value
    return out


def expected(
    state: Mapping[str, torch.Tensor], tp: int, flavour: str = "sglang", heads: Mapping[str, int] | None = None
) -> dict[str, str]:
    """The checksums SGLang (or vLLM) would report for `state` (HF names, in the dtypes sent) on
    `tp` ranks, with each rank's head (`with_head`); `heads` as `sglang_params` takes them."""
    pairs = sglang_params(state, tp, flavour, heads)
    return with_head({key: pieces_checksum(pieces, flavour) for key, pieces in pairs})


def reported(body: Any) -> dict[str, str]:
    """SGLang's /weights_checker answer as {"<parameter>@tp<rank>": checksum}, the target model's
    only (a draft runner's keys are prefixed with its role: weight_updater.py
    `_merge_checksum_payloads`); raises ValueError naming what is malformed."""
    if not isinstance(body, dict) or body.get("success") is not True:
        raise ValueError(f"the checksum was not computed: {str(body)[:200]}")
    ranks = body.get("ranks")
    if not isinstance(ranks, list) or not ranks:
        raise ValueError("the answer has no per-rank checksums ('ranks')")
    out: dict[str, str] = {}
    for info in ranks:
        roles = info.get("parallelism_info") if isinstance(info, dict) else None
        sums = info.get("checksums") if isinstance(info, dict) else None
        if not isinstance(roles, list) or not roles or not isinstance(sums, dict):
            raise ValueError(f"a rank's entry is not a ChecksumInfo: {str(info)[:200]}")
        rank = roles[0].get("tp_rank") if isinstance(roles[0], dict) else None
        if not isinstance(rank, int):
            raise ValueError(f"a rank's entry names no tp_rank: {str(roles)[:200]}")
        if not all(isinstance(r, dict) and isinstance(r.get("role"), str) for r in roles):
            raise ValueError(f"a rank's parallelism_info names no role: {str(roles)[:200]}")
        drafts = tuple(f"{r['role']}." for r in roles if r["role"] != "target")
        for name, value in sums.items():
            if drafts and name.startswith(drafts):
                continue
            out[f"{name}@tp{rank}"] = str(value)
    return with_head(out)


def param_of(name: str) -> str:
    """The SGLang parameter an HF tensor loads into."""
    prefix, _, rest = name.partition("layers.")
    layer, _, suffix = rest.partition(".")
    if prefix and suffix in FUSED:
        return f"{prefix}layers.{layer}.{FUSED[suffix][0]}"
    return name


def uncovered(sums: Mapping[str, str], planned: list[str], tp: int) -> list[str]:
    """The planned HF tensors whose SGLang parameter has no checksum on some rank."""
    return [
        n for n in planned
        if not any(p in n for p in NOT_PARAMETERS) and any(f"{param_of(n)}@tp{r}" not in sums for r in range(tp))
    ]  # fmt: skip


class LayoutDigests:
    """SGLang's checksums of a trainer's tensors taken as they are packed, one at a time (the same
    values as `expected` over the whole state): each parameter's hash is fed its pieces in order,
    and a fused part that comes before the parts it follows waits, copied, until they came. The
    host flavours read the bytes on the host; the CUDA flavour hashes where the tensors are."""

    def __init__(self, kind: str, heads: Mapping[str, int] | None = None) -> None:
        tp = tp_of(kind)
        if tp is None or tp < 1:
            raise ValueError(f"digest kind {kind!r} is not one of {', '.join(f'{p}<N>' for p in FLAVOURS)}")
        self.kind, self.tp, self.flavour = kind, tp, flavour_of(kind)
        self._heads = dict(heads or {})
        self._on_host = HASH[self.flavour] != "tile"
        self._open: dict[str, tuple[Any, int, dict[int, list[torch.Tensor]]]] = {}  # key -> (hash, next part, waiting)
        self._parts: dict[str, int] = {}  # fused parameter -> how many parts it has
        self._done: dict[str, str] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        t = t.cpu() if self._on_host and t.device.type != "cpu" else t
        prefix, _, rest = name.partition("layers.")
        suffix = rest.partition(".")[2]
        fused = FUSED.get(suffix) if prefix else None
        pairs = (
            sglang_params({name: t}, self.tp, self.flavour) if fused is None else self._fused_pieces(name, suffix, t)
        )
        for key, pieces in pairs:
            if fused is None:
                self._done[key] = pieces_checksum(pieces, self.flavour)
                continue
            h, at, waiting = self._open.setdefault(key, (hasher(self.flavour), 0, {}))
            if fused[1] == at:  # its turn: hashed from the tensor (hashlib releases the GIL on big buffers)
                for p in pieces:
                    h.update(p)
                at += 1
            else:  # early: a copy waits for the parts before it
                waiting[fused[1]] = [p.contiguous().clone() for p in pieces]
            while at in waiting:
                for piece in waiting.pop(at):
                    h.update(piece)
                at += 1
            self._open[key] = (h, at, waiting)
            if at == self._parts[key.rpartition("@tp")[0]]:
                self._done[key] = h.hexdigest()
                del self._open[key]

    def _fused_pieces(self, name: str, suffix: str, t: torch.Tensor) -> Iterator[tuple[str, list[torch.Tensor]]]:
        target = param_of(name)
        self._parts[target] = 3 if "qkv_proj" in target else 2
        kv = self._heads.get(name) if suffix in KV_PARTS else None
        for r in range(self.tp):
            start, n = part_rows(t.shape[0], self.tp, r, target, kv)
            yield f"{target}@tp{r}", [t.narrow(0, start, n)]

    def flush(self) -> None:
        pass

    def results(self) -> dict[str, str]:
        """Every parameter's checksum; a fused parameter missing a part is left out (not covered)."""
        return with_head(dict(self._done))
