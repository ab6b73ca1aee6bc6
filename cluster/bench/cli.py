"""`cluster bench`: compare serving configurations side by side, one run, one machine."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cluster.config import DEFAULT_CONFIG

ROOT = DEFAULT_CONFIG.parent.parent
SHIPPED_DRAFTERS = {
    "eagle3": ROOT / "drafters" / "smollm2-135m-instruct-eagle3",
    "eagle3.1": ROOT / "drafters" / "smollm2-135m-instruct-eagle3.1",
}


def _csv(kind):
    return lambda text: tuple(kind(part) for part in text.split(",") if part)


def _cmd_bench(args: argparse.Namespace) -> int:
    import yaml

    from cluster.bench import plan as bench_plan
    from cluster.bench import report, runner
    from cluster.config import load_config
    from cluster.models import local_model_path, prepare_config_models

    preset = Path(args.config)
    config = load_config(preset)
    prepare_config_models(config, quiet=True)
    target = config.targets[0]
    tokenizer = Path(local_model_path(config, target))
    chosen = bench_plan.QUICK if args.quick else bench_plan.DEFAULT
    overrides = {
        "code_long_contexts": args.contexts,
        "concurrencies": args.concurrency,
        "rates": args.rates,
        "output_tokens": args.output_tokens,
        "seed": args.seed,
        "chat_short": args.chat_short or None,
        "max_context_in_flight": args.max_context_in_flight,
    }
    plan = bench_plan.Plan(
        **{**chosen.__dict__, **{k: v for k, v in overrides.items() if v is not None}}
    )
    drafters = dict(SHIPPED_DRAFTERS)
    for item in args.drafter:
        name, _, path = item.partition("=")
        drafters[name] = Path(path)
    names = args.configs or (bench_plan.QUICK_CONFIGS if args.quick else bench_plan.CONFIG_NAMES)
    configs = bench_plan.configurations(yaml.safe_load(preset.read_text()), names, drafters, args.k)
    out = Path(args.out) / (time.strftime("%Y%m%d-%H%M%S") + ("-quick" if args.quick else ""))
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = runner.run(plan, configs, preset.resolve().parent, target.id, tokenizer, out)
    except KeyboardInterrupt:
        print(f"\ninterrupted; servers stopped. Configs finished so far in {out}", file=sys.stderr)
        return 130
    (out / runner.RESULT_FILE).write_text(json.dumps(result, indent=1) + "\n")
    table = report.markdown(result)
    (out / "table.md").write_text(table)
    pngs = report.plots(result, out)
    print(table)
    print(
        f"wrote {out / runner.RESULT_FILE}, {out / 'table.md'}, " + ", ".join(p.name for p in pngs)
    )
    failed = [name for name, c in result["configs"].items() if "failed" in c]
    if failed:
        print(f"did not start: {', '.join(failed)} (see result.json)", file=sys.stderr)
    return 1 if failed else 0


def add_command(commands: argparse._SubParsersAction) -> None:
    from cluster.bench.plan import CONFIG_NAMES

    bench = commands.add_parser(
        "bench",
        help="per-user throughput and speculation lift of several configurations, side by side",
        description="Deploy each configuration in turn on this machine (no speculation, "
        "n-gram, EAGLE 3, EAGLE 3.1, the routed two-pool cluster, raw vLLM), replay the same "
        "workloads built from stdlib code with vLLM's benchmark client (closed loop at each "
        "concurrency, open loop with Poisson arrivals), and write result.json, table.md and "
        "PNG plots. On 2 cores the default sweep (all six configs; code-long 1k at c=1,4,16 "
        "and 2k at c=1,4; mixed at 1 req/s) takes about 30 minutes, --quick (none vs eagle3.1, "
        "code-long 1k at c=1,4) about 5.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench.add_argument(
        "--quick", action="store_true", help="none vs eagle3.1, 1k context, c=1,4, no open loop"
    )
    bench.add_argument(
        "--configs",
        type=_csv(str),
        help=f"comma-separated, in run order, of: {', '.join(CONFIG_NAMES)} "
        "(default: all; with --quick: none,eagle3.1)",
    )
    bench.add_argument(
        "--config", default=str(DEFAULT_CONFIG), help="preset the configs derive from"
    )
    bench.add_argument(
        "--contexts", type=_csv(int), help="code-long context tokens, e.g. 1024,4096"
    )
    bench.add_argument("--concurrency", type=_csv(int), help="closed-loop levels, e.g. 1,4,16")
    bench.add_argument("--rates", type=_csv(float), help="open-loop request rates (req/s)")
    bench.add_argument("--output-tokens", type=int, help="output tokens of code-long requests")
    bench.add_argument(
        "--chat-short", action="store_true", help="add the chat-short closed-loop sweep"
    )
    bench.add_argument(
        "--max-context-in-flight",
        type=int,
        help="skip code-long levels where concurrency x context exceeds this many tokens "
        "(0: no limit; default plan: 16384, so 2k context runs at c=1,4)",
    )
    bench.add_argument("-k", type=int, default=3, help="speculative tokens of spec configs")
    bench.add_argument(
        "--drafter", action="append", default=[], metavar="NAME=PATH",
        help="override a drafter (eagle3, eagle3.1)",
    )  # fmt: skip
    bench.add_argument("--seed", type=int, help="workload and arrival seed")
    bench.add_argument("--out", default="benchmarks/results/bench", help="results root")
    bench.set_defaults(func=_cmd_bench)
