"""Request traces for the simulator: a seeded generator from a small YAML spec, and JSONL files.

A spec (`benchmarks/traces/*.yaml`) describes a day of traffic: a diurnal arrival-rate curve
(peak and trough, the peak's hour), bursts (extra rate for a while), and a mix of request kinds
(short chat, long-context coding), each with log-normal prompt and output lengths. The same spec
and seed always give the same trace, so a spec in the repository is a trace in the repository;
`cluster simulate --write-trace` also writes the requests out as JSONL for other tools.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from cluster.config import load_yaml_model


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RequestKind(_Strict):
    """One kind of request in the mix."""

    name: str
    share: float = Field(gt=0)
    """Relative share of arrivals (normalised over the kinds)."""
    prompt_tokens_median: int = Field(ge=1)
    prompt_tokens_sigma: float = Field(default=0.5, ge=0)
    """Log-normal spread of the prompt length (sigma of its log)."""
    output_tokens_median: int = Field(ge=1)
    output_tokens_sigma: float = Field(default=0.5, ge=0)
    max_prompt_tokens: int = Field(default=131072, ge=1)
    """Prompts are cut to this (the target's context)."""


class Burst(_Strict):
    """Extra arrivals on top of the curve for a while (a launch, a batch job, a retry storm)."""

    start_h: float = Field(ge=0)
    duration_min: float = Field(gt=0)
    extra_rate_per_s: float = Field(gt=0)


class TraceSpec(_Strict):
    """A day of traffic, compressed into `duration_s` of simulated time."""

    seed: int = 0
    duration_s: float = Field(default=86400, gt=0)
    """Simulated length of the day. Shorter than 86400 compresses the curve; the autoscalers'
    delays and replica start times stay in real seconds, which makes scaling harder."""
    peak_rate_per_s: float = Field(gt=0)
    """Arrivals per second at the busiest hour."""
    trough_rate_per_s: float = Field(ge=0)
    """Arrivals per second at the quietest hour (12 hours from the peak)."""
    peak_hour: float = Field(default=15, ge=0, lt=24)
    bursts: list[Burst] = Field(default_factory=list)
    kinds: list[RequestKind] = Field(min_length=1)

    @classmethod
    def load(cls, path: str | Path) -> TraceSpec:
        return load_yaml_model(cls, path)

    def scaled(self, factor: float) -> TraceSpec:
        """The same day with every arrival rate (curve and bursts) times `factor`: the traffic
        of a cluster `factor` times the size, same mix."""
        return self.model_copy(
            update={
                "peak_rate_per_s": self.peak_rate_per_s * factor,
                "trough_rate_per_s": self.trough_rate_per_s * factor,
                "bursts": [
                    b.model_copy(update={"extra_rate_per_s": b.extra_rate_per_s * factor})
                    for b in self.bursts
                ],
            }
        )

    def rate_at(self, t_s: float) -> float:
        """Arrivals per second at simulated time `t_s`."""
        hour = 24 * t_s / self.duration_s
        middle = (self.peak_rate_per_s + self.trough_rate_per_s) / 2
        swing = (self.peak_rate_per_s - self.trough_rate_per_s) / 2
        rate = middle + swing * math.cos(2 * math.pi * (hour - self.peak_hour) / 24)
        for burst in self.bursts:
            start = burst.start_h * self.duration_s / 24
            if start <= t_s < start + burst.duration_min * 60 * self.duration_s / 86400:
                rate += burst.extra_rate_per_s
        return max(rate, 0.0)


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    kind: str
    prompt_tokens: int
    output_tokens: int


def generate(spec: TraceSpec) -> list[TraceRequest]:
    """Arrivals of a non-homogeneous Poisson process (thinning against the highest rate)."""
    rng = random.Random(spec.seed)
    highest = spec.peak_rate_per_s + sum(b.extra_rate_per_s for b in spec.bursts)
    total_share = sum(k.share for k in spec.kinds)
    weights = [k.share / total_share for k in spec.kinds]
    requests, t = [], 0.0
    while True:
        t += rng.expovariate(highest)
        if t >= spec.duration_s:
            return requests
        if rng.random() * highest > spec.rate_at(t):
            continue
        kind = rng.choices(spec.kinds, weights)[0]
        prompt = rng.lognormvariate(math.log(kind.prompt_tokens_median), kind.prompt_tokens_sigma)
        output = rng.lognormvariate(math.log(kind.output_tokens_median), kind.output_tokens_sigma)
        requests.append(
            TraceRequest(
                arrival_s=round(t, 3),
                kind=kind.name,
                prompt_tokens=max(1, min(round(prompt), kind.max_prompt_tokens)),
                output_tokens=max(1, round(output)),
            )
        )


def load(path: str | Path) -> list[TraceRequest]:
    """A trace from a spec (`.yaml`/`.yml`, generated) or a JSONL file (one request per line)."""
    path = Path(path)
    if path.suffix in (".yaml", ".yml"):
        return generate(TraceSpec.load(path))
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            requests.append(TraceRequest(**json.loads(line)))
        except (TypeError, ValueError) as error:
            raise ValueError(f"{path}:{number}: not a trace request ({error})") from None
    return sorted(requests, key=lambda r: r.arrival_s)


def write(requests: Iterable[TraceRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in requests))
