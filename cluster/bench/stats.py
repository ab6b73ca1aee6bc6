"""From a run's records to numbers that can be believed (plain Python: no vLLM, no Ray).

A record is one (repetition, configuration, cell) measurement (`runner.measure`). Warm-up
repetitions are dropped. Per configuration and cell, every metric is reported as the median
over repetitions with its min and max; a ratio between two configurations is taken within each
repetition (both measured minutes apart on the same prompts) and then summarised the same way,
so the drift of a noisy machine between repetitions cancels instead of piling up.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from cluster.bench.metrics import percentile

METRICS = (
    "per_user_tok_s",
    "per_user_e2e_tok_s",
    "ttft_p50_s",
    "ttft_p90_s",
    "aggregate_tok_s",
    "engine_cpu_ms_per_token",
    "serving_cpu_ms_per_token",
)
RATIO_METRICS = ("per_user_tok_s", "aggregate_tok_s")
RATIO_PAIRS = (
    ("none", "vllm-serve"),
    ("eagle3.1", "none"),
    ("eagle3", "none"),
    ("ngram", "none"),
    ("routed", "none"),
    ("eagle3.1", "vllm-serve"),
    ("none", "vllm-serve:beside-ray"),  # the serving path's cost without Ray's idle share
)
"""(numerator, denominator) pairs reported whenever both ran."""
BASELINE_NAMES = ("vllm-serve", "inprocess", "rayllm")
"""Configurations that are not our cluster (never a static alternative to routing)."""


def spread(values: Iterable[float]) -> dict[str, float] | None:
    """Median and min-max of the finite values (None when there are none)."""
    present = sorted(v for v in values if v is not None and math.isfinite(v))
    if not present:
        return None
    return {
        "median": percentile(present, 50),
        "min": present[0],
        "max": present[-1],
        "n": len(present),
    }


def usable_records(result: dict[str, Any]) -> list[dict[str, Any]]:
    """A run's records without those of configurations that failed mid-run (a server that
    stopped answering): they are missing from every later repetition, which would otherwise
    leave no repetition complete for the configurations that went on."""
    failed = {name for name, config in result["configs"].items() if "failed" in config}
    return [r for r in result["records"] if r["config"] not in failed]


def measured(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records that count: not warm-up, and of complete repetitions only (a run stopped
    mid-repetition measured some configurations once more than others)."""
    visited: dict[int, set[tuple[str, str]]] = {}
    for record in records:
        visited.setdefault(record["repetition"], set()).add((record["config"], record["cell"]))
    everything = set().union(*visited.values()) if visited else set()
    complete = {rep for rep, seen in visited.items() if seen == everything}
    return [r for r in records if not r["warmup"] and r["repetition"] in complete]


def by_repetition(records: list[dict[str, Any]], config: str, cell: str) -> dict[int, dict]:
    return {
        r["repetition"]: r for r in measured(records) if r["config"] == config and r["cell"] == cell
    }


def cell_stats(records: list[dict[str, Any]], config: str, cell: str) -> dict[str, Any]:
    """Every metric of one configuration in one cell over the measured repetitions."""
    reps = by_repetition(records, config, cell)
    return {metric: spread(r.get(metric) for r in reps.values()) for metric in METRICS}


def paired(
    records: list[dict[str, Any]], numerator: str, denominator: str, cell: str, metric: str
) -> list[float]:
    """numerator / denominator within each repetition both measured."""
    pairs = _pairs(records, numerator, denominator, cell, metric)
    return [a / b for a, b in pairs if b and math.isfinite(a) and math.isfinite(b)]


def paired_difference(
    records: list[dict[str, Any]], numerator: str, denominator: str, cell: str, metric: str
) -> list[float]:
    """numerator - denominator within each repetition (e.g. added TTFT)."""
    return [a - b for a, b in _pairs(records, numerator, denominator, cell, metric)]


def _pairs(records, numerator: str, denominator: str, cell: str, metric: str):
    """(numerator's, denominator's) `metric` in each repetition both measured, in order."""
    top, bottom = by_repetition(records, numerator, cell), by_repetition(records, denominator, cell)
    return [(top[r][metric], bottom[r][metric]) for r in sorted(top.keys() & bottom.keys())]


