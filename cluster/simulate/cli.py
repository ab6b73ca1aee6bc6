"""`cluster simulate`: every strategy over one trace (or several: `--seeds`), and the numbers
that compare them.

Writes `<out>/result.json` (assumptions, each strategy's summary on the first trace, ours against
the best static split per trace and on average, the replica timelines of both on the first
trace), `<out>/table.md`, `<out>/replicas.png`, and the `simulation` block of
`benchmarks/results/routing_summary.json` (the rest of that file is kept).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from cluster.atomic import write_atomically
from cluster.autoscale.model import PerformanceModel
from cluster.autoscale.profile import CalibrationProfile
from cluster.config import ClusterConfig, ConfigError, load_config
from cluster.simulate import trace as traces
from cluster.simulate.hardware import HardwareScale, lift_by_concurrency, scaled_model
from cluster.simulate.plots import plot, plot_sweep
from cluster.simulate.result import SimulationResult
from cluster.simulate.strategies import OURS, strategies
from cluster.simulate.sweep import compare, ours_against_static, seeded
from cluster.slo import Slo

REPO = Path(__file__).resolve().parents[2]
DEFAULT_TRACE = REPO / "benchmarks" / "traces" / "kimi-diurnal-mix.yaml"
DEFAULT_PROFILE = REPO / "configs" / "profiles" / "embedded.yaml"
ROUTING_SUMMARY = REPO / "benchmarks" / "results" / "routing_summary.json"


def model_for(
    config: ClusterConfig, profile_path: Path, hardware: HardwareScale | None
) -> PerformanceModel:
    """The config's pools' models: the profile's own (same pool names), or the profile carried
    over to the config's hardware (pools matched by role: a pool with a drafter in the profile
    is the speculative one)."""
    profile = CalibrationProfile.load(profile_path)
    base = PerformanceModel.from_profile(profile)
    if hardware is None:
        missing = {p.name for p in config.pools} - set(base.pools)
        if missing:
            raise ValueError(f"{profile_path}: no calibration for pools {sorted(missing)}")
        return base
    base_roles = {
        name: "throughput" if spec.method == "none" else "speculative"
        for name, spec in profile.pools.items()
    }
    scaled = scaled_model(base, hardware, base_roles)
    by_role = {role: scaled.pools[name] for name, role in base_roles.items()}
    return PerformanceModel({p.name: by_role[p.role] for p in config.pools})


def table(results: list[SimulationResult], best: SimulationResult) -> str:
    lines = [
        "| strategy | GPU-hours | SLO attainment | rejected | per-user tok/s p10 / p50 / p90 "
        "| TTFT p50 / p99 s | routed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        mark = " (best static)" if r is best else ""
        rates = " / ".join(f"{r.per_user_tok_s[k]:.1f}" for k in ("p10", "p50", "p90"))
        routed = ", ".join(f"{k} {v}" for k, v in r.routed.items())
        lines.append(
            f"| {r.strategy}{mark} | {r.gpu_hours:.1f} | {r.slo_attainment:.3f} | {r.rejected} "
            f"| {rates} | {r.ttft_s['p50']:.2f} / {r.ttft_s['p99']:.2f} | {routed} |"
        )
    return "\n".join(lines) + "\n"


def _json_safe(value: Any) -> Any:
    """NaN and infinities (no requests counted, none completed) as null: JSON has neither."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _write_json(path: Path, document: dict[str, Any]) -> None:
    write_atomically(path, _json_safe(document))


