"""Packaging promises: a light `import refit`, the console script, traces as structlog JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from refit.buckets import TensorMeta, pack_into, plan_buckets, unpack
from refit.cli import main
from refit.drivers.torch_source import TorchSource
from refit.reference.model import TinyLlama
from refit.trace import SCHEMA, TraceRecorder, load_trace

from .conftest import CONFIG


def test_import_refit_stays_light() -> None:
    code = (
        "import sys, refit, refit.protocol, refit.states, refit.invariants, refit.drivers, refit.trace\n"
        "heavy = [m for m in ('torch', 'ray', 'sglang', 'megatron', 'vllm') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_console_script_help() -> None:
    out = subprocess.run([sys.executable, "-m", "refit.cli", "--help"], capture_output=True, text=True, check=True)
    for command in ("demo", "check", "diagram"):
        assert command in out.stdout


def test_check_reports_an_unreadable_trace(tmp_path: Path, capsys) -> None:
    assert main(["check", str(tmp_path / "missing.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_trace_lines_are_json_with_a_header(tmp_path: Path) -> None:
    rec = TraceRecorder(tmp_path / "t.jsonl", config={"mode": "colocated"})
    rec.emit("call", "pause", run="r1", state="PAUSING", engine="e0", outcome="ok", duration_s=0.001, error=None)
    rec.close()
    rec.close()  # idempotent
    lines = (tmp_path / "t.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    assert header["kind"] == "header" and header["schema"] == SCHEMA and header["config"] == {"mode": "colocated"}
    assert "torch" in header["versions"] and "structlog" in header["versions"]
    event = json.loads(lines[1])
    assert list(event)[:6] == ["seq", "t", "run", "state", "kind", "event"]
    assert event["engine"] == "e0" and "error" not in event  # None fields are left out
    assert json.loads(lines[2]) | {"t": 0} == {"seq": 1, "t": 0, "kind": "trace", "event": "end"}
    h, events, torn = load_trace(tmp_path / "t.jsonl")
    assert h == header and len(events) == 2 and not torn


def test_torch_source_renames_casts_and_buckets() -> None:
    model = TinyLlama(CONFIG, seed=0)
    src = TorchSource(
        model, rename=lambda n: None if n == "lm_head.weight" else n.replace("model.", "m."), dtype=torch.bfloat16
    )
    metas = src.metas()
    assert "lm_head.weight" not in {m.name for m in metas} and metas[0].name == "m.embed_tokens.weight"
    assert {m.dtype for m in metas} == {"bfloat16"}
    plan = plan_buckets(metas, 32 << 10)
    got = {}
    for manifest, bucket in zip(plan, src.iter_buckets(plan), strict=True):
        buf = torch.empty(manifest.nbytes, dtype=torch.uint8)
        pack_into(buf, manifest, bucket)
        got.update((n, t.clone()) for n, t in unpack(buf, manifest))
    sd = model.state_dict()
    assert torch.equal(got["m.norm.weight"], sd["model.norm.weight"].to(torch.bfloat16))
    assert len(got) == len(sd) - 1


def test_torch_source_offload_drops_grads() -> None:
    model = TinyLlama(CONFIG, seed=0)
    model(torch.tensor([[1, 2, 3]])).sum().backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    src = TorchSource(model, optimizer=opt)
    src.offload()
    assert all(p.grad is None for p in model.parameters())
    src.restore()  # CPU optimizer state has nowhere to move; restore is a no-op that must not fail
    assert all(s["exp_avg"].device.type == "cpu" for s in opt.state.values())


def test_dtensors_are_gathered_straight_into_the_bucket(tmp_path: Path) -> None:
    """A DTensor-sharded state dict (FSDP2's form) is sent as full tensors: the source passes the
    shards through and packing gathers them into the buffer (cast on the way when asked)."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        full = torch.arange(12.0).reshape(4, 3)
        src = TorchSource({"w": distribute_tensor(full, mesh, [Shard(0)])}, dtype=torch.bfloat16)
        assert src.metas() == [TensorMeta("w", "bfloat16", (4, 3))]
        plan = plan_buckets(src.metas(), 1 << 20)
        ((name, tensor),) = next(iter(src.iter_buckets(plan)))
        assert name == "w" and hasattr(tensor, "placements")  # still sharded: nothing gathered yet
        buf = torch.zeros(plan[0].nbytes, dtype=torch.uint8)
        pack_into(buf, plan[0], [(name, tensor)])
        ((_, got),) = unpack(buf, plan[0])
        assert torch.equal(got, full.to(torch.bfloat16))
    finally:
        dist.destroy_process_group()


def test_torch_source_leaves_grad_mode_alone() -> None:
    """A half-consumed bucket iterator (a refit that failed mid-transfer) must not leave autograd off."""
    src = TorchSource(TinyLlama(CONFIG, seed=0))
    buckets = src.iter_buckets(plan_buckets(src.metas(), 32 << 10))
    next(buckets)
    assert torch.is_grad_enabled()


def test_the_emulated_servers_need_no_dev_extra() -> None:
    """`refit demo --engine sglang|vllm` imports the emulated servers from `refit.testing`; the
    kit's Hypothesis (a dev extra) is imported only when the kit is asked for."""
    code = (
        "import sys, refit.testing.sglang_server, refit.testing.vllm_server, refit.testing; "
        "assert 'hypothesis' not in sys.modules, 'hypothesis imported'; "
        "from refit.testing import check_engine_driver; assert 'hypothesis' in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


# import circles issue 20 has yet to break: none may be added
KNOWN_CIRCLES: list[set[str]] = []


def test_no_new_import_circle() -> None:
    """Every import in the package that runs, module level or inside a function (not those under
    `if TYPE_CHECKING:`), as a graph of modules: its strongly connected components of more than
    one module are the circles."""
    import ast
    import itertools

    root = Path(__file__).resolve().parents[1] / "src"
    mods = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / "refit").rglob("*.py")
    }
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        out = set()
        tree = ast.parse(path.read_text())
        typing_only = {  # `if TYPE_CHECKING:` imports never run
            id(n) for b in ast.walk(tree) if isinstance(b, ast.If) and "TYPE_CHECKING" in ast.unparse(b.test)
            for stmt in b.body for n in ast.walk(stmt)
        }  # fmt: skip
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                above = package[: len(package) - node.level + 1]  # level 1: this package
                base = ".".join([*above, node.module or ""]).strip(".") if node.level else (node.module or "")
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            out |= {t for t in targets if t in mods and t != name and not name.startswith(t + ".")}
        graph[name] = out
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[set[str]] = []
    counter = itertools.count()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = next(counter)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert [c for c in circles if c not in KNOWN_CIRCLES] == [], circles


