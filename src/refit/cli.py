"""The `refit` command: demo, check, replay, soak, bench, doctor, diagram.

Exit codes: 0 ok, 1 the command ran and found a failure (a violation, a divergence, a failed
refit), 2 bad input (usage, a file that is not a refit trace, a bad --fail-at), before any work.
Long commands report progress on stderr; their results (and `--json`) go to stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import math
import os
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

DIAGRAMS = "docs/diagrams"  # where `refit diagram` writes, relative to the repository root
# Trainer-side calls a --fail-at can name (`refit.protocol.ranks.Participant` steps); engine calls
# are `refit.drivers.base.ENGINE_CALLS`.
TRAINER_CALLS = (
    "metas", "epoch", "prepare", "offload", "restore", "connect", "join", "pack", "send", "release", "abandon",
    "disconnect", "end_run",
)  # fmt: skip


def _version() -> str:
    try:
        return metadata.version("refit-engine")
    except metadata.PackageNotFoundError:
        return "unknown (refit-engine is not installed)"


@contextlib.contextmanager
def _runner_quiet() -> Iterator[None]:
    """For commands that report failed runs themselves: the runner's log warning about a failed
    refit (logger `refit.protocol.runner`) is not printed a second time. Handlers configured
    elsewhere still receive it."""
    logger = logging.getLogger("refit.protocol.runner")
    handler = logging.NullHandler()
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _load(command: str, path: str) -> tuple[dict[str, Any], list[dict[str, Any]], bool] | None:
    """The trace at `path`, or None after printing why it cannot be used (the caller exits 2)."""
    from refit.trace import load_trace

    p = Path(path)
    why: str | None = None
    if not p.exists():
        why = f"cannot read {path}: no such file"
    elif p.is_dir():
        why = f"cannot read {path}: it is a directory, not a trace file"
    else:
        try:
            return load_trace(p)
        except ValueError as exc:  # NotATrace, and undecodable bytes (UnicodeDecodeError)
            print(f"refit {command}: not a refit trace: {_naming(path, exc)}", file=sys.stderr)
            return None
        except OSError as exc:
            why = f"cannot read {path}: {exc.strerror or exc}"
    print(f"refit {command}: {why}", file=sys.stderr)
    return None


def _naming(path: str, exc: BaseException) -> str:
    text = str(exc)
    return text if path in text else f"{path}: {text}"


def _check(args: argparse.Namespace) -> int:
    from refit.invariants import check_trace
    from refit.trace import runs

    loaded = _load("check", args.trace)
    if loaded is None:
        return 2
    header, events, torn = loaded
    n_runs = len(runs(events))
    if n_runs == 0:
        print(f"refit check: not a refit trace: {args.trace}: no run in it (nothing to check)", file=sys.stderr)
        return 2
    violations = check_trace(events, torn=torn, header=header, whole=True)
    if not violations:  # a consistent trace: do its decisions follow from its outcomes? (replay)
        from refit.replay import check_decisions

        violations = check_decisions(args.trace, loaded)
    if args.json:
        print(json.dumps({"runs": n_runs, "events": len(events), "violations": [v.__dict__ for v in violations]}))
    elif violations:
        for v in violations:
            print(f"VIOLATION {v}")
            if v.seq is not None:
                event = next((e for e in events if e.get("seq") == v.seq), None)
                print(f"  event: {json.dumps(event)}")
        print(f"{len(violations)} violation(s) in {n_runs} run(s), {len(events)} events: {args.trace}")
    else:
        print(f"ok: {n_runs} run(s), {len(events)} events, every invariant holds, its decisions replay: {args.trace}")
    return 1 if violations else 0


def _replay(args: argparse.Namespace) -> int:
    from refit.replay import replay
    from refit.trace import NotATrace

    loaded = _load("replay", args.trace)
    if loaded is None:
        return 2
    try:
        report = replay(args.trace, loaded)  # replay keeps the runner quiet: a replayed failure is the recording's
    except NotATrace as exc:
        print(f"refit replay: not a refit trace: {_naming(args.trace, exc)}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"refit replay: cannot replay {args.trace}: {exc}", file=sys.stderr)
        return 2
    if report.cut is not None:  # said first, as `refit check` says it
        print(f"the trace was cut off mid-run: {report.cut}; replaying the {report.runs} complete run(s) before it")
    left_out = "; ".join(f"{n} {why}" for why, n in report.skipped.items())
    print(
        f"replayed {report.runs} run(s), {report.events} events in {report.seconds:.3f}s"
        f"{f' (not replayed: {left_out})' if left_out else ''}: {report.path}"
    )
    for i, (rec, rep) in enumerate(zip(report.recorded, report.replayed, strict=False)):
        same = "same" if rec == rep else "DIFFERENT"
        print(f"  run {i + 1}: recorded {rec.state}, replayed {rep.state} ({same})")
        if rec.failing_event:
            print(f"    first failing call: {rec.failing_event}")
    if report.divergence is not None:
        print(f"DIVERGED at {report.divergence}")
        return 1
    if report.cut is not None:
        if report.runs == 0:
            print("nothing reproduced: the trace holds no complete run, and the cut-off run cannot be replayed")
        else:
            print("reproduced the complete runs: same events, same final states, same failing calls; the cut-off "
                  "run cannot be replayed")  # fmt: skip
        return 1
    print("reproduced: same events, same final states, same failing calls")
    return 0


def _soak(args: argparse.Namespace) -> int:
    from refit.progress import Progress
    from refit.soak import soak

    kind = "threads" if args.in_thread else "processes"
    progress = Progress("soak")
    progress.note(f"soak: starting {args.engines} engine {kind}, one warm-up refit, then {args.refits} refits ...")
    try:
        report = soak(
            args.refits, engines=args.engines, mode=args.mode, bucket_bytes=args.bucket_bytes,
            fault_every=args.fault_every, verify_every=args.verify_every, in_thread=args.in_thread,
            progress=progress,
        )  # fmt: skip
    finally:
        progress.close()
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        r = report
        print(
            f"{r.refits} refits into {r.engines} engine {'threads' if args.in_thread else 'processes'} "
            f"({r.mode}, {r.buckets_per_refit} buckets each) in {r.seconds:.1f}s: {r.refits_per_second} refits/s"
        )
        print(
            f"  every engine updated: {r.ok}/{r.refits}; injected faults: {r.injected_faults}; "
            f"weight mismatches at checks: {r.mismatches}"
        )
        print(
            f"  growth while open: shm segments {r.segments_growth}, fds {r.fds_growth}, threads "
            f"{r.threads_growth} (call pool: {r.pool_threads} workers), RSS {r.rss_growth_mib:+.1f} MiB"
        )
        print(
            f"  left after close: shm segments {r.segments_left}, processes {r.processes_left}, "
            f"threads {r.threads_left}"
        )
        print(f"  leaks: {r.leaks}")
    return 1 if report.leaks or report.mismatches else 0


def _bench_gpu(args: argparse.Namespace) -> int:
    """`refit bench gpu` (one GPU) and `refit bench broadcast` (two GPUs of one host)."""
    from refit import bench, bench_gpu

    what, need = args.what, 2 if args.what == "broadcast" else 1
    shapes = tuple(s for s in args.shapes.split(",") if s)
    bad = [s for s in shapes if s not in bench_gpu.SHAPES]
    if bad or not shapes:
        known = ", ".join(bench_gpu.SHAPES)
        print(f"refit bench {what}: --shapes {args.shapes!r}: known shapes are {known}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError as exc:
        print(f"refit bench {what}: torch does not import here ({exc})", file=sys.stderr)
        return 2
    if torch.cuda.device_count() < need:
        print(
            f"refit bench {what}: needs {need} CUDA device(s) on this host, found {torch.cuda.device_count()}",
            file=sys.stderr,
        )
        return 2
    from refit.progress import Progress

    progress = Progress(f"bench {what}")
    tick = lambda s: progress.note(f"  {s}")  # noqa: E731
    progress.note(f"bench {what}: shapes {', '.join(shapes)}; {args.refits} timed refits per path ...")
    if what == "gpu":
        paths = tuple(p for p in (args.paths or ",".join(bench_gpu.PATHS)).split(",") if p)
        known = (*bench_gpu.PATHS, *bench_gpu.EXTRA_PATHS)
        unknown = [p for p in paths if p not in known]
        if unknown:
            print(f"refit bench gpu: unknown path(s) {unknown}; the paths are {list(known)}", file=sys.stderr)
            return 2
        report = bench_gpu.gpu(
            shapes, refits=args.refits, bucket_mb=args.bucket_mb or 512, tick=tick, verify=args.verify or "off",
            paths=paths, lora_tokens=args.lora_tokens,
        )  # fmt: skip
        print(bench_gpu.table(report))
    else:
        from refit import bench_broadcast

        report = bench_broadcast.broadcast(shapes, refits=args.refits, bucket_mb=args.bucket_mb or 512, tick=tick)
        print(bench_broadcast.table(report))
    bench.write_json(report, args.json)
    if args.json:
        print(f"wrote {args.json}")
    ok = all(r.get("bit_exact") is not False for s in report["shapes"].values() for r in s["paths"].values())
    return 0 if ok else 1


def _bench(args: argparse.Namespace) -> int:
    from refit import bench

    if args.what in ("gpu", "broadcast"):
        return _bench_gpu(args)
    if args.ray and args.what != "control":
        print(f"refit bench {args.what}: --ray applies to `refit bench control` only", file=sys.stderr)
        return 2
    if args.ray:
        try:
            import ray  # noqa: F401
        except ImportError:
            print("refit bench control --ray needs Ray: pip install -e '.[ray]'", file=sys.stderr)
            return 2
    from refit.progress import Progress

    progress = Progress(f"bench {args.what}")
    with progress:
        if args.what == "control":
            progress.note(
                f"bench control: starting {args.engines} engine {'Ray actors' if args.ray else 'processes'}, 3 warm-up "
                f"refits, then {args.refits} refits ..."
            )
            from refit.demo import ray_cluster

            with ray_cluster(args.ray):
                report = bench.control(
                    engines=args.engines,
                    refits=args.refits,
                    mode=args.mode,
                    progress=progress,
                    ray=args.ray,
                    verify=args.verify or "digest",
                )
            print(
                f"control plane: {report['engines']} engine {report['hosting']}, {report['refits']} refits "
                f"({report['mode']}), {report['buckets_per_refit']} bucket each"
            )
            print(f"  round trips per refit: {report['round_trips_per_refit']:g} (goal <= 2)")
            print(
                f"  stall minus transfer: median {report['control_ms_median']:.2f} ms, "
                f"p99 {report['control_ms_p99']:.2f} ms (goal: median <= 10 ms); "
                f"stall {report['stall_ms_median']:.2f} ms, transfer {report['transfer_ms_median']:.2f} ms"
            )
            if "verified_stall_ratio" in report:
                print(
                    f"  verify off / digest (alternate refits): stall {report['stall_ms_median_verify_off']:.2f} / "
                    f"{report['stall_ms_median_verify_digest']:.2f} ms, stall minus transfer "
                    f"{report['control_ms_median_verify_off']:.2f} / "
                    f"{report['control_ms_median_verify_digest']:.2f} ms; "
                    f"verified stall ratio {report['verified_stall_ratio']:.3f}"
                )
        else:
            progress.note(
                f"bench transport: 3 variants, each one engine process, a connecting refit and {args.refits} timed "
                f"refits of a {'small' if args.small else '0.67 GB'} state ..."
            )
            report = bench.transport(
                refits=args.refits, bucket_mb=args.bucket_mb or 64, checksums=not args.no_checksums, small=args.small,
                progress=progress,
            )  # fmt: skip
            print(
                f"shm transport: {report['bytes'] / 1e9:.2f} GB in {report['buckets']} buckets of "
                f"{report['bucket_bytes'] >> 20} MiB into one engine process; memcpy {report['memcpy_gbps']:.2f} GB/s; "
                f"bit-exact {report['bit_exact']}"
            )
            for name, v in report["variants"].items():
                print(
                    f"  {name:<24} checksums {'on ' if v['checksums'] else 'off'} {v['gbps']:6.2f} GB/s "
                    f"({v['seconds'] * 1e3:6.1f} ms)  ratio {v['ratio']:.2f}"
                )
            if args.small:  # a few MB: each refit's fixed cost (calls, checks) outweighs its copy, so its
                # ratio to memcpy's bandwidth says nothing about the transport
                print(
                    f"  (--small: {report['bytes'] / 1e6:.1f} MB per refit, where each refit's fixed cost outweighs "
                    "its copy: the ratios are no measure of the transport; the goal, zero_copy with checksums at "
                    ">= 0.7 x memcpy, is judged on the full-size state, without --small)"
                )
            else:
                verdict = "met" if report["ratio"] >= 0.7 else "MISSED"
                print(f"  goal (zero_copy, checksums on): ratio >= 0.7; measured {report['ratio']:.2f}: {verdict}")
    bench.write_json(report, args.json)
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _diagram(args: argparse.Namespace) -> int:
    from refit import diagram

    given = args.out is not None
    args.out = args.out or DIAGRAMS
    if not given and not args.check and not Path(args.out).is_dir():  # not in the repository: write nothing
        print(
            f"refit diagram: no {DIAGRAMS}/ here ({Path.cwd()}): run it in the refit repository's root, or give "
            "--out DIR to write the diagram there",
            file=sys.stderr,
        )
        return 2
    target = Path(args.out) / diagram.DIAGRAM_FILE
    if args.check:
        if diagram.is_current(args.out, args.readme):
            print(f"{target} is current")
            return 0
        if not target.is_file():
            print(f"{target.resolve()} does not exist: run `refit diagram` (in the repository root)", file=sys.stderr)
        else:
            print(f"{target} (or the README's copy) is stale: run `refit diagram`", file=sys.stderr)
        return 1
    for path in diagram.write(args.out, args.readme):
        print(f"wrote {path.resolve()}")
    return 0


def _demo_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the demo's options, found before any engine starts (None: nothing)."""
    from refit.drivers.base import ENGINE_CALLS
    from refit.protocol.faults import SILENT_KINDS, TP_KINDS, FaultPlan

    if args.fail_at is not None:  # ("" too: a spec that names nothing is refused, not taken as no fault)
        try:
            plan = FaultPlan.parse(args.fail_at, engines=args.engines)
        except ValueError as exc:
            return f"--fail-at: {exc}"
        call, kind = plan.faults[0].call, plan.faults[0].kind
        if kind in SILENT_KINDS and getattr(args, "engine", "reference") != "reference":
            return (
                f"--fail-at: kind={kind} is a silent fault, injected inside the reference engine; refit's "
                f"{args.engine} driver cannot host one (its engine's weights are the server's): use --engine reference"
            )
        if kind in TP_KINDS:
            from refit.reference.model import ModelConfig

            tp, kv = getattr(args, "engine_tp", 1), ModelConfig().num_kv_heads
            if tp < 2:
                return f"--fail-at: kind={kind} corrupts what TP ranks hold: it needs --engine-tp 2 or more"
            if kind == "kv_replica" and tp <= kv:
                return (
                    f"--fail-at: kind=kv_replica corrupts one of the copies of a KV head that TP ranks share: the "
                    f"demo's model has {kv} KV heads, so it needs --engine-tp {2 * kv} or more"
                )
        if call is not None and call not in (*ENGINE_CALLS, *TRAINER_CALLS):
            return (
                f"--fail-at: fault spec {args.fail_at!r}: call={call} is not a driver call (engine calls: "
                f"{', '.join(ENGINE_CALLS)}; trainer calls: {', '.join(TRAINER_CALLS)})"
            )
    from refit.protocol.context import in_place_refusal, kv_problem

    if getattr(args, "atomic", False):
        mode = args.mode or ("disaggregated" if getattr(args, "lora", False) else "colocated")
        if mode != "disaggregated":
            return (
                "--atomic: engines write the new weights into a second copy while they keep generating, which needs "
                "--mode disaggregated (colocated engines give their memory to the trainer)"
            )
        from refit.demo import driver_class

        if not getattr(driver_class(args), "stages", False):
            return f"--atomic: refit's {args.engine} driver cannot stage a second copy (see docs/async.md)"
    problem = kv_problem(args.kv, args.pause_mode, args.mode)
    if problem:
        return f"--kv {args.kv}, --pause-mode {args.pause_mode}, --mode {args.mode}: {problem}"
    if args.pause_mode == "in_place":
        from refit.demo import driver_class

        engine = driver_class(args)
        if not engine.supports_in_place_pause:
            return f"--pause-mode in_place: {in_place_refusal([engine])}"
    if args.engine != "reference" and args.ranks > 1:
        return f"--engine {args.engine} runs with one trainer rank here; drop --ranks"
    if args.verify not in (None, "off"):
        from refit.demo import driver_class, reports_digests, unverifiable

        cls = driver_class(args)
        if unverifiable(args):
            return (
                f"--verify {args.verify}: refit's {args.engine} driver reports no digests or probe yet "
                "(docs/verify.md); use --verify off"
            )
        if args.verify in ("digest", "both") and not reports_digests(cls):
            return f"--verify {args.verify}: refit's {args.engine} driver reports no digests; use --verify probe or off"
        if args.verify in ("probe", "both") and not cls.probes:
            return f"--verify {args.verify}: refit's {args.engine} driver answers no probe; use --verify digest or off"
    if args.in_thread and args.ranks > 1:
        return "--ranks runs engines as processes; drop --in-thread"
    if args.in_thread and args.engine_tp != 1:
        return "--in-thread engines have TP=1; drop --engine-tp or --in-thread"
    if args.ray:
        flags = (("--in-thread", args.in_thread), ("--engine", args.engine != "reference"))
        other = [flag for flag, on in flags if on]
        if other:
            return (
                f"--ray hosts the trainer ranks and reference engines as Ray actors; drop {', '.join(other)} "
                "(SGLang's and vLLM's engines on Ray are not built here)"
            )
        try:
            import ray  # noqa: F401
        except ImportError:
            return "--ray needs Ray: pip install -e '.[ray]'"
    from refit.reference.model import ModelConfig

    try:
        ModelConfig().check_tp(args.engine_tp)
    except ValueError as exc:
        return f"--engine-tp {args.engine_tp}: {exc}"
    return None


