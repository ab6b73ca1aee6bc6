"""`cluster load-step`: a live concurrency step (1 -> 16 -> 1 by default) on a cluster whose
pools autoscale, with the replicas per pool and the autoscaling policy's decisions over time.

The config is overlaid so that this machine can show scaling at all: every pool may grow to
`--max-replicas`, Serve's delays and our cool-downs are seconds instead of minutes, and Ray gets
enough logical CPUs for the extra replicas. Closed-loop clients stream chat completions for
each phase; every request that does not end in a complete stream counts as failed. Every 2 s
the ingress's `/readyz` gives the running replicas per pool; the decisions come from the Serve
controller's log (`autoscale pool=... replicas=a->b reason=...`).

Writes `<out>/result.json` and `<out>/replicas.png`, and the `load_step` block of
`benchmarks/results/routing_summary.json`.
"""

from __future__ import annotations

import argparse
import json
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import requests
import yaml

from cluster.autoscale.ray_policy import DECISION_LOG_PREFIX
from cluster.config import DEFAULT_CONFIG, parse_config
from cluster.launcher import ServeProcess
from cluster.simulate.cli import ROUTING_SUMMARY, update_summary

DECISION = re.compile(
    r"(?P<stamp>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ .*" + re.escape(DECISION_LOG_PREFIX)
    + r"pool-(?P<pool>\S+) replicas=(?P<before>\d+)->(?P<after>\d+) reason=(?P<reason>.*?) inputs="
)  # fmt: skip
MESSAGES = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]


def overlay(data: dict[str, Any], max_replicas: int, budget: int | None = None) -> dict[str, Any]:
    """The config under test: pools that may grow, fast delays, room for the replicas, and a
    replica budget per target (None: every pool's maximum, so none is held back)."""
    data = {**data, "server": {**data.get("server", {})}, "ray": {**data.get("ray", {})}}
    data["server"].pop("port", None)
    pools = []
    for pool in data["pools"]:
        scaling = {**pool.get("autoscaling", {}), "policy": "model", "min_replicas": 1,
                   "max_replicas": max_replicas, "upscale_delay_s": 5, "downscale_delay_s": 20,
                   "upscale_cooldown_s": 10, "downscale_cooldown_s": 40}  # fmt: skip
        pools.append({**pool, "autoscaling": scaling})
    data["pools"] = pools
    # The application-level policy (it sees the requests waiting at the ingress) with the
    # budget asked for; by default one every pool's maximum fits, so each grows as alone.
    budget = budget if budget is not None else max_replicas * len(pools)
    data["targets"] = [{**target, "replica_budget": budget} for target in data["targets"]]
    data["ray"]["num_cpus"] = 4 * max_replicas * len(pools)
    return data


def parse_phases(text: str) -> list[tuple[int, float]]:
    """`1:60,16:300,1:240` -> [(concurrency, seconds), ...]."""
    try:
        phases = [(int(c), float(s)) for c, s in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ValueError(f"--phases: {text!r}: want CONCURRENCY:SECONDS,...") from None
    if not phases or any(c < 1 or s <= 0 for c, s in phases):
        raise ValueError(f"--phases: {text!r}: concurrency >= 1 and seconds > 0")
    return phases


def _is_error_event(line: bytes) -> bool:
    """An SSE `data:` line whose JSON carries a top-level `error` (the text itself may say
    "error": a chunk whose content is that one token once counted as a failure)."""
    if not line.startswith(b"data: {"):
        return False
    try:
        return "error" in json.loads(line[len(b"data: ") :])
    except ValueError:
        return False


class Load:
    """Closed-loop streaming clients; `concurrency` can change while they run."""

    def __init__(self, base_url: str, model: str, max_tokens: int):
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens
        self.concurrency = 0
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.records: list[dict[str, Any]] = []
        self.threads: list[threading.Thread] = []

    def _one(self) -> dict[str, Any]:
        started, error, pool = time.time(), None, None
        try:
            with requests.post(
                f"{self.base_url}/v1/chat/completions", stream=True, timeout=600,
                json={"model": self.model, "messages": MESSAGES, "max_tokens": self.max_tokens,
                      "stream": True},
            ) as response:  # fmt: skip
                pool = response.headers.get("x-cluster-pool")
                if response.status_code != 200:
                    error = f"HTTP {response.status_code}: {response.text[:200]}"
                else:
                    lines = [line for line in response.iter_lines() if line]
                    if not lines or lines[-1] != b"data: [DONE]":
                        error = "stream ended without [DONE]"
                    elif any(_is_error_event(line) for line in lines):
                        error = "error event in the stream"
        except requests.RequestException as exc:
            error = f"{type(exc).__name__}: {exc}"
        return {"start": started, "end": time.time(), "pool": pool, "error": error}

    def _client(self, index: int) -> None:
        while not self.stop.is_set():
            if index >= self.concurrency:
                time.sleep(0.2)
                continue
            record = self._one()
            with self.lock:
                self.records.append(record)

    def set(self, concurrency: int) -> None:
        self.concurrency = concurrency
        while len(self.threads) < concurrency:
            thread = threading.Thread(target=self._client, args=(len(self.threads),), daemon=True)
            self.threads.append(thread)
            thread.start()

    def finish(self) -> None:
        self.concurrency = 0  # clients end their current request, then idle
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)