def update_summary(path: Path, key: str, block: dict[str, Any]) -> None:
    """Replace one block of the routing summary (`simulation`, `load_step`, `points`), keeping
    the others: each comes from its own command."""
    document = json.loads(path.read_text()) if path.exists() else {}
    document[key] = block
    _write_json(path, document)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    config = load_config(args.file)
    hardware = HardwareScale.load(args.hardware) if args.hardware else None
    profile = Path(
        args.profile
        or (hardware and hardware.profile)
        or (
            config.resolve_path(config.routing.profile)
            if config.routing.profile
            else DEFAULT_PROFILE
        )
    )
    model = model_for(config, profile, hardware)
    spec = traces.TraceSpec.load(args.trace) if args.trace.endswith((".yaml", ".yml")) else None
    requests = traces.load(args.trace)
    if not requests or args.warmup_s >= requests[-1].arrival_s:
        raise ValueError(f"{args.trace}: no request after the {args.warmup_s:g} s warm-up")
    if args.write_trace:
        traces.write(requests, args.write_trace)
    budget = args.budget or config.targets[0].replica_budget
    if budget is None:
        budget = sum(p.autoscaling.max_replicas for p in config.pools)
    configured = Slo.from_routing(config.routing) or Slo()
    slo = Slo(
        ttft_s=args.ttft_slo_s or configured.ttft_s or 5.0,
        per_user_tok_s=args.min_tok_s or configured.per_user_tok_s or 20.0,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"{len(requests)} requests over {requests[-1].arrival_s / 3600:.1f} h; budget {budget} "
        f"replicas; SLO: TTFT <= {slo.ttft_s} s, >= {slo.per_user_tok_s} tok/s per user"
    )
    if args.seeds < 1:
        raise ConfigError(f"--seeds: {args.seeds}: at least one trace")
    if args.seeds > 1 and spec is None:
        raise ConfigError(f"{args.trace}: --seeds draws traces from a spec (.yaml), not JSONL")
    if args.baseline and not args.sweep:
        raise ConfigError("--baseline: only with --sweep (it reuses a sweep's rows)")
    if args.sweep:
        return _run_sweep(args, config, model, spec, slo, budget, out)
    days = seeded(spec, args.seeds) if spec is not None else []
    kwargs = _simulation_kwargs(args)
    started = time.monotonic()
    runs: list[list[SimulationResult]] = []
    compared = strategies(config, model, slo, budget)
    with tqdm(desc="strategies", unit="run") as bar:
        for i in range(args.seeds):
            trace_requests = requests if i == 0 else traces.generate(days[i])

            def progress(name: str, i: int = i) -> None:
                bar.set_postfix_str(f"trace {i + 1}/{args.seeds}: {name}")
                bar.update(1)

            runs.append(compare(compared, model, trace_requests, slo, kwargs, progress))
    comparison = ours_against_static(runs, [day.seed for day in days] or [None])  # JSONL: none
    results = runs[0]
    best = next(r for r in results if r.strategy == comparison["ray_default_split"])
    ours = next(r for r in results if r.strategy == OURS)
    roles = {p.name: p.role for p in config.pools}
    context = config.routing.long_context_tokens
    document = {
        "config": args.file,
        "trace": args.trace,
        "requests": len(requests),
        "budget_replicas": budget,
        "gpus_per_replica": config.targets[0].accelerators_per_replica,
        "slo": slo.__dict__,
        "profile": str(profile),
        "hardware": hardware.model_dump() if hardware else None,
        "lift_by_concurrency": {
            "model": lift_by_concurrency(model, roles, [1, 4, 16], context),
            "documented": hardware.documented_lift if hardware else {},
            "context_tokens": context,
        },
        "settings": kwargs,
        "seconds": round(time.monotonic() - started, 1),
        "strategies": [r.summary() for r in results],
        "best_static": best.strategy,
        "over_traces": comparison,
        "timelines": {OURS: ours.replicas, best.strategy: best.replicas},
    }
    _write_json(out / "result.json", document)
    (out / "table.md").write_text(table(results, best))
    plot(document["timelines"], spec, out / "replicas.png")
    if args.summary:
        block = {k: v for k, v in comparison.items() if k != "traces"}
        update_summary(Path(args.summary), "simulation",
                       {**block, "result": str(out / "result.json")})  # fmt: skip
    print(table(results, best), end="")
    c = comparison
    print(
        f"ours / {best.strategy}, mean over {len(c['traces'])} trace(s): GPU-hours "
        f"{c['gpu_hours_ratio']:.3f}x (per trace {c['gpu_hours_ratio_min']:.3f}-"
        f"{c['gpu_hours_ratio_max']:.3f}), SLO attainment {c['slo_attainment_ours']:.3f} vs "
        f"{c['slo_attainment_ray_default']:.3f}, goal met on {c['traces_won']}; wrote {out}"
    )
    return 0


def _simulation_kwargs(args: argparse.Namespace) -> dict[str, float]:
    return {
        "step_s": args.step_s,
        "control_interval_s": args.control_interval_s,
        "replica_start_s": args.replica_start_s,
        "warmup_s": args.warmup_s,
    }