def test_the_sglang_and_vllm_demos_need_no_extra() -> None:
    """`pip install refit-engine` (no extras) then `refit demo --engine sglang|vllm`: what the
    demos import is refit's core dependencies only (dev and optional packages are blocked here,
    as absent from a plain install), and httpx, which the drivers speak, is one of them."""
    import tomllib

    core = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert any(d.startswith("httpx") for d in core["dependencies"]), core["dependencies"]
    blocked = ["hypothesis", "pytest", "transformers", "ray", "fastapi", "uvicorn", "sglang", "vllm", "megatron"]
    code = (
        "import importlib.abc, importlib.util, sys\n"
        f"BLOCKED = {blocked!r}\n"
        "class Block(importlib.abc.Loader):  # found (torch probes for some), but never importable\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in BLOCKED:\n"
        "            return importlib.util.spec_from_loader(name, self)\n"
        "    def create_module(self, spec):\n"
        "        raise ImportError(f'{spec.name} is not a core dependency')\n"
        "    def exec_module(self, module):\n"
        "        pass\n"
        "sys.meta_path.insert(0, Block())\n"
        "from refit.cli import main\n"
        "sys.exit(main(['demo', '--engine', sys.argv[1], '--refits', '1', '--steps', '2']))\n"
    )
    for engine in ("sglang", "vllm"):
        proc = subprocess.run([sys.executable, "-c", code, engine], capture_output=True, text=True, timeout=240,
                              check=False)  # fmt: skip
        assert proc.returncode == 0 and "matched the trainer" in proc.stdout, (engine, proc.stdout[-2000:], proc.stderr)