def running(base_url: str) -> dict[str, int]:
    """Running replicas per pool, as the ingress sees them ({} when it does not answer: a
    gap in the plot, not the end of the run)."""
    try:
        pools = requests.get(f"{base_url}/readyz", timeout=30).json()["pools"]
    except (requests.RequestException, ValueError, KeyError):
        return {}
    return {name: state["running_replicas"] for name, state in pools.items()}


def replica_changes(samples: list[dict[str, Any]]) -> int:
    """Changes of a pool's running replicas between consecutive samples (a decision is logged
    again while its replica starts, so the log overcounts)."""
    changes, answered = 0, [s for s in samples if s["running"]]
    for before, after in zip(answered, answered[1:], strict=False):
        changes += sum(
            after["running"].get(pool) != count for pool, count in before["running"].items()
        )
    return changes


def decisions(controller_logs: list[Path], since: float) -> list[dict[str, Any]]:
    found = []
    for path in controller_logs:
        for match in DECISION.finditer(path.read_text(errors="replace")):
            stamp = datetime.strptime(match["stamp"], "%Y-%m-%d %H:%M:%S").timestamp()
            if stamp >= since:
                found.append({"t": stamp, "pool": match["pool"], "before": int(match["before"]),
                              "after": int(match["after"]), "reason": match["reason"]})  # fmt: skip
    return sorted(found, key=lambda d: d["t"])


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (replicas, load) = plt.subplots(2, 1, figsize=(10, 6), sharex=True,
                                         gridspec_kw={"height_ratios": [2, 1]})  # fmt: skip
    samples, start = result["samples"], result["started"]
    for pool in result["pools"]:
        replicas.step([s["t"] - start for s in samples],
                      [s["running"].get(pool, 0) for s in samples], where="post",
                      label=f"{pool}: running replicas")  # fmt: skip
    shown = set()  # a decision is logged again while its replica starts: label it once
    labelled = 0  # alternate label heights: decisions seconds apart would overprint
    for decision in result["decisions"]:
        key = (decision["pool"], decision["before"], decision["after"])
        if decision["before"] != decision["after"] and key not in shown:
            shown = {k for k in shown if k[0] != key[0]} | {key}
            replicas.annotate(
                f"{decision['pool']} {decision['before']}->{decision['after']}\n"
                f"{decision['reason']}", (decision["t"] - start, decision["after"]),
                fontsize=7, rotation=0, xytext=(3, 6 + 20 * (labelled % 2)),
                textcoords="offset points",
            )  # fmt: skip
            labelled += 1
            replicas.plot(decision["t"] - start, decision["after"], "kx")
    replicas.set(ylabel="replicas", title="load step: replicas and the policy's decisions (x)")
    replicas.set_ylim(top=replicas.get_ylim()[1] + 0.4)  # room for the labels above the top
    replicas.legend(fontsize=8)
    replicas.grid(alpha=0.3)
    load.step([p["at"] - start for p in result["phases"]] + [result["ended"] - start],
              [p["concurrency"] for p in result["phases"]] + [result["phases"][-1]["concurrency"]],
              where="post", color="grey")  # fmt: skip
    load.set(xlabel="seconds", ylabel="clients")
    load.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    config_path = Path(args.file)
    data = overlay(yaml.safe_load(config_path.read_text()), args.max_replicas, args.budget)
    # A bad overlay (e.g. a budget below the pools' minimums) is refused here, not after a start.
    parse_config(data, str(config_path), base_dir=config_path.resolve().parent)
    phases = parse_phases(args.phases)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with ServeProcess(data, base_dir=config_path.resolve().parent) as server:
        logs = re.search(r"\(logs: (\S+)\)", server.log())
        serve_logs = Path(logs.group(1)) if logs else None
        load = Load(server.base_url, data["targets"][0]["id"], args.max_tokens)
        started = time.time()
        samples, marks = [], []
        total = sum(seconds for _, seconds in phases)
        with tqdm(total=round(total), desc="load step", unit="s") as bar:
            for concurrency, seconds in phases:
                marks.append({"at": time.time(), "concurrency": concurrency})
                load.set(concurrency)
                phase_end = time.time() + seconds
                while time.time() < phase_end:
                    samples.append({"t": time.time(), "running": running(server.base_url)})
                    time.sleep(2)
                    bar.update(min(round(time.time() - started), round(total)) - bar.n)
        load.finish()
        ended = time.time()
        controller = sorted(serve_logs.glob("controller_*.log")) if serve_logs else []
        found = decisions(controller, started)
    failed = [r for r in load.records if r["error"]]
    result = {
        "config": args.file,
        "overlay": {"max_replicas": args.max_replicas,
                    "replica_budget": data["targets"][0]["replica_budget"],
                    "delays_s": {"upscale": 5,
                    "downscale": 20, "upscale_cooldown": 10, "downscale_cooldown": 40}},
        "started": started,
        "ended": ended,
        "phases": marks,
        "pools": sorted({name for s in samples for name in s["running"]}),
        "requests": len(load.records),
        "failed": len(failed),
        "failures": failed[:20],
        "replica_changes": replica_changes(samples),
        "samples": samples,
        "decisions": found,
        "routed": {pool: sum(r["pool"] == pool for r in load.records)
                   for pool in {r["pool"] for r in load.records}},
    }  # fmt: skip
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out / "replicas.png")
    if args.summary:
        update_summary(Path(args.summary), "load_step", {
            "requests": result["requests"], "failed": result["failed"],
            "replica_changes": result["replica_changes"], "result": str(out / "result.json"),
        })  # fmt: skip
    print(f"{result['requests']} requests, {result['failed']} failed, "
          f"{result['replica_changes']} replica changes; wrote {out}")  # fmt: skip
    return 1 if failed else 0


