"""The reference engine core: a small but real CPU inference engine (no transport in here).

What it has, and why each part exists:
  * model     fused layout like SGLang: q/k/v (and their biases) load into one `qkv_proj`,
              gate/up into one `gate_up_proj`, so the engine's layout differs from the trainer's.
              Loads write the live weights in place: a refit cut short leaves the engine with
              mixed weights. Llama and Qwen2 layouts (`ModelConfig.from_hf`): biases, an explicit
              head_dim, a head tied to the embedding, float32/bfloat16/float16 weights.
  * session   `begin(plan)` validates the whole plan against the model (names, shapes, dtypes,
              duplicates, coverage) before any byte is applied; `load` copies one bucket;
              `finalize` runs post-load processing exactly once and checks every bucket arrived.
              Post-load processing rebuilds the output head's serving copy (the part quantized /
              repacked layouts play in real engines): skip finalize and the engine keeps serving
              the old head.
  * cache     a prefix (radix-like) KV cache keyed by token ids. Every KV position remembers the
              weights epoch that computed it; a forward that reads KV from another epoch counts
              `stale_kv_tokens`, which is how "served stale KV" is observed.
  * scheduler waiting/running queues, one token per running request per step; pause modes:
              abort (finish requests now), retract (drop their KV, requeue, recompute later),
              in_place (freeze them with their KV). `flush` refuses while a running request
              holds KV, except when they are held in place: then it clears the prefix cache only
              (each held request keeps its own KV, off-policy; none started later reuses it).
  * version   the label published after a complete update; every token records the label and the
              weights epoch it was sampled under, and its log-probability (float32); `commits`
              lists the (version, epoch) pairs the engine served as whole versions, the
              checkpoint's first, one per publish (and per intact resume of released weights).
  * memory    release/resume of "weights" and "kv_cache" (colocated refits): released weights
              come back as zeros unless a CPU backup was kept.
  * device    `device="cuda"` puts weights, KV and the forward on a GPU (same code path). A
              bucket's copies are queued on the current stream (one batched copy per bucket, no
              host sync); `finalize` waits for them once, so a refit's end means the bytes landed.
"""

from __future__ import annotations

import contextlib
import itertools
import operator
import os
import socket
import time
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from refit.buckets import BucketManifest, chunk_digests, combine, copy_digests, dtype_name
from refit.errors import EngineError
from refit.reference import lora
from refit.reference.model import ModelConfig, attention, grouped_attention, iter_init_weights, rms_norm, rope

PAUSE_MODES = ("abort", "retract", "in_place")
LOAD_HOST_PARTS = ("read", "load", "drop")  # `EngineCore.load_host_s`
SKIPPED_KEEP = 32  # the latest names a load skipped as unknown, kept for `info`
AUDIT_KEEP = 20_000  # engine-side audit records kept at least (`EngineCore.record`)
# faults an engine can be made to commit without noticing (tests, `refit demo --fail-at`): it acks,
# finalizes and would serve wrong weights; only verification before publish can catch them
SILENT_FAULTS = {
    "flip": "load: a bit of the bucket's first tensor flips in the engine's memory after it landed",
    "swap_qk": "load: the loader writes k where q goes and q where k goes (a name-mapping bug)",
    "downcast": "load: every tensor is rounded through a narrower dtype on its way in",
    "skip": "load: the bucket's first tensor is never written",
    "swap_tp": "load: this TP rank keeps the next rank's shard (shards landed on the wrong rank)",
    "kv_replica": "load: this TP rank keeps another KV head's k and v rows, where its KV head is replicated (a "
    "loader that splits KV heads over the ranks where there are fewer than ranks: its replica disagrees)",
    "stale_head": "finalize: post-processing forgets to rebuild the serving copy of the output head",
    "late_copy": "load: the engine acks before copying, keeping views of the transport's buffer, and copies them at "
    "finalize (a reference kept past its ack: the buffer may hold a later bucket by then)",
}
MANGLED_AFTER_LOAD = ("flip", "swap_qk", "downcast", "skip", "swap_tp", "kv_replica")  # `_mangle_loaded`, checksummed
MEMORY_TAGS = ("weights", "kv_cache")
ENGINE_DTYPE = "float32"  # the default ModelConfig.dtype: every tensor's but an auxiliary one's


