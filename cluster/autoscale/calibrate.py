"""`cluster calibrate CONFIG`: the calibration profile of a deployment's pools.

Each pool is measured alone, exactly as the config deploys it (`cluster bench` configuration
`<role>-x1`: its engine, cores, drafter and schedule); `--pool POOL=BENCH_CONFIG` measures it by
another configuration (a run of `<role>-x2` counts concurrency / 2 per replica). `--from-run`
reads finished runs (`RUN=POOL,...` takes only those pools' points from RUN: how one pool is
re-measured while the others keep their runs); without it a short sweep runs first through the
benchmark harness itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cluster.autoscale.profile import CalibrationProfile, PoolSpeculation
from cluster.config import (
    ClusterConfig,
    ConfigError,
    PoolConfig,
    load_config,
    profile_problems,
)

SWEEP = {
    "contexts": "1024,2048",
    "concurrency": "1,4,16",
    "repeats": "2",
    "warmup": "1",
    "output-tokens": "128",
    "max-context-in-flight": "16384",
}
"""The short sweep (`cluster bench` options): about 35 minutes per pool on 2 CPU cores (eight
requests per cell at c = 1 since `--min-requests`)."""
SWEEP_OUT = "benchmarks/results/calibrate"


def bench_config_of(pool: PoolConfig) -> str:
    """The benchmark configuration that measures `pool`: the pool alone, as deployed."""
    return f"{pool.role}-x1"


def default_pool_of_config(config: ClusterConfig) -> dict[str, str]:
    """bench config -> pool, for the first target's pools."""
    target = config.targets[0].id
    return {bench_config_of(p): p.name for p in config.pools if p.target == target}


def profile_from_runs(
    config: ClusterConfig,
    runs: list[Path | tuple[Path, set[str]]],
    pool_of_config: dict[str, str],
) -> CalibrationProfile:
    """Points from `runs` (a run, or a run and the pools to take from it); each pool's
    speculation as `config` deploys it (the runs may have measured another schedule; the points
    record the depth each measured)."""
    profiles = []
    for run in runs:
        path, pools = run if isinstance(run, tuple) else (run, set(pool_of_config.values()))
        mapping = {bench: pool for bench, pool in pool_of_config.items() if pool in pools}
        profiles.append(CalibrationProfile.from_bench_run(path, mapping))
    profile = CalibrationProfile.combine(profiles)
    for pool in config.pools:
        if pool.name in pool_of_config.values():
            profile.pools[pool.name] = PoolSpeculation.from_config(pool.speculation)
    return profile


def sweep_argv(config_path: Path, bench_configs: list[str]) -> list[str]:
    """`cluster bench` arguments of the short sweep that measures every pool as deployed."""
    argv = ["bench", "--config", str(config_path), "--configs", ",".join(bench_configs)]
    for option, value in SWEEP.items():
        argv += [f"--{option}", value]
    return [*argv, "--out", SWEEP_OUT]


def run_sweep(config_path: Path, bench_configs: list[str]) -> Path:
    """Run the sweep with `cluster bench` and return its run directory."""
    from cluster.cli import main

    before = set(Path(SWEEP_OUT).glob("*"))
    code = main(sweep_argv(config_path, bench_configs))
    if code != 0:
        raise SystemExit(code)
    return max(set(Path(SWEEP_OUT).glob("*")) - before)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    config_path = Path(args.file)
    config = load_config(config_path, require_profile=False)  # calibrate may create it
    pool_of_config = default_pool_of_config(config)
    for item in args.pool:
        pool, _, bench = item.partition("=")
        pool_of_config = {b: p for b, p in pool_of_config.items() if p != pool} | {bench: pool}
    if not args.from_run and (problems := profile_problems(config)):
        raise ConfigError(
            f"{config_path}: {problems[0]}; the sweep deploys {config_path} "
            "as it is: leave routing.profile out for the sweep (or calibrate --from-run a "
            "finished run, which writes it)"
        )
    runs = [_run_and_pools(item, config_path, pool_of_config) for item in args.from_run]
    runs = runs or [run_sweep(config_path, [*pool_of_config])]
    profile = profile_from_runs(config, runs, pool_of_config)
    named = config.routing.profile and config.resolve_path(config.routing.profile)
    out = Path(args.out or named or config_path.parent / "profiles" / f"{config_path.stem}.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    profile.save(out)
    print(f"wrote {out}: {len(profile.points)} points, pools {', '.join(sorted(profile.pools))}")
    return 0


def _run_and_pools(
    item: str, config_path: Path, pool_of_config: dict[str, str]
) -> tuple[Path, set[str]]:
    """`RUN` (every pool) or `RUN=POOL,...` of `--from-run`."""
    path, _, names = item.partition("=")
    known = set(pool_of_config.values())
    pools = set(names.split(",")) if names else known
    if unknown := sorted(pools - known):
        raise ConfigError(
            f"{config_path}: --from-run {item}: no pool {unknown[0]!r} to calibrate "
            f"(pools: {', '.join(sorted(known))})"
        )
    return Path(path), pools


def add_command(commands: argparse._SubParsersAction) -> None:
    sweep = " ".join(f"--{option} {value}" for option, value in SWEEP.items())
    calibrate = commands.add_parser(
        "calibrate",
        help="measure each pool (or read benchmark runs) into the performance model's profile",
        description="Write the calibration profile routing and autoscaling predict from: per "
        "pool, per-user decode rate, TTFT and acceptance per draft position at each context "
        "length and concurrency. With --from-run, read finished `cluster bench` runs; without, "
        f"run a short sweep first (`cluster bench {sweep}`).",
    )
    calibrate.add_argument("file", metavar="CONFIG", help="cluster YAML")
    calibrate.add_argument(
        "--from-run", action="append", default=[], metavar="RUN[=POOL,...]",
        help="a `cluster bench` run directory (repeatable; points of all runs are kept); "
        "=POOL,... takes only those pools' points from it (re-measure one pool, keep the rest)",
    )  # fmt: skip
    calibrate.add_argument(
        "--pool", action="append", default=[], metavar="POOL=BENCH_CONFIG",
        help="measure POOL by another benchmark configuration (default: <role>-x1, the pool "
        "alone as deployed; e.g. speculative=eagle3.1 for the two-core single-pool engine)",
    )  # fmt: skip
    calibrate.add_argument(
        "--out",
        help="profile file (default: CONFIG's routing.profile, else profiles/<config name>.yaml "
        "next to CONFIG)",
    )
    calibrate.set_defaults(func=_cmd_calibrate)