def add_command(commands: Any) -> None:
    parser = commands.add_parser(
        "load-step",
        help="step a live autoscaling cluster's load (1 -> 16 -> 1 clients); plot replicas "
        "and the policy's decisions; exit 1 if any request failed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("file", metavar="FILE", nargs="?", default=str(DEFAULT_CONFIG),
                        help="cluster YAML (default %(default)s)")  # fmt: skip
    parser.add_argument("--phases", default="1:60,16:300,1:300",
                        help="CONCURRENCY:SECONDS,... (default %(default)s)")  # fmt: skip
    parser.add_argument("--max-replicas", type=int, default=2,
                        help="most replicas per pool (default %(default)s)")  # fmt: skip
    parser.add_argument("--budget", type=int, default=None,
                        help="replica budget of the target, shared by its pools (default: "
                        "every pool's maximum, so none is held back)")  # fmt: skip
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="output tokens per request (default %(default)s)")  # fmt: skip
    parser.add_argument("--out", default="benchmarks/results/load_step",
                        help="output directory (default %(default)s)")  # fmt: skip
    parser.add_argument(
        "--summary",
        default=str(ROUTING_SUMMARY),
        help="routing summary whose `load_step` block is replaced ('' to skip)",
    )
    parser.set_defaults(func=run)