def _run_sweep(args, config, model, spec, slo, budget: int, out: Path) -> int:
    from tqdm import tqdm

    from cluster.simulate.sweep import sweep, sweep_table

    if spec is None:
        raise ValueError(f"{args.trace}: --sweep scales a trace spec (.yaml), not a JSONL trace")
    with tqdm(desc="sweep", unit="run") as bar:

        def progress(label: str) -> None:
            bar.set_postfix_str(label)
            bar.update(1)

        kwargs = _simulation_kwargs(args)
        baseline = json.loads(Path(args.baseline).read_text())["rows"] if args.baseline else None
        rows = sweep(config, model, spec, slo, budget, args.sweep, kwargs, progress, args.seeds,
                     baseline)  # fmt: skip
    document = {
        "config": args.file,
        "trace": args.trace,
        "base_budget_replicas": budget,
        "seeds": args.seeds,
        "slo": slo.__dict__,
        "settings": kwargs,
        "rows": rows,
    }
    _write_json(out / "sweep.json", document)
    (out / "sweep.md").write_text(sweep_table(rows))
    plot_sweep(rows, out / "sweep.png")
    if args.summary:
        keep = ("gpus", "gpu_hours_ratio", "gpu_hours_ratio_min", "gpu_hours_ratio_max",
                "slo_attainment_ours", "slo_attainment_ray_default", "traces_won")  # fmt: skip
        update_summary(Path(args.summary), "simulation_sweep",
                       [{k: row[k] for k in keep} for row in rows])  # fmt: skip
    print(sweep_table(rows), end="")
    print(f"wrote {out / 'sweep.json'}, sweep.md, sweep.png")
    return 0


def add_command(commands: Any) -> None:
    parser = commands.add_parser(
        "simulate",
        help="replay a trace against the performance model with our routing and autoscaling "
        "and with Ray's default, static splits and single pools; GPU-hours, SLO attainment",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE", help="cluster YAML (its first target's pools)")
    parser.add_argument(
        "--trace",
        default=str(DEFAULT_TRACE),
        help="trace spec (.yaml, generated with its seed) or JSONL requests (default %(default)s)",
    )
    parser.add_argument("--write-trace", help="also write the trace's requests as JSONL here")
    parser.add_argument(
        "--profile",
        help="calibration profile (default: the --hardware file's profile, else the config's "
        "routing.profile, else configs/profiles/embedded.yaml)",
    )
    parser.add_argument(
        "--hardware",
        help="HardwareScale YAML that carries the profile over to "
        "the config's hardware (default: use the profile as measured)",
    )
    parser.add_argument(
        "--budget", type=int, help="most replicas of the target (default: its replica_budget)"
    )
    parser.add_argument(
        "--sweep",
        type=lambda text: [int(part) for part in text.split(",") if part],
        metavar="BUDGETS",
        help="instead of one run: the comparison at each budget (replicas, comma-separated, "
        "e.g. 8,16,32,64), the trace's rates scaled by budget / --budget; writes sweep.json, "
        "sweep.md, sweep.png and the summary's `simulation_sweep` block",
    )
    parser.add_argument(
        "--baseline",
        metavar="SWEEP_JSON",
        help="with --sweep: run only our policy and take every other strategy's numbers from "
        "this earlier sweep.json (the simulator is deterministic; a row is reused only where "
        "the static strategies, traces, SLO and settings are the same: its fingerprint). "
        "About 5x faster for trying our policy's settings; use --out elsewhere to keep the "
        "committed results",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="run on N traces of the spec: its own seed and the N-1 that follow (default "
        "%(default)s). The static split compared is the one best over all of them; ours is "
        "reported per trace and on average (result.json `over_traces`, the summary block)",
    )
    parser.add_argument(
        "--ttft-slo-s", type=float, help="TTFT objective (default: routing.ttft_slo_s, else 5)"
    )
    parser.add_argument(
        "--min-tok-s",
        type=float,
        help="per-user decode rate objective (default: 1 / routing.tpot_slo_s, else 20)",
    )
    parser.add_argument(
        "--replica-start-s",
        type=float,
        default=300.0,
        help="decision to serving for a new replica (default %(default)s)",
    )
    parser.add_argument(
        "--warmup-s",
        type=float,
        default=1800.0,
        help="first seconds not counted (requests nor GPU time): every strategy "
        "starts at its pools' minimum replicas (default %(default)s)",
    )
    parser.add_argument(
        "--step-s", type=float, default=1.0, help="simulation time step (default %(default)s)"
    )
    parser.add_argument(
        "--control-interval-s",
        type=float,
        default=10.0,
        help="autoscaling decisions every this many seconds, as Serve's metrics "
        "push (default %(default)s)",
    )
    parser.add_argument(
        "--out",
        default="benchmarks/results/simulation",
        help="output directory (default %(default)s)",
    )
    parser.add_argument(
        "--summary",
        default=str(ROUTING_SUMMARY),
        help="routing summary whose `simulation` block is replaced "
        "('' to skip; default %(default)s)",
    )
    parser.set_defaults(func=run)
