"""`cluster bench`: compare serving configurations side by side, one run, one machine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path

from cluster.atomic import write_atomically
from cluster.config import DEFAULT_CONFIG
from cluster.help import DefaultsHelpFormatter

ROOT = DEFAULT_CONFIG.parent.parent
SHIPPED_DRAFTERS = {
    "eagle3": ROOT / "drafters" / "smollm2-135m-instruct-eagle3",
    "eagle3.1": ROOT / "drafters" / "smollm2-135m-instruct-eagle3.1",
}
HEADLINE_SUMMARY = ROOT / "benchmarks" / "results" / "summary.json"
README = ROOT / "README.md"


def _csv(kind):
    return lambda text: tuple(kind(part) for part in text.split(",") if part)


def _plan(args: argparse.Namespace):
    from cluster.bench.plan import Plan

    chosen = {
        "workloads": args.workloads,
        "contexts": args.contexts,
        "concurrencies": args.concurrency,
        "output_tokens": args.output_tokens,
        "repeats": args.repeats,
        "warmup": args.warmup,
        "waves": args.waves,
        "min_requests": args.min_requests,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos or None,
        "max_context_in_flight": args.max_context_in_flight,
        "restart_servers": args.restart_servers or None,
    }
    return Plan(**{k: v for k, v in chosen.items() if v is not None})


def _schedule(option: str | None) -> list[list[int]] | None:
    """`--schedule` as recorded in a run's options: the dynamic schedule, or None for `-k` at
    every batch size (`none`; runs from before the default recorded None)."""
    return None if option in (None, "", "none") else json.loads(option)


def _cmd_bench(args: argparse.Namespace) -> int:
    import yaml

    from cluster.bench import plan as bench_plan
    from cluster.bench import runner
    from cluster.bench.plan import Plan
    from cluster.config import load_config
    from cluster.models import local_model_path, prepare_config_models

    if args.resume:
        out = Path(args.resume)
        result = json.loads((out / runner.RESULT_FILE).read_text())
        known = {f.name for f in fields(Plan)}
        recorded = {"min_requests": 0, **result["plan"]}  # runs from before the field
        plan = Plan(**{k: tuple(v) if isinstance(v, list) else v
                       for k, v in recorded.items() if k in known})  # fmt: skip
        names = tuple(result["configs"])
        options = result["options"]
    else:
        try:
            plan = _plan(args)
        except ValueError as error:
            print(f"cluster bench: {error}", file=sys.stderr)
            return 2
        names = args.configs or bench_plan.HEADLINE_CONFIGS
        options = {"config": args.config, "k": args.k, "drafter": args.drafter,
                   "schedule": args.schedule}  # fmt: skip
    preset = Path(options["config"])
    config = load_config(preset)
    prepare_config_models(config, quiet=True)
    target = config.targets[0]
    tokenizer = Path(local_model_path(config, target))
    drafters = dict(SHIPPED_DRAFTERS)
    for item in options["drafter"]:
        name, _, path = item.partition("=")
        drafters[name] = Path(path)
    schedule = _schedule(options["schedule"])
    try:
        configs = bench_plan.configurations(
            yaml.safe_load(preset.read_text()), names, drafters, options["k"], schedule
        )
        if plan.restart_servers and (paired := [c.name for c in configs if c.beside]):
            raise ValueError(f"{', '.join(paired)} need servers kept for the run: "
                             "drop --restart-servers")  # fmt: skip
    except ValueError as error:
        print(f"cluster bench: {error}", file=sys.stderr)
        return 2
    if not args.resume:
        out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
        out.mkdir(parents=True, exist_ok=True)
        result = runner.new_result(plan, configs)
        result["options"] = options
    try:
        result = runner.run(
            plan, configs, preset.resolve().parent, target.id, tokenizer, out, result
        )
    except KeyboardInterrupt:
        print(f"\ninterrupted; servers stopped. Resume with: cluster bench --resume {out}",
              file=sys.stderr)  # fmt: skip
        return 130
    return _report(result, out, headline=args.headline)


def _report(result: dict, out: Path, headline: bool) -> int:
    from cluster.bench import report

    label = str(out.resolve().relative_to(ROOT)) if out.resolve().is_relative_to(ROOT) else str(out)
    doc, written = report.write(result, out, label)
    print((out / "table.md").read_text())
    print("wrote " + ", ".join(str(p) for p in written))
    if headline:
        write_atomically(HEADLINE_SUMMARY, doc)
        updated = report.update_readme(README, report.readme_block(doc))
        print(f"wrote {HEADLINE_SUMMARY}" + (" and the README table" if updated else ""))
    failed = [name for name, c in result["configs"].items() if "failed" in c]
    if failed:
        print(f"failed: {', '.join(failed)} (see result.json)", file=sys.stderr)
    return 1 if failed else 0


def _cmd_report(args: argparse.Namespace) -> int:
    from cluster.bench import runner

    out = Path(args.run)
    return _report(json.loads((out / runner.RESULT_FILE).read_text()), out, args.headline)


def _cmd_routing_points(args: argparse.Namespace) -> int:
    """Routed vs the best static configuration of a run, into routing_summary.json."""
    from cluster.bench import runner, stats
    from cluster.simulate.cli import update_summary

    result = json.loads((Path(args.run) / runner.RESULT_FILE).read_text())
    points = stats.routing_points(stats.usable_records(result))
    if not points:
        print(f"{args.run}: no cell where `routed` and another cluster configuration both ran")
        return 1
    for p in points:
        second = p.get("runner_up")
        print(f"{p['workload']}@c{p['concurrency']}: routed {p['routed']:.1f} vs "
              f"{p['best_static_name']} {p['best_static']:.1f} per-user tok/s: ratio "
              f"{p['ratio']:.3f} ({p['min']:.3f}-{p['max']:.3f})"
              + (f"; {second['name']} {second['median']:.3f} of it" if second else ""))  # fmt: skip
    update_summary(Path(args.summary), "points", points)
    return 0


def _depth_of(name: str, depths: dict[str, int]) -> int | None:
    """Fixed draft depth of a configuration: `--depth NAME=K`, `none` (0), `eagle3.1-k<N>`."""
    if name in depths:
        return depths[name]
    if name == "none":
        return 0
    if name.startswith("eagle3.1-k"):
        return int(name.removeprefix("eagle3.1-k"))
    return None  # not a fixed depth (e.g. a dynamic schedule run beside the sweep)


def _config_depth(item: str) -> tuple[str, int]:
    """`--depth CONFIG=K` as (CONFIG, K)."""
    name, _, depth = item.partition("=")
    if not name or not depth.isdigit():
        raise argparse.ArgumentTypeError(f"{item!r}: expected CONFIG=K (e.g. speculative-x1=3)")
    return name, int(depth)


def _cmd_schedule(args: argparse.Namespace) -> int:
    """Derive the dynamic speculation schedule from sweep runs (`--configs none,eagle3.1-kN`,
    or any configurations named with `--depth`)."""
    from cluster.bench import runner, stats
    from cluster.speculation import derive_schedule

    depths = dict(args.depth)
    rates: dict[int, dict[int, float]] = {}
    for run in args.run:
        result = json.loads((Path(run) / runner.RESULT_FILE).read_text())
        records = [r for r in stats.usable_records(result) if r["workload"] == args.workload]
        for name in stats.configs_of(records):
            depth = _depth_of(name, depths)
            if depth is None:
                continue
            for cell, _, concurrency in stats.cells_of(records):
                spread = stats.cell_stats(records, name, cell)["per_user_tok_s"]
                if not spread:
                    continue
                if concurrency in rates.get(depth, {}):
                    print(
                        f"cluster bench schedule: depth {depth} at c={concurrency} is measured "
                        f"twice ({run}: {name}); give each level one run",
                        file=sys.stderr,
                    )
                    return 2
                rates.setdefault(depth, {})[concurrency] = spread["median"]
    for depth, by_c in sorted(rates.items()):
        print(f"k={depth}: " + ", ".join(f"c={c}: {v:.1f}" for c, v in sorted(by_c.items())))
    schedule = derive_schedule(rates, args.max_batch_size)
    print(json.dumps([list(r) for r in schedule]))
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    from cluster.bench.plan import (
        ABLATION_CONFIGS,
        CONFIG_NAMES,
        HEADLINE_CONFIGS,
        LEVER_CONFIGS,
        SINGLE_POOL_SCHEDULE,
    )

    bench = commands.add_parser(
        "bench",
        help="per-user and aggregate rates of several configurations, side by side, repeated",
        description="Start every configuration's server once (idle ones frozen), then run "
        "--repeats repetitions (plus --warmup discarded), each visiting every configuration in "
        "a seeded balanced order (each configuration in every position equally often) and "
        "replaying every cell (held-out stdlib code at each --contexts length, closed loop at "
        "each --concurrency, --waves x c requests and at least --min-requests, unique prompt "
        "prefixes, stopping at the target's end) with vLLM's benchmark client. Writes "
        "result.json (atomically, after every cell: --resume continues), summary.json with "
        "paired ratios and the ablation, table.md and plots. On 2 cores the headline (`make "
        "bench`: the default configs and cells, 5+1 repetitions, --output-tokens 64) takes about "
        "3.5 hours (a repetition 35 minutes, 2k at c=16 13 of them). Subcommands "
        "`report` and `schedule` read a finished run.",
        formatter_class=DefaultsHelpFormatter,
    )
    bench.add_argument(
        "--configs",
        type=_csv(str),
        help=f"comma-separated: {', '.join(CONFIG_NAMES)}, eagle3.1-k<N> (fixed depth N, for "
        f"the sweep), one serving lever changed: {', '.join(LEVER_CONFIGS)}; "
        f"default {','.join(HEADLINE_CONFIGS)}; the ablation is {','.join(ABLATION_CONFIGS)}",
    )
    bench.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="preset the configs derive from"
    )
    bench.add_argument(
        "--workloads", type=_csv(str),
        help="comma-separated: code-long (held-out code continued), mixed (half short "
        "questions about one function, half code-long); default code-long",
    )  # fmt: skip
    bench.add_argument("--contexts", type=_csv(int), help="code context tokens (default 1024,2048)")
    bench.add_argument("--concurrency", type=_csv(int), help="closed-loop levels (default 1,4,16)")
    bench.add_argument("--output-tokens", type=int, help="most output tokens (default 128)")
    bench.add_argument("--repeats", type=int, help="measured repetitions (default 5)")
    bench.add_argument("--warmup", type=int, help="discarded leading repetitions (default 1)")
    bench.add_argument("--waves", type=int, help="requests per cell = waves x c (default 2)")
    bench.add_argument(
        "--min-requests", type=int,
        help="but at least this many per cell (default 8: steadier medians at low concurrency)",
    )  # fmt: skip
    bench.add_argument("--seed", type=int, help="order and prompt seed (default 0)")
    bench.add_argument(
        "--ignore-eos", action="store_true",
        help="force every response to --output-tokens (text past the answer; off by default)",
    )  # fmt: skip
    bench.add_argument(
        "--max-context-in-flight", type=int,
        help="skip cells where concurrency x context tokens exceed this (default 0: none)",
    )  # fmt: skip
    bench.add_argument(
        "--restart-servers", action="store_true",
        help="start each configuration's server afresh for every repetition (its own luck "
        "then varies between repetitions instead of repeating in all; about a start per "
        "configuration and repetition more)",
    )  # fmt: skip
    bench.add_argument(
        "-k", type=int, default=3,
        help="draft depth of speculative configs: the most a --schedule may draft, or the depth "
        "at every batch size with --schedule none",
    )  # fmt: skip
    bench.add_argument(
        "--schedule",
        default=json.dumps(SINGLE_POOL_SCHEDULE),
        help="dynamic speculation schedule of the speculative configs, JSON [[first, last, k], "
        "...] (see `cluster bench schedule`), or `none` for -k at every batch size (default: "
        "%(default)s, from the single-pool depth sweep; `eagle3.1-k<N>` is always fixed)",
    )
    bench.add_argument(
        "--drafter", action="append", default=[], metavar="NAME=PATH",
        help="override a drafter (eagle3, eagle3.1)",
    )  # fmt: skip
    bench.add_argument("--out", default="benchmarks/results/bench", help="results root")
    bench.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run")
    bench.add_argument(
        "--headline", action="store_true",
        help="also write benchmarks/results/summary.json and the README's table from this run",
    )  # fmt: skip
    bench.set_defaults(func=_cmd_bench)
    sub = bench.add_subparsers(dest="bench_command")
    rep = sub.add_parser("report", help="tables, summary.json and plots of a finished run again")
    rep.add_argument("run", help="run directory (holds result.json)")
    rep.add_argument("--headline", action="store_true", help="also summary.json and README")
    rep.set_defaults(func=_cmd_report)
    sched = sub.add_parser(
        "schedule",
        help="derive num_speculative_tokens_per_batch_size from a depth sweep run",
        description="Reads runs of --configs none,eagle3.1-k1,...,eagle3.1-kN (or of any "
        "configurations given a --depth) and prints, per depth, the median per-user decode "
        "rate at each concurrency, then the schedule that picks the fastest depth per level "
        "(see cluster.speculation.derive_schedule).",
    )
    sched.add_argument("run", nargs="+", help="run directories of the sweep")
    sched.add_argument(
        "--depth", action="append", default=[], metavar="CONFIG=K", type=_config_depth,
        help="count CONFIG's cells as depth K (e.g. the pools measured as deployed: --depth "
        "speculative-x1=3 --depth throughput-x1=0; a pool whose schedule turned drafting off "
        "at some level still counts as K there)",
    )  # fmt: skip
    sched.add_argument(
        "--workload",
        default="code-long-1024",
        help="the runs' workload whose per-user rates decide (default %(default)s)",
    )
    sched.add_argument("--max-batch-size", type=int, default=16, help="the pool's max_num_seqs")
    sched.set_defaults(func=_cmd_schedule)
    points = sub.add_parser(
        "routing-points",
        help="routed vs the best static configuration per cell (paired ratios; beside it the "
        "runner-up static against the best) into benchmarks/results/routing_summary.json",
    )
    points.add_argument("run", help="run directory with `routed` and static configurations")
    points.add_argument(
        "--summary",
        default="benchmarks/results/routing_summary.json",
        help="routing summary whose `points` block is replaced (default %(default)s)",
    )
    points.set_defaults(func=_cmd_routing_points)