def trace_problem(path: str) -> str | None:
    """What keeps `refit demo --trace PATH` from writing its trace there, found before any engine
    starts (None: it can): a directory, a folder that does not exist (the demo creates none), or a
    file it cannot create or append to."""
    target = Path(path)
    if target.is_dir():
        return f"--trace {path}: it is a directory; give a file to write, such as {target / 'refit-trace.jsonl'}"
    folder = target.parent
    if not folder.is_dir():
        return f"--trace {path}: its folder {folder} does not exist (refit demo creates none)"
    existed = target.exists()
    try:
        with open(target, "a"):
            pass
    except OSError as exc:
        return f"--trace {path}: cannot write there: {exc.strerror or exc}"
    if not existed:
        target.unlink(missing_ok=True)
    return None


def _demo(args: argparse.Namespace) -> int:
    if args.trace:
        problem = trace_problem(args.trace)
        if problem is not None:
            print(f"refit demo: {problem}", file=sys.stderr)
            return 2
    mode_given = args.mode is not None
    args.mode = args.mode or ("disaggregated" if args.lora else "colocated")
    if args.lora:
        from refit.demo_lora import lora_problem, run_lora_demo

        args.mode_given = mode_given
        problem = lora_problem(args)
        if problem is not None:
            print(f"refit demo: {problem}", file=sys.stderr)
            return 2
        with _runner_quiet():
            return run_lora_demo(args)
    problem = _demo_problem(args)  # refused now, not after the engines started and the trainer trained
    if problem is not None:
        print(f"refit demo: {problem}", file=sys.stderr)
        return 2
    from refit.demo import run_demo

    with _runner_quiet():  # the demo reports a failed refit itself, with its trace
        return run_demo(args)


