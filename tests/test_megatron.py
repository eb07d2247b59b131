"""The Megatron source: megatron-bridge's HF export of a Megatron-Core model, refit into the
reference engine.

End to end (real megatron-core and megatron-bridge on the CPU, see tests/megatron_support.py): a
tiny HF Llama is converted to a Megatron GPT model sharded over two tensor-parallel trainer
processes (gloo); each refit follows one optimizer step; rank 0 leads, both ranks drain the
bridge's export in step, and the engine (itself TP=2) must then hold the bridge's export bit for
bit and give the Megatron model's logits and greedy tokens.

Unit tests: the source's handling of what an export may do wrong, against a stand-in bridge (the
export is a plain iterator here; nothing of Megatron runs).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from refit.buckets import plan_buckets
from refit.drivers.flattened import plan_flattened
from refit.drivers.megatron import MegatronSource

ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, hf_dir: Path, spec: dict[str, Any], tmp: Path) -> list[dict[str, Any]]:
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1"}
    outs = [tmp / f"rank{r}.json" for r in range(world)]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.megatron_job",
                str(r),
                str(world),
                str(hf_dir),
                json.dumps(spec),
                str(outs[r]),
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    errs = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        errs.append(err)
    for r, p in enumerate(procs):
        assert p.returncode == 0 and outs[r].exists(), f"rank {r} exited {p.returncode}:\n{errs[r][-3000:]}"
    return [json.loads(o.read_text()) for o in outs]


@pytest.mark.e2e
def test_megatron_tp2_trainer_refits_into_reference_engine(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    reports = _launch(2, tmp_path / "hf", {"engine_tp": 2, "refits": 2, "bucket_bytes": 16 << 10}, tmp_path)
    lead, follower = reports
    assert lead["local_params"] == follower["local_params"] < 90432, "the model is not TP-sharded"
    assert [e["ok"] for e in follower["refits"]] == [True, True]
    for version, entry in enumerate(lead["refits"], start=1):
        assert entry["ok"], entry["error"]
        assert entry["version"] == version
        assert entry["engines"]["megatron-engine"] == {"status": "updated", "version": version, "attempts": 1}
        assert entry["tensors"] == 21 and entry["buckets"] > 10  # HF names after conversion, many buckets
        assert entry["weights_equal"], "the engine does not hold the bridge's export bit for bit"
        tolerance = 1e-5 * max(1.0, entry["logit_scale"])
        assert entry["logit_diff"] <= tolerance, entry
        assert entry["before_diff"] > 100 * tolerance, "the training step did not change what the engine serves"
        assert entry["greedy_equal"]
        # both ranks ran every trainer-side step (the leader's record of each rank's steps)
        assert len(entry["rank_steps"]) == 2 and entry["rank_steps"][0] == entry["rank_steps"][1]
    assert lead["refits"][1]["round_trips"] < lead["refits"][0]["round_trips"]  # the connection was reused


# ---- the source's contract, against a stand-in export ---------------------------------------------


class _Bridge:
    """A stand-in for AutoBridge: `export_hf_weights` yields `items()` anew on every call."""

    def __init__(self, items: Any) -> None:
        self.items = items
        self.exports = 0

    def get_conversion_tasks(self, model: Any) -> list[str]:
        return ["tasks"]

    def export_hf_weights(self, model: Any, cpu: bool, show_progress: bool, conversion_tasks: Any) -> Any:
        assert conversion_tasks == ["tasks"] and show_progress is False
        self.exports += 1
        yield from self.items()


def _tensors() -> list[tuple[str, torch.Tensor]]:
    return [
        ("a.weight", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        ("b.bias", torch.arange(3, dtype=torch.bfloat16)),
        ("c.weight", torch.ones(2, 2, dtype=torch.float16)),
        ("d.weight", torch.full((5,), 7.0)),
    ]


def _drain(source: MegatronSource, plan: Any) -> list[list[tuple[str, torch.Tensor]]]:
    return [list(bucket) for bucket in source.iter_buckets(plan)]


def test_megatron_source_learns_metas_once_and_yields_in_plan_order() -> None:
    bridge = _Bridge(_tensors)
    source = MegatronSource(bridge, object(), cpu=True, rename=lambda n: None if n == "d.weight" else f"model.{n}")
    metas = source.metas()
    assert [m.name for m in metas] == ["model.a.weight", "model.b.bias", "model.c.weight"]
    assert source.metas() == metas and bridge.exports == 1  # learnt once
    # a wire format that orders each bucket's tensors by element size (fp32 before 16-bit)
    plan = plan_flattened(metas, 1 << 20)
    order = [e.meta.name for m in plan for e in m.entries]
    got = _drain(source, plan)
    assert [n for bucket in got for n, _ in bucket] == order
    expected = {f"model.{n}": t for n, t in _tensors()}
    assert all(torch.equal(t, expected[n]) for bucket in got for n, t in bucket)
    assert _drain(source, plan_buckets(metas, 16)) and bridge.exports == 3  # every pass is a fresh export


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (lambda: [(n, t.double() if n == "c.weight" else t) for n, t in _tensors()], "c.weight exported as float64"),
        (lambda: [(n, t[:1] if n == "a.weight" else t) for n, t in _tensors()], "a.weight exported as float32[1, 4]"),
        (lambda: _tensors()[:2], "the export ended without 'c.weight'"),
        (lambda: [*_tensors()[:2], ("x.weight", torch.zeros(1)), *_tensors()[2:]], "'x.weight', which this refit"),
        (lambda: [*_tensors()[:1], *_tensors()], "yields 'a.weight' twice"),
        (lambda: [*_tensors(), ("x.weight", torch.zeros(1))], "'x.weight' after the planned tensors"),
        (lambda: [*_tensors(), _tensors()[1]], "yields 'b.bias' twice"),
    ],
    ids=["dtype", "shape", "missing", "unplanned", "twice", "trailing-unplanned", "trailing-twice"],
)
def test_megatron_source_names_what_the_export_got_wrong(items: Any, message: str) -> None:
    bridge = _Bridge(_tensors)
    source = MegatronSource(bridge, object())
    metas = source.metas()  # learnt on an earlier run; this run's export misbehaves
    bridge.items = items
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        _drain(source, plan_buckets(metas, 1 << 20))


def test_megatron_source_refuses_an_export_with_a_name_twice_or_nothing() -> None:
    with pytest.raises(ValueError, match=r"'a\.weight' twice"):
        MegatronSource(_Bridge(lambda: [*_tensors(), _tensors()[0]]), object()).metas()
    with pytest.raises(ValueError, match="exported no tensors"):
        MegatronSource(_Bridge(lambda: []), object()).metas()


def test_megatron_source_copies_what_it_holds_for_a_later_bucket() -> None:
    """A bridge may hand out one buffer per shape and overwrite it for the next tensor: what the
    source holds for a later bucket (the export came early) must be its own copy."""
    shared = torch.zeros(4)

    def reusing() -> Any:
        for value in (1.0, 2.0, 3.0):
            shared.fill_(value)
            yield f"w{int(value)}", shared

    source = MegatronSource(_Bridge(reusing), object())
    metas = source.metas()
    plan = plan_buckets(list(reversed(metas)), 1 << 20)  # w3 first: w1 and w2 are held until their turn
    got = {n: t.clone() for bucket in source.iter_buckets(plan) for n, t in bucket}
    assert {n: float(t[0]) for n, t in got.items()} == {"w1": 1.0, "w2": 2.0, "w3": 3.0}