def cells_of(records: list[dict[str, Any]]) -> list[tuple[str, str, int]]:
    """(cell, workload, concurrency) in workload then concurrency order."""
    seen = {(r["cell"], r["workload"], r["concurrency"]) for r in records}
    return sorted(seen, key=lambda c: (c[1], c[2]))


def configs_of(records: list[dict[str, Any]]) -> list[str]:
    return sorted({r["config"] for r in records})


def base_of(config: str) -> str:
    """The configuration a lever variant (`<base>:<lever>`) changes; others are their own."""
    return config.partition(":")[0]


def ratios(records: list[dict[str, Any]], pairs=RATIO_PAIRS) -> list[dict[str, Any]]:
    """Paired ratios of every pair that ran, and of each lever variant over its base, per cell
    and ratio metric."""
    present = set(configs_of(records))
    levers = tuple((c, base_of(c)) for c in sorted(present) if base_of(c) != c)
    rows = []
    for numerator, denominator in (*pairs, *levers):
        if numerator not in present or denominator not in present:
            continue
        for cell, workload, concurrency in cells_of(records):
            for metric in RATIO_METRICS:
                summary = spread(paired(records, numerator, denominator, cell, metric))
                if summary:
                    rows.append(
                        {
                            "name": f"{numerator}/{denominator}",
                            "workload": workload,
                            "concurrency": concurrency,
                            "metric": metric,
                            **summary,
                        }
                    )
    return rows


REQUEST_PATH = ("inprocess", "vllm-serve", "rayllm", "none")  # the layers, outermost last


def request_path_position(config: str) -> tuple:
    """Sort key: the request path's layers in order, each base's lever variants right after it,
    then the other configurations."""
    base = base_of(config)
    layer = REQUEST_PATH.index(base) if base in REQUEST_PATH else len(REQUEST_PATH)
    return layer, base, config != base, config


def ablation(records: list[dict[str, Any]], reference: str = "vllm-serve") -> list[dict[str, Any]]:
    """Every configuration against `reference` (in request-path order): paired ratios of
    per-user and aggregate rates, and the paired TTFT it adds (ms), per cell."""
    rows = []
    for config in sorted(configs_of(records), key=request_path_position):
        if config == reference:
            continue
        for cell, workload, concurrency in cells_of(records):
            row: dict[str, Any] = {
                "config": config,
                "vs": reference,
                "workload": workload,
                "concurrency": concurrency,
            }
            for metric in RATIO_METRICS:
                row[metric] = spread(paired(records, config, reference, cell, metric))
            added = spread(
                1000 * d for d in paired_difference(records, config, reference, cell, "ttft_p50_s")
            )
            row["added_ttft_p50_ms"] = added
            if row["per_user_tok_s"] is not None:
                rows.append(row)
    return rows


def routing_points(
    records: list[dict[str, Any]], routed: str = "routed", metric: str = "per_user_tok_s"
) -> list[dict[str, Any]]:
    """Per cell: the routed configuration against the best static one (every other cluster
    configuration that ran; the best is the one with the highest median `metric` in that
    cell), the ratio paired within each repetition (`routing_summary.json` `points`).

    With two or more statics, `runner_up` is the second best against the best, paired the same
    way: what "within noise" means in that cell. Picking the best of several statics favours
    whichever was luckier, so when they run the same engines the runner-up's ratio is below 1
    by that luck alone, and so is routed's."""
    statics = [c for c in configs_of(records) if c != routed and base_of(c) not in BASELINE_NAMES]
    points = []
    for cell, workload, concurrency in cells_of(records):
        ours = cell_stats(records, routed, cell)[metric]
        medians = {c: (cell_stats(records, c, cell)[metric] or {}).get("median") for c in statics}
        medians = {c: m for c, m in medians.items() if m is not None}
        if not ours or not medians:
            continue
        best = max(medians, key=medians.get)
        ratio = spread(paired(records, routed, best, cell, metric))
        if not ratio:
            continue
        point = {
            "workload": workload, "concurrency": concurrency, "routed": ours["median"],
            "best_static": medians[best], "best_static_name": best,
            "ratio": ratio["median"], "min": ratio["min"], "max": ratio["max"],
        }  # fmt: skip
        others = [c for c in medians if c != best]
        runner_up = max(others, key=medians.get) if others else None
        if runner_up and (second := spread(paired(records, runner_up, best, cell, metric))):
            point["runner_up"] = {"name": runner_up, **second}
        points.append(point)
    return points