def _count(minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=_count(1), default=2, help="reference engines to refit (default 2)")
    p.add_argument("--refits", type=_count(1), default=3, help="refits to run (default 3)")
    p.add_argument("--steps", type=_count(1), default=20, help="optimizer steps between refits (default 20)")
    p.add_argument(
        "--mode", choices=("colocated", "disaggregated"), default=None,
        help="default colocated (with --lora: disaggregated, the only mode it runs in)",
    )  # fmt: skip
    p.add_argument(
        "--lora", action="store_true",
        help="LoRA refits: the trainer is the tiny model with PEFT adapters; only the adapter moves, into engines "
        "that keep generating, each request pinned to its adapter version (needs peft: the lora extra)",
    )  # fmt: skip
    p.add_argument(
        "--pause-mode", choices=("abort", "retract", "in_place"), default="retract",
        help="what happens to requests in flight: abort them, or hold them and continue after the update, "
        "retract recomputing their KV, in_place keeping it (--engine reference only, with --kv keep and --mode "
        "disaggregated; SGLang and vLLM cannot serve it safely) (default retract)",
    )  # fmt: skip
    p.add_argument(
        "--kv", choices=("recompute", "keep"), default="recompute",
        help="held requests' KV: recomputed under the new weights, or kept (off-policy; with --pause-mode in_place) "
        "(default recompute)",
    )  # fmt: skip
    p.add_argument(
        "--atomic", action="store_true",
        help="stage, then swap (with --mode disaggregated): engines write the new weights into a second copy while "
        "they keep generating, and stop only for the swap",
    )  # fmt: skip
    p.add_argument("--bucket-bytes", type=_count(1), default=64 << 10, help="bucket size in bytes (default 64 KiB)")
    p.add_argument("--deadline", type=_seconds, default=60.0, help="seconds each refit may take (default 60)")
    p.add_argument("--retries", type=_count(0), default=1, help="retries for an engine whose update failed (default 1)")
    p.add_argument("--call-timeout", type=_seconds, default=5.0, help="cap on one engine call in seconds (default 5)")
    p.add_argument("--seed", type=int, default=0, help="seed of the trainer's data and the engines' sampling")
    p.add_argument("--trace", metavar="PATH", help="write the JSONL trace of every refit here")
    p.add_argument(
        "--fail-at",
        metavar="SPEC",
        help="inject one fault, e.g. transferring:engine=1:bucket=2:kind=kill "
        "(keys: engine, bucket, call, kind = raise | hang | kill | corrupt, or a silent one the engine does not "
        "notice: flip | swap_qk | downcast | skip | late_copy on a load, swap_tp (--engine-tp 2 or more) and "
        "kv_replica (--engine-tp 4 or more) on a load, stale_head on a finalize)",
    )
    p.add_argument(
        "--verify",
        choices=("digest", "probe", "both", "off"),
        default=None,
        help="check each engine before it publishes: digest (its weights, bit for bit; --engine sglang / vllm: "
        "SGLang's or vLLM's own checksums), probe (its next-token log-probabilities against the trainer's), both, or "
        "off (default: digest)",
    )
    p.add_argument("--in-thread", action="store_true", help="run engines on threads instead of processes")
    p.add_argument(
        "--ray",
        action="store_true",
        help="trainer ranks and engines as Ray actors (a local Ray cluster, or RAY_ADDRESS's)",
    )
    p.add_argument("--ranks", type=_count(1), default=1, help="trainer ranks; >1: FSDP2 on gloo processes (default 1)")
    p.add_argument(
        "--engine-tp", type=_count(1), default=1, help="TP processes per engine, each with a shard (default 1)"
    )
    p.add_argument("--transport", choices=("shm", "broadcast"), default="shm", help="shm or a broadcast group")
    p.add_argument(
        "--engine",
        choices=("reference", "sglang", "vllm"),
        default="reference",
        help="reference: the reference engine's own driver; sglang / vllm: refit's SGLang or vLLM driver against "
        "emulated endpoints (reference engines behind that engine's HTTP API)",
    )


