"""The performance model against the recorded calibration data, and its online correction."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.autoscale.calibrate import profile_from_runs
from cluster.autoscale.model import EMA_ALPHA, PerformanceModel, PoolModel
from cluster.autoscale.profile import CalibrationPoint, CalibrationProfile, PoolSpeculation
from cluster.cli import main
from cluster.config import load_config

ROOT = Path(__file__).resolve().parent.parent
PROFILE = ROOT / "configs" / "profiles" / "embedded.yaml"
RUNS = [
    ROOT / "benchmarks" / "results" / "bench" / run
    for run in ("20261205-115044", "20261205-123741", "20261205-130635")
]
EMBEDDED = {"eagle3.1": "speculative", "none": "throughput"}
CALIBRATE = ROOT / "benchmarks" / "results" / "calibrate"
PRESET_ARGS = [
    arg
    for run in ("20261206-164850=speculative", "20261206-073631=throughput",
                "20261206-192353=throughput", "20261206-192935=throughput")
    for arg in ("--from-run", str(CALIBRATE / run))
]  # fmt: skip
"""The preset's profile: each pool alone, as deployed (one core each) on one machine, and the
throughput pool at fixed depths (k = 0 at c = 1, 2; k = 3 at c = 4..16) so that depth and batch
vary apart."""
AS_DEPLOYED_RUNS = [CALIBRATE / run for run in ("20261206-020125", "20261206-023831")]
"""`cluster calibrate`'s own sweep of the preset before its throughput pool drafted (each pool
alone, as deployed), and the same configurations at c = 2, 8; on another machine."""
AS_DEPLOYED_RUN = AS_DEPLOYED_RUNS[0]
UNDRAFTED_PROFILE = ROOT / "configs" / "profiles" / "embedded-undrafted-throughput.yaml"
"""The profile of those runs: only the speculative pool drafts, so the pools differ at low batch
(the policy tests' profile)."""
TWO_CORE_PROFILE = ROOT / "configs" / "profiles" / "embedded-two-core.yaml"
"""Each pool measured as the two-core single-pool engine: the Kimi simulation's base."""


def held_out_errors(profile: CalibrationProfile) -> list[tuple[CalibrationPoint, float, float]]:
    """Leave-one-out: fit on every other point, predict the held-back one at the depth its run
    measured (runs used different schedules); (point, rate error, TTFT error), relative."""
    errors = []
    for i, point in enumerate(profile.points):
        rest = profile.model_copy(update={"points": profile.points[:i] + profile.points[i + 1 :]})
        model = PerformanceModel.from_profile(rest).pools[point.pool]
        method = "eagle3" if point.depth else "none"
        model.speculation = PoolSpeculation(method=method, num_speculative_tokens=point.depth)
        rate = model.per_user_rate(point.batch, point.context_tokens, point.output_tokens)
        ttft = model.ttft_s(point.batch, point.context_tokens)
        errors.append((point, abs(rate / point.per_user_tok_s - 1), abs(ttft / point.ttft_s - 1)))
    return errors


def test_committed_profile_is_what_calibrate_builds_from_the_runs(tmp_path):
    out = tmp_path / "profile.yaml"
    argv = ["calibrate", str(ROOT / "configs" / "embedded.yaml"), "--out", str(out)]
    assert main(argv + PRESET_ARGS) == 0
    assert out.read_text() == PROFILE.read_text()


def test_undrafted_profile_points_are_what_calibrate_builds_from_their_runs(tmp_path):
    out = tmp_path / "profile.yaml"
    argv = ["calibrate", str(ROOT / "configs" / "embedded.yaml"), "--out", str(out)]
    assert main(argv + [arg for run in AS_DEPLOYED_RUNS for arg in ("--from-run", str(run))]) == 0
    undrafted = CalibrationProfile.load(UNDRAFTED_PROFILE)
    assert CalibrationProfile.load(out).points == undrafted.points
    assert undrafted.pools["throughput"] == PoolSpeculation()  # as those runs deployed it


def test_from_run_takes_only_the_named_pools_of_a_run(tmp_path, capsys):
    out = tmp_path / "profile.yaml"
    argv = ["calibrate", str(ROOT / "configs" / "embedded.yaml"), "--out", str(out)]
    assert main([*argv, "--from-run", f"{AS_DEPLOYED_RUN}=throughput"]) == 0
    points = CalibrationProfile.load(out).points
    assert points and {p.pool for p in points} == {"throughput"}
    assert main([*argv, "--from-run", f"{AS_DEPLOYED_RUN}=speculative,throughput"]) == 0
    assert {p.pool for p in CalibrationProfile.load(out).points} == {"speculative", "throughput"}
    assert main([*argv, "--from-run", f"{AS_DEPLOYED_RUN}=throughputt"]) == 2
    assert "--from-run" in (err := capsys.readouterr().err) and "'throughputt'" in err


def test_two_core_profile_points_are_what_calibrate_builds_from_their_runs(tmp_path):
    out = tmp_path / "profile.yaml"
    argv = ["calibrate", str(ROOT / "configs" / "embedded.yaml"), "--out", str(out),
            "--pool", "speculative=eagle3.1", "--pool", "throughput=none"]  # fmt: skip
    assert main(argv + [arg for run in RUNS for arg in ("--from-run", str(run))]) == 0
    # Its pools keep the schedule derived on two cores ([1, 15, 3], [16, 16, 0]), which the
    # preset no longer deploys; the points are the runs' own.
    assert CalibrationProfile.load(out).points == CalibrationProfile.load(TWO_CORE_PROFILE).points


def test_profile_round_trips_through_yaml(tmp_path):
    profile = CalibrationProfile.load(PROFILE)
    profile.save(tmp_path / "p.yaml")
    assert CalibrationProfile.load(tmp_path / "p.yaml") == profile


def test_from_bench_run_takes_medians_and_pooled_acceptance():
    profile = CalibrationProfile.from_bench_run(RUNS[1], EMBEDDED)
    by_source = {p.source.split("/", 1)[1]: p for p in profile.points}
    k1_sweep_cell = by_source["eagle3.1/code-long-1024@c16"]  # schedule [5, 16, 1]
    assert k1_sweep_cell.depth == 1 and len(k1_sweep_cell.acceptance_per_position) == 1
    assert by_source["eagle3.1/code-long-1024@c1"].depth == 3
    assert by_source["none/code-long-1024@c1"].acceptance_per_position == ()
    assert profile.pools["speculative"].schedule == [(1, 4, 3), (5, 16, 1)]


def test_calibrate_writes_the_profile_the_config_names_even_before_it_exists(tmp_path, capsys):
    import yaml

    from cluster.launcher import with_absolute_paths

    preset = ROOT / "configs" / "embedded.yaml"
    data = with_absolute_paths(yaml.safe_load(preset.read_text()), preset.parent)
    data["routing"]["profile"] = "profiles/new.yaml"
    config = tmp_path / "cluster.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["calibrate", str(config), *PRESET_ARGS]) == 0
    assert (tmp_path / "profiles" / "new.yaml").read_text() == PROFILE.read_text()
    (tmp_path / "profiles" / "new.yaml").unlink()  # a sweep would deploy the missing profile
    assert main(["calibrate", str(config)]) == 2  # refused before any sweep starts
    assert "routing.profile: profiles/new.yaml: no such file" in capsys.readouterr().err


def test_calibrate_measures_the_pools_as_deployed_by_default(tmp_path):
    out = tmp_path / "profile.yaml"
    config = ROOT / "configs" / "embedded.yaml"
    assert (
        main(["calibrate", str(config), "--out", str(out), "--from-run", str(AS_DEPLOYED_RUN)]) == 0
    )
    profile = CalibrationProfile.load(out)
    assert profile.configs == {"speculative": "speculative-x1", "throughput": "throughput-x1"}
    # Each pool's speculation is the config's, not the one the run measured.
    for pool in load_config(config).pools:
        deployed = pool.speculation.num_speculative_tokens_per_batch_size
        assert profile.pools[pool.name].schedule == [tuple(r) for r in deployed]
    cells = {(p.pool, p.context_tokens // 1000, p.batch) for p in profile.points}
    assert cells == {
        (pool, k, batch)
        for pool in ("speculative", "throughput")
        for k, batch in ((1, 1), (1, 4), (1, 16), (2, 1), (2, 4))
    }


def test_calibrate_takes_each_pools_speculation_from_the_config():
    config = load_config(ROOT / "configs" / "embedded.yaml")
    profile = profile_from_runs(config, RUNS[1:2], EMBEDDED)
    deployed = config.pools[0].speculation.num_speculative_tokens_per_batch_size
    assert profile.pools["speculative"].schedule == [tuple(r) for r in deployed]


@pytest.mark.parametrize(
    "profile",
    [PROFILE, UNDRAFTED_PROFILE, TWO_CORE_PROFILE],
    ids=["as-deployed", "undrafted-throughput", "two-core"],
)
def test_held_out_error_on_the_calibration_points(profile):
    """Goal of issue 21: median absolute relative error <= 15% on held-back points."""
    errors = held_out_errors(CalibrationProfile.load(profile))
    for point, rate_error, ttft_error in errors:
        print(f"{point.source}: rate {rate_error:.1%} ttft {ttft_error:.1%}")
    for pool in ("speculative", "throughput"):
        rate = statistics.median(r for p, r, _ in errors if p.pool == pool)
        ttft = statistics.median(t for p, _, t in errors if p.pool == pool)
        print(f"{pool}: median rate error {rate:.1%}, TTFT {ttft:.1%}")
        assert rate <= 0.15, pool
        # TTFT in a closed loop is noisier (a cell's TTFT varied 2.7x between repetitions).
        assert ttft <= 0.25, pool


def test_speculation_pays_at_low_batch_and_not_at_high():
    model = PerformanceModel.load(UNDRAFTED_PROFILE)
    spec, plain = model.pools["speculative"], model.pools["throughput"]
    assert spec.per_user_rate(1, 2048) > 1.2 * plain.per_user_rate(1, 2048)
    assert spec.per_user_rate(16, 1024) <= 1.05 * plain.per_user_rate(16, 1024)
    rates = [plain.per_user_rate(b, 1024) for b in (1, 2, 4, 8, 16, 32)]
    assert rates == sorted(rates, reverse=True)
    ttfts = [plain.ttft_s(b, 1024) for b in (1, 4, 16)] + [plain.ttft_s(16, 4096)]
    assert ttfts == sorted(ttfts)


def test_depth_follows_the_schedule():
    model = PerformanceModel.load(PROFILE).pools["speculative"]
    assert [model.depth_at(b) for b in (1, 3, 4, 40)] == [3, 3, 0, 0]
    assert model.tokens_per_step(4) == 1
    assert model.tokens_per_step(1) == pytest.approx(1 + sum(model.acceptance_per_position))


def test_both_pools_of_the_preset_draft_while_nearly_idle():
    """The preset's throughput pool drafts with the speculative pool's drafter up to 3 requests
    in flight and not from 4, as the speculative pool does (measured on one core: k = 3 gives
    1.4x k = 0 at one request and costs 5-10% from 4)."""
    for pool in PerformanceModel.load(PROFILE).pools.values():
        assert [pool.depth_at(b) for b in (1, 3, 4, 32)] == [3, 3, 0, 0]
        plain = replace(pool, speculation=PoolSpeculation())
        assert pool.per_user_rate(1, 1024) > 1.2 * plain.per_user_rate(1, 1024)
        assert pool.per_user_rate(8, 1024) == pytest.approx(plain.per_user_rate(8, 1024))


def _model(**changes) -> PoolModel:
    base = PoolModel(
        step_coefficients=(0.05, 0.001, 0.0, 0.0, 0.0, 0.0),
        ttft_coefficients=(0.0, 1.0, 0.5),
        speculation=PoolSpeculation(method="eagle3", num_speculative_tokens=2),
        acceptance_per_position=(0.6, 0.4),
    )
    return replace(base, **changes)


@pytest.mark.parametrize(
    ("observations", "acceptance_scale", "step_time_scale"),
    [
        ([], 1.0, 1.0),
        ([(None, None)], 1.0, 1.0),
        # Acceptance length 2.0 observed where 2.0 is calibrated: no change.
        ([(2.0, None)] * 5, 1.0, 1.0),
        # Half the calibrated acceptance, once: one alpha step towards 0.5.
        ([(1.5, None)], 1 - EMA_ALPHA * 0.5, 1.0),
        # Steps twice as slow, once: one alpha step towards 2.
        ([(None, 2.0)], 1.0, 1 + EMA_ALPHA),
        # Nonsense ratios are ignored.
        ([(None, 0.0), (None, float("nan")), (None, -1.0)], 1.0, 1.0),
    ],
)
def test_observe_moves_by_one_ema_step(observations, acceptance_scale, step_time_scale):
    model = _model()
    for acceptance, ratio in observations:
        model.observe(acceptance, ratio)
    assert model.acceptance_scale == pytest.approx(acceptance_scale)
    assert model.step_time_scale == pytest.approx(step_time_scale)


@pytest.mark.parametrize(("observed", "depth"), [(1.3, 2), (1.3, 1), (2.4, None)])
def test_observe_converges_to_the_observation(observed, depth):
    model = _model()
    for _ in range(200):
        model.observe(observed, 1.5, depth=depth)
    calibrated = sum(model.acceptance_per_position[: depth or 2])
    assert model.acceptance_scale == pytest.approx((observed - 1) / calibrated, rel=1e-3)
    assert model.step_time_scale == pytest.approx(1.5, rel=1e-3)


def test_observed_corrections_change_predictions():
    model, corrected = _model(), _model()
    for _ in range(50):
        corrected.observe(1.2, 1.3)
    assert corrected.per_user_rate(1, 1024) < model.per_user_rate(1, 1024)
    # Acceptance can be scaled up, but no position accepts more than every draft.
    for _ in range(200):
        corrected.observe(10.0, 1.0)
    assert corrected.tokens_per_step(1) == pytest.approx(3.0)


def test_observing_a_pool_without_speculation_keeps_its_acceptance():
    model = _model(speculation=PoolSpeculation(), acceptance_per_position=())
    model.observe(2.0, None)
    assert model.acceptance_scale == 1.0


def test_fit_refuses_no_points():
    with pytest.raises(ValueError):
        PoolModel.fit([])


def test_calibration_measures_each_pool_as_deployed_and_splits_replicas():
    from cluster.autoscale.calibrate import default_pool_of_config
    from cluster.autoscale.profile import _fixed_replicas

    config = load_config(ROOT / "configs" / "embedded.yaml")
    assert default_pool_of_config(config) == {
        "speculative-x1": "speculative",
        "throughput-x1": "throughput",
    }
    two = {"pools": [{"autoscaling": {"min_replicas": 2, "max_replicas": 2}}]}
    assert _fixed_replicas(two) == 2
    assert (
        _fixed_replicas({"pools": [{"autoscaling": {"min_replicas": 1, "max_replicas": 3}}]}) == 1
    )
    assert _fixed_replicas(None) == 1
