"""Configuration: presets load, and every bad case gives one line naming file and field."""

import shutil
from pathlib import Path

import pytest
import yaml

from cluster.cli import main
from cluster.config import ConfigError, load_config, parse_config
from cluster.deployments.app import render

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
PRESETS = sorted(CONFIGS.glob("*.yaml"))
SHIPPED_DRAFTER = CONFIGS.parent / "drafters" / "smollm2-135m-instruct-eagle3.1"


def embedded_data() -> dict:
    """The embedded preset's data, its routing profile and drafters made absolute (tests parse
    it from elsewhere)."""
    data = yaml.safe_load((CONFIGS / "embedded.yaml").read_text())
    data["routing"]["profile"] = str(CONFIGS / data["routing"]["profile"])
    for pool in data["pools"]:
        if drafter := pool.get("speculation", {}).get("drafter"):
            pool["speculation"]["drafter"] = str((CONFIGS / drafter).resolve())
    return data


def test_both_presets_exist():
    names = {p.name for p in PRESETS}
    assert {"embedded.yaml", "kimi-k2.6-nvfp4-p6-b200.yaml"} <= names


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_presets_load_and_render(path):
    config = load_config(path)
    rendered = render(config)
    assert set(rendered["pools"]) == {p.name for p in config.pools}
    roles = {p.role for p in config.pools}
    assert roles == {"speculative", "throughput"}


def test_kimi_preset_is_tp8_strict_pack_on_b200_with_eagle3():
    config = load_config(CONFIGS / "kimi-k2.6-nvfp4-p6-b200.yaml")
    rendered = render(config)["pools"]
    for pool in rendered.values():
        llm = pool["llm_config"]
        assert llm["accelerator_type"] == "B200"
        assert llm["engine_kwargs"]["tensor_parallel_size"] == 8
        assert llm["placement_group_config"]["strategy"] == "STRICT_PACK"
        assert sum(b.get("GPU", 0) for b in llm["placement_group_config"]["bundles"]) == 8
    spec = rendered["speculative"]["llm_config"]["engine_kwargs"]["speculative_config"]
    assert spec["method"] == "eagle3" and spec["num_speculative_tokens"] == 5
    assert "speculative_config" not in rendered["throughput"]["llm_config"]["engine_kwargs"]


def test_rendered_llm_configs_are_accepted_by_ray_serve_llm():
    from ray.serve.llm import LLMConfig

    for path in PRESETS:
        for pool in render(load_config(path))["pools"].values():
            LLMConfig(**pool["llm_config"])


def _error(data: dict, source: str = "bad.yaml") -> str:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, source)
    return str(caught.value)


def _mutate(path: str, value):
    data = embedded_data()
    keys = path.split(".")
    node = data
    for key in keys[:-1]:
        node = node[int(key)] if key.isdigit() else node.setdefault(key, {})
    node[keys[-1]] = value
    return data