class Comm:
    """Collectives among one engine's TP ranks over a gloo backend made from a store (no default
    process group involved); a single rank needs none."""

    def __init__(self, group: Any = None, rank: int = 0, size: int = 1) -> None:
        self.group, self.rank, self.size = group, rank, size

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            self.group.allreduce([t]).wait()
        return t

    def all_gather_cat(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.group.allgather([parts], [t.contiguous()]).wait()
        return torch.cat(parts, dim=dim)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.size == 1:
            return [obj]
        import pickle

        raw = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self.group.allgather([sizes], [torch.tensor([raw.numel()], dtype=torch.int64)]).wait()
        width = int(max(int(s) for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8)
        padded[: raw.numel()] = raw
        outs = [torch.empty(width, dtype=torch.uint8) for _ in range(self.size)]
        self.group.allgather([outs], [padded]).wait()
        return [pickle.loads(o[: int(n)].numpy().tobytes()) for o, n in zip(outs, sizes, strict=True)]


class WeightLayout:
    """HF name -> where this TP rank keeps its shard of it: (engine parameter, dim, first index
    in the full tensor, first index in the local parameter, length). q/k/v (weights and biases)
    fuse into one `qkv_proj` and gate/up into one `gate_up_proj`, column-sharded by heads / rows;
    o_proj and down_proj are row-parallel (sharded by columns; o_proj's bias is replicated and
    added once, after the all-reduce); lm_head is sharded by vocabulary rows; embeddings and
    norms are replicated. A tied head (`tied`: alias -> tensor) has no parameter of its own: the
    engine serves this rank's vocabulary rows of the embedding."""

    def __init__(self, config: ModelConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        c, t, r = config, tp_size, tp_rank
        config.check_tp(t)
        assert c.head_dim is not None
        self.hf_shapes = config.hf_shapes()
        self.hf_dtypes = config.hf_dtypes()
        self.tied = config.tied
        self.dtype = config.dtype
        h = c.hidden_size
        rep = config.kv_replicas(t)  # ranks per KV head (1: the KV heads split over the ranks)
        qn, kn, inn, vn = (
            c.num_heads * c.head_dim // t,
            c.num_kv_heads * rep * c.head_dim // t,
            c.intermediate_size // t,
            c.vocab_size // t,
        )
        kr = (r // rep) * kn  # where this rank's k and v rows start in the HF tensors
        self.kv_rows = kn  # this rank's k (and v) rows
        self.kv_replicas = rep
        self.head_rows = (r * vn, vn)  # this rank's rows of the (possibly tied) output head
        sharded: dict[str, tuple[str, int, int, int, int]] = {  # suffix -> (target, dim, src start, dst start, length)
            "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0, r * qn, 0, qn),
            "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 0, kr, qn, kn),
            "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 0, kr, qn + kn, kn),
            "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0, r * qn, 0, qn),
            "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 0, kr, qn, kn),
            "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 0, kr, qn + kn, kn),
            "self_attn.o_proj.weight": ("self_attn.o_proj.weight", 1, r * qn, 0, qn),
            "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0, r * inn, 0, inn),
            "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 0, r * inn, inn, inn),
            "mlp.down_proj.weight": ("mlp.down_proj.weight", 1, r * inn, 0, inn),
        }
        local = {"self_attn.qkv_proj.weight": (qn + 2 * kn, h), "self_attn.qkv_proj.bias": (qn + 2 * kn,),
                 "self_attn.o_proj.weight": (h, qn), "mlp.gate_up_proj.weight": (2 * inn, h),
                 "mlp.down_proj.weight": (h, inn)}  # fmt: skip
        self.targets: dict[str, tuple[str, int, int, int, int]] = {}
        self.sharded: set[str] = set()
        self.replicated: set[str] = set()  # sharded names each of whose shards `rep` ranks hold (k, v)
        self.engine_shapes: dict[str, tuple[int, ...]] = {}
        for name, shape in self.hf_shapes.items():
            prefix, _, suffix = name.partition("layers.")
            layer, _, rest = suffix.partition(".")
            if prefix and rest in sharded:
                target, dim, src, dst, n = sharded[rest]
                engine_name = f"{prefix}layers.{layer}.{target}"
                self.engine_shapes[engine_name] = local[target]
                self.targets[name] = (engine_name, dim, src, dst, n)
                self.sharded.add(name)
                if rep > 1 and rest.split(".")[1] in ("k_proj", "v_proj"):
                    self.replicated.add(name)
            elif name == "lm_head.weight":
                self.engine_shapes[name] = (vn, shape[1])
                self.targets[name] = (name, 0, r * vn, 0, vn)
                self.sharded.add(name)
            else:
                self.engine_shapes[name] = shape
                self.targets[name] = (name, 0, 0, 0, shape[0])


# the digest `verify` reports for a KV tensor whose replicas (ranks sharing a KV head) disagree
REPLICAS_DIFFER = "replicas-differ"


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)  # the weights epoch each token was sampled under
    logprobs: list[float] = field(default_factory=list)  # each token's log-probability, float32
    finish_reason: str | None = None
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    kv_epochs: list[int] = field(default_factory=list)
    stale_kv_tokens: int = 0
    cached_tokens: int = 0
    num_retractions: int = 0
    adapter_name: str | None = None  # the LoRA adapter it asked for (None: the base model)
    adapter: Any = None  # the version it was pinned to when admitted (`lora.AdapterVersion`)
    seqs: list[int] = field(default_factory=list)  # the engine's token counter at each of its tokens

    def to_dict(self) -> dict[str, Any]:
        return {
            "rid": self.rid,
            "prompt": self.prompt,
            "output": self.output,
            "finish_reason": self.finish_reason,
            "weight_versions": self.versions,
            "weights_epochs": self.epochs,
            "logprobs": self.logprobs,
            "stale_kv_tokens": self.stale_kv_tokens,
            "cached_tokens": self.cached_tokens,
            "num_retractions": self.num_retractions,
            "adapter": self.adapter_name,
            "adapter_version": None if self.adapter is None else self.adapter.version,
            "token_seqs": self.seqs,
        }


class _Node:
    __slots__ = ("children", "epoch", "kv")

    def __init__(self, kv: torch.Tensor | None, epoch: int) -> None:
        self.children: dict[int, _Node] = {}
        self.kv = kv  # [layers, 2, kv_heads, head_dim] for this token position
        self.epoch = epoch


class PrefixCache:
    """Token-level trie of KV entries; each entry remembers the weights epoch that computed it."""

    def __init__(self) -> None:
        self.root = _Node(None, -1)
        self.size = 0

    def match(self, tokens: Sequence[int], limit: int) -> list[_Node]:
        node, path = self.root, []
        for tok in tokens[:limit]:
            node = node.children.get(tok)  # type: ignore[assignment]
            if node is None:
                break
            path.append(node)
        return path

    def insert(self, tokens: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]], epochs: list[int]) -> None:
        stacked = torch.stack([torch.stack([k[0], v[0]]) for k, v in kv])  # [L, 2, KV, T, D]
        node = self.root
        for pos, tok in enumerate(tokens):
            child = node.children.get(tok)
            if child is None:
                child = _Node(stacked[:, :, :, pos].clone(), epochs[pos])
                node.children[tok] = child
                self.size += 1
            node = child

    def clear(self) -> int:
        n, self.root, self.size = self.size, _Node(None, -1), 0
        return n


@dataclass
class _Session:
    plan: dict[int, BucketManifest] | None  # None: no plan (SGLang's sessions carry none)
    loaded: set[int] = field(default_factory=set)
    broken: str | None = None  # why a bucket was refused: every later bucket is refused too
    written: Any = None  # `refit.wsum.Written`: the served tensors hashed as they are written (begin's digest)
    deferred: list[tuple[str, torch.Tensor]] = field(default_factory=list)  # late_copy: views copied at finalize
    staged: bool = False  # into a second copy of the weights while the first is served (`swap` serves it)
    adapter: str | None = None  # a LoRA refit: into a staged version of this adapter (publish serves it)


@dataclass
class _Program:
    """A loaded bucket's checked copies (`EngineCore._keep_program`), valid while the engine's
    parameters are the objects they were built on: its destinations, what each source must be
    (name, shape, dtype), and, for a receiver that hands back the same views each time
    (`stable_views`), those views."""

    manifest: BucketManifest  # the plan's manifest it was checked for (by identity)
    params: tuple[tuple[str, torch.Tensor], ...]  # (name, parameter) the destinations are views of
    dsts: list[torch.Tensor]
    names: list[str]
    want: list[tuple[torch.Size, torch.dtype]]  # each source's shape and dtype
    whole: bool  # each source is copied whole (no shard of it narrowed: a single-rank engine)
    tensors: Sequence[tuple[str, torch.Tensor]] | None = None  # stable views: the receiver's list, by identity
    srcs: list[torch.Tensor] | None = None  # stable views: the sources, kept with them

    def current(self, params: dict[str, torch.Tensor]) -> bool:
        return all(params.get(name) is p for name, p in self.params)

    def sources(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor] | None:
        """Fresh views of this bucket as sources, when they are what was checked (the same names,
        shapes and dtypes, none of them a destination itself, each copied whole); else None (the
        full checks run, and the views are narrowed to this rank's shards there)."""
        if not self.whole or [n for n, _ in tensors] != self.names:
            return None
        srcs = [t for _, t in tensors]
        if [(t.shape, t.dtype) for t in srcs] != self.want or any(map(operator.is_, srcs, self.dsts)):
            return None
        return srcs


class EngineCore:
    """One reference engine. Not thread-safe: one adapter thread drives it."""

    def __init__(
        self,
        config: ModelConfig,
        seed: int,
        *,
        max_running: int = 8,
        version: int = 0,
        serving: bool = True,
        comm: Comm | None = None,
        device: str = "cpu",
        memory_limit: int | None = None,
        batch_decode: bool = False,
    ) -> None:
        """`serving=False` starts the engine out of service until a refit completes (a recovered
        engine must not answer requests with checkpoint weights before it has the current ones).
        `comm`: this process is one TP rank of the engine (every rank runs every request; the
        weights are sharded, the scheduler state replicated). `device`: where the weights, KV and
        forward live (a CUDA engine has one TP rank: its TP collectives are gloo's). `memory_limit`:
        the bytes its weights may take, staged copies included (as a server's static memory
        fraction bounds it): the probe reports what is left as free for a staged copy.
        `batch_decode`: one forward per step decodes every running request that holds KV, each
        from its own slot of a static KV cache (`max_running` slots of `max_seq_len`, allocated at
        the first batched step), as serving engines batch; off, each request is its own forward,
        the computation the bit-exact tests repeat on a fresh engine (a batched matmul may round
        a row differently)."""
        self.config = config
        self.batch_decode = batch_decode
        self._slots: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None  # K and V per layer
        self._slot_of: dict[int, int] = {}  # rid -> its slot, while it runs
        self.memory_limit = memory_limit
        self.comm = comm or Comm()
        self.device = torch.device(device)
        if self.device.type != "cpu" and self.comm.size > 1:
            raise ValueError(f"device {device!r} with TP {self.comm.size}: a reference engine on a GPU has one TP rank")
        self.layout = WeightLayout(config, self.comm.rank, self.comm.size)
        self.replicas_differ: list[str] = []  # KV tensors whose replicas disagreed at the last read-back
        self.params: dict[str, torch.Tensor] = {name: self._zeros(name) for name in self.layout.engine_shapes}
        self._dst_views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # name -> (its param, the view into it)
        self._programs: dict[int, _Program] = {}  # bucket index -> its checked copies, for the same received views
        self._plan_checked: tuple[BucketManifest, ...] | None = None  # the last plan `begin` found whole
        self._side_streams = False  # a load this session queued its copies on a stream other than the default
        # while a staged copy is written (begin(..., staged=True) until swap or discard): the weights
        # and head generation serves; `params` and `head_serving` are then the staged copy
        self._live: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        self._load_checkpoint(seed)
        self.head_serving = self._head()
        self.version = version
        self.weights_epoch = 0
        self.commits: list[tuple[int, int]] = [(version, 0)]  # (version, weights epoch) served whole
        self.held_in_place = False  # paused in place: requests keep their KV across the update
        self.tokens_sampled = 0  # tokens generated so far, every request
        self.tokens_while_staged = 0  # of those, sampled while a staged copy was held (atomic refits)
        self.seconds_staged = 0.0  # time staged copies were held, from each stage to its swap or discard
        self._staged_at: float | None = None
        self._written: tuple[Any, int] | None = None  # the last finalized session's Written, and the epoch it hashed
        self._regions: tuple[Any, Any, Any] | None = None  # (params, serving head, their `wsum.Regions`)
        self.dirty = False  # weights differ from what `version` names
        self.ready_to_publish = False  # last session completed and post-processed
        self.session: _Session | None = None
        self.paused = False
        self.quarantined: str | None = None
        self.weights_released = False
        self.kv_released = False
        self._backup: dict[str, torch.Tensor] | None = None
        self.cache = PrefixCache()
        # LoRA adapters, several versions live; each version keeps its own prefix cache
        self.lora = lora.AdapterTable(
            config, self.device, self.record, lambda: self.tokens_sampled, self._shard_of,
            (lambda held: bool(self.comm.gather_objects(held)[0])) if self.comm.size > 1 else (lambda held: held),
        )  # fmt: skip
        self._adapter_ready: str | None = None  # a LoRA refit's adapter, finalized whole: publish serves it
        self._adapter_written: tuple[Any, str, int] | None = None  # its session's Written, adapter, version
        # the last LoRA plan that passed `_check_adapter_plan` (its manifests) and its (spec, dtype)
        self._adapter_plan_checked: tuple[tuple[BucketManifest, ...], tuple[Any, Any]] | None = None
        self.step_s = 0.0  # a step's time, averaged (`step`)
        self.max_running = max_running
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[int, Request] = {}
        self._finished: list[int] = []
        self._rids = itertools.count()
        self.copies_landed_at: float | None = None  # CLOCK_MONOTONIC when the last finalize saw its copies land
        self.copy_span_s: float | None = None  # GPU time from the session's first queued copy to its last one's end
        self._copy_events: list[Any] = []
        self.direct_tensors = 0  # tensors a receiver wrote straight into the weights (no copy-out), so far
        self.kept_loads = 0  # buckets loaded by rerunning their kept copies (`_Program`), so far
        self.checked_loads = 0  # buckets of fresh views loaded by a kept program's checks and copies, so far
        self.skipped_tensors = 0  # tensors loads dropped unread as names the model lacks (`known_only`), so far
        self.skipped_recent: list[str] = []  # the latest of their names
        # host seconds of the last session's loads (the server's clock): the receiver's read (decode,
        # views), the engine's load (checks, queued copies) and the drop of the views after it
        self.load_host_s = dict.fromkeys(LOAD_HOST_PARTS, 0.0)
        self.sessions = 0  # update sessions opened so far; each begin that succeeds opens the next
        self.audit: list[dict[str, Any]] = []  # what the engine itself did, for engine-side invariants
        self.audit_keep = AUDIT_KEEP  # records kept at least (older ones go at a quiet point: `record`)
        self._quiet: list[int] = []  # indexes in `audit` of continues with no session open
        self._dropped = 0
        self.mangle: str | None = None  # an injected silent fault for the call in progress (SILENT_FAULTS)
        if not serving:
            self.quarantine("awaiting its first refit")
        if self.device.type == "cuda":  # start-up temporaries (the initial weights) are not the engine's peak
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    @torch.no_grad()
    def _load_checkpoint(self, seed: int) -> None:
        for name, tensor in iter_init_weights(self.config, seed, self.device):  # one at a time: no second model
            self._write(name, tensor)

    def _zeros(self, engine_name: str) -> torch.Tensor:
        dtype = self.layout.hf_dtypes.get(engine_name, self.layout.dtype)  # fused parameters: the model's dtype
        return torch.zeros(self.layout.engine_shapes[engine_name], dtype=getattr(torch, dtype), device=self.device)

    def _head(self) -> torch.Tensor:
        """A copy of this rank's output head as loaded: lm_head, or the embedding when tied."""
        return self._head_weights().clone()

    def _head_weights(self) -> torch.Tensor:
        if "lm_head.weight" in self.params:
            return self.params["lm_head.weight"]
        start, n = self.layout.head_rows
        return self.params[self.layout.tied["lm_head.weight"]].narrow(0, start, n)

    def record(self, op: str, ok: bool, **fields: Any) -> None:
        """Append one engine-side audit record (time is CLOCK_MONOTONIC, comparable across processes).
        The record is bounded: once it holds twice `audit_keep` records, those before the latest
        quiet point (a continue with no update session open) that leaves at least `audit_keep`
        are dropped, and a first record `{"op": "truncated", "dropped": n}` says how many in all
        (`refit.invariants.check_engine_audit` starts afresh there: nothing was open)."""
        self.audit.append(
            {"t": time.monotonic(), "op": op, "ok": ok, "session": self.sessions, "dirty": self.dirty,
             "paused": self.paused, "version": self.version, "epoch": self.weights_epoch, **fields}
        )  # fmt: skip
        if op == "continue_generation" and ok and self.session is None:
            self._quiet.append(len(self.audit) - 1)
            if len(self.audit) >= 2 * self.audit_keep:
                self._trim()

    def _trim(self) -> None:
        cut = max((i for i in self._quiet if len(self.audit) - i >= self.audit_keep), default=None)
        if cut is None or cut <= 1:
            return
        head = self.audit[0]
        self._dropped += cut - (1 if head.get("op") == "truncated" else 0)
        marker = {"t": self.audit[cut - 1]["t"], "op": "truncated", "ok": True, "dropped": self._dropped}
        self.audit = [marker, *self.audit[cut:]]
        self._quiet = [i - cut + 1 for i in self._quiet if i >= cut]

    # ---- weights ---------------------------------------------------------------------------

    def _write(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Keep this rank's shard of the full HF tensor."""
        target, dim, src, dst, n = self.layout.targets[hf_name]
        self.params[target].narrow(dim, dst, n).copy_(tensor.narrow(dim, src, n))

    def served_state_dict(self) -> dict[str, torch.Tensor]:
        """`hf_state_dict` with an untied head as it serves it (its serving copy, every rank's rows):
        the weights as a server without a separate serving copy would hold them (a tied head is
        the embedding: not listed). A tied head whose serving copy is not the embedding (a stale
        copy) is listed: such a server serves a head of its own, and the emulators' checksums
        must cover what is served, or a wrong head would verify."""
        from refit.verify import SERVED_HEAD

        state = self.hf_state_dict()
        head = self.comm.all_gather_cat(self.head_serving, dim=0)  # (every rank takes part)
        tied_to = self.layout.tied.get(SERVED_HEAD)
        if tied_to is None or not torch.equal(head, state[tied_to]):
            state[SERVED_HEAD] = head
        return state

    @contextlib.contextmanager
    def serving_view(self) -> Iterator[None]:
        """Reads inside see the weights generation serves, even while a staged copy is written
        (`params` is then the copy: what `verify` reads, what a swap will serve)."""
        if self._live is None:
            yield
            return
        staged = self.params, self.head_serving
        self.params, self.head_serving = self._live
        try:
            yield
        finally:
            self.params, self.head_serving = staged

    def _shard_of(self, hf_name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of HF weight `hf_name`'s shard on this TP rank (None: one rank)."""
        if self.comm.size == 1:
            return None
        _target, dim, src, _dst, n = self.layout.targets[hf_name]
        return dim, src, n

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights read back and unfused, in HF names (what a refit's check compares); every TP
        rank contributes its shards."""
        self._require_weights()
        local = {}
        for name, (target, dim, _src, dst, n) in self.layout.targets.items():
            local[name] = self.params[target].narrow(dim, dst, n).clone()
        if self.comm.size == 1:
            return local
        ranks = self.comm.gather_objects(local)
        rep, out = self.layout.kv_replicas, {}
        self.replicas_differ = []
        for name, mine in local.items():
            if name not in self.layout.sharded:
                out[name] = mine
                continue
            holders = ranks[rep - 1 :: rep] if name in self.layout.replicated else ranks  # one rank per KV head
            out[name] = torch.cat([r[name] for r in holders], dim=self.layout.targets[name][1])
            if name in self.layout.replicated and any(
                not torch.equal(r[name], ranks[i - i % rep + rep - 1][name]) for i, r in enumerate(ranks)
            ):
                self.replicas_differ.append(name)  # the ranks sharing a KV head hold different bytes
        return out

    def cannot_fault(self, kind: str) -> str | None:
        """Why a silent fault of `kind` would change nothing on this engine (None: it can act)."""
        if self.session is not None and self.session.adapter is not None:  # the loads go to `lora.load`
            return "a LoRA refit's loads into a staged adapter version take no silent fault (they mangle base weights)"
        if kind == "swap_tp" and self.comm.size == 1:
            return "it needs TP ranks (this engine has one)"
        if kind == "kv_replica" and (self.layout.kv_replicas == 1 or self.config.num_kv_heads == 1):
            return (
                f"it needs KV heads replicated over TP ranks and a second KV head (this engine: "
                f"{self.config.num_kv_heads} KV heads over {self.comm.size} ranks)"
            )
        return None

    def rank_shards(self) -> list[dict[str, torch.Tensor]]:
        """Each TP rank's own rows (or columns) of every sharded HF tensor, as that rank holds them,
        in rank order: what a server that hashes each rank's parameters reads (ranks sharing a KV
        head each hold a copy)."""
        self._require_weights()
        local = {
            name: self.params[t].narrow(dim, dst, n).clone()
            for name, (t, dim, _s, dst, n) in self.layout.targets.items()
            if name in self.layout.sharded
        }
        return [local] if self.comm.size == 1 else self.comm.gather_objects(local)

    def _require_weights(self) -> None:
        if self.weights_released:
            raise EngineError("weights_released", "weight memory is released; resume it first")

    def begin(
        self,
        plan: Sequence[BucketManifest] | None,
        digest: str | None = None,
        staged: bool = False,
        adapter: dict[str, Any] | None = None,
    ) -> None:
        """Open a weight-update session for `plan`, validated whole against the model first. With
        `plan=None` (an engine API whose session names no plan, as SGLang's begin_weight_update),
        each bucket is validated on arrival and finalize cannot check completeness. `digest="wsum"`
        (a single-rank engine): every served tensor is hashed as the session writes it, the digest
        fused into the copy, so `verify` reads back only what was not written whole. `staged`
        (atomic refits): the session writes a second copy of the weights, made now from the served
        one, while generation goes on serving the first; finalize and verify act on the copy, `swap`
        serves it, `discard` drops it (`staging_bytes` of memory while it lives). `adapter` (a LoRA
        refit: {"name", "version", the spec's fields, "dtype", "max_live"}): the session writes a new
        version of that adapter instead (`_begin_adapter`)."""
        if self.session is not None:
            raise EngineError("session_open", "a weight-update session is already open; finalize it first")
        if self._live is not None:
            raise EngineError("staged", "a staged copy of the weights is held; swap or discard it first")
        self._require_weights()
        if adapter is not None:
            if self.quarantined or self.dirty:  # its base weights are no version's: an adapter cannot fix that
                raise EngineError(
                    "not_serving",
                    f"a LoRA refit cannot bring this engine into service: its base weights "
                    f"{'are quarantined (' + self.quarantined + ')' if self.quarantined else 'match no version'}; "
                    "a full refit first",
                )
            self._begin_adapter(plan, adapter, digest)
            return
        if staged and plan is None:
            raise EngineError("bad_request", "a staged session needs its plan (what it writes is checked whole first)")
        self.load_host_s = dict.fromkeys(LOAD_HOST_PARTS, 0.0)
        if plan is None:
            self.session = _Session(plan=None)
            self.sessions += 1
            self.ready_to_publish = False
            return
        plan = tuple(plan)
        if plan != self._plan_checked:  # (the same manifests as last time compare by identity: no walk)
            self._check_plan(plan)
            self._plan_checked = plan
        if staged:  # the copy the session writes; generation keeps the served one until `swap`
            self._staged_at = time.monotonic()
            self._live = (self.params, self.head_serving)
            self.params = {k: v.clone() for k, v in self.params.items()}
            self.head_serving = self.head_serving.clone()
        self.session = _Session(plan={m.index: m for m in plan}, staged=staged)
        self._written = None
        if digest == "wsum" and self.comm.size == 1:
            from refit.wsum import Regions, Written

            kept = self._regions
            if kept is None or kept[0] is not self.params or kept[1] is not self.head_serving:  # built once per place
                self._regions = kept = (self.params, self.head_serving, Regions(self._served_regions()))
            self.session.written = Written(kept[2])
        self.sessions += 1
        self.ready_to_publish = False

    def _check_plan(self, plan: Sequence[BucketManifest]) -> None:
        """Refuse a plan this model cannot take whole (before anything is written)."""
        problems: list[str] = []
        seen: dict[str, int] = {}
        order: dict[str, tuple[int, int]] = {}  # name -> (bucket, position): the order buckets apply in
        indexes = [m.index for m in plan]
        if len(set(indexes)) != len(indexes):
            problems.append(f"bucket indexes repeat: {indexes}")
        for manifest in plan:
            for pos, entry in enumerate(manifest.entries):
                meta = entry.meta
                model_name = self.layout.tied.get(meta.name, meta.name)  # a tied head is checked as the embedding
                shape = self.layout.hf_shapes.get(model_name)
                if shape is None:
                    problems.append(f"unknown tensor {meta.name!r}")
                    continue
                if meta.name in seen:
                    problems.append(f"duplicate tensor {meta.name!r} (buckets {seen[meta.name]} and {manifest.index})")
                seen[meta.name] = manifest.index
                order.setdefault(meta.name, (manifest.index, pos))
                if tuple(meta.shape) != shape:
                    problems.append(f"{meta.name}: shape {list(meta.shape)} != model {list(shape)}")
                want = self.layout.hf_dtypes[model_name]
                if meta.dtype != want:
                    problems.append(f"{meta.name}: dtype {meta.dtype} != model {want}")
        for alias, target in self.layout.tied.items():
            if alias in order and target in order and order[alias] < order[target]:
                problems.append(f"{alias} is tied to {target} (tie_word_embeddings) and must come after it in the plan")
        missing = [n for n in self.layout.hf_shapes if n not in seen]
        if missing:
            problems.append(f"{len(missing)} model tensors missing from the plan, first {missing[0]!r}")
            if "lm_head.weight" in missing and "model.embed_tokens.weight" in seen:
                problems.append(
                    "this engine's head is its own (tie_word_embeddings false) and the trainer sent none: a trainer "
                    "that ties its head sends it once, as model.embed_tokens.weight (TorchSource(send_aliases=True) "
                    "sends both names)"
                )
        if problems:
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            prefix = self._name_prefix(plan)
            if prefix:  # the engine's names behind a wrapper's prefix: the model fits, its names do not
                shown = (
                    f"the trainer's tensor names carry a prefix ({prefix!r}) before the engine's (HF) names: pass "
                    f"TorchSource(model, rename=lambda n: n.removeprefix({prefix!r})), or the wrapped model itself: "
                    f"{shown}"
                )
            elif any(p.startswith("unknown tensor") or "shape" in p or "missing from the plan" in p for p in problems):
                c = self.config  # the trainer's model is not the one this engine was started with: say which it is
                shown = (
                    f"the trainer's model does not fit this engine's ({c.model_type}: {c.num_layers} layers, hidden "
                    f"{c.hidden_size}, vocab {c.vocab_size}); start the engines with the trainer's config, e.g. "
                    f"ReferenceEngine.spawn_many(names, ModelConfig.from_hf(model.config)): {shown}"
                )
            elif any(": dtype " in p for p in problems):  # the right model in another dtype (fp32 master weights)
                shown = (
                    f"the trainer sends another dtype than this engine serves ({self.config.dtype}): cast as it sends "
                    f"with TorchSource(model, dtype=torch.{self.config.dtype}), or start the engines with "
                    f"ModelConfig(..., dtype=...) (ModelConfig.from_hf takes the dtype from the config, not from the "
                    f"model's parameters): {shown}"
                )
            raise EngineError("bad_manifest", shown)

    def _name_prefix(self, plan: Sequence[BucketManifest]) -> str | None:
        """The prefix every sent name has before one of this engine's names (a wrapper module's
        attribute path, e.g. "policy."), where there is one; None otherwise."""
        known = self.layout.hf_shapes
        names = [e.meta.name for m in plan for e in m.entries]
        prefixes = {n[: len(n) - len(k)] for n in names for k in known if n.endswith("." + k) and n != k}
        prefixes = {p for p in prefixes if all(n.startswith(p) and n[len(p) :] in known for n in names)}
        return min(prefixes, key=len) if prefixes else None

    def _begin_adapter(
        self, plan: Sequence[BucketManifest] | None, adapter: dict[str, Any], digest: str | None = None
    ) -> None:
        """A LoRA refit's session: stage the version (`stage_adapter`), then check the plan against
        its spec whole (every tensor of the spec once, its shape and dtype, nothing else) before any
        byte; refused plans discard the staged version. Loads fill it (`digest="wsum"`: hashing
        each tensor as it is copied, so verify reads nothing back); finalize checks it complete and
        waits for its copies; verify hashes it; publish makes it live; discard drops it. The served
        weights never change."""
        if plan is None:
            raise EngineError("bad_request", "a LoRA refit's session needs its plan")
        try:
            name, version = str(adapter["name"]), int(adapter["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError("bad_request", f"adapter {adapter!r}: needs a name and a version") from exc
        self.stage_adapter(name, version, adapter, adapter.get("dtype"), max_live=adapter.get("max_live"))
        staged = self.lora.staged(name)
        assert staged is not None
        key = (staged.spec, staged.dtype)
        checked = self._adapter_plan_checked
        if not (  # this very plan passed for this spec last time (the wire's memo hands back its manifests)
            checked is not None and checked[1] == key and len(checked[0]) == len(plan)
            and all(a is b for a, b in zip(checked[0], plan, strict=True))
        ):  # fmt: skip
            self._check_adapter_plan(plan, staged)
            self._adapter_plan_checked = (tuple(plan), key)
        self.load_host_s = dict.fromkeys(LOAD_HOST_PARTS, 0.0)
        self.session = _Session(plan={m.index: m for m in plan}, staged=True, adapter=name)
        if digest == "wsum" and staged.slab is not None:
            from refit.wsum import Written

            self.session.written = Written(staged.slab.written_regions())
        self._adapter_ready = None
        self._adapter_written = None
        self.sessions += 1
        self.ready_to_publish = False

    def _check_adapter_plan(self, plan: Sequence[BucketManifest], staged: lora.AdapterVersion) -> None:
        """Every tensor of `staged`'s spec once in `plan`, its shape and dtype, nothing else; a
        refused plan discards the staged version (EngineError "bad_manifest" naming what was wrong)."""
        name = staged.name
        problems, seen = [], set()
        for manifest in plan:
            for entry in manifest.entries:
                meta, want = entry.meta, staged.shapes.get(entry.meta.name)
                if want is None:
                    problems.append(f"{meta.name!r} is not a tensor of adapter {name!r} (r={staged.spec.r}, "
                                    f"targets {list(staged.spec.targets)})")  # fmt: skip
                elif meta.name in seen:
                    problems.append(f"duplicate tensor {meta.name!r}")
                elif tuple(meta.shape) != want or meta.dtype != dtype_name(staged.dtype):
                    problems.append(f"{meta.name}: {meta.dtype}{list(meta.shape)} != adapter "
                                    f"{dtype_name(staged.dtype)}{list(want)}")  # fmt: skip
                seen.add(meta.name)
        missing = [n for n in staged.shapes if n not in seen]
        if missing:
            problems.append(f"{len(missing)} tensors of the adapter missing from the plan, first {missing[0]!r}")
        if problems:
            self.lora.discard(name, reason="its plan was refused")
            shown = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
            raise EngineError("bad_manifest", shown)

    def stage(
        self, plan: Sequence[BucketManifest], digest: str | None = None, adapter: dict[str, Any] | None = None
    ) -> None:
        """`begin(plan, digest, staged=True)`: the atomic refit's session into a second copy (or,
        with `adapter`, a LoRA refit's into a new version of that adapter)."""
        self.begin(plan, digest, staged=True, adapter=adapter)

    def probe(
        self, target_version: int, adapter: str | None = None, moves_ack: tuple[str, int] | None = None
    ) -> dict[str, Any]:
        """The engine's own account before a refit: its version, whether it serves, and any update
        session a crashed run left open (voided here: its weights are then unnamed until a refit
        completes). Refuses, changing nothing, when it already holds `target_version` or newer.
        `adapter` (a LoRA refit): the version is that adapter's live one (0: none is loaded), and a
        staged version a crashed run left is discarded. `moves_ack`: (epoch, n), the last adapter
        move the caller recorded (`lora.AdapterTable.ack`)."""
        self.ack_moves(moves_ack)
        if adapter is not None:
            live = self.lora.live(adapter)
            held = 0 if live is None else live.version
            if held >= target_version:
                raise EngineError(
                    "version_ahead", f"adapter {adapter!r} is at version {held}, the refit targets {target_version}",
                    {"version": held},
                )  # fmt: skip
            closed = self.session is not None
            if closed:
                self.session = None
                self.ready_to_publish = False
            dropped = self.discard()["discarded"]
            serving = self.quarantined is None and not self.dirty and adapter not in self.lora.stale
            return {"version": held, "serving": serving, "closed_session": closed,
                    "discarded_staged": dropped, "adapter_moves": self.lora.report()}  # fmt: skip
        if self.version >= target_version:
            raise EngineError(
                "version_ahead",
                f"engine holds version {self.version}, the refit targets {target_version}",
                {"version": self.version},
            )
        closed = self.session is not None
        if closed:
            self.session = None
            self.ready_to_publish = False
        dropped = self.discard()["discarded"]  # a staged copy a crashed run left: the served weights are intact
        return {
            "version": self.version,
            "serving": self.quarantined is None and not self.dirty,
            "closed_session": closed,
            "discarded_staged": dropped,
            **self.staging_memory(),
        }

    def staging_memory(self) -> dict[str, int | None]:
        """What a staged session needs beside the served weights (a copy of them), and the memory
        free where they live now (CUDA: the device's; host: the machine's available pages; less
        where `memory_limit` leaves less), for the check before an atomic refit connects. `pool`
        names that memory: engines on one host (or one device) share it. With TP every rank
        holds a copy of its shard: the need is the head's times the ranks (host memory)."""
        need = sum(t.numel() * t.element_size() for t in self.params.values())
        need += self.head_serving.numel() * self.head_serving.element_size()
        held = need + (need if self._live is not None else 0)  # what the weights take now
        need *= self.comm.size
        if self.device.type == "cuda":
            free: int | None = int(torch.cuda.mem_get_info(self.device)[0])
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            pool = f"{socket.gethostname()}/cuda:{torch.cuda.get_device_properties(index).uuid}"
        else:
            pool = f"{socket.gethostname()}/host"
            try:
                free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            except (ValueError, OSError, AttributeError):
                free = None
        if self.memory_limit is not None:
            left = max(self.memory_limit - held * self.comm.size, 0)
            free = left if free is None else min(free, left)
            pool = f"{pool}/{id(self)}"  # its own budget: not shared with other engines
        return {"staging_bytes": need, "free_bytes": free, "pool": pool}

    def swap(self) -> dict[str, Any]:
        """Serve the staged copy (atomic refits): finalized whole, with generation paused (its
        pause mode decided what the held requests keep: retract recomputes their KV under the new
        weights, in_place keeps it). The old weights are dropped; like a finished load, the weights
        are unpublished until `publish` names them."""
        if self._live is None:
            raise EngineError("no_staged", "swap without a staged copy: begin(plan, staged=True) first")
        if self.session is not None:
            raise EngineError("session_open", "swap while the staged session is open; finalize it first")
        if not self.ready_to_publish:
            raise EngineError("not_ready", "swap of a staged copy that was not finalized whole")
        if not self.paused:
            raise EngineError("not_paused", "swap while generating: pause first (its mode decides the held KV)")
        self._live = None
        self._unstage()
        self.weights_epoch += 1
        self.dirty = True
        return {"swapped": True}

    def _unstage(self) -> None:
        if self._staged_at is not None:
            self.seconds_staged += time.monotonic() - self._staged_at
            self._staged_at = None

    def discard(self) -> dict[str, bool]:
        """Drop the staged copy and its session (a failed atomic refit): generation never stopped
        serving the old weights, which stay served, clean and named as before. A LoRA refit's staged
        adapter version likewise (the live versions serve on)."""
        adapters = [n for n in list(self.lora.versions) if self.lora.discard(n, reason="discarded")]
        if adapters:
            if self.session is not None and self.session.adapter is not None:
                self.session = None
            self._adapter_ready = None
            self.ready_to_publish = False
            return {"discarded": True}
        if self._live is None:
            return {"discarded": False}
        self.params, self.head_serving = self._live
        self._live = None
        self._unstage()
        if self.session is not None and self.session.staged:
            self.session = None
        self.ready_to_publish = False
        self._written = None
        return {"discarded": True}

    def check_load(self, manifest: BucketManifest, *, cast: bool = False) -> None:
        """Refuse (changing nothing) a bucket this session cannot take: no session, not the
        planned manifest, already loaded, out of plan order, or an earlier bucket was refused.
        `cast` (a session with no plan): a tensor sent in another dtype than the model's is
        taken and cast as it is copied (SGLang's loaders: `param.data.copy_`)."""
        session = self.session
        if session is None:
            raise EngineError("no_session", "load outside a weight-update session (begin was not called)")
        if session.broken:
            raise EngineError("session_broken", f"bucket {manifest.index} refused: {session.broken}; begin again")
        if session.plan is None:
            self.check_against_model(manifest, cast=cast)
            return
        planned = session.plan.get(manifest.index)
        if planned is None or planned != manifest:
            self.break_session(f"bucket {manifest.index} does not match the plan")
            raise EngineError("bad_manifest", f"bucket {manifest.index} does not match the plan given to begin()")
        if manifest.index in session.loaded:
            raise EngineError("bad_manifest", f"bucket {manifest.index} was already loaded in this session")
        expected = min(set(session.plan) - session.loaded)
        if manifest.index != expected:
            self.break_session(f"bucket {manifest.index} arrived before bucket {expected}")
            raise EngineError("bad_manifest", f"bucket {manifest.index} arrived before bucket {expected}")

    def check_against_model(self, manifest: BucketManifest, *, cast: bool = False) -> None:
        """Refuse (changing nothing) a bucket naming a tensor the model lacks, or a wrong shape/dtype
        (`cast`: any dtype, cast on its copy)."""
        for entry in manifest.entries:
            meta = entry.meta
            model_name = self.layout.tied.get(meta.name, meta.name)
            shape = self.layout.hf_shapes.get(model_name)
            if shape is None:
                raise EngineError("bad_manifest", f"bucket {manifest.index}: unknown tensor {meta.name!r}")
            want = self.layout.hf_dtypes[model_name]
            if tuple(meta.shape) != shape or (meta.dtype != want and not cast):
                raise EngineError(
                    "bad_manifest",
                    f"{meta.name}: {meta.dtype}{list(meta.shape)} != model {want}{list(shape)}",
                )

    def known_only(self, manifest: BucketManifest, *, drop_tied: bool = False) -> tuple[BucketManifest, list[str]]:
        """The bucket's entries naming tensors this model has, and the names of the others, which a
        loader that skips unknown names drops unread (SGLang 0.5.23: models/qwen2.py and llama.py
        `_legacy_load_weights` log "Parameter ... not found in params_dict", or skip silently a
        layer out of range, and load the rest). `drop_tied`: a tied head's alias is dropped unread
        too, whatever its shape (SGLang's loaders: Qwen2's finds no such parameter, Llama's skips
        it). They are counted in `skipped_tensors` (`info`)."""
        tied = {} if drop_tied else self.layout.tied
        known = [e for e in manifest.entries if tied.get(e.meta.name, e.meta.name) in self.layout.hf_shapes]
        if len(known) == len(manifest.entries):
            return manifest, []
        skipped = [e.meta.name for e in manifest.entries if e not in known]
        self.skipped_tensors += len(skipped)
        self.skipped_recent = (self.skipped_recent + skipped)[-SKIPPED_KEEP:]
        return BucketManifest(manifest.index, tuple(known), manifest.nbytes, manifest.oversized), skipped

    def break_session(self, reason: str) -> None:
        if self.session is not None and self.session.broken is None:
            self.session.broken = reason

    def load(
        self,
        manifest: BucketManifest,
        tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        expected: int | None = None,
        tied_head: str = "check",
        keep: bool = False,
        cast: bool = False,
    ) -> None:
        """Apply one bucket in place (fused layout). Buckets apply in plan order; a refused one
        (validation, before any byte) makes the session refuse the rest, so an in-flight next
        bucket never lands after a gap. With `expected` (a single-rank engine), each piece is
        hashed as it is copied (no second pass over memory); a mismatch is found after the bytes
        landed: the bucket fails as `corrupted`, the session breaks and the engine is poisoned
        (weights no version names) until a refit completes. `tied_head`, what a tied head sent
        does: "check" (it must equal the tensor it is: this engine's own rule), "skip" (dropped
        unread: SGLang's loaders) or "write" (written where the tensor it is lives, in stream
        order, so the later of the two is served: vLLM's loaders inside a weight-update session).
        `keep`: the receiver hands back the same views for this bucket next time (`Receiver.
        stable_views`): its checked copies are kept and rerun for that very list. `cast`: see
        `check_load`."""
        self.check_load(manifest, cast=cast)
        session = self.session
        assert session is not None
        if session.adapter is not None:  # a LoRA refit: into the staged adapter version (checked there first)
            self._start_copies()
            self.lora.load(session.adapter, tensors, session.written, keep=keep)
            session.loaded.add(manifest.index)
            return
        program = self._programs.get(manifest.index)
        if (
            program is not None and program.manifest is manifest and expected is None and self.mangle is None
            and tied_head == "check" and not cast and program.current(self.params) and self.session is not None
            and self.session.written is None
        ):  # fmt: skip
            srcs = program.srcs if program.tensors is tensors else program.sources(tensors)
            if srcs is not None:
                self._run_program(manifest, program, srcs, stable=program.tensors is tensors)
                return
        try:
            self._check_tensors(manifest, tensors)
            if tied_head == "check":  # "skip": a server whose loader drops a tied head unread (SGLang's)
                self._check_ties(tensors)
        except EngineError as exc:
            self.break_session(f"bucket {manifest.index} was refused ({exc.kind})")
            raise
        if tied_head == "write":  # the alias's bytes go where the tensor it is lives, in stream order
            tensors = [(self.layout.tied.get(n, n), t) for n, t in tensors]
        digests: list[int] = []
        kept = self._keep_for_skip(tensors) if self.mangle == "skip" else None
        self._start_copies()
        with torch.no_grad():
            written = self.session is not None and self.session.written is not None
            if self.mangle == "late_copy":  # acked now, copied (from whatever the buffer holds then) at finalize
                assert self.session is not None
                self.session.deferred += [(n, t) for n, t in tensors if n not in self.layout.tied]
                expected = None
            elif expected is None or written:  # a tied head: checked, not written
                if expected is not None:  # the checksum of the bytes as received, then the hashed copy
                    digests = [d for _, t in tensors for d in chunk_digests(t)]
                untied = [(n, t) for n, t in tensors if n not in self.layout.tied]
                pairs = self._write_all(untied, self.session)
                if pairs is not None and tied_head == "check" and expected is None and self.mangle is None and not cast:
                    self._keep_program(manifest, tensors, untied, pairs, stable=keep)
            else:
                run: list[tuple[torch.Tensor, torch.Tensor]] = []  # digests stay in bucket order
                for name, tensor in tensors:
                    if name in self.layout.tied:
                        digests += copy_digests(run) if run else []
                        digests += chunk_digests(tensor)
                        run = []
                    else:
                        run.append((self._target(name), tensor))
                digests += copy_digests(run) if run else []
        assert self.session is not None
        after_copy = ("flip", "swap_tp", "kv_replica") if expected is None or written else MANGLED_AFTER_LOAD
        if self.mangle in after_copy:
            self._mangle_loaded(tensors, kept)
        if not self.session.staged:  # a staged session writes a copy nothing serves yet
            self.weights_epoch += 1
            self.dirty = True
        if expected is not None and combine(digests) != expected:
            self.break_session(f"bucket {manifest.index} failed its checksum")
            raise EngineError(
                "corrupted",
                f"bucket {manifest.index}: checksum mismatch, the bytes changed after the sender hashed them "
                "(in transit, or written during the refit)",
            )
        self.session.loaded.add(manifest.index)

    # ---- silent faults (injected for tests: the engine acks and serves wrong weights) -------------

    def _mangled(self, named: list[tuple[str, torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The bucket's (name, destination, source) copies as a buggy loader makes them: skip
        drops the first; downcast rounds every source through a narrower dtype; swap_qk writes q's
        first rows where k goes and k where those rows go (whichever buckets q and k come in)."""
        kind = self.mangle
        if kind == "skip":
            return [(d, s) for _, d, s in named[1:]]
        if kind == "downcast":
            f8 = torch.float8_e4m3fn
            narrow = {torch.float32: torch.bfloat16, torch.bfloat16: f8, torch.float16: f8}
            return [(d, s.to(narrow[s.dtype]).to(s.dtype) if s.dtype in narrow else s) for _, d, s in named]
        assert kind == "swap_qk"
        kn = self.layout.kv_rows
        out = []
        for name, dst, src in named:
            if name.endswith("self_attn.q_proj.weight"):
                out += [(dst[kn:], src[kn:]), (self._dst_view(name.replace("q_proj", "k_proj")), src[:kn])]
            elif name.endswith("self_attn.k_proj.weight"):
                out.append((self._dst_view(name.replace("k_proj", "q_proj"))[:kn], src))
            else:
                out.append((dst, src))
        return out

    def _keep_for_skip(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> tuple[str, torch.Tensor] | None:
        name = next((n for n, _ in tensors if n not in self.layout.tied), None)
        return None if name is None else (name, self._dst_view(name).clone())

    @torch.no_grad()
    def _mangle_loaded(
        self, tensors: Sequence[tuple[str, torch.Tensor]], kept: tuple[str, torch.Tensor] | None
    ) -> None:
        """What `self.mangle` does to a bucket that landed correctly (see SILENT_FAULTS)."""
        names = [n for n, _ in tensors if n not in self.layout.tied]
        kind = self.mangle
        if kind == "skip" and kept is not None:
            self._dst_view(kept[0]).copy_(kept[1])  # as if never written
        elif kind == "flip" and names:
            block = next((b for b in map(self._dst_view, names) if b.is_contiguous() and b.numel()), None)
            if block is not None:
                raw = block.view(-1).view(torch.uint8)
                raw[0] = raw[0] ^ 1
        elif kind == "downcast":
            for name in names:
                block = self._dst_view(name)
                if block.dtype == torch.float32:
                    block.copy_(block.to(torch.bfloat16))
                elif block.dtype in (torch.bfloat16, torch.float16):
                    block.copy_(block.to(torch.float8_e4m3fn))
        elif kind == "swap_qk":
            for name in names:
                if name.endswith("self_attn.q_proj.weight"):
                    target, _dim, _src, _dst, qn = self.layout.targets[name]
                    kn = self.layout.kv_rows
                    fused = self.params[target]
                    q, k = fused[:kn].clone(), fused[qn : qn + kn].clone()
                    fused[:kn].copy_(k)
                    fused[qn : qn + kn].copy_(q)
        elif kind == "swap_tp" and self.comm.size > 1:
            given = dict(tensors)
            following = WeightLayout(self.config, (self.comm.rank + 1) % self.comm.size, self.comm.size)
            for name in names:
                if name in self.layout.sharded:
                    _target, dim, _src, _dst, n = self.layout.targets[name]
                    other = following.targets[name][2]  # the next rank's shard (a replicated KV head: maybe its own)
                    self._dst_view(name).copy_(given[name].narrow(dim, other, n))
        elif kind == "kv_replica" and self.layout.kv_replicas > 1 and self.config.num_kv_heads > 1:
            given = dict(tensors)
            for name in names:
                if name in self.layout.replicated:
                    _target, dim, src, _dst, n = self.layout.targets[name]
                    other = (src + n) % given[name].shape[dim]  # the next KV head's rows
                    self._dst_view(name).copy_(given[name].narrow(dim, other, n))

    def direct_targets(self, manifest: BucketManifest, names: Collection[str]) -> dict[str, torch.Tensor]:
        """Where a receiver may write this bucket's tensors `names` (those it can, `writes_into`)
        itself (`Receiver.read_into`), with no copy-out: on a single-rank engine, each untied one
        whose place is its whole, contiguous block of a parameter, of the entry's shape and dtype.
        Call after `check_load`. When any is offered the weights are marked dirty first (they are
        written outside `load`: a failed read leaves them no version's)."""
        if not names or self.comm.size != 1 or self.weights_released or self.session is None or self.session.adapter:
            return {}
        wanted = set(names)
        out = {}
        for entry in manifest.entries:
            meta = entry.meta
            place = self.layout.targets.get(meta.name)
            if meta.name not in wanted or place is None or meta.name in self.layout.tied or place[2] != 0:
                continue
            block = self._dst_view(meta.name)
            if block.is_contiguous() and tuple(block.shape) == meta.shape and dtype_name(block.dtype) == meta.dtype:
                out[meta.name] = block
        if out and not self.session.staged:  # (a staged copy is written: nothing served changes)
            self.weights_epoch += 1
            self.dirty = True
        return out

    def _dst_view(self, name: str) -> torch.Tensor:
        """This rank's block of `name` in its parameter, kept while the parameter is the same object."""
        target, dim, _src, dst, n = self.layout.targets[name]
        param = self.params[target]
        kept = self._dst_views.get(name)
        if kept is None or kept[0] is not param:
            kept = self._dst_views[name] = (param, param.narrow(dim, dst, n))
        return kept[1]

    def _keep_program(
        self,
        manifest: BucketManifest,
        tensors: Sequence[tuple[str, torch.Tensor]],
        untied: Sequence[tuple[str, torch.Tensor]],
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        stable: bool,
    ) -> None:
        """Keep a checked bucket's copies: the next load of this manifest skips the per-tensor
        checks and view building and queues one batched copy. `stable`: the receiver hands back
        the same views next time (`IPCReceiver`: views of storages opened once), kept with it;
        else only the destinations and what each source must be are kept (no view of the
        receiver's, whose memory may be a trainer's export: SGLang's receiver)."""
        whole = len(pairs) == len(tensors) and all(s is t for (_, s), (_, t) in zip(pairs, tensors, strict=True))
        if len(untied) != len(tensors) or not (whole or stable):  # a tied head checked, or sources narrowed
            self._programs.pop(manifest.index, None)
            return
        targets = tuple(dict.fromkeys(self.layout.targets[n][0] for n, _ in untied))
        self._programs[manifest.index] = _Program(
            manifest, tuple((t, self.params[t]) for t in targets), [d for d, _ in pairs], [n for n, _ in tensors],
            [(t.shape, t.dtype) for _, t in tensors], whole, tensors if stable else None,
            [s for _, s in pairs] if stable else None,
        )  # fmt: skip

    def _start_copies(self) -> None:
        """Before a load queues its copies (GPU): the session's first one starts the copy-span clock,
        and a load on a stream other than the device's default (a receiver's own) makes finalize
        wait for every stream, not only its own."""
        if self.device.type != "cuda":
            return
        if torch.cuda.current_stream(self.device) != torch.cuda.default_stream(self.device):
            self._side_streams = True
        if self.session is not None and not self.session.loaded:
            self._copy_events = [torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)]
            self._copy_events[0].record()

    def forget_kept(self) -> None:
        """Drop every kept bucket program and every adapter slab's kept copy plans (a receiver whose
        views they read, and hold, is going away)."""
        self._programs = {}
        self.lora.forget_plans()

    def _run_program(
        self, manifest: BucketManifest, program: _Program, srcs: list[torch.Tensor], *, stable: bool
    ) -> None:
        """The kept copies of a bucket whose checks are those of its last load (`stable`: its views
        too; else `srcs` are fresh views found to be what was checked)."""
        assert self.session is not None
        self._start_copies()
        with torch.no_grad():
            torch._foreach_copy_(program.dsts, srcs)
        if stable:
            self.kept_loads += 1
        else:
            self.checked_loads += 1
        if not self.session.staged:
            self.weights_epoch += 1
            self.dirty = True
        self.session.loaded.add(manifest.index)

    def _write_all(
        self, tensors: Sequence[tuple[str, torch.Tensor]], session: _Session | None = None
    ) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Keep this rank's shard of each tensor: one batched copy (`torch._foreach_copy_`) for the
        bucket, queued on the current stream without a host sync when on a GPU; in a session that
        hashes what it writes, one fused copy-and-hash pass instead (`Written.copy`). The
        destination views are kept per tensor while its parameter is the same object (building
        views costs microseconds each on a GPU: a bucket of many small tensors is bound by them)."""
        named = []
        for name, tensor in tensors:
            _target, dim, src, _dst, n = self.layout.targets[name]
            block = self._dst_view(name)
            if tensor is block:  # the receiver wrote it in place (direct_targets)
                self.direct_tensors += 1
                if session is not None and session.written is not None:
                    session.written.touched(block)  # not hashed on its way in: read back at verify
                continue
            named.append((name, block, tensor if src == 0 and n == tensor.shape[dim] else tensor.narrow(dim, src, n)))
        if self.mangle in ("skip", "downcast", "swap_qk"):
            pairs = self._mangled(named)
        else:
            pairs = [(d, s) for _, d, s in named]
        if session is not None and session.written is not None:
            session.written.copy(pairs)
            return None
        if pairs:
            torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])
        direct = len(named) != len(tensors)  # some written in place by the receiver: not a plain copy
        return pairs if self.mangle is None and not direct else None

    def _served_regions(self) -> dict[str, torch.Tensor]:
        """Where each served tensor lives (HF names; the head under its name, as its serving copy)."""
        from refit.verify import SERVED_HEAD

        regions = {name: self._dst_view(name) for name in self.layout.targets if name != SERVED_HEAD}
        regions[SERVED_HEAD] = self.head_serving
        return regions

    def _target(self, hf_name: str) -> torch.Tensor:
        """Where a whole HF tensor lands on a single-rank engine (a contiguous block of rows)."""
        target, dim, src, dst, n = self.layout.targets[hf_name]
        block = self.params[target].narrow(dim, dst, n)
        if self.comm.size != 1 or src != 0 or not block.is_contiguous():
            raise RuntimeError(f"{hf_name} is sharded on this engine: it cannot be copied whole")
        return block

    def _check_tensors(self, manifest: BucketManifest, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        names = [n for n, _ in tensors]
        if names != manifest.names:
            missing = sorted(set(manifest.names) - set(names))
            raise EngineError(
                "bad_manifest",
                f"bucket {manifest.index} is truncated or reordered: missing {missing[:3]}, got {len(names)} "
                f"of {len(manifest.names)} tensors",
            )
        for (name, tensor), entry in zip(tensors, manifest.entries, strict=True):
            if tuple(tensor.shape) != entry.meta.shape or dtype_name(tensor.dtype) != entry.meta.dtype:
                raise EngineError(
                    "bad_manifest",
                    f"{name}: payload {dtype_name(tensor.dtype)}{list(tensor.shape)} != manifest "
                    f"{entry.meta.dtype}{list(entry.meta.shape)}",
                )

    def _check_ties(self, tensors: Sequence[tuple[str, torch.Tensor]]) -> None:
        """A tied head must be bit for bit the tensor it is tied to (this bucket's copy, or the one
        an earlier bucket of this session loaded: `begin` put it first): an engine that ties them
        cannot serve a trainer whose head is its own."""
        if not self.layout.tied:
            return
        given = dict(tensors)
        for name, tensor in tensors:
            target = self.layout.tied.get(name)
            if target is None:
                continue
            ref = given.get(target, self.params[target])
            if not torch.equal(_bits(ref), _bits(tensor)):
                raise EngineError(
                    "bad_payload",
                    f"{name} differs from {target}, which this engine ties to it (tie_word_embeddings): "
                    "the trainer's output head is not tied",
                )

    def finalize(self) -> dict[str, Any]:
        session = self.session
        if session is None:
            raise EngineError("no_session", "finalize without an open weight-update session")
        self.session = None
        if session.adapter is not None:  # a LoRA refit: the staged version checked whole (STAGED)
            missing = sorted(set(session.plan or ()) - session.loaded)
            if missing:
                self.lora.discard(session.adapter, reason="finalized incomplete")
                raise EngineError("incomplete", f"finalize after {len(session.loaded)} buckets; missing {missing}")
            version = self.lora.complete(session.adapter).version
            if self.device.type == "cuda":  # every stream's copies (a receiver's side stream too) land first
                events, self._copy_events = self._copy_events, []
                if events:
                    events[1].record()
                if session.written is not None:
                    session.written.stage()  # verify's digests come back with this sync
                torch.cuda.synchronize(self.device)
                self._side_streams = False
                if events:
                    self.copy_span_s = events[0].elapsed_time(events[1]) / 1e3
            if session.written is not None:
                self._adapter_written = (session.written, session.adapter, version)
            self._adapter_ready = session.adapter
            self.ready_to_publish = True
            return {"post_processed": True, "adapter": session.adapter}
        if not session.loaded:
            return {"post_processed": False}
        missing = sorted(set(session.plan) - session.loaded) if session.plan is not None else []
        if missing:
            raise EngineError(
                "incomplete",
                f"finalize after {len(session.loaded)} of {len(session.plan)} buckets; missing {missing}",
            )
        if session.deferred:  # (late_copy) the copies an engine acked before making
            with torch.no_grad():
                self._write_all(session.deferred, session)
            session.deferred = []
        t0 = time.perf_counter()
        events, self._copy_events = self._copy_events, []
        if self.device.type == "cuda":  # the buckets' queued copies, then the head's, on this stream
            if self._side_streams:  # a receiver copied out on a stream of its own: wait for every stream
                torch.cuda.synchronize(self.device)
                self._side_streams = False
            if events:  # ends once the buckets' copies have landed (the head's come after)
                events[1].record()
        loaded = self._head_weights()
        written = session.written
        if self.mangle == "stale_head":
            pass  # injected: post-processing forgets the serving head
        elif self.head_serving.shape == loaded.shape:  # into the serving copy it already holds: no allocation
            if written is not None:
                written.copy([(self.head_serving, loaded)])
            else:
                self.head_serving.copy_(loaded)
        else:
            self.head_serving = loaded.clone()
            written = None  # a new serving copy: not a region the session hashed
        if self.device.type == "cuda":  # the serving head has landed too: finalize's answer means every byte did
            if written is not None:
                written.stage()  # what verify reports comes back with this sync, not with one of its own
            torch.cuda.current_stream(self.device).synchronize()  # one sync: the buckets' copies and the head's
            if events:
                self.copy_span_s = events[0].elapsed_time(events[1]) / 1e3
        landed = time.perf_counter() - t0
        self.copies_landed_at = time.monotonic()
        self._written = None if written is None else (written, self.weights_epoch)
        self.ready_to_publish = True
        return {"post_processed": True, "copies_landed_s": round(landed, 6)}

    def publish(self, version: int) -> dict[str, Any] | None:
        if self.session is not None:
            raise EngineError("session_open", "publish while a weight-update session is open")
        if not self.ready_to_publish:
            raise EngineError("not_ready", "publish without a complete, finalized update: the weights match no version")
        if self._adapter_ready is not None:  # a LoRA refit: its version goes live (the base weights' label stays)
            staged = self.lora.staged(self._adapter_ready)
            if staged is None or staged.version != version:
                raise EngineError("version", f"publish {version}: the staged adapter version is not that version")
            self.lora.publish(self._adapter_ready)
            self._adapter_ready = None
            self.ready_to_publish = False
            return {"adapter_moves": self.lora.report()}
        if version <= self.version:
            raise EngineError("version", f"version {version} is not newer than the engine's {self.version}")
        self.version = version
        self.dirty = False
        self.ready_to_publish = False
        self.quarantined = None
        self.commits.append((version, self.weights_epoch))
        return None

    def label_version(self, version: int) -> None:
        """Set the version label and nothing else (like SGLang's /update_weight_version): no check
        that the weights are complete. refit never calls it; it exists so tests can show why."""
        self.version = version

    # ---- LoRA adapters (`refit.reference.lora`) ----------------------------------------------

    def ack_moves(self, ack: Sequence[Any] | None) -> None:
        """The caller recorded the adapter moves up to (epoch, n): the rest are reported again."""
        if ack is None:
            return
        try:
            epoch, n = str(ack[0]), int(ack[1])
        except (IndexError, TypeError, ValueError, OverflowError) as exc:
            raise EngineError("bad_request", f"moves_ack {ack!r}: (epoch, move number)") from exc
        self.lora.ack(epoch, n)

    def stage_adapter(
        self, name: str, version: int, spec: Any, dtype: str | None = None, *, max_live: int | None = None
    ) -> dict[str, Any]:
        """Open STAGING for version `version` of adapter `name` (`spec`: a `LoraSpec`, its dict or a
        PEFT config; `dtype`: its tensors', the model's by default). Generation goes on: requests
        pinned to other versions are untouched. `max_live`: at most this many versions of `name`
        serve at once (`max_staleness + 1`); staging one more is refused while the oldest still has
        requests. On TP ranks each keeps its shard (`lora.AdapterTable.slice_of`)."""
        try:
            parsed = spec if isinstance(spec, lora.LoraSpec) else lora.LoraSpec.from_dict(spec)
        except (ValueError, KeyError, TypeError) as exc:
            raise EngineError("bad_request", f"adapter {name!r}: {exc}") from exc
        if max_live is not None and (not isinstance(max_live, int) or max_live < 1):
            raise EngineError("bad_request", f"max_live={max_live!r}: an integer, at least 1 (None: no bound)")
        want = dtype or self.config.dtype
        if want not in ("float32", "bfloat16", "float16"):
            raise EngineError("bad_request", f"adapter {name!r}: dtype {want!r}")
        v = self.lora.stage(name, version, parsed, getattr(torch, want), max_live)
        return {"adapter": name, "version": version, "tensors": len(v.shapes)}

    def load_adapter(self, name: str, tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, int]:
        """Copy a bucket of adapter tensors into the staging version of `name` (checked first)."""
        return {"bytes": self.lora.load(name, tensors)}

    def publish_adapter(self, name: str) -> dict[str, Any]:
        """Check the staged version of `name` whole (STAGED), then make it LIVE: new requests get
        it, the one before is retired and unloaded once its last pinned request finishes."""
        staged = self.lora.staged(name)
        if staged is not None and staged.state == "STAGING":
            self.lora.complete(name)
        v = self.lora.publish(name)
        return {"adapter": name, "version": v.version, "live": [x.version for x in self.lora.servable(name)]}

    def drain(self, hold_s: float = 60.0) -> dict[str, Any]:
        """A LoRA refit, finalized: whether its version may be published within `max_live` now
        (`AdapterTable.drain`; `hold_s`: how long new requests may be held for it at most);
        generation goes on either way."""
        if self._adapter_ready is None:
            raise EngineError("not_ready", "drain without a finalized LoRA refit")
        out = self.lora.drain(self._adapter_ready, hold_s)
        if not out["ready"]:  # when the requests on the going versions will have ended, at the latest
            # (their most tokens left, and one step more, at the averaged step time plus a tenth: the
            # runner asks again then, so an estimate that comes short costs the engine another call)
            going = set(out["going"])
            left = [
                r.max_new_tokens - len(r.output) for r in (*self.running, *self.waiting)
                if r.adapter_name == self._adapter_ready and r.adapter is not None and r.adapter.version in going
            ]  # fmt: skip
            out["eta_s"] = round((max(left, default=0) + 1) * self.step_s * 1.1, 4)
        return {**out, "adapter_moves": self.lora.report()}

    def drained(self) -> bool:
        """Whether a drain would now answer ready, or has nothing to wait for (a parked drain's
        look after a request ended: no state changes)."""
        name = self._adapter_ready
        if name is None or self.lora.staged(name) is None:
            return True
        return not any(g.pinned for g in self.lora.going(name))

    def load_adapter_dir(self, name: str, path: str) -> dict[str, Any]:
        """Load adapter `name` from a PEFT directory (adapter_config.json, adapter_model.safetensors)
        as its only version and serve it (as a server that loads adapters from paths: vLLM's worker
        reads `lora_path`); refused whole, changing nothing, if the config or a tensor does not fit."""
        import json
        from pathlib import Path

        from safetensors.torch import load_file

        root = Path(path)
        try:
            config = json.loads((root / "adapter_config.json").read_text())
            tensors = load_file(str(root / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise EngineError("bad_request", f"adapter {name!r} at {path}: {exc}") from exc
        dtype = next(iter(tensors.values())).dtype if tensors else None
        self.stage_adapter(name, 1, config, dtype_name(dtype) if dtype is not None else None)
        try:
            self.load_adapter(name, list(tensors.items()))
            return self.publish_adapter(name)
        except EngineError:
            self.lora.discard(name, reason="its files were refused")
            raise

    def discard_adapter(self, name: str, reason: str = "discarded") -> dict[str, bool]:
        return {"discarded": self.lora.discard(name, reason=reason)}

    def unload_adapter(self, name: str) -> dict[str, int]:
        """No new request gets adapter `name`; each of its versions is freed once no request is pinned to it."""
        return {"unloaded": self.lora.unload(name)}

    def abort_requests(self) -> int:
        """Finish every running and waiting request as aborted (SGLang's abort_all); returns how many."""
        reqs = [*self.running, *self.waiting]
        for req in reqs:
            self._finish(req, "abort")
        self.running.clear()
        self.waiting.clear()
        return len(reqs)

    def quarantine(self, reason: str, keep_requests: bool = False, adapter: str | None = None) -> None:
        """Out of service until a refit completes: new requests are refused. An open update
        session is voided (not finalized): a later refit begins a fresh one instead of finding it
        "already open". Its requests end ("quarantined"), unless `keep_requests` (a hold: the
        version policy's STALE, clean weights merely behind): then they wait, their KV dropped, and
        go on under the version the refit that reaches it publishes. `adapter` (a LoRA refit's
        version policy): that adapter alone is held, its staged version dropped: new requests naming
        it wait until a refit publishes one, requests already pinned finish under their versions,
        and the engine serves everything else as before."""
        if adapter is not None:
            self.lora.discard(adapter, reason="held")
            self.lora.hold(adapter, reason)
            return
        self.quarantined = reason
        self.discard()
        self.session = None
        self.ready_to_publish = False
        if keep_requests:
            self.pause("retract")
            self.held_in_place = False
            return
        self.paused, self.held_in_place = True, False
        for req in [*self.running, *self.waiting]:
            self._finish(req, "quarantined")
        self.running.clear()
        self.waiting.clear()

    # ---- memory (colocated refits) --------------------------------------------------------

    def release_memory(self, tags: Sequence[str], *, cpu_backup: bool = False) -> None:
        self._check_tags(tags)
        if "weights" in tags and self._live is not None:
            raise EngineError("staged", "release_memory of the weights while a staged copy is held; swap or discard it")
        if any(r.kv is not None for r in self.running):
            raise EngineError("busy", "release_memory while requests hold KV; pause them first")
        if "kv_cache" in tags:
            self.cache.clear()
            self._slots, self._slot_of = None, {}
            self.kv_released = True
        if "weights" in tags and not self.weights_released:
            if self.session is not None:  # what the session hashed as it wrote is gone: read back at verify
                self.session.written = None
            self._backup = {k: v.to("cpu", copy=True) for k, v in self.params.items()} if cpu_backup else None
            self.params = {k: torch.empty(0) for k in self.params}
            self._dst_views, self._programs = {}, {}  # they hold the released parameters
            self._regions = self._written = None  # so do these
            self.head_serving = torch.empty(0)
            self.weights_released = True

    def resume_memory(self, tags: Sequence[str]) -> dict[str, Any]:
        """Give memory back; reports which of `tags` were released before (and are back now)."""
        self._check_tags(tags)
        intact = True
        resumed = [t for t in tags if (self.weights_released if t == "weights" else self.kv_released)]
        if "weights" in tags and self.weights_released:
            if self._backup is not None:
                self.params, self._backup = {k: v.to(self.device) for k, v in self._backup.items()}, None
            else:
                self.params = {name: self._zeros(name) for name in self.layout.engine_shapes}
                intact = False
                self.dirty = True  # zeros are no version's weights until a refit completes
            self.head_serving = self._head()
            self.weights_released = False
            self.weights_epoch += 1
            if intact and not self.dirty:  # the same version's weights, back whole
                self.commits.append((self.version, self.weights_epoch))
        if "kv_cache" in tags:
            self.kv_released = False
        return {"weights_intact": intact, "resumed": resumed}

    @staticmethod
    def _check_tags(tags: Sequence[str]) -> None:
        bad = [t for t in tags if t not in MEMORY_TAGS]
        if bad:
            raise EngineError("bad_request", f"unknown memory tags {bad}; known {list(MEMORY_TAGS)}")

    # ---- generation control -----------------------------------------------------------------

    def pause(self, mode: str) -> dict[str, int]:
        if mode not in PAUSE_MODES:
            raise EngineError("bad_request", f"pause mode {mode!r}; known {list(PAUSE_MODES)}")
        self.paused = True
        self.held_in_place = mode == "in_place"
        if mode == "abort":
            aborted = len(self.running) + len(self.waiting)
            for req in [*self.running, *self.waiting]:
                self._finish(req, "abort")
            self.running.clear()
            self.waiting.clear()
            return {"aborted": aborted}
        if mode == "retract":
            retracted = 0
            for req in reversed(self.running):
                if req.kv is not None:
                    retracted += 1
                req.kv, req.kv_epochs = None, []
                req.num_retractions += 1
                self.waiting.appendleft(req)
            self.running.clear()
            return {"retracted": retracted}
        return {"frozen": len(self.running)}

    def continue_generation(self) -> None:
        if self.quarantined:
            raise EngineError("quarantined", f"engine is quarantined ({self.quarantined}); restart it or refit it")
        self.paused = self.held_in_place = False

    def flush(self, keep_held: bool = True) -> dict[str, int]:
        """Clear the prefix cache. Refused while a running request holds KV, unless every such
        request is held in place and `keep_held` (each keeps its own KV: the run's kv="keep"). An
        emulated server whose flush refuses whenever requests run (SGLang's flush_cache, vLLM's
        reset_prefix_cache) passes keep_held=False."""
        holders = [r.rid for r in self.running if r.kv is not None]
        if holders and keep_held and self.paused and self.held_in_place:  # they keep their own KV
            return {"flushed_tokens": self.cache.clear() + self.lora.flush(), "kept_kv_requests": len(holders)}
        if holders:
            raise EngineError(
                "flush_refused",
                f"{len(holders)} running requests hold KV (rids {holders[:5]}); pause with abort or retract",
            )
        return {"flushed_tokens": self.cache.clear() + self.lora.flush()}

    # ---- requests ---------------------------------------------------------------------------

    def submit(self, prompt: Sequence[int], max_new_tokens: int, adapter: str | None = None) -> int:
        """Queue a request; `adapter`: the name of a loaded LoRA adapter (EngineError if no version
        of it is live): the request is pinned to its live version when admitted, until its last
        token (while a publish waits for the version it pushes out to drain, it waits unpinned)."""
        if self.quarantined:
            raise EngineError("quarantined", f"engine is quarantined ({self.quarantined})")
        c = self.config
        if not prompt or any(not 0 <= t < c.vocab_size for t in prompt):
            raise EngineError("bad_request", f"prompt must be non-empty token ids in [0, {c.vocab_size})")
        if max_new_tokens < 1 or len(prompt) + max_new_tokens > c.max_seq_len:
            raise EngineError("bad_request", f"prompt + max_new_tokens exceeds max_seq_len {c.max_seq_len}")
        if adapter is not None and self.lora.live(adapter) is None:
            raise EngineError("bad_request", f"adapter {adapter!r} is not loaded (loaded: {self.lora.names()})")
        req = Request(next(self._rids), list(prompt), max_new_tokens, adapter_name=adapter)
        self.requests[req.rid] = req
        self.waiting.append(req)
        return req.rid

    def has_work(self) -> bool:
        return (
            not self.paused
            and not self.weights_released
            and not self.kv_released
            and bool(self.running or any(self._admissible(r, decide=False) for r in self.waiting))
        )

    def wake_in(self) -> float | None:
        """When an idle engine must look again without being asked (seconds; None: only when asked):
        while a request waits for a draining hold that will lapse (`AdapterTable.drain`)."""
        if self.has_work() or not self.waiting:
            return None
        return self.lora.next_lapse()

    def _admissible(self, req: Request, *, decide: bool = True) -> bool:
        """Not waiting for a publish: no adapter, pinned already (retracted), or its adapter admits."""
        return req.adapter_name is None or req.adapter is not None or self.lora.admits(req.adapter_name, decide=decide)

    def _admit(self) -> None:
        """Waiting requests into the running set, in order, up to `max_running`; a request naming an
        adapter is pinned to its live version now (one whose adapter is held waits, unpinned; one
        whose adapter was unloaded meanwhile ends, "adapter_unloaded")."""
        held: deque[Request] = deque()
        while self.waiting and len(self.running) < self.max_running:
            req = self.waiting.popleft()
            if not self._admissible(req):
                held.append(req)
                continue
            if req.adapter_name is not None and req.adapter is None:
                if self.lora.live(req.adapter_name) is None:
                    self._finish(req, "adapter_unloaded")
                    continue
                req.adapter = self.lora.pin(req.adapter_name)
            self.running.append(req)
        self.waiting.extendleft(reversed(held))

    def step(self, go: bool | None = None) -> None:
        """Admit waiting requests, then advance every running request by one token (its time kept
        as a moving average, `step_s`: how long a drain still has to wait, `drain`). `go`: whether
        there is work, as the TP head found it (its followers step on its answer: their own clocks
        may differ on whether a draining hold lapsed); None: this engine looks itself."""
        if not (self.has_work() if go is None else go):
            return
        t0 = time.perf_counter()
        try:
            self._step()
        finally:
            took = time.perf_counter() - t0
            self.step_s = took if self.step_s == 0.0 else 0.9 * self.step_s + 0.1 * took

    def _step(self) -> None:
        self._admit()
        if not self.batch_decode:
            for req in list(self.running):
                self._advance(req)
            return
        running = {r.rid for r in self.running}
        self._slot_of = {rid: s for rid, s in self._slot_of.items() if rid in running}  # who left gave theirs back
        decoding = [r for r in self.running if r.kv is not None]  # each holds a slot
        for req in [r for r in self.running if r not in decoding]:
            self._advance(req)  # prefill (one request per forward), then into its slot
        if decoding:
            self._decode_batch(decoding)

    def pop_finished(self) -> list[int]:
        done, self._finished = self._finished, []
        return done

    def result(self, rid: int) -> dict[str, Any]:
        return self.requests[rid].to_dict()

    def _finish(self, req: Request, reason: str) -> None:
        req.finish_reason = reason
        if req.adapter is not None:
            self.lora.unpin(req.adapter)
        req.kv, req.kv_epochs = None, []
        self._slot_of.pop(req.rid, None)  # (requests leaving otherwise give theirs back at the next step)
        self._finished.append(req.rid)

    @torch.no_grad()
    def _advance(self, req: Request) -> None:
        tokens = req.prompt + req.output
        cache = self.cache if req.adapter is None else self._adapter_cache(req.adapter)
        if req.kv is None:  # prefill (first time, or after a retraction)
            nodes = cache.match(tokens, len(tokens) - 1)
            past = self._stack(nodes) if nodes else None
            epochs = [n.epoch for n in nodes]
            req.cached_tokens += len(nodes)
            req.stale_kv_tokens += sum(e != self.weights_epoch for e in epochs)
            logits, kv = self._forward(tokens[len(nodes) :], past, len(nodes), req.adapter)
            req.kv_epochs = epochs + [self.weights_epoch] * (len(tokens) - len(nodes))
            cache.insert(req.prompt, kv, req.kv_epochs)
            req.kv = self._into_slot(req, kv) if self.batch_decode else kv
        else:  # decode the last token against the request's own KV
            req.stale_kv_tokens += len(req.kv_epochs) - req.kv_epochs.count(self.weights_epoch)
            logits, req.kv = self._forward(tokens[-1:], req.kv, len(tokens) - 1, req.adapter)
            req.kv_epochs.append(self.weights_epoch)
        last = logits[-1].float()
        token = int(torch.argmax(last))
        self._emit(req, token, float(torch.log_softmax(last, dim=-1)[token]))

    def _emit(self, req: Request, token: int, logprob: float) -> None:
        req.output.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version)
        req.epochs.append(self.weights_epoch)
        req.seqs.append(self.tokens_sampled)
        self.tokens_sampled += 1
        if self._live is not None:
            self.tokens_while_staged += 1  # generated with the served weights while a staged copy is written
        if len(req.output) >= req.max_new_tokens:
            self.running.remove(req)
            self._finish(req, "length")

    def _into_slot(
        self, req: Request, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Batched decoding: copy a prefilled request's KV into its slot (a free one the first
        time), the rest of the slot zeroed: a masked position's weight is 0, and 0 times a NaN (a
        request before, under weights that made one) would not be. From now on the request's KV is that slot; the views
        returned (`req.kv`) mark that it holds KV, and the batched steps write past their end."""
        if self._slots is None:
            c, d = self.config, self.config.head_dim
            assert d is not None
            shape = (self.max_running, self.layout.kv_rows // d, c.max_seq_len, d)
            dtype = getattr(torch, c.dtype)  # what the forward computes K and V in
            self._slots = tuple(  # type: ignore[assignment]
                [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(c.num_layers)] for _ in range(2)
            )
        assert self._slots is not None
        slot = self._slot_of.get(req.rid)
        if slot is None:
            slot = min(set(range(self.max_running)) - set(self._slot_of.values()))
            self._slot_of[req.rid] = slot
        n = kv[0][0].shape[2]
        for layer, (k, v) in enumerate(kv):
            for cache, new in ((self._slots[0][layer], k[0]), (self._slots[1][layer], v[0])):
                cache[slot, :, :n] = new
                cache[slot, :, n:] = 0  # what a request before left here (it may be NaN) is masked, not read
        return [(k_[slot : slot + 1, :, :n], v_[slot : slot + 1, :, :n]) for k_, v_ in zip(*self._slots, strict=True)]

    @torch.no_grad()
    def _decode_batch(self, reqs: list[Request]) -> None:
        """One token for each of `reqs` (each holds KV in its slot) in one forward."""
        reqs = sorted(reqs, key=lambda r: self._slot_of[r.rid])
        for req in reqs:
            req.stale_kv_tokens += len(req.kv_epochs) - req.kv_epochs.count(self.weights_epoch)
        last = (r.output[-1] if r.output else r.prompt[-1] for r in reqs)
        positions = [len(r.prompt) + len(r.output) - 1 for r in reqs]
        slots = [self._slot_of[r.rid] for r in reqs]
        logits = self._forward_slots(list(last), slots, positions, [r.adapter for r in reqs]).float()
        tokens = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
        for req, token, logprob in zip(reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            req.kv_epochs.append(self.weights_epoch)
            self._emit(req, token, logprob)

    @staticmethod
    def _stack(nodes: list[_Node]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        kv = torch.stack([n.kv for n in nodes], dim=3)  # [L, 2, KV, T, D]
        return [(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])]

    # ---- forward ----------------------------------------------------------------------------

    @torch.no_grad()
    def score(self, tokens: Sequence[int], adapter: str | None = None) -> torch.Tensor:
        """Logits [T, V] for every position, computed fresh (the cache is neither read nor written),
        under the live version of LoRA adapter `adapter` where one is named."""
        self._require_weights()
        version = None
        if adapter is not None:
            version = self.lora.live(adapter)
            if version is None:
                raise EngineError("bad_request", f"adapter {adapter!r} is not loaded (loaded: {self.lora.names()})")
        return self._forward(list(tokens), None, 0, version)[0]

    def _adapter_cache(self, version: lora.AdapterVersion) -> PrefixCache:
        if version.cache is None:
            version.cache = PrefixCache()
        cache: PrefixCache = version.cache
        return cache

    def _forward(
        self,
        tokens: list[int],
        past: list[tuple[torch.Tensor, torch.Tensor]] | None,
        start: int,
        adapter: lora.AdapterVersion | None = None,
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        c, comm = self.config, self.comm
        ad = [adapter]
        p, head = self._live if self._live is not None else (self.params, self.head_serving)  # what is served
        assert c.head_dim is not None
        heads, kv_heads = c.num_heads // comm.size, self.layout.kv_rows // c.head_dim  # this rank's heads
        qd, kvd, t = heads * c.head_dim, kv_heads * c.head_dim, len(tokens)
        pos = torch.arange(start, start + t, device=self.device)
        x = F.embedding(torch.tensor([tokens], device=self.device), p["model.embed_tokens.weight"])
        new_kv = []
        for i in range(c.num_layers):
            pre = f"model.layers.{i}."
            n = rms_norm(x, p[pre + "input_layernorm.weight"], c.rms_norm_eps)
            qkv = F.linear(n, p[pre + "self_attn.qkv_proj.weight"], p.get(pre + "self_attn.qkv_proj.bias"))
            qkv = lora.apply(qkv, n, i, (("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)), ad)
            q = qkv[..., :qd].contiguous().view(1, t, heads, c.head_dim).transpose(1, 2)
            k = qkv[..., qd : qd + kvd].contiguous().view(1, t, kv_heads, c.head_dim).transpose(1, 2)
            v = qkv[..., qd + kvd :].contiguous().view(1, t, kv_heads, c.head_dim).transpose(1, 2)
            q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
            if past is not None:
                k = torch.cat([past[i][0], k], dim=2)
                v = torch.cat([past[i][1], v], dim=2)
            new_kv.append((k, v))
            out = attention(q, k, v, start).transpose(1, 2).reshape(1, t, qd)
            x = self._rest_of_layer(x, out, p, i, ad)
        logits = F.linear(rms_norm(x, p["model.norm.weight"], c.rms_norm_eps), head)
        return comm.all_gather_cat(logits[0], dim=-1), new_kv

    def _forward_slots(
        self,
        tokens: list[int],
        slots: list[int],
        positions: list[int],
        ad: Sequence[lora.AdapterVersion | None] | None = None,
    ) -> torch.Tensor:
        """Logits [B, V] for one token per row (`tokens[b]` at `positions[b]`), attending to the
        KV in `slots[b]` (this token's K and V are written there first); row b under LoRA adapter
        version `ad[b]` where one is given."""
        ad = ad or [None] * len(tokens)
        c, comm = self.config, self.comm
        p, head = self._live if self._live is not None else (self.params, self.head_serving)
        assert c.head_dim is not None and self._slots is not None
        d, heads, kv_heads = c.head_dim, c.num_heads // comm.size, self.layout.kv_rows // c.head_dim
        qd, kvd, b, t = heads * d, kv_heads * d, len(tokens), max(positions) + 1
        pos = torch.tensor(positions, device=self.device)
        rows = torch.tensor(slots, device=self.device)
        contiguous = slots == list(range(slots[0], slots[0] + b))  # a slice, not a gather, of the cache
        masked = torch.arange(t, device=self.device)[None, :] > pos[:, None]  # [B, T]: past each row's end
        x = F.embedding(torch.tensor(tokens, device=self.device)[:, None], p["model.embed_tokens.weight"])
        for i in range(c.num_layers):
            pre = f"model.layers.{i}."
            n = rms_norm(x, p[pre + "input_layernorm.weight"], c.rms_norm_eps)
            qkv = F.linear(n, p[pre + "self_attn.qkv_proj.weight"], p.get(pre + "self_attn.qkv_proj.bias"))
            qkv = lora.apply(qkv, n, i, (("q_proj", qd), ("k_proj", kvd), ("v_proj", kvd)), ad)
            q = qkv[..., :qd].reshape(b, 1, heads, d).transpose(1, 2)
            k = qkv[..., qd : qd + kvd].reshape(b, 1, kv_heads, d).transpose(1, 2)
            v = qkv[..., qd + kvd :].reshape(b, 1, kv_heads, d).transpose(1, 2)
            q, k = rope(q, pos[:, None], c.rope_theta), rope(k, pos[:, None], c.rope_theta)
            keys, values = self._slots[0][i], self._slots[1][i]
            keys[rows, :, pos] = k[:, :, 0]
            values[rows, :, pos] = v[:, :, 0]
            if contiguous:
                keys, values = keys[slots[0] : slots[0] + b, :, :t], values[slots[0] : slots[0] + b, :, :t]
            else:
                keys, values = keys[rows, :, :t], values[rows, :, :t]
            out = grouped_attention(q, keys, values, masked).transpose(1, 2).reshape(b, 1, qd)
            x = self._rest_of_layer(x, out, p, i, ad)
        logits = F.linear(rms_norm(x, p["model.norm.weight"], c.rms_norm_eps), head)
        return comm.all_gather_cat(logits[:, 0], dim=-1)

    def _rest_of_layer(
        self,
        x: torch.Tensor,
        out: torch.Tensor,
        p: dict[str, torch.Tensor],
        i: int,
        ad: Sequence[lora.AdapterVersion | None],
    ) -> torch.Tensor:
        """Layer `i` after attention (`out`): o_proj and the residual, then the MLP and its residual,
        each projection with its row's LoRA update (`ad`) where one is given."""
        c, pre = self.config, f"model.layers.{i}."
        reduce = self.comm.all_reduce if self.comm.size > 1 else None  # a row-parallel update's A @ x
        o = self._row_parallel(out, p[pre + "self_attn.o_proj.weight"], p.get(pre + "self_attn.o_proj.bias"))
        x = x + lora.apply(o, out, i, (("o_proj", o.shape[-1]),), ad, reduce)
        n = rms_norm(x, p[pre + "post_attention_layernorm.weight"], c.rms_norm_eps)
        gate_up = F.linear(n, p[pre + "mlp.gate_up_proj.weight"])
        half = gate_up.shape[-1] // 2
        gate, up = lora.apply(gate_up, n, i, (("gate_proj", half), ("up_proj", half)), ad).chunk(2, dim=-1)
        h = F.silu(gate) * up
        down = self._row_parallel(h, p[pre + "mlp.down_proj.weight"], None)
        return x + lora.apply(down, h, i, (("down_proj", c.hidden_size),), ad, reduce)

    def _row_parallel(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """`x @ weight.T + bias` for a row-parallel projection (o_proj, down_proj). One rank: one
        F.linear, as HF's nn.Linear. TP ranks: each rank's partial product in float32, summed across
        ranks with the (replicated) bias, rounded to the model's dtype once, as one matmul would
        be (bf16 partials rounded before the sum land units in the last place away from HF's)."""
        if self.comm.size == 1:
            return F.linear(x, weight, bias)
        out = self.comm.all_reduce(F.linear(x.float(), weight.float()))
        return (out if bias is None else out + bias.float()).to(x.dtype)

    def verify(self, kind: str | None = "xxh3", probe: Sequence[Any] | None = None) -> dict[str, Any]:
        """VERIFYING: the digest (`refit.verify`) of each HF tensor as this engine will serve it,
        unfused from its stored layout (all TP ranks' shards) and, under the head's name, of the
        head it serves (its serving copy, rebuilt by finalize); kind None: no digests. `probe`
        ([prompt, token ids] pairs): per prompt, the next-token log-probabilities at those ids from
        a fresh forward (the cache is neither read nor written; works while paused). Refused while
        an update session is open or the weights are released."""
        if self.session is not None:
            raise EngineError("session_open", "verify while a weight-update session is open: finalize first")
        self._require_weights()
        t0 = time.perf_counter()
        out: dict[str, Any] = {"kind": kind}
        if self._adapter_ready is not None:  # a LoRA refit: the staged version's tensors, as it will serve them
            if probe is not None:
                raise EngineError("unsupported", "the logprob probe of a staged adapter version is not served")
            if kind is not None:
                out["digests"], out["read_back"] = self._adapter_digests(kind, self._adapter_ready)
            out["seconds"] = round(time.perf_counter() - t0, 6)
            return out
        if kind is not None:
            out["digests"], out["read_back"] = self._digests(kind)
        if probe is not None:
            answers = []
            live, self._live = self._live, None  # a staged copy is what the probe checks: it will serve it
            try:
                for prompt, ids in probe:
                    row = torch.log_softmax(self.score(prompt)[-1].float(), dim=-1)
                    answers.append(row[torch.tensor(list(ids), dtype=torch.long, device=row.device)].tolist())
            finally:
                self._live = live
            out["logprobs"] = answers
        out["seconds"] = round(time.perf_counter() - t0, 6)
        return out

    def _adapter_digests(self, kind: str, name: str) -> tuple[dict[str, str], int]:
        from refit.verify import Digests

        staged = self.lora.staged(name)
        assert staged is not None
        assert staged.slab is not None
        kept, self._adapter_written = self._adapter_written, None
        if kind == "wsum" and kept is not None and kept[1:] == (name, staged.version):
            hashed, missed = kept[0].report()  # hashed as the loads copied them: read back only the rest
            batch = Digests(kind)
            for tname in missed:
                batch.add(tname, staged.slab.views[tname])
            return {**hashed, **batch.results()}, len(missed)
        views: dict[str, torch.Tensor] = staged.slab.views
        differ: list[str] = []
        if self.comm.size > 1:  # every rank's shards, unsharded into the HF tensors (one rank per KV head)
            ranks = self.comm.gather_objects({n: t.clone() for n, t in views.items() if self.lora.slice_of(n)})
            rep, full = self.layout.kv_replicas, {}
            for tname, t in views.items():
                part = self.lora.slice_of(tname)
                if part is None:
                    full[tname] = t
                    continue
                kv = lora.parse_name(tname)[1] in ("k_proj", "v_proj")
                holders = ranks[rep - 1 :: rep] if rep > 1 and kv else ranks
                full[tname] = torch.cat([r[tname] for r in holders], dim=part[0])
                if (
                    rep > 1
                    and kv
                    and any(not torch.equal(r[tname], ranks[i - i % rep + rep - 1][tname]) for i, r in enumerate(ranks))
                ):
                    differ.append(tname)  # the ranks sharing a KV head hold different rows: none is served whole
            views = full
        batch = Digests(kind)
        for tname, t in views.items():
            batch.add(tname, t)
        out = batch.results()
        out.update(dict.fromkeys(differ, REPLICAS_DIFFER))  # (as `_digests` reports the weights')
        return out, len(views)

    def _digests(self, kind: str) -> tuple[dict[str, str], int]:
        """Each served tensor's digest, and how many were read back from memory (the rest were
        hashed as this session wrote them)."""
        from refit.verify import SERVED_HEAD, Digests

        kept = self._written
        if kind == "wsum" and kept is not None and kept[1] == self.weights_epoch:
            # hashed as they were written (nothing wrote the weights since): read back only the rest
            hashed, missed = kept[0].report()
            if not missed:
                return hashed, 0
            regions = self._served_regions()
            batch = Digests(kind)
            for name in missed:
                batch.add(name, regions[name])
            return {**hashed, **batch.results()}, len(missed)
        if self.comm.size > 1:
            state = self.hf_state_dict()
        else:  # views into the parameters: nothing copied but what a digest reads
            state = {
                name: self.params[t].narrow(dim, dst, n) for name, (t, dim, _s, dst, n) in self.layout.targets.items()
            }
        state[SERVED_HEAD] = self.comm.all_gather_cat(self.head_serving, dim=0)
        batch = Digests(kind)  # on a GPU: queued, read back with one sync
        for name, t in state.items():
            batch.add(name, t)
        out = batch.results()
        out.update({name: REPLICAS_DIFFER for name in self.replicas_differ})  # no one tensor is served
        return out, len(state)

    def digests(self) -> dict[str, int]:
        """Each HF tensor's xxHash3 digest of its bytes as this engine holds them, unfused (a
        bit-exact check of a large state without shipping it: the trainer hashes its own)."""
        from refit.buckets import tensor_digest

        if self.comm.size > 1:
            out = {name: tensor_digest(t) for name, t in self.hf_state_dict().items()}
            return out | {name: -1 for name in self.replicas_differ}  # no digest of xxHash3's is -1
        self._require_weights()
        return {
            name: tensor_digest(self.params[target].narrow(dim, dst, n))
            for name, (target, dim, _src, dst, n) in self.layout.targets.items()
        }

    def info(self) -> dict[str, Any]:
        cuda = self.device.type == "cuda"
        return {
            "version": self.version,
            "dirty": self.dirty,
            "paused": self.paused,
            "quarantined": self.quarantined,
            "session_open": self.session is not None,
            "weights_epoch": self.weights_epoch,
            "staged": self._live is not None,  # a staged copy of the weights is held (atomic refit)
            "commits": [list(c) for c in self.commits],
            "tokens_sampled": self.tokens_sampled,
            "tokens_while_staged": self.tokens_while_staged,
            "seconds_staged": round(self.seconds_staged, 6),
            "weights_released": self.weights_released,
            "kv_released": self.kv_released,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "cached_tokens": self.cache.size,
            "tp": self.comm.size,
            "heads": [self.config.num_heads, self.config.num_kv_heads],  # attention heads, KV heads
            "intermediate_size": self.config.intermediate_size,
            "vocab_size": self.config.vocab_size,
            "device": str(self.device),
            "copies_landed_at": self.copies_landed_at,
            "copy_span_s": self.copy_span_s,
            "direct_tensors": self.direct_tensors,
            "kept_loads": self.kept_loads,
            "checked_loads": self.checked_loads,
            "load_host_s": {k: round(v, 6) for k, v in self.load_host_s.items()},
            "skipped_tensors": self.skipped_tensors,
            "skipped_recent": list(self.skipped_recent),
            "adapters": self.lora.info(),
            "adapters_held": self.lora.holds(),
            "gpu_allocated_bytes": torch.cuda.memory_allocated(self.device) if cuda else None,
            "gpu_peak_bytes": torch.cuda.max_memory_allocated(self.device) if cuda else None,
        }


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor (bitwise comparison: -0.0 is not 0.0, a NaN equals itself)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)
