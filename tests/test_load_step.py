"""`cluster load-step`'s pure parts: phases, the overlay (it must still be a valid config), and
the decisions read back from a Serve controller log."""

from pathlib import Path

import pytest
import yaml

from cluster.config import parse_config
from cluster.load_step import decisions, overlay, parse_phases

ROOT = Path(__file__).resolve().parent.parent


def test_phases():
    assert parse_phases("1:60,16:300,1:240") == [(1, 60.0), (16, 300.0), (1, 240.0)]
    for bad in ("", "16", "0:10", "4:-1", "a:b"):
        with pytest.raises(ValueError, match="--phases"):
            parse_phases(bad)


def test_overlay_lets_every_pool_scale_and_stays_valid():
    data = yaml.safe_load((ROOT / "configs" / "embedded.yaml").read_text())
    config = parse_config(overlay(data, 3), base_dir=ROOT / "configs")
    for pool in config.pools:
        assert (pool.autoscaling.min_replicas, pool.autoscaling.max_replicas) == (1, 3)
        assert pool.autoscaling.policy == "model" and pool.autoscaling.upscale_delay_s == 5
    assert config.ray.num_cpus >= 4 * 3 * len(config.pools)
    # The preset's budget (2) would hold both pools at 1: every pool's maximum fits now.
    assert config.targets[0].replica_budget == 3 * len(config.pools)
    shared = parse_config(overlay(data, 2, budget=3), base_dir=ROOT / "configs")
    assert shared.targets[0].replica_budget == 3
    assert "port" not in overlay(data, 3)["server"]


def test_decisions_from_the_controller_log(tmp_path):
    log = tmp_path / "controller_1.log"
    log.write_text(
        "INFO 2026-12-05 18:45:00,378 controller 31986 -- autoscale pool=pool-throughput "
        'replicas=1->2 reason=scale_up inputs={"demand": 16}\n'
        "INFO 2026-12-05 18:40:00,000 controller 31986 -- autoscale pool=pool-speculative "
        "replicas=1->1 reason=hold inputs={}\n"
        "INFO 2026-12-05 18:46:00,000 controller 31986 -- something else\n"
    )
    found = decisions([log], since=0)
    assert [(d["pool"], d["before"], d["after"], d["reason"]) for d in found] == [
        ("speculative", 1, 1, "hold"), ("throughput", 1, 2, "scale_up"),
    ]  # fmt: skip
    assert decisions([log], since=found[1]["t"]) == found[1:]


def test_only_an_error_object_is_an_error_event():
    from cluster.load_step import _is_error_event

    assert _is_error_event(b'data: {"error": {"message": "replica died", "code": 503}}')
    # a chunk whose text is the token "error" is output, not a failure
    assert not _is_error_event(b'data: {"choices": [{"delta": {"content": "error"}}]}')
    assert not _is_error_event(b"data: [DONE]")
    assert not _is_error_event(b'data: {"error"')  # not JSON: not an error object


def test_a_budget_below_the_pools_minimums_is_refused_before_any_server(tmp_path, capsys):
    from cluster.cli import main

    assert main(["load-step", "--budget", "1", "--out", str(tmp_path / "out")]) == 2
    assert "replica_budget" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