BAD_CASES = {
    "unknown key": (_mutate("routing.long_context_tokns", 5), "routing.long_context_tokns"),
    "unknown pool target": (_mutate("pools.0.target", "gpt-9"), "pools[0].target"),
    "drafter with ngram": (
        _mutate("pools.0.speculation.drafter", "drafters/x"),
        "pools[0].speculation.drafter",
    ),
    "too many speculative tokens": (
        _mutate("pools.0.speculation.num_speculative_tokens", 17),
        "pools[0].speculation.num_speculative_tokens",
    ),
    "zero speculative tokens": (
        _mutate("pools.0.speculation.num_speculative_tokens", 0),
        "pools[0].speculation.num_speculative_tokens",
    ),
    "speculative pool without speculation": (
        _mutate("pools.0.speculation", {"method": "none"}),
        "pools[0].speculation.method",
    ),
    "eagle3 without drafter": (
        _mutate("pools.0.speculation", {"method": "eagle3", "num_speculative_tokens": 3}),
        "pools[0].speculation.drafter",
    ),
    "tensor parallel on cpu": (_mutate("targets.0.tensor_parallel_size", 2), "targets[0]"),
    "wrong type": (_mutate("server.port", "eighty"), "server.port"),
    "min above max replicas": (
        _mutate("pools.1.autoscaling", {"min_replicas": 3, "max_replicas": 2}),
        "pools[1].autoscaling.min_replicas",
    ),
    "duplicate pool name": (_mutate("pools.1.name", "speculative"), "pools[1].name"),
    "engine argument the config sets": (
        _mutate("pools.1.engine.extra", {"speculative_config": {"method": "ngram"}}),
        "pools[1].engine.extra",
    ),
    "stats turned off": (
        _mutate("pools.1.engine.extra", {"disable_log_stats": True}),
        "pools[1].engine.extra",
    ),
    "data parallel of null": (
        _mutate("pools.1.engine.extra", {"data_parallel_size": None}),
        "pools[1].engine.extra",
    ),
    "s3 source without a bucket": (_mutate("targets.0.source", "s3://"), "targets[0].source"),
    "s3 drafter that climbs out of the cache": (
        _mutate("pools.0.speculation.drafter", "s3://weights/../../etc"),
        "pools[0].speculation.drafter",
    ),
    "cores per replica and per pool": (
        _mutate("pools.0.engine.cpu_cores_per_replica", ["0", "1"]),
        "pools[0].engine.cpu_cores_per_replica",
    ),
    "empty cores of a replica": (
        _mutate("pools.1.engine", {"cpu_cores_per_replica": ["0", ""]}),
        "pools[1].engine.cpu_cores_per_replica",
    ),
}


@pytest.mark.parametrize("case", BAD_CASES, ids=list(BAD_CASES))
def test_bad_config_gives_one_line_naming_file_and_field(case):
    data, field = BAD_CASES[case]
    message = _error(data)
    assert "\n" not in message, message
    assert message.startswith("bad.yaml: "), message
    assert field in message, message


def test_tp_beyond_one_node_cannot_strict_pack():
    data = yaml.safe_load((CONFIGS / "kimi-k2.6-nvfp4-p6-b200.yaml").read_text())
    data["targets"][0]["tensor_parallel_size"] = 16
    message = _error(data)
    assert "targets[0].tensor_parallel_size" in message and "STRICT_PACK" in message
    for pool in data["pools"]:  # nor across nodes otherwise: one pod, weights on one node
        pool["placement_strategy"] = "PACK"
    message = _error(data)
    assert "targets[0].tensor_parallel_size" in message and "spanning nodes" in message