def _doctor(args: argparse.Namespace) -> int:
    """Exit 0 when some refit mode works with the server, 1 when none does or it cannot be reached,
    2 for a URL that is not one."""
    from refit.doctor import BadURL, doctor, render_json

    try:
        import httpx  # noqa: F401 - the SGLang and vLLM extras bring it
    except ImportError:
        print("refit doctor needs httpx: pip install 'refit-engine[sglang]' (or [vllm])", file=sys.stderr)
        return 2

    if not math.isfinite(args.timeout) or not 0 < args.timeout <= 3600:
        print(f"refit doctor: --timeout must be seconds in (0, 3600], got {args.timeout}", file=sys.stderr)
        return 2
    try:
        report = doctor(
            args.url, args.engine, api_key=args.api_key, admin_api_key=args.admin_api_key, timeout=args.timeout
        )
    except BadURL as exc:
        print(f"refit doctor: {exc}", file=sys.stderr)
        return 2
    print(render_json(report) if args.json else report.text())
    return 0 if report.ok else 1


class _Help(argparse.HelpFormatter):
    """Each option's default at the end of its help, unless it has none (None, off) or the help
    already says it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if not action.option_strings or default is None or default is False or default == argparse.SUPPRESS:
            return text
        if "default" in text:
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


def _parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    """The top-level parser and each subcommand's own (for its usage line in errors)."""
    parser = argparse.ArgumentParser(
        prog="refit", description="Refit trainer weights into rollout engines, checked.", formatter_class=_Help
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    sub_parser = functools.partial(sub.add_parser, formatter_class=_Help)

    demo = sub_parser("demo", help="a real CPU refit into reference-engine processes")
    _demo_arguments(demo)
    demo.set_defaults(func=_demo)

    check = sub_parser("check", help="check a recorded trace against the refit invariants")
    check.add_argument("trace", help="a JSONL trace (refit demo --trace PATH writes one)")
    check.add_argument("--json", action="store_true", help="print a JSON summary")
    check.set_defaults(func=_check)

    rep = sub_parser("replay", help="re-run a recorded trace through the real runner, report divergence")
    rep.add_argument("trace", help="a JSONL trace (refit demo --trace PATH writes one)")
    rep.set_defaults(func=_replay)

    soak_p = sub_parser("soak", help="many consecutive refits, then count leaked segments, fds, threads, processes")
    soak_p.add_argument("--refits", type=_count(1), default=1000, help="consecutive refits")
    soak_p.add_argument("--engines", type=_count(1), default=2, help="reference engines")
    soak_p.add_argument("--mode", choices=("colocated", "disaggregated"), default="disaggregated", help="refit mode")
    soak_p.add_argument("--bucket-bytes", type=_count(1), default=64 << 10, help="bucket size in bytes")
    soak_p.add_argument(
        "--fault-every", type=_count(0), default=10, help="inject a raise/corrupt fault every N refits (0: none)"
    )
    soak_p.add_argument(
        "--verify-every",
        type=_count(0),
        default=100,
        help="compare engine weights with the trainer every N refits (0: never)",
    )
    soak_p.add_argument("--in-thread", action="store_true", help="engines on threads instead of processes")
    soak_p.add_argument("--json", action="store_true", help="print the report as JSON")
    soak_p.set_defaults(func=_soak)

    bench_p = sub_parser(
        "bench", help="measured figures against a floor: control plane, transport, gpu (one GPU), broadcast (two)"
    )
    bench_p.add_argument(
        "what", choices=("control", "transport", "gpu", "broadcast"),
        help="control: control-plane cost; transport: CPU shared memory; gpu: one GPU, CUDA IPC paths vs the copy "
        "floor; broadcast: two GPUs, NCCL vs the broadcast floor",
    )  # fmt: skip
    bench_p.add_argument("--engines", type=_count(1), default=8, help="control: engine processes (default 8)")
    bench_p.add_argument("--ray", action="store_true", help="control: the engines are Ray actors (a local cluster)")
    bench_p.add_argument(
        "--refits",
        type=_count(1),
        default=None,
        help="refits to measure (control 100, transport 6, gpu 5, broadcast 5)",
    )
    bench_p.add_argument(
        "--mode", choices=("colocated", "disaggregated"), default="disaggregated", help="control, transport: refit mode"
    )
    bench_p.add_argument(
        "--bucket-mb", type=_count(1), default=None,
        help="bucket size in MiB (transport: default 64, gpu and broadcast: 512)",
    )  # fmt: skip
    bench_p.add_argument("--shapes", default="7b,1.5b", help="gpu, broadcast: model shapes (default 7b,1.5b)")
    bench_p.add_argument(
        "--paths",
        default=None,
        help="gpu: which paths, comma-separated (default floor,seed,flattened,ipc,ipc_512; also atomic: path (b) "
        "in atomic refits, decoding throughout)",
    )
    bench_p.add_argument(
        "--lora-tokens", type=_count(1), default=128,
        help="gpu, path lora: tokens per request in flight (fewer: shorter drains, more refits per minute)",
    )  # fmt: skip
    bench_p.add_argument("--no-checksums", action="store_true", help="transport: turn corruption detection off")
    bench_p.add_argument(
        "--verify",
        choices=("digest", "probe", "both", "off", "alternate"),
        default=None,
        help="control, gpu: the runs' verify mode; alternate: refits alternate off and digest on one context (gpu: "
        "off, digest hashed as the engine writes, and digest read back after finalize), and each mode's stall and "
        "its ratio to off are reported (default: control digest, as a run's default; gpu off; gpu verifies path (b) "
        "only)",
    )
    bench_p.add_argument("--small", action="store_true", help="transport: a few-MB state (a quick smoke run)")
    bench_p.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    bench_p.set_defaults(func=_bench)

    doc = sub_parser(
        "doctor", help="read-only check of a live SGLang or vLLM server: what refit can do with it, and the fixes"
    )
    doc.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:30000")
    doc.add_argument("--engine", choices=("sglang", "vllm"), default=None, help="default: told by its answers")
    doc.add_argument("--api-key", default=None, help="the server's --api-key, if it set one")
    doc.add_argument("--admin-api-key", default=None, help="SGLang's --admin-api-key, if it set one")
    doc.add_argument("--timeout", type=float, default=5.0, help="seconds per request (default 5)")
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.set_defaults(func=_doctor)

    diag = sub_parser("diagram", help="regenerate docs/diagrams from the state table")
    diag.add_argument("--out", default=None, help=f"output directory (default {DIAGRAMS}, which must exist)")
    diag.add_argument("--readme", default="README.md", help="README whose diagram block to refresh (default README.md)")
    diag.add_argument("--check", action="store_true", help="exit 1 if the committed diagram is stale")
    diag.set_defaults(func=_diagram)
    commands = {"demo": demo, "check": check, "replay": rep, "soak": soak_p, "bench": bench_p, "doctor": doc}
    return parser, {**commands, "diagram": diag}


def main(argv: list[str] | None = None) -> int:
    """Run the `refit` command line; returns the exit code (argparse's own exits included)."""
    parser, commands = _parser()
    try:
        args, unknown = parser.parse_known_args(argv)
        if unknown:  # with the subcommand's usage, not the top-level one
            commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    except SystemExit as exc:  # --help, --version, usage errors: argparse printed them
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    if getattr(args, "func", None) is _bench and args.refits is None:
        args.refits = {"control": 100, "gpu": 5, "broadcast": 5}.get(args.what, 6)
    try:
        return int(args.func(args))
    except BrokenPipeError:  # the reader went away (`refit check T | head`): stop quietly
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