def test_cli_validate_reports_errors_with_exit_code(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_mutate("pools.0.target", "gpt-9")))
    assert main(["config", "validate", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{bad}: pools[0].target: unknown target 'gpt-9'")


def test_invalid_yaml_and_missing_file_name_the_file(tmp_path):
    broken = tmp_path / "broken.yaml"
    broken.write_text("targets: [\n  - id: x\n")
    with pytest.raises(ConfigError, match=r"broken.yaml: line \d+: invalid YAML"):
        load_config(broken)
    with pytest.raises(ConfigError, match="missing.yaml: cannot read"):
        load_config(tmp_path / "missing.yaml")


def test_a_missing_routing_profile_is_named():
    data = embedded_data()
    data["routing"]["profile"] = "profiles/nope.yaml"
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "c.yaml", CONFIGS)
    assert str(caught.value) == "c.yaml: routing.profile: profiles/nope.yaml: no such file"


def test_relative_paths_resolve_against_the_config_file(tmp_path):
    # a real drafter must be there: the config validates it against the target when it loads
    shutil.copytree(SHIPPED_DRAFTER, tmp_path / "drafters" / "mine")
    # A link stays the link: `cluster models pull` keeps a directory as a link to its current
    # version, which a replica started after the next pull must follow anew.
    (tmp_path / "drafters" / "current").symlink_to("mine")
    data = _mutate(
        "pools.0.speculation",
        {"method": "eagle3", "drafter": "drafters/./current", "num_speculative_tokens": 3},
    )
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    rendered = render(load_config(path))
    spec = rendered["pools"]["speculative"]["llm_config"]["engine_kwargs"]["speculative_config"]
    assert spec["model"] == str(tmp_path / "drafters" / "current")


def test_cli_render_prints_what_will_be_deployed(capsys):
    assert main(["config", "render", str(CONFIGS / "embedded.yaml")]) == 0
    rendered = yaml.safe_load(capsys.readouterr().out)
    spec = rendered["pools"]["speculative"]["llm_config"]
    speculative_config = spec["engine_kwargs"]["speculative_config"]
    assert speculative_config["method"] == "eagle3"
    assert speculative_config["model"] == str(SHIPPED_DRAFTER)
    assert spec["placement_group_config"]["bundles"] == [{"CPU": 1}]
    assert spec["deployment_config"]["autoscaling_config"]["min_replicas"] == 1


def test_replica_budget_cannot_break_the_pools_minimums():
    from cluster.config import ConfigError, parse_config

    data = {
        "targets": [{"id": "m", "source": "/models/m", "replica_budget": 1}],
        "pools": [
            {"name": "s", "target": "m", "role": "speculative",
             "speculation": {"method": "ngram", "num_speculative_tokens": 3}},
            {"name": "t", "target": "m", "role": "throughput"},
        ],
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"targets\[0\]\.replica_budget: 1 is below"):
        parse_config(data)


def test_cores_per_replica_reach_each_replica_by_rank():
    from cluster.deployments.pool_server import CORES_PER_REPLICA_ENV, replica_cores

    data = embedded_data()
    engine = data["pools"][1]["engine"]
    del engine["cpu_omp_threads_bind"]
    engine["cpu_cores_per_replica"] = ["0", "1-2"]
    pool = render(parse_config(data, "two-replicas.yaml"))["pools"]["throughput"]
    env = pool["llm_config"]["runtime_env"]["env_vars"]
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env  # every replica would share it
    per_replica = env[CORES_PER_REPLICA_ENV]
    assert [replica_cores(per_replica, rank) for rank in range(3)] == ["0", "1-2", "0"]


def test_a_new_replica_never_takes_the_cores_a_running_one_holds(tmp_path):
    from cluster.deployments.pool_server import claim_cores

    def claim(rank):
        return claim_cores("0;1", rank, tmp_path, "pool")

    first, second = claim(0), claim(1)
    assert (first[0], second[0]) == ("0", "1")
    first[1].close()  # rank 0 scales down; Serve renumbers the survivor (on "1") to rank 0
    third = claim(1)  # so the next replica gets rank 1, whose entry the survivor holds
    assert third[0] == "0"
    assert claim(0) == ("0", None)  # every entry held: by rank, said in the log
    assert claim_cores("0;1", 0, tmp_path, "other-pool")[0] == "0"  # deployments apart


@pytest.mark.parametrize(
    ("command", "shown"),
    [
        # a default shown once: said in the help, not appended again
        (["bench"], "closed-loop levels (default 1,4,16) --output-tokens"),
        (["bench"], "--out OUT results root (default: benchmarks/results/bench)"),
        (["drafters", "train"], "draft steps unrolled (default: 5)"),
    ],
)
def test_help_names_each_real_default_once_and_never_none(command, shown, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert shown in text
    assert "(default: None)" not in text and "(default: [])" not in text


def test_every_option_of_every_command_says_what_it_does():
    import argparse

    from cluster.cli import build_parser

    def silent(parser: argparse.ArgumentParser, path: str) -> list[str]:
        parser.format_help()  # renders: no stray % in any help string
        found = []
        for action in parser._actions:  # argparse has no public walk over its subcommands
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    found += silent(sub, f"{path} {name}")
            elif not action.help and not isinstance(action, argparse._HelpAction):
                found.append(f"{path} {'/'.join(action.option_strings) or action.dest}")
        return found

    assert silent(build_parser(), "cluster") == []


def test_the_idle_status_refresh_must_stay_below_the_stats_age_routing_trusts():
    from cluster.config import ConfigError, parse_config

    data = embedded_data()
    data["routing"] = {"pool_status_idle_refresh_s": 5.5}  # max_stats_age_s is 10
    with pytest.raises(ConfigError, match=r"routing.*pool_status_idle_refresh_s: 5.5 s is more"):
        parse_config(data)
    data["routing"] = {"pool_status_refresh_s": 6}
    with pytest.raises(ConfigError, match=r"pool_status_refresh_s: larger than"):
        parse_config(data)
